"""Hostile HTTP/2 for the router's gRPC port (its own HTTP/2, service/router/http2).

grpc's own client never sends a malformed frame, so :mod:`fuzzing` never
reaches the frame layer; this does. Each case is raw bytes (frames built
with our ``frames`` module and HPACK ``Encoder``, no outside HTTP/2 code)
written on a fresh TCP connection; what the server writes back is read
frame by frame and judged (:func:`judge`):

* a VALID stream (a ModelInfer for ``echo`` with a real tensor) must end
  with grpc-status 0 and the tensor echoed, also when the case around it is
  odd but lawful (padding, PRIORITY, unknown frames, CONTINUATION, tiny DATA
  frames, gzip, Huffman and the dynamic table, PING, RST_STREAM of a closed
  stream); next to hostile frames it may instead go unanswered when the
  server ended the connection (GOAWAY with an error, or closed);
* a BAD case must be answered: GOAWAY with an error code, RST_STREAM, a
  grpc-status other than 0, or the connection closed; never grpc-status 0
  for a malformed call; never nothing within the timeout, except where the
  protocol lets a server wait (``Case.waits``): an incomplete preface or
  frame, a CONTINUATION that never ends, streams left open, a message
  whose length promises more bytes with the stream still open;
* streams opened past the connection's bound (2 * max_concurrent_streams
  + 64 not yet begun) must be RST_STREAM REFUSED_STREAM;
* whatever the case, the server's own bytes must be lawful HTTP/2: SETTINGS
  first, header blocks HPACK decodes, nothing on a stream after its
  END_STREAM but RST_STREAM, one grpc-status per stream.

Standard library and our own frames/HPACK only, beside :mod:`fuzz`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gzip
import random
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np

from poolserve.protos import inference_pb2 as pb
from poolserve.service.router.http2.frames import (
    ACK,
    END_HEADERS,
    END_STREAM,
    HEADER,
    HEADER_SIZE,
    PADDED,
    PREFACE,
    PRIORITY_FLAG,
    ErrorCode,
    Kind,
    Setting,
    frame,
    frame_header,
    goaway,
    ping,
    rst_stream,
    settings_frame,
    window_update,
)
from poolserve.service.router.http2.hpack import Decoder, Encoder, HpackError, encode_integer
from poolserve.service.router.http2.huffman import huffman_encode
from poolserve.service.router.http2.resets import COST_OPENED, COST_STARTED, RESET_BUDGET

INFER = b"/inference.GRPCInferenceService/ModelInfer"
MAX_HEADER_BYTES = 16 * 1024  # http_max_header_bytes of the fuzzed tree (the default)
MAX_STREAMS = 2 * 1024 + 64  # 2 * max_concurrent_streams + 64 (the default)
SERVER_FRAME_SIZE = 1 << 20  # the largest frame the router takes
ANSWER_TIMEOUT = 10.0  # a case the server must answer: no answer by then is wrong
WAIT_TIMEOUT = 0.5  # a case the server may lawfully leave waiting: read this long
SPLIT_SHARE = 0.2  # of the cases, written in pieces
SPLIT_MAX = 100_000  # bytes: larger cases are written whole
RESETS = int(RESET_BUDGET)  # resets (of running calls: the costliest) always let through
_ENCODER = Encoder()


@dataclass(frozen=True)
class Case:
    family: str
    data: bytes
    bad: bool = True  # something in it is malformed (else: all of it must be served)
    valid: tuple[int, ...] = ()  # streams carrying a valid call
    expect: dict[int, tuple[str, bytes]] = field(default_factory=dict)  # stream: (id, tensor)
    refused: tuple[int, ...] = ()  # streams that must get RST_STREAM REFUSED_STREAM
    waits: bool = False  # the protocol lets the server wait: no answer is fine
    any_status: bool = False  # a mutant: grpc-status 0 may be right
    cuts: tuple[int, ...] = ()  # written in pieces cut here, a moment apart (partial frames)


# -- building frames ------------------------------------------------------------


def request_headers(
    path: bytes = INFER, *extra: tuple[bytes, bytes], drop: tuple[bytes, ...] = ()
) -> list[tuple[bytes, bytes]]:
    fields = [
        (b":method", b"POST"),
        (b":scheme", b"http"),
        (b":path", path),
        (b":authority", b"fuzz"),
        (b"content-type", b"application/grpc"),
        (b"te", b"trailers"),
        *extra,
    ]
    return [(k, v) for k, v in fields if k not in drop]


def block(fields: list[tuple[bytes, bytes]]) -> bytes:
    return _ENCODER.encode(fields)


def message(body: bytes, compressed: bool = False, length: int | None = None) -> bytes:
    size = len(body) if length is None else length
    return bytes((1 if compressed else 0,)) + struct.pack(">I", size) + body


def handshake(settings: dict[Setting, int] | None = None) -> bytes:
    return PREFACE + settings_frame(settings or {})


def infer_body(rng: random.Random) -> tuple[bytes, str, bytes]:
    """A ModelInfer for echo: its bytes, its id and its tensor's raw bytes."""
    values = np.array([rng.uniform(-1e3, 1e3) for _ in range(rng.randint(1, 16))], np.float32)
    request = pb.ModelInferRequest(model_name="echo", id=f"h2-{rng.randrange(10**6)}")
    request.inputs.add(name="INPUT0", datatype="FP32", shape=[1, len(values)])
    request.raw_input_contents.append(values.tobytes())
    return request.SerializeToString(), request.id, values.tobytes()


