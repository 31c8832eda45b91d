"""The header blocks of gRPC replies (PROTOCOL-HTTP2.md, Responses), through
a connection's :class:`~.hpack.TableEncoder`.

The fields every reply repeats (``:status 200``, the content type, what
encodings the router takes and each ``grpc-status``) go into the
connection's dynamic table once and are one byte each after; a message and
metadata, which vary, are literals. ``grpc-accept-encoding`` says what the
router decompresses (call.py: gzip and deflate), as grpcio's server does.
"""

from __future__ import annotations

import base64

import grpc

from poolserve.service.router.http2.frames import END_HEADERS, END_STREAM, Kind, frame
from poolserve.service.router.http2.hpack import Fields, TableEncoder

Field = tuple[bytes, bytes]
Metadata = tuple[tuple[str, str | bytes], ...]

ACCEPT_ENCODING = b"identity,deflate,gzip"
_HEADERS = Fields(
    (
        (b":status", b"200"),
        (b"content-type", b"application/grpc"),
        (b"grpc-accept-encoding", ACCEPT_ENCODING),
    )
)
_STATUS = {
    code: Fields(((b"grpc-status", str(code.value[0]).encode()),)) for code in grpc.StatusCode
}
_MESSAGE_SAFE = frozenset(range(0x20, 0x7F)) - {ord("%")}
_ONLY = {code: Fields(_HEADERS + status) for code, status in _STATUS.items()}
_OK = grpc.StatusCode.OK
_OK_STATUS, _OK_ONLY = _STATUS[_OK], _ONLY[_OK]


def response_headers(encoder: TableEncoder, metadata: Metadata = ()) -> bytes:
    """The block of a reply's headers (before its first message)."""
    return encoder.encode(_HEADERS, encoded_metadata(metadata) if metadata else ())


def trailers(
    encoder: TableEncoder,
    code: grpc.StatusCode,
    details: str = "",
    metadata: Metadata = (),
    only: bool = False,
) -> bytes:
    """The block of a reply's status (``only``: Trailers-Only, the headers too)."""
    if code is _OK and not details and not metadata:
        return encoder.encode(_OK_ONLY if only else _OK_STATUS)
    fields = (_ONLY if only else _STATUS)[code]
    if not details and not metadata:
        return encoder.encode(fields)
    literal = [(b"grpc-message", percent_encoded(details))] if details else []
    return encoder.encode(fields, literal + encoded_metadata(metadata))


def trailers_only(encoder: TableEncoder, stream: int, code: grpc.StatusCode, details: str) -> bytes:
    """The one HEADERS frame of a call refused before it began."""
    block = trailers(encoder, code, details, only=True)
    return frame(Kind.HEADERS, END_HEADERS | END_STREAM, stream, block)


def percent_encoded(text: str) -> bytes:
    """grpc-message's encoding: UTF-8, with bytes outside printable ASCII and '%' as %XX."""
    raw = text.encode("utf-8", "replace")
    if all(byte in _MESSAGE_SAFE for byte in raw):
        return raw
    return b"".join(bytes((b,)) if b in _MESSAGE_SAFE else b"%%%02X" % b for b in raw)


def encoded_metadata(metadata: Metadata) -> list[Field]:
    """Metadata as header fields: ``-bin`` values in base64 without padding."""
    fields = []
    for key, value in metadata:
        if key.endswith("-bin"):
            raw = value if isinstance(value, bytes) else value.encode()
            fields.append((key.encode(), base64.b64encode(raw).rstrip(b"=")))
        else:
            text = value if isinstance(value, str) else value.decode("latin-1")
            fields.append((key.encode(), text.encode("latin-1", "replace")))
    return fields
