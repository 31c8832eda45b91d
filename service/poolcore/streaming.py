"""A worker's side of a stream (a request to a decoupled model), and of a
sequence's end notice (:func:`end_sequence`).

The handler's ``stream`` attribute turns the request into an iterator of
frames: one PART frame per response the model yields, then the final REPLY
or ERROR frame. Each part is sent as soon as it is produced, but at most
``window`` of them unacknowledged: past that the worker waits for the pool's
ACK. Between parts it looks (without waiting) for a CANCEL; on one, or on the
pool's socket closing, the iterator is closed (so is the model's generator,
which sees GeneratorExit) and the stream ends.

All reads go through the worker's one buffered reader, so frames are seen in
order; a CANCEL that arrived in the same read as an earlier frame is seen at
the latest when the window fills, since the pool acknowledges nothing after
it cancelled.
"""

from __future__ import annotations

import select
import socket
import threading
from collections.abc import Callable, Generator
from typing import BinaryIO

from poolserve.service.contract.errors import Failure
from poolserve.service.contract.framing import HEADER
from poolserve.service.poolcore.frames import (
    ACK,
    CANCEL,
    COUNT,
    PART,
    Frame,
    error_frame,
    frame_parts,
    join_frames,
)
from poolserve.service.poolcore.stats import Timings

StreamHandler = Callable[[bytes, int], Generator[Frame, None, None]]
"""(request body, sequence number) -> PART frames, then one REPLY or ERROR frame."""


class Cancelled(Exception):
    """The pool cancelled the stream."""


def _read_exact(reader: BinaryIO, size: int) -> bytes:
    data = reader.read(size) if size else b""
    if data is None or len(data) < size:
        raise ConnectionResetError("the pool closed the worker's socket")
    return data


def _control(reader: BinaryIO, sock: socket.socket, seq: int, wait: bool) -> int:
    """Reads the pool's frames for this stream: the parts acknowledged; waits for
    one frame if ``wait``, then reads only what is there. Raises Cancelled."""
    acked = 0
    while wait or select.select([sock], [], [], 0)[0]:
        wait = False
        length, kind, got = HEADER.unpack(_read_exact(reader, HEADER.size))
        payload = _read_exact(reader, length)
        if got != seq:
            continue  # an ACK or CANCEL for a stream that already ended
        if kind == CANCEL:
            raise Cancelled
        if kind == ACK and len(payload) == COUNT.size:
            acked += COUNT.unpack(payload)[0]
    return acked


def run_stream(
    sock: socket.socket,
    reader: BinaryIO,
    handler: object,
    seq: int,
    payload: bytes,
    send_lock: threading.Lock,
) -> Frame:
    """Streams one request's parts to the pool; returns the final frame to send."""
    produce: StreamHandler | None = getattr(handler, "stream", None)
    if produce is None or len(payload) < COUNT.size:
        return error_frame(
            seq, Timings(), Failure.UNIMPLEMENTED, "this worker does not serve streams"
        )
    (window,) = COUNT.unpack_from(payload)
    window = max(1, window)
    frames = produce(payload[COUNT.size :], seq)
    unacked = 0
    try:
        for frame in frames:
            if HEADER.unpack_from(frame_parts(frame)[0])[1] != PART:
                return frame  # the final REPLY (as parts) or ERROR
            unacked -= _control(reader, sock, seq, wait=False)
            while unacked >= window:
                unacked -= _control(reader, sock, seq, wait=True)
            with send_lock:
                sock.sendall(join_frames([frame]))  # a PART frame is one bytes
            unacked += 1
    except Cancelled:
        pass
    finally:
        frames.close()
    return error_frame(seq, Timings(), Failure.CANCELLED, "the stream was cancelled")


def end_sequence(handler: object, seq: int, body: bytes) -> Frame:
    """A SEQUENCE_END notice to the handler's ``sequence_end`` (body -> frame)."""
    notify: Callable[[bytes, int], Frame] | None = getattr(handler, "sequence_end", None)
    if notify is None:
        return error_frame(
            seq, Timings(), Failure.UNIMPLEMENTED, "this worker does not serve sequences"
        )
    return notify(body, seq)