def call_frames(stream: int, body: bytes, *extra: tuple[bytes, bytes], end: bool = True) -> bytes:
    return frame(Kind.HEADERS, END_HEADERS, stream, block(request_headers(INFER, *extra))) + frame(
        Kind.DATA, END_STREAM if end else 0, stream, message(body)
    )


def with_valid(
    family: str, rng: random.Random, hostile: bytes, stream: int, *, bad: bool = True
) -> Case:
    """``hostile`` (after the handshake), then a valid call on ``stream``."""
    body, ident, tensor = infer_body(rng)
    data = handshake() + hostile + call_frames(stream, body)
    return Case(family, data, bad=bad, valid=(stream,), expect={stream: (ident, tensor)})


# -- families ---------------------------------------------------------------------


def valid(rng: random.Random) -> Case:
    streams = tuple(range(1, 2 * rng.randint(1, 3), 2))
    data = bytearray(handshake())
    expect = {}
    for stream in streams:
        body, ident, tensor = infer_body(rng)
        data += call_frames(stream, body)
        expect[stream] = (ident, tensor)
    return Case("valid", bytes(data), bad=False, valid=streams, expect=expect)


def lawful(rng: random.Random) -> Case:
    """Odd but lawful: the call must be served exactly."""
    body, ident, tensor = infer_body(rng)
    head = block(request_headers())
    data = message(body)
    choice = rng.randrange(11)
    settings = {}
    pre = b""
    extra: tuple[tuple[bytes, bytes], ...] = ()
    if choice == 0:  # padded HEADERS and DATA
        pad = rng.randint(0, 40)
        frames = frame(Kind.HEADERS, END_HEADERS | PADDED, 1, bytes((pad,)) + head + b"\0" * pad)
        frames += frame(Kind.DATA, END_STREAM | PADDED, 1, bytes((pad,)) + data + b"\0" * pad)
    elif choice == 1:  # PRIORITY flag and PRIORITY frames, unknown frame kinds
        frames = frame(0xF3, 0xFF, 0, rng.randbytes(rng.randint(0, 30)))
        frames += frame(Kind.PRIORITY, 0, 7, b"\0\0\0\0\x10")
        frames += frame(Kind.HEADERS, END_HEADERS | PRIORITY_FLAG, 1, b"\0\0\0\0\x20" + head)
        frames += frame(0x42, 0, 1, b"x") + frame(Kind.DATA, END_STREAM, 1, data)
    elif choice == 2:  # the header block in CONTINUATIONs
        cuts = sorted(rng.sample(range(1, len(head)), min(3, len(head) - 1)))
        parts = [head[a:b] for a, b in zip([0, *cuts], [*cuts, len(head)], strict=True)]
        frames = frame(Kind.HEADERS, 0, 1, parts[0])
        for i, part in enumerate(parts[1:], 1):
            frames += frame(Kind.CONTINUATION, END_HEADERS if i == len(parts) - 1 else 0, 1, part)
        frames += frame(Kind.DATA, END_STREAM, 1, data)
    elif choice == 3:  # the message in tiny DATA frames, END_STREAM on an empty one
        frames = frame(Kind.HEADERS, END_HEADERS, 1, head)
        step = rng.randint(1, 7)
        for at in range(0, len(data), step):
            frames += frame(Kind.DATA, 0, 1, data[at : at + step])
        frames += frame(Kind.DATA, END_STREAM, 1)
    elif choice == 4:  # gzip, as grpc compresses
        extra = ((b"grpc-encoding", b"gzip"),)
        frames = frame(Kind.HEADERS, END_HEADERS, 1, block(request_headers(INFER, *extra)))
        frames += frame(Kind.DATA, END_STREAM, 1, message(gzip.compress(body), compressed=True))
    elif choice == 5:  # Huffman strings, literals indexed into the dynamic table
        hpack = bytearray()
        for name, value in request_headers(INFER, (b"x-note", b"fuzz")):
            hpack += b"\x40" + _string(name, True) + _string(value, rng.random() < 0.5)
        frames = frame(Kind.HEADERS, END_HEADERS, 1, bytes(hpack))
        frames += frame(Kind.DATA, END_STREAM, 1, data)
    elif choice == 6:  # PING, WINDOW_UPDATEs, SETTINGS of unknown ids, HEADER_TABLE_SIZE 0
        settings = {Setting.HEADER_TABLE_SIZE: 0, Setting.MAX_FRAME_SIZE: 1 << 20}
        pre = (
            ping(rng.randbytes(8))
            + window_update(0, 1 << 20)
            + frame(Kind.SETTINGS, 0, 0, struct.pack(">HI", 0x99, 7))
            + frame(Kind.SETTINGS, ACK, 0)
        )
        frames = call_frames(1, body) + window_update(1, 1000)
    elif choice == 7:  # a generous grpc-timeout, metadata, binary metadata
        extra = ((b"grpc-timeout", b"30S"), (b"x-k", b"v"), (b"x-b-bin", b"AAEC"))
        frames = call_frames(1, body, *extra)
    elif choice == 8:  # RST_STREAM of streams already answered, then the call
        pre = _answered_then()
        frames = call_frames(5, body)
    elif choice == 9:  # a small initial window: the reply waits for WINDOW_UPDATEs
        settings = {Setting.INITIAL_WINDOW_SIZE: rng.randint(1, 20)}
        frames = call_frames(1, body) + b"".join(window_update(1, 10) for _ in range(30))
    else:  # a dynamic table size update first, then the block
        frames = frame(Kind.HEADERS, END_HEADERS, 1, b"\x3f\xe1\x1f" + head)  # size 4096
        frames += frame(Kind.DATA, END_STREAM, 1, data)
    stream = 5 if choice == 8 else 1
    return Case(
        "lawful oddity",
        handshake(settings) + pre + frames,
        bad=False,
        valid=(stream,),
        expect={stream: (ident, tensor)},
    )


