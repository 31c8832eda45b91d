"""Sequences (Triton's sequence batcher): a model's policy and a request's controls.

A model is a sequence model when its settings say
``parameters.extra.sequence: {"idle_timeout_s": ..., "max_sequences": ...}``.
It may declare Triton's control inputs there too, ``"control_inputs":
{"START": "START", "END": {"name": "END", "datatype": "BOOL"}, ...}`` (kind ->
input name, or name and datatype): the worker fills them in as input tensors
from each request's controls (:mod:`poolserve.service.inference.controls`).
Its requests carry Triton's ``sequence_id`` (int64, uint64 or string, never 0
nor empty), ``sequence_start`` and ``sequence_end`` (bool) parameters, read
here from the request's wire bytes without parsing its tensors.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from poolserve.service.contract.errors import InvalidInput, QueueFull
from poolserve.service.contract.settings import ConfigError
from poolserve.service.contract.wire import _LEN, _VARINT, Wire, _varint

DEFAULT_IDLE_TIMEOUT_S = 60.0
DEFAULT_MAX_SEQUENCES = 1000


# Triton's ModelSequenceBatching.Control kinds, and the datatypes each may have
# (flags: int32_false_true, fp32_false_true or bool_false_true; CORRID: data_type)
FLAG_TYPES = ("INT32", "FP32", "BOOL")
CORRID_TYPES = ("UINT64", "INT64", "UINT32", "INT32", "BYTES")
CONTROL_TYPES = {
    "START": FLAG_TYPES,
    "END": FLAG_TYPES,
    "READY": FLAG_TYPES,
    "CORRID": CORRID_TYPES,
}


@dataclass(frozen=True)
class ControlInput:
    """One control the model reads as an input tensor: Triton's kind
    (START, END, READY, CORRID), the input's name and datatype."""

    kind: str
    name: str
    datatype: str


@dataclass(frozen=True)
class SequencePolicy:
    idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S
    max_sequences: int = DEFAULT_MAX_SEQUENCES
    controls: tuple[ControlInput, ...] = ()


def sequence_policy(
    source: str, extra: Mapping[str, Any], declared: Mapping[str, str] | None = None
) -> SequencePolicy | None:
    """The policy of ``parameters.extra.sequence``; ConfigError names the bad field.
    ``declared``: the model's declared inputs' datatypes, by name."""
    spec = extra.get("sequence")
    if spec is None:
        return None
    where = "parameters.extra.sequence"
    if spec is True:
        spec = {}
    if not isinstance(spec, dict):
        raise ConfigError(source, where, f"expected an object, got {spec!r}")
    unknown = set(spec) - {"idle_timeout_s", "max_sequences", "control_inputs"}
    if unknown:
        raise ConfigError(source, f"{where}.{sorted(unknown)[0]}", "unknown field")
    idle = spec.get("idle_timeout_s", DEFAULT_IDLE_TIMEOUT_S)
    if isinstance(idle, bool) or not isinstance(idle, int | float) or idle <= 0:
        raise ConfigError(source, f"{where}.idle_timeout_s", f"expected seconds > 0, got {idle!r}")
    most = spec.get("max_sequences", DEFAULT_MAX_SEQUENCES)
    if isinstance(most, bool) or not isinstance(most, int) or most < 1:
        raise ConfigError(
            source, f"{where}.max_sequences", f"expected an integer >= 1, got {most!r}"
        )
    controls = control_inputs(source, spec.get("control_inputs", {}), declared or {})
    return SequencePolicy(float(idle), most, controls)


def control_inputs(
    source: str, spec: object, declared: Mapping[str, str]
) -> tuple[ControlInput, ...]:
    """``control_inputs``: kind -> input name, or {"name", "datatype"}. Without a
    datatype, a declared input's own, else INT32 (flags) or UINT64 (CORRID)."""
    where = "parameters.extra.sequence.control_inputs"
    if not isinstance(spec, dict):
        raise ConfigError(source, where, f"expected an object, got {spec!r}")
    controls: list[ControlInput] = []
    for kind, value in spec.items():
        allowed = CONTROL_TYPES.get(kind)
        if allowed is None:
            raise ConfigError(source, f"{where}.{kind}", f"expected one of {sorted(CONTROL_TYPES)}")
        if isinstance(value, str):
            value = {"name": value}
        if not isinstance(value, dict) or set(value) - {"name", "datatype"}:
            raise ConfigError(
                source,
                f"{where}.{kind}",
                f"expected an input name or {{name, datatype}}, got {value!r}",
            )
        name = value.get("name")
        if not isinstance(name, str) or not name:
            raise ConfigError(source, f"{where}.{kind}.name", f"expected a name, got {name!r}")
        datatype = value.get(
            "datatype", declared.get(name, allowed[0] if kind != "CORRID" else "UINT64")
        )
        if datatype not in allowed:
            raise ConfigError(
                source,
                f"{where}.{kind}.datatype",
                f"expected one of {list(allowed)}, got {datatype!r}",
            )
        if any(c.name == name for c in controls):
            raise ConfigError(source, f"{where}.{kind}.name", f"input '{name}' is used twice")
        controls.append(ControlInput(kind, name, datatype))
    return tuple(controls)


