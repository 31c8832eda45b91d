"""Reading just enough of a protobuf message's wire bytes to route it.

The router and the pool server look at ``model_name`` (field 1) and
``model_version`` (field 2) of a ModelInferRequest without parsing its tensors.
Fields may appear in any order and more than once (the last one wins, as in
protobuf), so the whole top level is walked, jumping over payloads.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from poolserve.service.contract.errors import InvalidInput

_VARINT, _I64, _LEN, _SGROUP, _EGROUP, _I32 = 0, 1, 2, 3, 4, 5

Wire = bytes | bytearray | memoryview  # a large request is a view of the frame it came in


def _varint(data: Wire, pos: int) -> tuple[int, int]:
    result = 0
    shift = 0
    end = len(data)
    while True:
        if pos >= end:
            raise InvalidInput("request bytes are truncated (varint runs past the end)")
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7
        if shift >= 64:
            raise InvalidInput("request bytes hold a varint longer than 10 bytes")


@dataclass(slots=True)
class Routing:
    """What the pool needs from a request without parsing its tensors."""

    name: str
    version: str
    priority: int | None = None
    idempotent: bool = True
    timeout_us: int | None = None  # the schedule_policy extension's ``timeout``
    # A REST body, read once per request by the pool
    # (:func:`poolserve.service.poolserver.rest_scheduling.scheduling_routing`):
    # its scheduling parameters as wire fields (what the peeks read) and, when
    # its JSON was small enough to read, what its batch key is made of (the
    # JSON but the tensors' data); None: not a REST body.
    rest_view: bytes | None = None
    rest_json: dict[str, Any] | None = None
    # the same body's whole JSON document and its text, for the response cache's
    # key (:mod:`poolserve.service.poolserver.response_cache`)
    rest_doc: dict[str, Any] | None = None
    rest_text: Wire | None = None
    # The first field of :data:`WRAPPER_FIELDS` the bytes carry at top level, 0: none.
    wrapper_field: int = 0
    # An ensemble's chain (:mod:`poolserve.service.contract.chain`): the pool's
    # entries of its steps after the first, whose statistics count it too.
    chain: tuple[Any, ...] = ()


WRAPPER_FIELDS = range(4089, 4096)
"""The field numbers of the HTTP door's REST wrapper (:mod:`poolserve.service.contract.rest`)."""


SCHEDULING_KEYS = (b"priority", b"idempotent", b"timeout")
# InferParameter's oneof fields that carry a varint
_BOOL_PARAM, _INT64_PARAM, _UINT64_PARAM = 1, 2, 5
# what each scheduling parameter may be, as Triton takes them
_ACCEPTED = {
    b"priority": ((_INT64_PARAM, _UINT64_PARAM), "int64_param or uint64_param"),
    b"timeout": ((_INT64_PARAM,), "int64_param"),
    b"idempotent": ((_BOOL_PARAM, _INT64_PARAM), "bool_param"),
}


def peek_model(data: Wire) -> tuple[str, str]:
    """Returns (model_name, model_version) from serialized ModelInferRequest bytes."""
    routing = peek_routing(data, with_parameters=False)
    return routing.name, routing.version