def _answered_then() -> bytes:
    """Stream 1 and 3: a call with a bad grpc-timeout (answered at once), then
    the client resets it (lawful: the stream is closed)."""
    bad = block(request_headers(INFER, (b"grpc-timeout", b"x")))
    out = b""
    for stream in (1, 3):
        out += frame(Kind.HEADERS, END_HEADERS | END_STREAM, stream, bad)
        out += rst_stream(stream, ErrorCode.CANCEL)
    return out


def _string(value: bytes, huffman: bool) -> bytes:
    if huffman:
        coded = huffman_encode(value)
        return _integer(len(coded), 7, 0x80) + coded
    return _integer(len(value), 7, 0) + value


def _integer(value: int, prefix: int, first: int) -> bytes:
    return bytes(encode_integer(value, prefix, first))


def preface(rng: random.Random) -> Case:
    choice = rng.randrange(7)
    if choice == 0:
        return Case("preface", settings_frame({}) + call_frames(1, b""))  # no preface
    if choice == 1:
        garbled = bytearray(PREFACE)
        garbled[rng.randrange(len(garbled))] ^= 1 << rng.randrange(8)
        return Case("preface", bytes(garbled) + settings_frame({}))
    if choice == 2:
        return Case("preface", b"POST /x HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n")
    if choice == 3:
        return Case("preface", rng.randbytes(rng.randint(1, 200)))
    if choice == 4:  # a part of the preface: the server may wait (handshake_timeout_s)
        return Case("preface", PREFACE[: rng.randint(1, len(PREFACE) - 1)], waits=True)
    if choice == 5:  # preface only, no SETTINGS yet: it may wait
        return Case("preface", PREFACE, waits=True)
    return Case("preface", PREFACE + rng.randbytes(rng.randint(9, 100)), waits=True)


def before_settings(rng: random.Random) -> Case:
    first = rng.choice(
        [
            call_frames(1, b""),
            ping(b"12345678"),
            window_update(0, 100),
            frame(Kind.DATA, 0, 1, b"x"),
            rst_stream(1, ErrorCode.CANCEL),
        ]
    )
    return Case("frame before SETTINGS", PREFACE + first + settings_frame({}))


def frame_sizes(rng: random.Random) -> Case:
    size = rng.choice([SERVER_FRAME_SIZE + 1, 2**24 - 1, rng.randint(SERVER_FRAME_SIZE + 1, 2**24)])
    size = min(size, 2**24 - 1)
    kind = rng.choice([Kind.DATA, Kind.HEADERS, Kind.SETTINGS, Kind.PING, 0x77])
    head = frame_header(kind, 0, 1 if kind in (Kind.DATA, Kind.HEADERS) else 0, size)
    if rng.random() < 0.5:  # an honest header, an incomplete frame: the server may wait
        small = rng.randint(1, 1000)
        cut = rng.randint(0, small - 1)
        return Case(
            "frame size",
            handshake() + frame_header(Kind.PING, 0, 0, small) + b"x" * cut,
            waits=True,
        )
    return Case("frame size", handshake() + head + rng.randbytes(rng.randint(0, 64)))


def bad_settings(rng: random.Random) -> Case:
    choice = rng.randrange(7)
    if choice == 0 and rng.random() < 0.3:  # a stream's window pushed past 2^31-1 (6.9.2)
        body, _, _ = infer_body(rng)
        grown = window_update(1, 2**31 - 1 - 65_535)
        bigger = settings_frame({Setting.INITIAL_WINDOW_SIZE: 2**31 - 1})
        return Case("bad SETTINGS", handshake() + call_frames(1, body, end=False) + grown + bigger)
    if choice == 0:
        payload = struct.pack(">HI", Setting.INITIAL_WINDOW_SIZE, rng.randint(2**31, 2**32 - 1))
    elif choice == 1:
        value = rng.choice([0, 1, 16_383, 2**24, 2**32 - 1])
        payload = struct.pack(">HI", Setting.MAX_FRAME_SIZE, value)
    elif choice == 2:
        payload = rng.randbytes(rng.choice([1, 5, 7, 13]))
    elif choice == 3:
        payload = struct.pack(">HI", Setting.ENABLE_PUSH, rng.randint(2, 100))
    if choice <= 3:
        bad = frame(Kind.SETTINGS, 0, 0, payload)
    elif choice == 4:
        bad = frame(Kind.SETTINGS, ACK, 0, rng.randbytes(rng.choice([1, 6, 12])))
    elif choice == 5:
        bad = frame(Kind.SETTINGS, 0, rng.choice([1, 3, 2**31 - 1]), b"")
    else:  # a good SETTINGS, then a bad one
        payload = struct.pack(">HI", Setting.INITIAL_WINDOW_SIZE, 2**31)
        return Case("bad SETTINGS", handshake() + frame(Kind.SETTINGS, 0, 0, payload))
    return Case("bad SETTINGS", PREFACE + bad)


