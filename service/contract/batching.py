"""Adaptive batching: a model's batching settings and a request's batch key.

Settings, as MLServer names them in ``model-settings.json``:
``max_batch_size`` (above 1 turns batching on: rows along dimension 0 of
every input, outputs split along dimension 0), ``max_batch_time`` (seconds
the first request of a batch may wait for others) and, as Triton's dynamic
batcher has them, ``parameters.extra.preferred_batch_sizes``; plus
``parameters.extra.batch_safe_parameters``, the request parameters that may
differ inside one batch (any other parameter that differs keeps requests in
separate batches).

The pool server never parses tensors: :func:`peek_batch` walks a
ModelInferRequest's wire bytes for what decides whether two requests may
share a batch (input names, datatypes, non-batch dimensions, input and
request parameters) and how many rows it brings. The worker checks the same
again on the decoded tensors before it concatenates anything.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from poolserve.service.contract.errors import InvalidInput
from poolserve.service.contract.settings import ConfigError
from poolserve.service.contract.wire import SCHEDULING_KEYS, Wire, _varint

_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5


@dataclass(frozen=True, slots=True)
class BatchPolicy:
    """How the dispatcher forms one model's batches."""

    max_size: int  # rows; a request larger than this runs alone
    max_time: float  # seconds the first request may wait for others
    preferred: tuple[int, ...] = ()  # sizes that start a batch at once
    safe_parameters: frozenset[str] = frozenset()

    def full(self, rows: int) -> bool:
        return rows >= self.max_size or rows in self.preferred


def batch_settings(
    source: str, max_batch_size: object, max_batch_time: object, extra: Mapping[str, Any]
) -> tuple[int, float, tuple[int, ...], frozenset[str]]:
    """Validated (max_batch_size, max_batch_time, preferred sizes, batch-safe
    parameters); ConfigError naming the field otherwise."""
    if isinstance(max_batch_size, bool) or not isinstance(max_batch_size, int):
        raise ConfigError(source, "max_batch_size", f"expected int, got {max_batch_size!r}")
    if max_batch_size < 0:
        raise ConfigError(source, "max_batch_size", f"must be 0 or more, got {max_batch_size}")
    if isinstance(max_batch_time, bool) or not isinstance(max_batch_time, int | float):
        raise ConfigError(source, "max_batch_time", f"expected seconds, got {max_batch_time!r}")
    if not math.isfinite(max_batch_time) or not 0 <= max_batch_time <= 10:
        raise ConfigError(
            source, "max_batch_time", f"must be seconds in [0, 10], got {max_batch_time!r}"
        )
    field = "parameters.extra.preferred_batch_sizes"
    preferred = extra.get("preferred_batch_sizes", [])
    if not isinstance(preferred, list) or not all(
        isinstance(n, int) and not isinstance(n, bool) for n in preferred
    ):
        raise ConfigError(source, field, f"expected a list of integers, got {preferred!r}")
    if preferred and max_batch_size <= 1:
        raise ConfigError(source, field, "needs batching on (max_batch_size above 1)")
    for n in preferred:
        if not 1 <= n <= max_batch_size:
            raise ConfigError(source, field, f"{n} is not in [1, max_batch_size={max_batch_size}]")
    field = "parameters.extra.batch_safe_parameters"
    safe = extra.get("batch_safe_parameters", [])
    if not isinstance(safe, list) or not all(isinstance(p, str) for p in safe):
        raise ConfigError(source, field, f"expected a list of parameter names, got {safe!r}")
    return max_batch_size, float(max_batch_time), tuple(sorted(set(preferred))), frozenset(safe)


def peek_batch(data: Wire, safe: frozenset[str] = frozenset()) -> tuple[int, bytes] | None:
    """(rows, key) of a serialized ModelInferRequest, or None if it cannot batch
    (no inputs, a scalar input, inputs that disagree on dimension 0).

    Requests of one model with equal keys have the same input names in the
    same order, datatypes, dimensions past the first, input parameters and
    request parameters (scheduling parameters and ``safe`` ones aside).
    Malformed bytes raise InvalidInput, as protobuf's parser would.
    """
    key = bytearray()
    params: list[bytes] = []
    rows: int | None = None
    pos, end = 0, len(data)
    while pos < end:
        tag, pos = _varint(data, pos)
        number, wire_type = tag >> 3, tag & 7
        if wire_type == _VARINT:
            _, pos = _varint(data, pos)
        elif wire_type == _I64:
            pos += 8
        elif wire_type == _I32:
            pos += 4
        elif wire_type == _LEN:
            size, pos = _varint(data, pos)
            start, pos = pos, pos + size
            if pos > end:
                raise InvalidInput("request bytes are truncated (a field runs past the end)")
            if number == 4:
                entry = _parameter_entry(data, start, pos, safe)
                if entry is not None:
                    params.append(entry)
            elif number == 5:
                first = _input_key(data, start, pos, key)
                if first is None or (rows is not None and first != rows):
                    return None
                rows = first
        else:
            raise InvalidInput(f"request bytes use unsupported wire type {wire_type}")
    if rows is None or rows < 1:
        return None
    for entry in sorted(params):
        key += b"\x00P" + entry
    return rows, bytes(key)


def _input_key(data: Wire, pos: int, end: int, key: bytearray) -> int | None:
    """Appends one InferInputTensor's batch key to ``key``; returns its dim 0."""
    shape: list[int] = []
    parts: list[bytes] = []
    while pos < end:
        tag, pos = _varint(data, pos)
        number, wire_type = tag >> 3, tag & 7
        if wire_type == _VARINT:
            value, pos = _varint(data, pos)
            if number == 3:
                shape.append(value)
        elif wire_type == _LEN:
            size, pos = _varint(data, pos)
            start, pos = pos, min(pos + size, end)
            if number == 3:  # packed shape
                while start < pos:
                    value, start = _varint(data, start)
                    shape.append(value)
            elif number in (1, 2, 4):  # name, datatype, parameters
                parts.append(bytes([number]) + data[start:pos])
        elif wire_type == _I64:
            pos += 8
        elif wire_type == _I32:
            pos += 4
        else:
            return None
    if not shape:
        return None
    key += b"\x00I" + b"\x00".join(parts) + b"\x00S" + ",".join(map(str, shape[1:])).encode()
    return shape[0] if shape[0] < 1 << 63 else None


def _parameter_entry(data: Wire, pos: int, end: int, safe: frozenset[str]) -> bytes | None:
    """A request parameter's map entry bytes, unless scheduling or batch-safe."""
    name = b""
    cursor = pos
    while cursor < end:
        tag, cursor = _varint(data, cursor)
        if tag & 7 != _LEN:
            break
        size, cursor = _varint(data, cursor)
        if tag >> 3 == 1:
            name = bytes(data[cursor : cursor + size])
        cursor += size
    if name in SCHEDULING_KEYS or name.decode("utf-8", "replace") in safe:
        return None
    return bytes(data[pos:end])
