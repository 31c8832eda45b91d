"""The lane: ModelInfer from the router to a pool as frames on a unix stream socket.

A second gRPC hop (an HTTP/2 client in the router, an HTTP/2 server in the
pool) cost more CPU per request than a whole single-process server spends on
a light model, so the hot path uses this instead: one stream connection per
pool, length-prefixed frames, many calls in flight on it at once.

Frames are the worker protocol's header (payload length u32, kind u8,
sequence u64, little-endian) and a payload:

- INFER (router -> pool, written as two parts: all before the request, and
  the request's bytes as the router got them): absolute deadline on CLOCK_MONOTONIC (f64, both
  ends are on one host), the trace context length (u16) and text
  (``traceparent`` and ``tracestate`` as ``key=value`` lines), then the
  serialized ModelInferRequest, untouched; or, for a request over 64 KiB,
  the envelope of :mod:`poolserve.service.contract.slab` (a zero byte first:
  the request is in one of the router's shared-memory slabs, and the
  envelope carries its reference and the request without its raw tensors).
- CANCEL (router -> pool): no payload; the caller gave up on that sequence.
- PING (router -> pool): no payload; the pool's event loop answers it at once
  with an empty REPLY of the same sequence (the router's liveness check).
- REPLY (pool -> router): the serialized ModelInferResponse; to an enveloped
  request it may instead be :func:`~poolserve.service.contract.slab.reply_ref`
  (a zero byte first, then the length of the response the worker wrote into
  the slab's reply area).
- ERROR (pool -> router): the :class:`Failure` (u8), the stage length (u8)
  and text, then the message.

ModelStreamInfer travels on the lane too, as a stream of frames under one
sequence number (issue 19):

- STREAM_OPEN (router -> pool): the stream's absolute deadline (f64,
  CLOCK_MONOTONIC); the pool starts the stream's task.
- STREAM_REQUEST (router -> pool): one request of the stream, the serialized
  ModelInferRequest as the router got it (with its shared-memory
  registrations in front when it names regions); or, for a request the router
  refused (one that starts with a zero byte, which no client may send), the
  refusal (:func:`refused_request`), so that the pool answers it with
  ``error_message`` in its place among the stream's responses.
- STREAM_CLOSE (router -> pool): no payload; the client sent its last request.
- STREAM_RESPONSE (pool -> router): one serialized ModelStreamInferResponse
  (a response, or a request's error in ``error_message``), sent on as it is.
- STREAM_ACK (both ways): a count (u32). Router -> pool: the client's call took
  that many responses; pool -> router: the stream took that many requests.
  Each side keeps at most a window of the other's messages unacknowledged
  (:class:`poolserve.service.contract.lane_window.Window`: a count and a byte
  budget), so a slow reader holds the pool (and through it the worker), and
  a fast writer the router, instead of filling a buffer without bound.
- The stream ends with REPLY (empty: every request answered) or ERROR (the
  stream as a whole failed, e.g. the pool is stopping); CANCEL (the client went
  away) makes the pool cancel the stream's task, which closes a decoupled
  model's generator on its worker.

The frames are cut by :mod:`poolserve.service.contract.framing`; the router's
end is :mod:`poolserve.service.router.lane_client`, the pool's
:mod:`poolserve.service.poolserver.lane_server`. One party owns each side's
table of calls in flight: the router's protocol
object pops a sequence number when its reply, its cancel or the connection's
end arrives, whichever is first, and a reply for a sequence it no longer
holds is dropped; the pool's connection object cancels the task of a
cancelled sequence. GRPC stays on the pool's other socket for health, model
control and metadata.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from pathlib import Path

from poolserve.service.contract.errors import (
    Failure,
    ServingError,
    error_for,
)
from poolserve.service.contract.framing import HEADER, Payload

INFER_HEAD = struct.Struct("<dH")
ERROR_HEAD = struct.Struct("<BB")

INFER = 1
CANCEL = 2
REPLY = 3
ERROR = 4
PING = 5
# streams (numbered apart from the unary kinds above)
STREAM_OPEN = 16
STREAM_REQUEST = 17
STREAM_CLOSE = 18
STREAM_RESPONSE = 19
STREAM_ACK = 20
STREAM_HEAD = struct.Struct("<d")
COUNT = struct.Struct("<I")

LANE_OVERHEAD = 64 * 1024  # an INFER frame's head and trace context, beyond the request
Trace = Sequence[tuple[str, str]]


def lane_path(pool_socket: Path) -> Path:
    """The lane socket beside a pool's gRPC socket (same length, so same limit)."""
    return pool_socket.with_name(pool_socket.stem + ".lane")


def infer_frame(seq: int, deadline: float, trace: Trace, body: Payload) -> tuple[bytes, Payload]:
    """An INFER frame as two parts, (header, head and trace) and the body: the
    body is written as it is (a scatter write), never copied into the frame."""
    text = "\n".join(f"{k}={v}" for k, v in trace).encode()
    head = INFER_HEAD.pack(deadline, len(text))
    return HEADER.pack(len(head) + len(text) + len(body), INFER, seq) + head + text, body


def parse_infer(payload: Payload) -> tuple[float, list[tuple[str, str]], Payload]:
    """(deadline, trace, body); the body is a slice of ``payload``: of a large
    frame's buffer (a memoryview) it is a view, no copy."""
    deadline, size = INFER_HEAD.unpack_from(payload)
    start = INFER_HEAD.size
    trace: list[tuple[str, str]] = []
    if size:
        for line in bytes(payload[start : start + size]).decode("utf-8", "replace").split("\n"):
            key, _, value = line.partition("=")
            trace.append((key, value))
    return deadline, trace, payload[start + size :]


def error_frame(seq: int, error: ServingError) -> bytes:
    stage = error.stage.encode()[:255]
    payload = ERROR_HEAD.pack(int(error.failure), len(stage)) + stage + error.message.encode()
    return HEADER.pack(len(payload), ERROR, seq) + payload


def parse_error(payload: Payload) -> ServingError:
    code, size = ERROR_HEAD.unpack_from(payload)
    start = ERROR_HEAD.size
    try:
        failure = Failure(code)
    except ValueError:
        failure = Failure.INTERNAL
    error = error_for(failure, bytes(payload[start + size :]).decode("utf-8", "replace"))
    error.stage = bytes(payload[start : start + size]).decode("utf-8", "replace")
    return error


def stream_open_frame(seq: int, deadline: float) -> bytes:
    return HEADER.pack(STREAM_HEAD.size, STREAM_OPEN, seq) + STREAM_HEAD.pack(deadline)


def parse_stream_open(payload: Payload) -> float:
    """The stream's deadline (struct.error when the payload is malformed)."""
    return float(STREAM_HEAD.unpack_from(payload)[0])


REFUSED = b"\x00refused1"  # a zero byte first: never a client's request on the lane


def refused_request(message: str) -> bytes:
    """A STREAM_REQUEST payload that stands for a request the router refused."""
    return REFUSED + message.encode()


def refusal(payload: Payload) -> str | None:
    """The router's reason when ``payload`` stands for a refused request, else None."""
    if bytes(payload[: len(REFUSED)]) != REFUSED:
        return None
    return bytes(payload[len(REFUSED) :]).decode("utf-8", "replace")


def stream_ack_frame(seq: int, count: int) -> bytes:
    return HEADER.pack(COUNT.size, STREAM_ACK, seq) + COUNT.pack(count)


def parse_count(payload: Payload) -> int:
    """A STREAM_ACK's count; 0 for a malformed one."""
    return int(COUNT.unpack_from(payload)[0]) if len(payload) == COUNT.size else 0