def window_updates(rng: random.Random) -> Case:
    choice = rng.randrange(6)
    body, _, _ = infer_body(rng)
    open_call = call_frames(1, body, end=False)  # stream 1 open: its request not ended
    if choice == 0:
        return Case("WINDOW_UPDATE", handshake() + window_update(0, 0))
    if choice == 1:
        return Case("WINDOW_UPDATE", handshake() + window_update(0, 2**31 - 1) * 2)
    if choice == 2:
        bad = frame(Kind.WINDOW_UPDATE, 0, 0, rng.randbytes(rng.choice([0, 3, 5, 8])))
        return Case("WINDOW_UPDATE", handshake() + bad)
    if choice == 3:  # 0 on an open stream: a stream error; the connection goes on
        return with_valid("WINDOW_UPDATE", rng, open_call + window_update(1, 0), 3)
    if choice == 4:  # overflowing an open stream's window
        return with_valid("WINDOW_UPDATE", rng, open_call + window_update(1, 2**31 - 1) * 2, 3)
    return Case("WINDOW_UPDATE", handshake() + window_update(rng.choice([1, 9, 101]), 100))


def pings(rng: random.Random) -> Case:
    size = rng.choice([0, 1, 7, 9, 16, 64])
    bad = frame(Kind.PING, rng.choice([0, ACK]), 0, rng.randbytes(size))
    if rng.random() < 0.3:
        bad = frame(Kind.PING, 0, rng.choice([1, 3]), b"12345678")
    return Case("PING", handshake() + bad)


def rst_streams(rng: random.Random) -> Case:
    choice = rng.randrange(4)
    if choice == 0:
        bad = rst_stream(0, ErrorCode.CANCEL)
    elif choice == 1:
        bad = frame(Kind.RST_STREAM, 0, 1, rng.randbytes(rng.choice([0, 3, 5, 8])))
    elif choice == 2:  # an idle stream (never opened): a connection error (RFC 9113 6.4)
        bad = rst_stream(rng.choice([1, 3, 99]), ErrorCode.CANCEL)
    else:
        bad = rst_stream(rng.choice([2, 4]), ErrorCode.CANCEL)  # even: never opened
    return Case("RST_STREAM", handshake() + bad)


def data_frames(rng: random.Random) -> Case:
    choice = rng.randrange(4)
    body, _, _ = infer_body(rng)
    if choice == 0:
        return Case("DATA", handshake() + frame(Kind.DATA, 0, 0, message(body)))
    if choice == 1:
        return Case("DATA", handshake() + frame(Kind.DATA, END_STREAM, 3, message(body)))
    if choice == 2:  # DATA after the request's END_STREAM (half-closed): STREAM_CLOSED
        more = frame(Kind.DATA, END_STREAM, 1, message(body))
        return Case("DATA", handshake() + call_frames(1, body) + more, waits=True, any_status=True)
    # a second HEADERS (trailers) after END_STREAM
    trailers = frame(Kind.HEADERS, END_HEADERS | END_STREAM, 1, block([(b"x-t", b"1")]))
    return Case("DATA", handshake() + call_frames(1, body) + trailers, waits=True, any_status=True)


def headers_frames(rng: random.Random) -> Case:
    choice = rng.randrange(7)
    body, _, _ = infer_body(rng)
    if choice == 0:
        return Case("HEADERS", handshake() + call_frames(rng.choice([0, 2, 4, 100]), body))
    if choice == 1:  # decreasing stream ids (the first call is valid)
        body, ident, tensor = infer_body(rng)
        data = handshake() + call_frames(5, body) + call_frames(3, body)
        return Case("HEADERS", data, valid=(5,), expect={5: (ident, tensor)})
    if choice == 2:  # a stream reopened: its call is answered (0) or reset, then GOAWAY
        data = handshake() + call_frames(1, body) + call_frames(1, body)
        return Case("HEADERS", data, any_status=True)
    if choice == 3:  # trailers without END_STREAM: a stream error, the connection goes on
        trailers = frame(Kind.HEADERS, END_HEADERS, 1, block([(b"x-t", b"1")]))
        return with_valid("HEADERS", rng, call_frames(1, body, end=False) + trailers, 3)
    if choice == 4:  # PRIORITY flag with too short a payload
        short = frame(Kind.HEADERS, PRIORITY_FLAG | rng.choice([0, END_HEADERS]), 1, b"\0\0")
        return Case("HEADERS", handshake() + short)
    if choice == 5:  # PUSH_PROMISE from a client
        promise = frame(Kind.PUSH_PROMISE, END_HEADERS, 1, b"\0\0\0\2" + block(request_headers()))
        return Case("HEADERS", handshake() + call_frames(1, body, end=False) + promise)
    # another frame inside a header block
    head = block(request_headers())
    return Case("HEADERS", handshake() + frame(Kind.HEADERS, 0, 1, head) + ping(b"12345678"))


