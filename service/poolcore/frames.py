"""The frame protocol between a pool server and one of its workers.

A frame is the 13-byte header of :mod:`poolserve.service.contract.framing`
(payload length u32, kind u8, sequence u64, all little-endian, the lane's
too) and the payload. The pool sends REQUEST frames holding the
serialized ModelInferRequest; the worker answers with exactly one REPLY or
ERROR frame carrying the same sequence number, and its timings. The
sequence number lets the pool recognise a reply that belongs to a request it
has already given up on.

A REQUEST body (also inside a BATCH) may be an envelope of
:mod:`poolserve.service.contract.slab`: the request is in the router's
shared-memory slab it names, and the worker reads it there
(:mod:`poolserve.service.poolcore.slabs`). To a lone REQUEST's envelope the
worker may answer a REPLY whose body is the slab's reply reference (the
response written into the slab's reply area); batch replies, errors and
replies larger than the reply area are sent inline as ever.

Before its first request, a fresh worker runs its self-test: a WARMUP frame
names each model as its warm-up prediction starts, and one READY frame (JSON:
the models whose warm-up raised, which is no failure) says it takes requests.
A spawned worker (start_method spawn) first loads its models, each announced
by a LOADING frame.

A batch (adaptive batching) is one BATCH frame whose payload is the batch's
REQUEST frames, each with its index in the batch as sequence number; the
worker answers one BATCH_REPLY frame (the batch's sequence number) whose
payload is one REPLY or ERROR frame per request, in the same order.

A request to a decoupled model (any number of responses) is one STREAM frame
(payload: the window, u32, then the request). The worker answers a PART frame
per response as the model yields it, then the final REPLY (body: the stream's
closing response, often empty) or ERROR frame. It keeps at most ``window``
parts unacknowledged: the pool sends an ACK frame (payload: u32 count) as its
caller takes parts, and a CANCEL frame when the caller is gone, on which the
worker closes the model's generator and answers its final frame at once.
ACK and CANCEL frames carry the stream's sequence number; a worker ignores
one for a stream it already finished.

A sequence model's state lives in the worker that runs its sequence; a
SEQUENCE_END frame (JSON: model, sequence id, reason) tells that worker the
sequence ended (its end request ran, or it was idle too long) and is answered
like a request, with an empty REPLY (or an ERROR).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

from poolserve.service.contract.errors import Failure
from poolserve.service.contract.framing import HEADER, FrameReader, Part, Payload
from poolserve.service.poolcore.stats import Timings

TIMINGS = struct.Struct("<QQQ")

Frame = bytes | Sequence[Part]
"""A frame to send: its bytes, or its parts (written as a scatter list, not joined)."""
ERROR_HEAD = struct.Struct("<B")

REQUEST = 1
REPLY = 2
ERROR = 3
HEARTBEAT = 4  # worker -> pool, from the worker's heartbeat thread; seq 0, no payload
WARMUP = 5  # worker -> pool: the warm-up of this model (payload: its name) starts now
READY = 6  # worker -> pool: self-test done, requests welcome (payload: JSON report)
LOADING = 7  # worker -> pool: a spawned worker loads this model (payload: its name) now
BATCH = 8  # pool -> worker: several requests of one model, run as one batch
BATCH_REPLY = 9  # worker -> pool: one REPLY or ERROR frame per request of the batch
STREAM = 10  # pool -> worker: a request to a decoupled model (window u32, then the request)
PART = 11  # worker -> pool: one response of a stream
ACK = 12  # pool -> worker: the caller took this many parts (u32)
CANCEL = 13  # pool -> worker: the stream's caller is gone
SEQUENCE_END = 14  # pool -> worker: a sequence ended (JSON: model, id, reason); answer: REPLY
AHEAD = 15  # pool -> worker: a request sent before the one it runs ended (deadline f64, request)
SELF_TEST = (WARMUP, READY, LOADING)
COUNT = struct.Struct("<I")


@dataclass(slots=True)
class Reply:
    seq: int
    timings: Timings
    body: Payload = b""  # a large reply's body is a view of its frame's buffer
    failure: Failure | None = None
    message: str = ""
    kind: int = REPLY
    parts: list[Reply] | None = None  # a BATCH_REPLY's replies, one per request


def request_frame(seq: int, body: Payload) -> tuple[bytes, Payload]:
    """A REQUEST frame as parts (header, body): written as a scatter list, the
    body (a view of the lane's INFER frame) is not copied."""
    return HEADER.pack(len(body), REQUEST, seq), body


DEADLINE = struct.Struct("<d")


def ahead_frame(seq: int, deadline: float, body: Payload) -> tuple[bytes, Payload]:
    """An AHEAD frame as parts: a REQUEST that waits on the worker behind the one it
    runs, with its deadline (monotonic clock: the same in every process of a host)
    so that the worker does not start it once the deadline passed."""
    return HEADER.pack(DEADLINE.size + len(body), AHEAD, seq) + DEADLINE.pack(deadline), body


def batch_frame(seq: int, bodies: Sequence[Payload]) -> list[Part]:
    """A BATCH frame as parts: its header, then each request's header and body."""
    parts: list[Part] = [b""]
    for i, body in enumerate(bodies):
        parts.extend(request_frame(i, body))
    parts[0] = HEADER.pack(sum(len(part) for part in parts), BATCH, seq)
    return parts


def batch_reply_frame(seq: int, frames: Sequence[Frame]) -> list[Part]:
    """A BATCH_REPLY frame as parts: its header, then each reply frame's parts."""
    parts: list[Part] = [b""]
    for frame in frames:
        parts.extend(frame_parts(frame))
    parts[0] = HEADER.pack(sum(len(part) for part in parts), BATCH_REPLY, seq)
    return parts


def frame_parts(frame: Frame) -> Sequence[Part]:
    return (frame,) if isinstance(frame, bytes) else frame


def join_frames(frames: Sequence[Frame]) -> bytes:
    """Frames as one bytes (where they are read back at once, as an inline batch's)."""
    return b"".join(part for frame in frames for part in frame_parts(frame))


def split_frames(payload: Payload, kind: int) -> list[tuple[int, bytes]]:
    """The (sequence, payload) of each frame in a BATCH (``kind`` REQUEST) payload."""
    out: list[tuple[int, bytes]] = []
    pos = 0
    view = memoryview(payload)
    while pos < len(payload):
        if pos + HEADER.size > len(payload):
            raise ValueError("truncated frame inside a batch")
        length, got, seq = HEADER.unpack_from(payload, pos)
        pos += HEADER.size
        if got != kind or pos + length > len(payload):
            raise ValueError(f"unexpected frame kind {got} or short payload inside a batch")
        out.append((seq, bytes(view[pos : pos + length])))
        pos += length
    return out


def parse_batch_reply(seq: int, payload: bytes) -> Reply:
    parts: list[Reply] = []
    pos = 0
    while pos < len(payload):
        if pos + HEADER.size > len(payload):
            raise ValueError("truncated reply inside a batch reply")
        length, kind, index = HEADER.unpack_from(payload, pos)
        pos += HEADER.size
        if pos + length > len(payload) or index != len(parts):
            raise ValueError(f"reply {index} out of order or short inside a batch reply")
        parts.append(parse_reply(kind, index, payload[pos : pos + length]))
        pos += length
    return Reply(seq, Timings(), kind=BATCH_REPLY, parts=parts)


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


def stream_frame(seq: int, window: int, body: Payload) -> tuple[bytes, Payload]:
    """A STREAM frame as parts (header and window, body): the body is not copied."""
    return HEADER.pack(COUNT.size + len(body), STREAM, seq) + COUNT.pack(window), body


def sequence_end_frame(seq: int, body: Payload) -> tuple[bytes, Payload]:
    return HEADER.pack(len(body), SEQUENCE_END, seq), body


def part_frame(seq: int, body: bytes) -> bytes:
    return HEADER.pack(len(body), PART, seq) + body


def ack_frame(seq: int, count: int) -> bytes:
    return HEADER.pack(COUNT.size, ACK, seq) + COUNT.pack(count)


def cancel_frame(seq: int) -> bytes:
    return HEADER.pack(0, CANCEL, seq)


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
        if kind in SELF_TEST or kind == PART:
            return Reply(seq, Timings(), bytes(buf[start:stop]), kind=kind)
        if kind == HEARTBEAT:
            return None
        if kind == BATCH_REPLY:
            return parse_batch_reply(seq, bytes(buf[start:stop]))
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