@dataclass(frozen=True)
class SequenceControl:
    """A request's sequence controls, as the client sent them."""

    id: int | str | None = None
    start: bool = False
    end: bool = False


def sequence_id(model: str, control: SequenceControl) -> int | str:
    """The request's sequence id; InvalidInput when it names none."""
    if control.id is None:
        raise InvalidInput(
            f"model '{model}' is a sequence model: its requests need a "
            "non-zero or non-empty 'sequence_id' parameter"
        )
    return control.id


def admit_new(model: str, policy: SequencePolicy, control: SequenceControl, live: int) -> None:
    """A request of a sequence that is not live (``live`` sequences are): refused
    unless it starts one, and while ``max_sequences`` are live."""
    if not control.start:
        raise InvalidInput(
            f"sequence {control.id!r} of model '{model}' is unknown or expired "
            "(idle past its timeout, or ended): a request that starts a "
            "sequence sets 'sequence_start'"
        )
    if live >= policy.max_sequences:
        raise QueueFull(
            f"model '{model}' holds its maximum of {policy.max_sequences} "
            "live sequences (max_sequences); end one or wait for an idle one to expire"
        )


_BOOL, _INT64, _STRING, _UINT64 = 1, 2, 3, 5
_KEYS = (b"sequence_id", b"sequence_start", b"sequence_end")


def peek_sequence(data: Wire) -> SequenceControl:
    """The controls of a serialized ModelInferRequest; InvalidInput if one has a
    type Triton does not accept."""
    found: dict[bytes, tuple[int, int | bytes]] = {}
    pos, end = 0, len(data)
    while pos < end:
        key, pos = _varint(data, pos)
        number, wire_type = key >> 3, key & 7
        if wire_type == _VARINT:
            _, pos = _varint(data, pos)
        elif wire_type == 1:
            pos += 8
        elif wire_type == 5:
            pos += 4
        elif wire_type == _LEN:
            size, pos = _varint(data, pos)
            if number == 4:
                _entry(data, pos, min(pos + size, end), found)
            pos += size
        else:
            raise InvalidInput(f"request bytes use unsupported wire type {wire_type}")
    ident: int | str | None = None
    if b"sequence_id" in found:
        kind, value = found[b"sequence_id"]
        if kind in (_INT64, _UINT64) and isinstance(value, int):
            ident = value - (1 << 64) if kind == _INT64 and value >= 1 << 63 else value
            ident = ident or None
        elif kind == _STRING and isinstance(value, bytes):
            ident = value.decode("utf-8", "replace") or None
        else:
            raise InvalidInput("parameter 'sequence_id' must be an int64, uint64 or string")
    flags = []
    for name in (b"sequence_start", b"sequence_end"):
        kind, value = found.get(name, (_BOOL, 0))
        if kind not in (_BOOL, _INT64) or not isinstance(value, int):
            raise InvalidInput(f"parameter '{name.decode()}' must be a bool")
        flags.append(bool(value))
    return SequenceControl(ident, flags[0], flags[1])


def _entry(data: Wire, pos: int, end: int, found: dict[bytes, tuple[int, int | bytes]]) -> None:
    key = b""
    value: tuple[int, int | bytes] | None = None
    while pos < end:
        tag, pos = _varint(data, pos)
        if tag == (1 << 3) | _LEN:
            size, pos = _varint(data, pos)
            key, pos = bytes(data[pos : pos + size]), pos + size
        elif tag == (2 << 3) | _LEN:
            size, pos = _varint(data, pos)
            stop = min(pos + size, end)
            if pos < stop:
                inner, at = _varint(data, pos)
                if inner & 7 == _VARINT:
                    number, _ = _varint(data, at)
                    value = (inner >> 3, number)
                elif inner & 7 == _LEN:
                    length, at = _varint(data, at)
                    value = (inner >> 3, bytes(data[at : at + length]))
                else:
                    value = (inner >> 3, 0)
            pos += size
        else:
            return
    if key in _KEYS and value is not None:
        found[key] = value
