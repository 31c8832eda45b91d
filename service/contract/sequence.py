"""Sequences (Triton's sequence batcher): a model's policy and a request's controls.

A model is a sequence model when its settings say
``parameters.extra.sequence: {"idle_timeout_s": ..., "max_sequences": ...}``.
Its requests carry Triton's ``sequence_id`` (int64, uint64 or string, never 0
nor empty), ``sequence_start`` and ``sequence_end`` (bool) parameters, read
here from the request's wire bytes without parsing its tensors.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from poolserve.service.contract.errors import InvalidInput
from poolserve.service.contract.settings import ConfigError
from poolserve.service.contract.wire import _LEN, _VARINT, Wire, _varint

DEFAULT_IDLE_TIMEOUT_S = 60.0
DEFAULT_MAX_SEQUENCES = 1000


@dataclass(frozen=True)
class SequencePolicy:
    idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S
    max_sequences: int = DEFAULT_MAX_SEQUENCES


def sequence_policy(source: str, extra: Mapping[str, Any]) -> SequencePolicy | None:
    """The policy of ``parameters.extra.sequence``; ConfigError names the bad field."""
    spec = extra.get("sequence")
    if spec is None:
        return None
    where = "parameters.extra.sequence"
    if spec is True:
        spec = {}
    if not isinstance(spec, dict):
        raise ConfigError(source, where, f"expected an object, got {spec!r}")
    unknown = set(spec) - {"idle_timeout_s", "max_sequences"}
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
    return SequencePolicy(float(idle), most)


@dataclass(frozen=True)
class SequenceControl:
    """A request's sequence controls, as the client sent them."""

    id: int | str | None = None
    start: bool = False
    end: bool = False


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
