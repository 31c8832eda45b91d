"""HTTP/2 frames (RFC 9113 section 4 and 6): the numbers of the wire and the
bytes of the frames the router's gRPC door writes."""

from __future__ import annotations

import struct
from enum import IntEnum
from typing import overload

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
HEADER = struct.Struct(">BHBBI")  # length (24 bits: high byte, low 16), type, flags, stream
HEADER_SIZE = 9
DEFAULT_WINDOW = 65_535
DEFAULT_FRAME_SIZE = 16_384
MAX_WINDOW = 2**31 - 1
MAX_FRAME_SIZE_LIMIT = 2**24 - 1


class Kind(IntEnum):
    DATA = 0
    HEADERS = 1
    PRIORITY = 2
    RST_STREAM = 3
    SETTINGS = 4
    PUSH_PROMISE = 5
    PING = 6
    GOAWAY = 7
    WINDOW_UPDATE = 8
    CONTINUATION = 9


END_STREAM = 0x1
ACK = 0x1
END_HEADERS = 0x4
PADDED = 0x8
PRIORITY_FLAG = 0x20


class ErrorCode(IntEnum):
    NO_ERROR = 0x0
    PROTOCOL_ERROR = 0x1
    INTERNAL_ERROR = 0x2
    FLOW_CONTROL_ERROR = 0x3
    SETTINGS_TIMEOUT = 0x4
    STREAM_CLOSED = 0x5
    FRAME_SIZE_ERROR = 0x6
    REFUSED_STREAM = 0x7
    CANCEL = 0x8
    COMPRESSION_ERROR = 0x9
    CONNECT_ERROR = 0xA
    ENHANCE_YOUR_CALM = 0xB
    INADEQUATE_SECURITY = 0xC
    HTTP_1_1_REQUIRED = 0xD


class Setting(IntEnum):
    HEADER_TABLE_SIZE = 0x1
    ENABLE_PUSH = 0x2
    MAX_CONCURRENT_STREAMS = 0x3
    INITIAL_WINDOW_SIZE = 0x4
    MAX_FRAME_SIZE = 0x5
    MAX_HEADER_LIST_SIZE = 0x6


class ConnectionError_(Exception):
    """The peer broke the protocol: the connection ends with GOAWAY ``code``."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class StreamError(Exception):
    """The peer broke the protocol on one stream: it is reset with ``code``."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    size = len(payload)
    return HEADER.pack(size >> 16, size & 0xFFFF, kind, flags, stream) + payload


def header_frames(stream: int, block: bytes, end: bool, max_size: int) -> bytes:
    """A header block as one HEADERS frame or, past the peer's
    SETTINGS_MAX_FRAME_SIZE (``max_size``), HEADERS and CONTINUATION frames
    (RFC 9113 4.2, 6.10), to be written as one piece: nothing between them."""
    flags = END_STREAM if end else 0
    if len(block) <= max_size:
        return frame(Kind.HEADERS, flags | END_HEADERS, stream, block)
    last = len(block) - max_size
    out = [frame(Kind.HEADERS, flags, stream, block[:max_size])]
    for at in range(max_size, len(block), max_size):
        more = END_HEADERS if at >= last else 0
        out.append(frame(Kind.CONTINUATION, more, stream, block[at : at + max_size]))
    return b"".join(out)


def frame_header(kind: int, flags: int, stream: int, size: int) -> bytes:
    return HEADER.pack(size >> 16, size & 0xFFFF, kind, flags, stream)


def settings_frame(values: dict[Setting, int]) -> bytes:
    payload = b"".join(struct.pack(">HI", key, value) for key, value in values.items())
    return frame(Kind.SETTINGS, 0, 0, payload)


SETTINGS_ACK = frame(Kind.SETTINGS, ACK, 0)


def parse_settings(payload: bytes) -> list[tuple[int, int]]:
    if len(payload) % 6:
        raise ConnectionError_(ErrorCode.FRAME_SIZE_ERROR, "SETTINGS length not a multiple of 6")
    return [struct.unpack_from(">HI", payload, at) for at in range(0, len(payload), 6)]


def window_update(stream: int, increment: int) -> bytes:
    return frame(Kind.WINDOW_UPDATE, 0, stream, struct.pack(">I", increment))


def rst_stream(stream: int, code: ErrorCode) -> bytes:
    return frame(Kind.RST_STREAM, 0, stream, struct.pack(">I", code))


def goaway(last_stream: int, code: ErrorCode, debug: bytes = b"") -> bytes:
    return frame(Kind.GOAWAY, 0, 0, struct.pack(">II", last_stream, code) + debug)


def ping(opaque: bytes, ack: bool = False) -> bytes:
    return frame(Kind.PING, ACK if ack else 0, 0, opaque)


@overload
def unpadded(flags: int, payload: bytes) -> bytes: ...
@overload
def unpadded(flags: int, payload: bytes | memoryview) -> bytes | memoryview: ...
def unpadded(flags: int, payload: bytes | memoryview) -> bytes | memoryview:
    """A DATA or HEADERS payload without its padding (PADDED flag)."""
    if not flags & PADDED:
        return payload
    if not payload:
        raise ConnectionError_(ErrorCode.PROTOCOL_ERROR, "padded frame without its pad length")
    pad = payload[0]
    if pad >= len(payload):
        raise ConnectionError_(ErrorCode.PROTOCOL_ERROR, "padding longer than the frame")
    return payload[1 : len(payload) - pad]