def peek_routing(data: Wire, with_parameters: bool = True) -> Routing:
    """Model name and version, plus the scheduling parameters ``priority`` (int64,
    1 is the highest), ``timeout`` (int64, microseconds) and ``idempotent`` (bool)
    when ``with_parameters``; one of those of another type is InvalidInput."""
    name = b""
    version = b""
    params: dict[bytes, tuple[int, int]] = {}
    wrapper = 0
    pos = 0
    end = len(data)
    while pos < end:
        key = data[pos]  # a one-byte varint (fields 1 to 15), else the whole reader
        if key < 0x80:
            pos += 1
        else:
            key, pos = _varint(data, pos)
        number, wire_type = key >> 3, key & 7
        if number == 0:
            raise InvalidInput("request bytes hold a field number 0")
        if number > 4088 and not wrapper and number in WRAPPER_FIELDS:
            wrapper = number
        if wire_type == _VARINT:
            _, pos = _varint(data, pos)
        elif wire_type == _I64:
            pos += 8
        elif wire_type == _I32:
            pos += 4
        elif wire_type == _LEN:
            if pos < end and data[pos] < 0x80:  # a length under 128: one byte
                size = data[pos]
                pos += 1
            else:
                size, pos = _varint(data, pos)
            start, pos = pos, pos + size
            if pos > end:
                raise InvalidInput("request bytes are truncated (a field runs past the end)")
            if number == 1:
                name = bytes(data[start:pos])
            elif number == 2:
                version = bytes(data[start:pos])
            elif number == 4 and with_parameters:
                _map_entry(data, start, pos, params)
        else:
            raise InvalidInput(f"request bytes use unsupported wire type {wire_type}")
        if pos > end:
            raise InvalidInput("request bytes are truncated")
    try:
        routing = Routing(name.decode("utf-8"), version.decode("utf-8"))
    except UnicodeDecodeError:
        raise InvalidInput("model_name or model_version is not valid UTF-8") from None
    routing.wrapper_field = wrapper
    for param, (kind, value) in params.items():
        kinds, wanted = _ACCEPTED[param]
        if kind not in kinds:
            raise InvalidInput(f"parameter '{param.decode()}' must be set as {wanted}")
        if param == b"idempotent":
            routing.idempotent = bool(value)
        elif param == b"timeout":
            routing.timeout_us = _signed(value)
        else:
            routing.priority = value if kind == _UINT64_PARAM else _signed(value)
    return routing


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def _map_entry(data: Wire, pos: int, end: int, params: dict[bytes, tuple[int, int]]) -> None:
    """One ``map<string, InferParameter>`` entry: keeps (oneof field, value) of known keys."""
    key = b""
    value: tuple[int, int] | None = None
    while pos < end:
        tag, pos = _varint(data, pos)
        if tag == (1 << 3) | _LEN:
            size, pos = _varint(data, pos)
            key, pos = bytes(data[pos : pos + size]), pos + size
        elif tag == (2 << 3) | _LEN:
            size, pos = _varint(data, pos)
            value = _parameter_value(data, pos, min(pos + size, end))
            pos += size
        else:
            return  # not a well-formed entry: protobuf's own parser will say so later
    if key in SCHEDULING_KEYS and value is not None:
        params[key] = value


def _parameter_value(data: Wire, pos: int, end: int) -> tuple[int, int] | None:
    """The oneof field an InferParameter sets and, for a varint one, its value
    (0 for string_param and double_param); None when it sets none."""
    if pos >= end:
        return None
    tag, pos = _varint(data, pos)
    number = tag >> 3
    if tag & 7 == _VARINT:
        value, pos = _varint(data, pos)
        return number, value
    return number, 0


def encode_len_field(number: int, payload: bytes) -> bytes:
    """One length-delimited field: used to wrap response bytes without parsing them."""
    return _encode_varint((number << 3) | _LEN) + _encode_varint(len(payload)) + payload


def _encode_varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def fields(data: Wire) -> Iterator[tuple[int, int, int, int]]:
    """Each top-level field of a message's wire bytes, none parsed: (its tag,
    where it starts, where its value starts, where it ends); a length-delimited
    field's value is its payload. InvalidInput when the bytes are truncated or
    use a wire type other than varint, 64-bit, length-delimited and 32-bit."""
    pos, end = 0, len(data)
    while pos < end:
        start = pos
        tag = data[pos]  # a one-byte tag (fields 1 to 15), else the whole reader
        if tag < 0x80:
            pos += 1
        else:
            tag, pos = _varint(data, pos)
        value = pos
        wire_type = tag & 7
        if wire_type == _VARINT:
            _, pos = _varint(data, pos)
        elif wire_type == _I64:
            pos += 8
        elif wire_type == _I32:
            pos += 4
        elif wire_type == _LEN:
            if pos < end and data[pos] < 0x80:  # a length under 128: one byte
                size = data[pos]
                pos += 1
            else:
                size, pos = _varint(data, pos)
            value, pos = pos, pos + size
        else:
            raise InvalidInput(f"request bytes use unsupported wire type {wire_type}")
        if pos > end:
            raise InvalidInput("request bytes are truncated (a field runs past the end)")
        yield tag, start, value, pos


read_varint = _varint  # (value, position after it) at ``pos``; InvalidInput when malformed
encode_varint = _encode_varint
