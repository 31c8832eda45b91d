"""An HTTP/REST inference as it travels from the router to a worker and back.

The router's HTTP door never parses a REST body. It sends it over the lane
inside a wrapper that is itself a valid ModelInferRequest: ``model_name``
(field 1) and ``model_version`` (field 2), taken from the URL, then the
body's content kind and the body as fields no client sets. Every peek on
the way (the pool's routing, the slab's head, batching's key) reads the
wrapper as it reads any request; only the worker (or an inline model's
pool) that runs it looks inside (:mod:`poolserve.service.inference.rest`).

- field :data:`HEADER_FIELD` (varint, optional): Triton's binary tensor
  extension is in use, and this is ``Inference-Header-Content-Length``: the
  body's first that many bytes are the JSON, the tensors' bytes follow;
  absent, the whole body is JSON.
- fields :data:`ENCODING_FIELD`, :data:`LIMIT_FIELD` and
  :data:`ACCEPT_FIELD` (varints, optional): the body's ``Content-Encoding``
  (gzip or deflate; the worker inflates it, to at most the limit) and the
  encoding the client accepts for the reply (``Accept-Encoding``).
- fields :data:`PROTOCOL_FIELD` (varint) and :data:`CALL_FIELD` (bytes):
  the body's protocol, and for :data:`CUSTOM` (an MLServer model's
  ``@custom_handler`` endpoint) the call's method, path, query and headers,
  as JSON (:func:`custom_call`): the worker runs the handler on them.
- field :data:`BODY_FIELD` (bytes): the body as the client sent it. When
  the body travels in a slab, the envelope's head (what the pool peeks at)
  holds instead :data:`JSON_HEAD_FIELD`: the JSON of a binary-extension
  body, when small (:func:`envelope_head`).

The reply is :data:`REPLY_HEAD` (the JSON's length, the reply's encoding,
whether binary outputs follow), then the JSON and the binary outputs' bytes,
compressed together when the reply is encoded: the router answers with
``Inference-Header-Content-Length`` when binary outputs follow the JSON.
Standard library only.
"""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from poolserve.service.contract.errors import InvalidInput
from poolserve.service.contract.wire import WRAPPER_FIELDS, Wire, encode_varint, read_varint

HEADER_FIELD = 4094
BODY_FIELD = 4095
ENCODING_FIELD = 4093  # the body's Content-Encoding (absent: identity)
ACCEPT_FIELD = 4092  # the reply encoding the client accepts (absent: identity)
LIMIT_FIELD = 4091  # the most bytes a compressed body may inflate to
JSON_HEAD_FIELD = 4090  # a slab envelope's head: the JSON before the binary tensors
PROTOCOL_FIELD = 4089  # the body's protocol (absent: the Open Inference Protocol, V2)
CALL_FIELD = 4088  # CUSTOM: the HTTP call's method, path, query and headers (JSON)
V2, V1 = 0, 1  # KServe's V1: {"instances": [...]} in, {"predictions": [...]} out
CUSTOM = 2  # an MLServer model's @custom_handler endpoint: the body as it came, its reply as is
_BODY_TAG = (BODY_FIELD << 3) | 2
_JSON_HEAD_TAG = (JSON_HEAD_FIELD << 3) | 2
_CALL_TAG = (CALL_FIELD << 3) | 2
MAX_PEEK = 64 * 1024  # the most JSON the pool reads on its event loop for scheduling
MAX_PEEK_COMPRESSED = MAX_PEEK + 1024  # the most of a compressed body it inflates for that
_BODY_TAG_BYTES = encode_varint(_BODY_TAG)
_NAME_OR_VERSION = (0x0A, 0x12)  # the tags of fields 1 and 2 (bytes)
_VARINT_FIELDS = {
    (HEADER_FIELD << 3): "header_length",
    (ENCODING_FIELD << 3): "encoding",
    (ACCEPT_FIELD << 3): "accept",
    (LIMIT_FIELD << 3): "limit",
    (PROTOCOL_FIELD << 3): "protocol",
}
# The reply's head: the JSON's length (uncompressed), the reply's encoding, and
# whether binary outputs follow the JSON (CUSTOM_REPLY there: the JSON is a
# custom endpoint's status and headers, and its body follows as it is).
REPLY_HEAD = struct.Struct("<IBB")
CUSTOM_REPLY = 2

IDENTITY, GZIP, DEFLATE = 0, 1, 2
ENCODINGS = {b"identity": IDENTITY, b"gzip": GZIP, b"deflate": DEFLATE}
ENCODING_NAMES = {GZIP: b"gzip", DEFLATE: b"deflate"}


@dataclass(frozen=True, slots=True)
class RestHead:
    """What the router read from a REST call's headers for the worker."""

    header_length: int | None = None  # Inference-Header-Content-Length
    encoding: int = IDENTITY  # Content-Encoding of the body
    accept: int = IDENTITY  # the encoding of the reply (from Accept-Encoding)
    limit: int = 0  # max_message_size: what a compressed body may inflate to
    protocol: int = V2  # V1: KServe's V1 predict
    call: bytes = b""  # CUSTOM: the HTTP call (:func:`custom_call`)