def continuations(rng: random.Random) -> Case:
    choice = rng.randrange(5)
    head = block(request_headers())
    if choice == 0:  # a flood past http_max_header_bytes
        chunk = b"\x00\x03x-f" + _integer(1000, 7, 0) + b"a" * 1000
        count = MAX_HEADER_BYTES // len(chunk) + rng.randint(2, 30)
        flood = b"".join(frame(Kind.CONTINUATION, 0, 1, chunk) for _ in range(count))
        return Case("CONTINUATION", handshake() + frame(Kind.HEADERS, 0, 1, head) + flood)
    if choice == 1:  # out of place: no HEADERS before it
        return Case("CONTINUATION", handshake() + frame(Kind.CONTINUATION, END_HEADERS, 1, head))
    if choice == 2:  # on another stream than its HEADERS
        bad = frame(Kind.HEADERS, 0, 1, head[:3]) + frame(Kind.CONTINUATION, END_HEADERS, 3, head)
        return Case("CONTINUATION", handshake() + bad)
    if choice == 3:  # after END_HEADERS (of a valid call)
        body, ident, tensor = infer_body(rng)
        more = frame(Kind.CONTINUATION, END_HEADERS, 1, b"\x82")
        data = handshake() + call_frames(1, body) + more
        return Case("CONTINUATION", data, valid=(1,), expect={1: (ident, tensor)})
    # empty CONTINUATIONs that never end the block: the server may wait
    flood = frame(Kind.CONTINUATION, 0, 1) * rng.randint(100, 3000)
    return Case("CONTINUATION", handshake() + frame(Kind.HEADERS, 0, 1, head) + flood, waits=True)


