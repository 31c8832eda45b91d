"""The frame protocol between a pool server and one of its workers.

A frame is the 13-byte header of :mod:`poolserve.service.contract.framing`
(payload length u32, kind u8, sequence u64, all little-endian, the lane's
too) and the payload. The pool sends REQUEST frames holding the
serialized ModelInferRequest; the worker answers with exactly one REPLY or
ERROR frame carrying the same sequence number, and its timings. The
sequence number lets the pool recognise a reply that belongs to a request it
has already given up on.

Before its first request, a fresh worker runs its self-test: a WARMUP frame
names each model as its warm-up prediction starts, and one READY frame (JSON:
the models whose warm-up raised, which is no failure) says it takes requests.
A spawned worker (start_method spawn) first loads its models, each announced
by a LOADING frame.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

from poolserve.service.contract.errors import Failure
from poolserve.service.contract.framing import HEADER, FrameReader, Part, Payload
from poolserve.service.poolcore.stats import Timings

TIMINGS = struct.Struct("<QQQ")
ERROR_HEAD = struct.Struct("<B")

REQUEST = 1
REPLY = 2
ERROR = 3
HEARTBEAT = 4  # worker -> pool, from the worker's heartbeat thread; seq 0, no payload
WARMUP = 5  # worker -> pool: the warm-up of this model (payload: its name) starts now
READY = 6  # worker -> pool: self-test done, requests welcome (payload: JSON report)
LOADING = 7  # worker -> pool: a spawned worker loads this model (payload: its name) now
SELF_TEST = (WARMUP, READY, LOADING)


@dataclass(slots=True)
class Reply:
    seq: int
    timings: Timings
    body: Payload = b""  # a large reply's body is a view of its frame's buffer
    failure: Failure | None = None
    message: str = ""
    kind: int = REPLY


def request_frame(seq: int, body: Payload) -> tuple[bytes, Payload]:
    """A REQUEST frame as parts (header, body): written as a scatter list, the
    body (a view of the lane's INFER frame) is not copied."""
    return HEADER.pack(len(body), REQUEST, seq), body


def reply_frame(seq: int, timings: Timings, body: Part | Sequence[Part]) -> list[Part]:
    """A REPLY frame as parts: header and timings, then the body's parts (the
    response's tensors may be views of the model's arrays: never joined)."""
    parts: Sequence[Part] = (body,) if isinstance(body, (bytes, bytearray, memoryview)) else body
    size = sum(len(part) for part in parts)
    head = TIMINGS.pack(timings.decode_ns, timings.compute_ns, timings.encode_ns)
    return [HEADER.pack(TIMINGS.size + size, REPLY, seq) + head, *parts]


def error_frame(seq: int, timings: Timings, failure: Failure, message: str) -> bytes:
    text = message.encode("utf-8", "replace")
    head = TIMINGS.pack(timings.decode_ns, timings.compute_ns, timings.encode_ns)
    payload = head + ERROR_HEAD.pack(int(failure)) + text
    return HEADER.pack(len(payload), ERROR, seq) + payload


def heartbeat_frame() -> bytes:
    return HEADER.pack(0, HEARTBEAT, 0)


def warmup_frame(model: str) -> bytes:
    name = model.encode()
    return HEADER.pack(len(name), WARMUP, 0) + name


def loading_frame(model: str) -> bytes:
    name = model.encode()
    return HEADER.pack(len(name), LOADING, 0) + name


def ready_frame(report: bytes) -> bytes:
    return HEADER.pack(len(report), READY, 0) + report


class ReplyBuffer(FrameReader[Reply]):
    """Cuts a worker's byte stream into replies; keeps an incomplete tail.

    A small REPLY's body is cut straight out of the buffer (one copy of a small
    payload); a large one's is a view of the buffer it was received into
    (none). Heartbeats are consumed (the caller notes that bytes arrived at all).
    """

    def whole(self, kind: int, seq: int, payload: bytearray) -> Reply | None:
        if kind == REPLY:  # large: the body stays where it was received
            timings = Timings(*TIMINGS.unpack_from(payload))
            return Reply(seq, timings, memoryview(payload).toreadonly()[TIMINGS.size :])
        return self.cut(kind, seq, payload, 0, len(payload))

    def cut(self, kind: int, seq: int, buf: bytearray, start: int, stop: int) -> Reply | None:
        if kind == REPLY and stop - start >= TIMINGS.size:
            timings = Timings(*TIMINGS.unpack_from(buf, start))
            return Reply(seq, timings, bytes(buf[start + TIMINGS.size : stop]))
        if kind in SELF_TEST:
            return Reply(seq, Timings(), bytes(buf[start:stop]), kind=kind)
        if kind == HEARTBEAT:
            return None
        return parse_reply(kind, seq, bytes(buf[start:stop]))


def parse_reply(kind: int, seq: int, payload: bytes) -> Reply:
    if kind not in (REPLY, ERROR) or len(payload) < TIMINGS.size:
        raise ValueError(f"unexpected frame kind {kind} or short payload from worker")
    timings = Timings(*TIMINGS.unpack_from(payload))
    if kind == REPLY:
        return Reply(seq, timings, payload[TIMINGS.size :])
    (code,) = ERROR_HEAD.unpack_from(payload, TIMINGS.size)
    message = payload[TIMINGS.size + ERROR_HEAD.size :].decode("utf-8", "replace")
    try:
        failure = Failure(code)
    except ValueError:
        failure = Failure.INTERNAL
    return Reply(seq, timings, failure=failure, message=message, kind=ERROR)