def _len_field(number: int, payload: bytes) -> bytes:
    return encode_varint((number << 3) | 2) + encode_varint(len(payload)) + payload


def _varint_field(number: int, value: int) -> bytes:
    return encode_varint(number << 3) + encode_varint(value)


def wrap_head(name: str, version: str, body_length: int, rest: RestHead) -> bytes:
    """Everything of the wrapper before the body's bytes (the body then follows as it is)."""
    head = routing_head(name, version)
    if rest.header_length is not None:
        head += _varint_field(HEADER_FIELD, rest.header_length)
    if rest.encoding != IDENTITY:
        head += _varint_field(ENCODING_FIELD, rest.encoding)
        head += _varint_field(LIMIT_FIELD, rest.limit)
    if rest.accept != IDENTITY:
        head += _varint_field(ACCEPT_FIELD, rest.accept)
    if rest.protocol != V2:
        head += _varint_field(PROTOCOL_FIELD, rest.protocol)
    if rest.call:
        head += _len_field(CALL_FIELD, rest.call)
    return head + _BODY_TAG_BYTES + encode_varint(body_length)


def routing_head(name: str, version: str) -> bytes:
    """Fields 1 and 2: the model and version."""
    head = _len_field(1, name.encode())
    return head + (_len_field(2, version.encode()) if version else b"")


def envelope_head(name: str, version: str, rest: RestHead, body: Wire) -> bytes:
    """What the pool peeks at when the body travels in a slab: the model, and
    the part of the body :func:`scheduling_json` reads (the JSON when small,
    the first bytes of a compressed body); the rest stays in the slab."""
    head = routing_head(name, version)
    length = rest.header_length
    if rest.encoding != IDENTITY:
        head += _varint_field(ENCODING_FIELD, rest.encoding)
        if length is not None:
            head += _varint_field(HEADER_FIELD, length)
        return head + _len_field(JSON_HEAD_FIELD, bytes(body[:MAX_PEEK_COMPRESSED]))
    if length is None:
        length = len(body)
    elif length > len(body):
        return head  # refused by the worker
    if length > MAX_PEEK:
        return head
    if rest.header_length is not None:
        head += _varint_field(HEADER_FIELD, length)
    return head + _len_field(JSON_HEAD_FIELD, bytes(body[:length]))


def scheduling_json(rest: RestHead, body: Wire) -> Wire | None:
    """The JSON the pool reads a REST body's scheduling parameters from, or
    None when it reads none (V1, or a JSON over :data:`MAX_PEEK` bytes).

    The JSON is the body, or its first ``Inference-Header-Content-Length``
    bytes, inflated when the body is compressed; at most
    :data:`MAX_PEEK_COMPRESSED` bytes of a compressed body are inflated.
    Only a prefix of the body is ever looked at, so the pool (that may hold
    only :func:`envelope_head`'s part of the body) and the worker (that holds
    all of it, and refuses scheduling parameters the pool could not read)
    get the same answer."""
    if rest.protocol != V2:
        return None
    length = rest.header_length
    if rest.encoding == IDENTITY:
        size = len(body) if length is None else length
        return body[:size] if size <= min(MAX_PEEK, len(body)) else None
    if length is not None and length > MAX_PEEK:
        return None
    inflater = inflater_of()
    try:
        out = peek_inflate(inflater, body)
    except zlib.error:
        return None  # the worker says what is wrong with it
    return peeked_json(out, inflater.eof, length)


def deflate(parts: Sequence[Wire], encoding: int) -> bytes:
    """A REST reply's JSON and binary outputs compressed as one (level 1: fast),
    for a client that accepts ``encoding`` (the worker's, and the pool's
    response cache's again on a hit, so both are the same bytes)."""
    compressor = zlib.compressobj(1, wbits=31 if encoding == GZIP else 15)
    return b"".join([*(compressor.compress(p) for p in parts), compressor.flush()])


def inflater_of() -> zlib._Decompress:
    """An inflater for a gzip or deflate (zlib) body."""
    return zlib.decompressobj(wbits=47)  # 32 + 15: a gzip or a zlib header


def peek_inflate(inflater: zlib._Decompress, body: Wire) -> bytes:
    """The first step of inflating a compressed body, the part the pool reads
    for scheduling: at most :data:`MAX_PEEK_COMPRESSED` bytes in, at most
    ``MAX_PEEK + 1`` out. The worker inflates on from there
    (:func:`poolserve.service.inference.rest.inflate`)."""
    return inflater.decompress(body[:MAX_PEEK_COMPRESSED], MAX_PEEK + 1)


def peeked_json(out: bytes, eof: bool, length: int | None) -> bytes | None:
    """The JSON the pool reads from :func:`peek_inflate`'s ``out`` (``eof``:
    the body ended in it), or None: too large (``length``: the JSON's length
    when binary tensors follow it)."""
    if length is not None:
        return out[:length] if length <= MAX_PEEK and len(out) >= length else None
    return out if eof and len(out) <= MAX_PEEK else None