def big_headers(rng: random.Random) -> Case:
    if rng.random() < 0.5:
        extra = [(b"x-big", b"a" * rng.randint(MAX_HEADER_BYTES, 4 * MAX_HEADER_BYTES))]
    else:
        extra = [(b"x-%d" % i, b"v" * 20) for i in range(MAX_HEADER_BYTES // 50 + 50)]
    head = block(request_headers(INFER, *extra))
    if len(head) > SERVER_FRAME_SIZE:
        head = head[:SERVER_FRAME_SIZE]
    return Case("header list too large", handshake() + frame(Kind.HEADERS, END_HEADERS, 1, head))


def bad_hpack(rng: random.Random) -> Case:
    head = block(request_headers())
    choice = rng.randrange(9)
    if choice == 0:
        bad = rng.randbytes(rng.randint(1, 100))  # (may decode: then a call without POST)
    else:
        bad = [
            b"",
            b"\x00\x03x-h" + b"\x84\xff\xff\xff\xff",  # Huffman: padding over 7 bits
            b"\x00\x03x-h" + b"\x84" + huffman_encode(b"ab")[:1] + b"\xff\xff\xff",  # EOS
            b"\x3f\xe1\xff\x7f",  # a table size update far past 4096
            head + b"\x20",  # a size update after a field
            b"\x80" + head,  # index 0
            b"\xff\x80\x01" + head,  # index past the tables
            b"\x0f\xff\xff\xff\xff\xff\x0f",  # an integer past 2**31 - 1
        ][choice - 1]
        if choice == 1:
            bad = head[:-1]  # truncated: a string cut
    return Case("bad HPACK", handshake() + frame(Kind.HEADERS, END_HEADERS | END_STREAM, 1, bad))


def padding(rng: random.Random) -> Case:
    body, _, _ = infer_body(rng)
    head = block(request_headers())
    data = message(body)
    choice = rng.randrange(4)
    if choice == 0:
        bad = frame(Kind.HEADERS, END_HEADERS | PADDED, 1, bytes((len(head) + 1,)) + head)
    elif choice == 1:  # PADDED without its pad length
        bad = frame(Kind.HEADERS, END_HEADERS | PADDED, 1, b"")
    elif choice == 2:
        pad = rng.randint(len(data) + 1, 255) if len(data) < 255 else 255
        bad = frame(Kind.HEADERS, END_HEADERS, 1, head) + frame(
            Kind.DATA, END_STREAM | PADDED, 1, bytes((pad,)) + data[: max(pad - 1, 0)]
        )
    else:
        bad = frame(Kind.HEADERS, END_HEADERS, 1, head) + frame(Kind.DATA, PADDED, 1, b"")
    return Case("padding", handshake() + bad)


def grpc_messages(rng: random.Random) -> Case:
    body, _, _ = infer_body(rng)
    choice = rng.randrange(8)
    extra: tuple[tuple[bytes, bytes], ...] = ()
    if choice == 0:  # the prefix promises more than is sent, then END_STREAM
        data = message(body, length=len(body) + rng.randint(1, 10_000))
    elif choice == 1:  # compressed flag without grpc-encoding
        data = message(gzip.compress(body), compressed=True)
    elif choice == 2:  # grpc-encoding unknown
        extra = ((b"grpc-encoding", rng.choice([b"br", b"snappy", b"x" * 40])),)
        data = message(body, compressed=True)
    elif choice == 3:  # compressed garbage
        extra = ((b"grpc-encoding", rng.choice([b"gzip", b"deflate"])),)
        data = message(rng.randbytes(rng.randint(0, 200)), compressed=True)
    elif choice == 4:  # two messages on a unary call
        data = message(body) * 2
    elif choice == 5:  # no message at all / a cut prefix
        data = message(body)[: rng.randint(0, 4)]
    elif choice == 6:  # over max_message_size
        data = message(b"", length=rng.choice([1 << 21, 2**32 - 1]))
    else:  # a gzip bomb past max_message_size
        extra = ((b"grpc-encoding", b"gzip"),)
        data = message(gzip.compress(b"\0" * (4 << 20)), compressed=True)
    head = block(request_headers(INFER, *extra))
    frames = frame(Kind.HEADERS, END_HEADERS, 1, head) + frame(Kind.DATA, END_STREAM, 1, data)
    return Case("gRPC message", handshake() + frames)


def grpc_headers(rng: random.Random) -> Case:
    choice = rng.randrange(6)
    if choice == 0:
        timeout = rng.choice([b"", b"1", b"123456789S", b"1x", b"-1S", b"1.5S", b"S", b"\xff1S"])
        fields = request_headers(INFER, (b"grpc-timeout", timeout))
    elif choice == 1:
        fields = [
            (b":method", rng.choice([b"GET", b"PUT", b"post", b""])),
            *request_headers(drop=(b":method",)),
        ]
    elif choice == 2:
        fields = request_headers(drop=(b":path",))
    elif choice == 3:
        kind = rng.choice([b"text/plain", b"application/json", b"", b"application/grp"])
        fields = [*request_headers(drop=(b"content-type",)), (b"content-type", kind)]
    elif choice == 4:
        fields = request_headers(drop=(b"content-type",))
    else:
        fields = request_headers(
            rng.choice([b"/inference.GRPCInferenceService/Nope", b"", b"/", b"*"])
        )
    body, _, _ = infer_body(rng)
    frames = frame(Kind.HEADERS, END_HEADERS, 1, block(fields))
    frames += frame(Kind.DATA, END_STREAM, 1, message(body))
    return Case("gRPC headers", handshake() + frames)


def unfinished_streams(rng: random.Random) -> Case:
    """More streams than the bound, none ever ending: those past it are refused."""
    head = block(request_headers())
    extra = rng.randint(1, 20)
    count = MAX_STREAMS + extra
    data = b"".join(frame(Kind.HEADERS, END_HEADERS, 2 * i + 1, head) for i in range(count))
    refused = tuple(2 * i + 1 for i in range(MAX_STREAMS, count))
    return Case("unfinished streams", handshake() + data, refused=refused, waits=True)


def rapid_reset(rng: random.Random, count: int | None = None) -> Case:
    """A flood of calls reset right after they opened (CVE-2023-44487), then a
    valid call. Under RESETS resets (none costs more than 1) it is served; a
    flood whose resets cost past the budget even at the least each may cost
    (the request whole, its handler not run: COST_STARTED; not whole:
    COST_OPENED), with room for what time gives back, is GOAWAY
    ENHANCE_YOUR_CALM first (refusing the valid call). (Such floods are larger
    than SPLIT_MAX: written whole, each reset comes before its call's answer.)"""
    body, _, _ = infer_body(rng)
    whole = rng.random() < 0.5  # the call complete (a handler made) or not
    least = COST_STARTED if whole else COST_OPENED
    if count is None:
        over = int((RESET_BUDGET + 100) / least) + 50  # (100: two seconds of refill)
        count = rng.randint(100, RESETS - 1) if rng.random() < 0.5 else over
    one = (lambda s: call_frames(s, body)) if whole else (lambda s: call_frames(s, body, end=False))
    flood = b"".join(one(2 * i + 1) + rst_stream(2 * i + 1, ErrorCode.CANCEL) for i in range(count))
    return with_valid("rapid reset", rng, flood, 2 * count + 1, bad=count * least > RESET_BUDGET)


def client_goaway(rng: random.Random) -> Case:
    """The client said GOAWAY: a stream it opens after is refused."""
    body, _, _ = infer_body(rng)
    data = handshake() + goaway(0, ErrorCode.NO_ERROR) + call_frames(1, body)
    return Case("client GOAWAY", data, bad=False, refused=(1,))


def mutant(rng: random.Random) -> Case:
    data = bytearray(valid(rng).data)
    start = len(PREFACE) + HEADER_SIZE  # keep the preface: mutate the frames
    for _ in range(rng.randint(1, 4)):
        if len(data) <= start:
            break
        pos = rng.randrange(start, len(data))
        action = rng.randrange(4)
        if action == 0:
            data[pos] ^= 1 << rng.randrange(8)
        elif action == 1:
            del data[pos:]
        elif action == 2:
            del data[pos : pos + rng.randint(1, 8)]
        else:
            data[pos:pos] = rng.randbytes(rng.randint(1, 8))
    return Case("mutant", bytes(data), waits=True, any_status=True)


FAMILIES: tuple[tuple[Callable[[random.Random], Case], int], ...] = (
    (valid, 6),
    (lawful, 6),
    (preface, 2),
    (before_settings, 2),
    (frame_sizes, 2),
    (bad_settings, 3),
    (window_updates, 3),
    (pings, 2),
    (rst_streams, 2),
    (data_frames, 3),
    (headers_frames, 3),
    (continuations, 3),
    (big_headers, 1),
    (bad_hpack, 3),
    (padding, 2),
    (grpc_messages, 4),
    (grpc_headers, 4),
    (unfinished_streams, 1),
    (rapid_reset, 1),
    (client_goaway, 1),
    (mutant, 6),
)


def largest() -> list[Case]:
    """The largest allocations, for the warm-up: the router's heap reaches its
    size before the measured run (so that growth means a leak)."""
    rng = random.Random(0)
    out = [unfinished_streams(rng), big_headers(rng)]
    one = frame(
        Kind.HEADERS, END_HEADERS, 1, block(request_headers(INFER, (b"grpc-encoding", b"gzip")))
    )
    one += frame(
        Kind.DATA, END_STREAM, 1, message(gzip.compress(b"\0" * (4 << 20)), compressed=True)
    )
    out.append(Case("gRPC message", handshake() + one))
    out.append(rapid_reset(rng, RESETS - 1))  # the most streams served after resets
    return out * 2


def cases(seed: int) -> Iterator[Case]:
    rng = random.Random(seed)
    makers = [maker for maker, _ in FAMILIES]
    weights = [weight for _, weight in FAMILIES]
    while True:
        case = rng.choices(makers, weights)[0](rng)
        size = len(case.data)
        if 1 < size < SPLIT_MAX and rng.random() < SPLIT_SHARE:
            cuts = sorted(set(rng.sample(range(1, size), min(size - 1, rng.randint(1, 8)))))
            case = dataclasses.replace(case, cuts=tuple(cuts))
        yield case


# -- what the server answered ------------------------------------------------------


@dataclass
class Answer:
    closed: bool = False  # the server closed the connection
    http1: bool = False  # it answered in HTTP/1.1 (not HTTP/2)
    frames: int = 0
    goaway: int | None = None  # its error code
    resets: dict[int, int] = field(default_factory=dict)  # stream: code
    statuses: dict[int, int] = field(default_factory=dict)  # stream: grpc-status
    messages: dict[int, bytearray] = field(default_factory=dict)  # stream: DATA bytes
    ended: set[int] = field(default_factory=set)  # streams the server sent END_STREAM on
    faults: list[str] = field(default_factory=list)  # what the server got wrong in HTTP/2
    rest: int = 0  # bytes of an incomplete frame at the end


def parse(raw: bytes, closed: bool) -> Answer:
    """The server's bytes, frame by frame."""
    answer = Answer(closed=closed)
    if raw.startswith(b"HTTP/1.1 "):
        answer.http1 = True
        return answer
    decoder = Decoder(max_header_list_size=1 << 20)
    at = 0
    headers_seen: set[int] = set()
    while len(raw) - at >= HEADER_SIZE:
        high, low, kind, flags, stream = HEADER.unpack_from(raw, at)
        size = high << 16 | low
        if len(raw) - at - HEADER_SIZE < size:
            break
        payload = raw[at + HEADER_SIZE : at + HEADER_SIZE + size]
        at += HEADER_SIZE + size
        if answer.frames == 0 and kind != Kind.SETTINGS:
            answer.faults.append(f"the first frame is kind {kind}, not SETTINGS")
        answer.frames += 1
        if stream in answer.ended and kind in (Kind.DATA, Kind.HEADERS):
            answer.faults.append(f"kind {kind} on stream {stream} after its END_STREAM")
        if kind == Kind.GOAWAY:
            if len(payload) < 8:
                answer.faults.append("a short GOAWAY")
            elif answer.goaway is None or answer.goaway == ErrorCode.NO_ERROR:
                answer.goaway = struct.unpack_from(">I", payload, 4)[0]
        elif kind == Kind.RST_STREAM:
            if len(payload) != 4 or stream == 0:
                answer.faults.append("a malformed RST_STREAM")
            else:
                answer.resets.setdefault(stream, struct.unpack(">I", payload)[0])
        elif kind == Kind.HEADERS:
            try:
                fields = dict(decoder.decode(payload))
            except HpackError as exc:
                answer.faults.append(f"a header block HPACK cannot read: {exc}")
                continue
            if b"grpc-status" in fields:
                if stream in answer.statuses:
                    answer.faults.append(f"two grpc-status on stream {stream}")
                try:
                    answer.statuses[stream] = int(fields[b"grpc-status"])
                except ValueError:
                    answer.faults.append(f"grpc-status {fields[b'grpc-status']!r}")
            elif stream in headers_seen:
                answer.faults.append(f"a second HEADERS without grpc-status on {stream}")
            headers_seen.add(stream)
        elif kind == Kind.DATA:
            if stream not in headers_seen:
                answer.faults.append(f"DATA before HEADERS on stream {stream}")
            answer.messages.setdefault(stream, bytearray()).extend(payload)
        if flags & END_STREAM and kind in (Kind.DATA, Kind.HEADERS):
            answer.ended.add(stream)
    answer.rest = len(raw) - at
    if closed and answer.rest:
        answer.faults.append(f"closed inside a frame ({answer.rest} bytes of it)")
    return answer


def kind_of(case: Case, answer: Answer) -> str:
    """One word for the answer, for the report."""
    if answer.http1:
        return "HTTP/1.1 505"
    if answer.goaway is not None:
        return f"GOAWAY {ErrorCode(answer.goaway).name if answer.goaway < 14 else answer.goaway}"
    resets = [code for s, code in answer.resets.items() if s not in case.valid]
    statuses = [code for s, code in answer.statuses.items() if s not in case.valid]
    if resets and (resets[0] != ErrorCode.NO_ERROR or not statuses):
        return f"RST_STREAM {ErrorCode(resets[0]).name if resets[0] < 14 else resets[0]}"
    if statuses:  # (a status and RST_STREAM NO_ERROR: the request was not read to its end)
        return f"grpc-status {statuses[0]}"
    if answer.closed:
        return "closed"
    if case.valid and all(answer.statuses.get(s) == 0 for s in case.valid):
        return "served"
    return "no answer"


def _ended_by_server(answer: Answer) -> bool:
    return answer.closed or (answer.goaway is not None and answer.goaway != ErrorCode.NO_ERROR)


def _answered(case: Case, answer: Answer) -> bool:
    """A bad case got an answer that says no."""
    if answer.http1 or _ended_by_server(answer):
        return True
    if any(s not in case.valid for s in answer.resets):
        return True
    return any(code != 0 for s, code in answer.statuses.items() if s not in case.valid)


def done(case: Case, answer: Answer) -> bool:
    """Nothing more to read for the judge."""
    if answer.closed or answer.http1:
        return True
    if answer.goaway is not None and answer.goaway != ErrorCode.NO_ERROR:
        return False  # the close follows: read on until it
    streams = set(case.valid) | set(case.refused)
    if not all(s in answer.ended or s in answer.resets for s in streams):
        return False
    return not case.bad or _answered(case, answer)  # (a case that waits: until the timeout)


def judge(case: Case, answer: Answer) -> str | None:
    """What is wrong with the answer to a case, or None."""
    if answer.faults:
        return "the server broke HTTP/2: " + "; ".join(answer.faults[:3])
    ended = _ended_by_server(answer)
    for stream in case.valid:
        status = answer.statuses.get(stream)
        if status is None:
            if ended and case.bad:
                continue  # the connection ended on the hostile frames: lawful
            if answer.resets.get(stream) == ErrorCode.REFUSED_STREAM and case.bad:
                continue
            return f"valid stream {stream} got no status ({kind_of(case, answer)})"
        if status != 0:
            return f"valid stream {stream} got grpc-status {status}"
        wrong = echo_differs(bytes(answer.messages.get(stream, b"")), *case.expect[stream])
        if wrong:
            return f"valid stream {stream}: {wrong}"
    for stream in case.refused:
        code = answer.resets.get(stream)
        if code != ErrorCode.REFUSED_STREAM and not ended:
            return f"stream {stream} past the bound got {code} not REFUSED_STREAM"
    if not case.any_status:
        oks = [s for s, code in answer.statuses.items() if code == 0 and s not in case.valid]
        if oks:
            return f"grpc-status 0 for a malformed call on stream {oks[0]}"
    if case.bad and not case.waits and not _answered(case, answer):
        return f"no answer to a bad case ({kind_of(case, answer)})"
    return None


def echo_differs(data: bytes, ident: str, tensor: bytes) -> str | None:
    if len(data) < 5 or data[0] != 0 or int.from_bytes(data[1:5], "big") != len(data) - 5:
        return f"not one uncompressed gRPC message: {data[:20].hex()}"
    try:
        reply = pb.ModelInferResponse.FromString(data[5:])
    except Exception as exc:  # (protobuf's DecodeError)
        return f"not a ModelInferResponse: {exc}"
    if reply.id != ident or list(reply.raw_output_contents) != [tensor]:
        return f"not the echo: id {reply.id!r}, {len(reply.raw_output_contents)} outputs"
    return None


# -- sending -----------------------------------------------------------------------


async def send(
    host: str,
    port: int,
    case: Case,
    answer_timeout: float = ANSWER_TIMEOUT,
    wait_timeout: float = WAIT_TIMEOUT,
) -> tuple[Answer, bool]:
    """Writes the case on a new connection and reads until the judge has
    what it needs, the server closes, or the timeout (the case's answer, and
    whether the timeout ended the reading)."""
    reader, writer = await asyncio.open_connection(host, port)
    raw = bytearray()
    closed = timed_out = False

    async def write() -> None:
        with contextlib.suppress(ConnectionError):
            at = 0
            for cut in (*case.cuts, len(case.data)):
                writer.write(case.data[at:cut])
                await writer.drain()
                if cut < len(case.data):
                    await asyncio.sleep(0.001)  # (TCP_NODELAY: the piece goes out alone)
                at = cut

    writing = asyncio.get_running_loop().create_task(write())
    # a case the server may leave waiting is read for wait_timeout, unless it
    # has streams that must be answered (valid, refused)
    waits = case.waits and not case.valid and not case.refused
    timeout = wait_timeout if waits else answer_timeout
    try:
        async with asyncio.timeout(timeout):
            while True:
                try:
                    chunk = await reader.read(65536)
                except ConnectionError:
                    chunk = b""
                if not chunk:
                    closed = True
                    break
                raw += chunk
                if done(case, parse(bytes(raw), False)):
                    break
    except TimeoutError:
        timed_out = True
    finally:
        writing.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await writing
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
    return parse(bytes(raw), closed), timed_out
