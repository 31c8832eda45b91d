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
- field :data:`BODY_FIELD` (bytes): the body as the client sent it.

The reply is :data:`REPLY_HEAD` (the JSON's length, u32 little-endian), the
JSON, then the binary outputs' bytes: the router answers with
``Inference-Header-Content-Length`` when anything follows the JSON.
Standard library only.
"""

from __future__ import annotations

import struct

from poolserve.service.contract.errors import InvalidInput
from poolserve.service.contract.wire import Wire, encode_varint, read_varint

HEADER_FIELD = 4094
BODY_FIELD = 4095
_HEADER_TAG = (HEADER_FIELD << 3) | 0
_BODY_TAG = (BODY_FIELD << 3) | 2
_BODY_TAG_BYTES = encode_varint(_BODY_TAG)
REPLY_HEAD = struct.Struct("<I")


def _len_field(number: int, payload: bytes) -> bytes:
    return encode_varint((number << 3) | 2) + encode_varint(len(payload)) + payload


def wrap_head(name: str, version: str, body_length: int, header_length: int | None) -> bytes:
    """Everything of the wrapper before the body's bytes (the body then follows as it is)."""
    head = _len_field(1, name.encode())
    if version:
        head += _len_field(2, version.encode())
    if header_length is not None:
        head += encode_varint(_HEADER_TAG) + encode_varint(header_length)
    return head + _BODY_TAG_BYTES + encode_varint(body_length)


def routing_head(name: str, version: str) -> bytes:
    """The wrapper's fields 1 and 2 only: what the pool peeks at (a slab's envelope head)."""
    head = _len_field(1, name.encode())
    return head + (_len_field(2, version.encode()) if version else b"")


def unwrap(data: Wire) -> tuple[int | None, Wire] | None:
    """(Inference-Header-Content-Length or None, the body as a slice of ``data``)
    when ``data`` is a REST wrapper, else None (a ModelInferRequest)."""
    header: int | None = None
    pos, end = 0, len(data)
    try:
        while pos < end:
            tag, pos = read_varint(data, pos)
            if tag == _BODY_TAG:
                size, pos = read_varint(data, pos)
                if pos + size != end:
                    raise InvalidInput("REST body is truncated")
                return header, data[pos:end]
            if tag == _HEADER_TAG:
                header, pos = read_varint(data, pos)
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