def unwrap(data: Wire) -> tuple[RestHead, Wire] | None:
    """(what the router read from the headers, the body as a slice of ``data``)
    when ``data`` is a REST wrapper, else None (a ModelInferRequest)."""
    pos, end = 0, len(data)
    # A ModelInferRequest's first field after its name and version (short, as
    # nearly all are) has a one-byte tag; every wrapper field's takes three.
    while pos + 1 < end and data[pos] in _NAME_OR_VERSION and data[pos + 1] < 0x80:
        pos += 2 + data[pos + 1]
    if pos >= end or (data[pos] < 0x80 and data[pos] not in _NAME_OR_VERSION):
        return None
    values: dict[str, Any] = {}
    pos = 0
    try:
        while pos < end:
            tag, pos = read_varint(data, pos)
            if tag in (_BODY_TAG, _JSON_HEAD_TAG):
                size, pos = read_varint(data, pos)
                if pos + size != end:
                    return None
                return RestHead(**values), data[pos:end]
            key = _VARINT_FIELDS.get(tag)
            if tag == _CALL_TAG:
                size, pos = read_varint(data, pos)
                values["call"] = bytes(data[pos : pos + size])
                pos += size
            elif key is not None:
                values[key], pos = read_varint(data, pos)
            elif tag & 7 == 2 and tag >> 3 in (1, 2):
                size, pos = read_varint(data, pos)
                pos += size
            else:
                return None  # any other field: not a wrapper
    except InvalidInput:
        return None
    return None


def is_rest(data: Wire) -> bool:
    return unwrap(data) is not None


RESERVED = WRAPPER_FIELDS  # 4089-4095, PROTOCOL_FIELD to BODY_FIELD: the wrapper's own fields


def reserved_field(data: Wire) -> int | None:
    """The first of the wrapper's fields (:data:`RESERVED`) a ModelInferRequest
    from a gRPC client carries, else None: the gRPC door refuses such a
    request, so that only the HTTP door makes REST wrappers. Top-level fields
    only, none parsed; bytes that are not a message are the parser's to refuse."""
    pos, end = 0, len(data)
    try:
        while pos < end:
            tag, pos = read_varint(data, pos)
            number, kind = tag >> 3, tag & 7
            if number in RESERVED:
                return number
            if kind == 0:
                _, pos = read_varint(data, pos)
            elif kind == 2:
                size, pos = read_varint(data, pos)
                pos += size
            elif kind == 1:
                pos += 8
            elif kind == 5:
                pos += 4
            else:
                return None
    except InvalidInput:
        return None
    return None


def refuse_reserved(data: Wire, number: int | None = None) -> None:
    """InvalidInput when a gRPC client's ModelInferRequest carries a reserved field
    (``number``: the one it carries, 0 for none, when its fields were walked
    already: :attr:`poolserve.service.contract.wire.Routing.wrapper_field`)."""
    if number is None:
        number = reserved_field(data)
    if number:
        raise InvalidInput(
            f"ModelInferRequest field {number} is reserved: fields {RESERVED.start}-"
            f"{RESERVED.stop - 1} carry the HTTP door's REST bodies inside the server "
            "and cannot come from a gRPC client"
        )


# The request parameters the pool schedules by (the schedule_policy and sequence
# extensions), read from a REST body's JSON by the pool: everything else is the
# worker's to read.
SCHEDULING = ("priority", "timeout", "idempotent", "sequence_id", "sequence_start", "sequence_end")


def encode_parameters(params: Mapping[str, object]) -> bytes:
    """JSON parameters as ModelInferRequest field 4 entries (``map<string,
    InferParameter>``): true/false as bool_param, integers as int64_param
    (uint64_param beyond), strings as string_param, other numbers as
    double_param; other values are left out (the worker says what is wrong)."""
    out = bytearray()
    for key, value in params.items():
        if isinstance(value, bool):
            param = _varint_field(1, int(value))
        elif isinstance(value, int) and -(1 << 63) <= value < 1 << 64:
            if value >= 1 << 63:
                param = _varint_field(5, value)
            else:
                param = _varint_field(2, value & ((1 << 64) - 1))
        elif isinstance(value, str):
            param = _len_field(3, value.encode())
        elif isinstance(value, float):
            param = encode_varint((4 << 3) | 1) + struct.pack("<d", value)
        else:
            continue
        out += _len_field(4, _len_field(1, key.encode()) + _len_field(2, param))
    return bytes(out)


def custom_call(method: str, path: str, query: bytes, headers: list[tuple[bytes, bytes]]) -> bytes:
    """The :data:`CALL_FIELD` of a custom endpoint's call (JSON)."""
    pairs = [[k.decode("latin-1"), v.decode("latin-1")] for k, v in headers]
    return json.dumps(
        {"method": method, "path": path, "query": query.decode("latin-1"), "headers": pairs}
    ).encode()
