"""A worker: forked from its pool's zygote with the models already in memory.

It serves one request at a time from its socket: read a REQUEST frame, hand
its opaque body to the pool's request handler, write the one REPLY or ERROR
frame the handler returns. An AHEAD frame is a request the pool sent while
the one before ran (:mod:`poolserve.service.poolcore.ahead`): it runs the
same way, unless its deadline passed while it waited (a DEADLINE error, the
model never called). The handler is what the zygote was built with:
:func:`poolserve.service.inference.cargo.inference_handler` (a serialized
ModelInferRequest, for the pool server) or the WorkerPool's pickled ``score`` calls
(:mod:`poolserve.service.workerpool.scoring`). A model exception becomes an error frame,
never a dead worker. It exits when the pool closes the socket, and dies with
the zygote (PR_SET_PDEATHSIG plus a parent check).

Before its first request it runs its self-test: one warm-up prediction per
model (:data:`Warmup`), each announced by a WARMUP frame, then one READY
frame. A model that cannot survive the fork hangs or crashes here, where the
pool can name it, instead of in a caller's request.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import BinaryIO, NoReturn, cast

from poolserve.service.contract.errors import Failure, ServingError
from poolserve.service.contract.framing import HEADER, IOV_MAX, Payload, flat
from poolserve.service.contract.slab import Mapper
from poolserve.service.poolcore.frames import (
    ACK,
    AHEAD,
    BATCH,
    CANCEL,
    DEADLINE,
    REQUEST,
    SEQUENCE_END,
    STREAM,
    Frame,
    batch_reply_frame,
    error_frame,
    frame_parts,
    heartbeat_frame,
    loading_frame,
    ready_frame,
    split_frames,
    warmup_frame,
)
from poolserve.service.poolcore.slabs import put_reply, take
from poolserve.service.poolcore.stats import Timings
from poolserve.service.poolcore.streaming import end_sequence, run_stream

FrameOut = Frame
"""A frame to send: its bytes, or its parts (written as a scatter list, not joined)."""
Handler = Callable[[bytes, int], FrameOut]
"""A request handler: (request body, sequence number) -> one REPLY or ERROR frame.

A handler that batches has a ``batch`` attribute: (the batch's request bodies)
-> one REPLY or ERROR frame per request, each with its index as sequence
number. Without one, a batch's requests run one after the other."""

BatchHandler = Callable[[list[bytes]], list[FrameOut]]


def run_batch(handler: Handler, bodies: list[bytes]) -> list[FrameOut]:
    batch: BatchHandler | None = getattr(handler, "batch", None)
    if batch is not None:
        return batch(bodies)
    return [handler(body, i) for i, body in enumerate(bodies)]


Warmup = tuple[str, Callable[[], object]]
"""A model's warm-up: (model name, one prediction on an example input)."""


def _read_exact(stream: BinaryIO, size: int) -> bytes | None:
    # A large read goes straight from the socket into the bytes it returns
    # (BufferedReader reads past its buffer): the body's only copy, the kernel's.
    data = stream.read(size)
    if data is None or len(data) < size:
        return None
    return data


def serve(sock: socket.socket, handler: Handler, send_lock: threading.Lock) -> None:
    stream = sock.makefile("rb")
    slabs = Mapper()  # the router's slabs this worker has mapped (large requests)
    while True:
        header = _read_exact(stream, HEADER.size)
        if header is None:
            return
        length, kind, seq = HEADER.unpack(header)
        deadline = None
        if kind == AHEAD:  # a request sent while we ran the one before: its deadline first
            head = _read_exact(stream, DEADLINE.size) if length >= DEADLINE.size else None
            if head is None:
                return
            (deadline,) = DEADLINE.unpack(head)
            length -= DEADLINE.size
        body = _read_exact(stream, length)
        if kind in (ACK, CANCEL):
            continue  # for a stream that already ended
        if body is None or kind not in (REQUEST, BATCH, STREAM, SEQUENCE_END, AHEAD):
            return
        if deadline is not None and time.monotonic() >= deadline:
            frame: FrameOut = error_frame(seq, Timings(), Failure.DEADLINE, LATE_AHEAD)
        elif kind == STREAM:
            frame = run_stream(sock, stream, handler, seq, body, send_lock)
        elif kind == SEQUENCE_END:
            frame = end_sequence(handler, seq, body)
        elif kind == BATCH:
            frame = batch_reply_frame(seq, _run_batch(handler, slabs, body))
        else:
            frame = _run_request(handler, slabs, body, seq)
        del body  # a large request is not kept alive while we wait for the next
        with send_lock:
            send_frame(sock, frame)
        del frame  # nor a large reply (its parts may be views of the request)


def _run_batch(handler: Handler, slabs: Mapper, body: Payload) -> list[FrameOut]:
    """A batch's requests; a large one is a view of its slab (replies go inline)."""
    bodies: list[bytes] = []
    refused: dict[int, FrameOut] = {}
    for i, (_, part) in enumerate(split_frames(body, REQUEST)):
        try:  # a view is read as bytes are: only the inference handler gets envelopes
            bodies.append(cast(bytes, take(slabs, part)[1]))
        except ServingError as exc:
            refused[i] = error_frame(i, Timings(), exc.failure, exc.message)
    if not refused:
        return run_batch(handler, bodies)
    frames: list[FrameOut] = []
    ran = iter(run_batch(handler, bodies)) if bodies else iter(())
    for i in range(len(bodies) + len(refused)):
        frames.append(refused[i] if i in refused else _renumber(next(ran), i))
    return frames


def _renumber(frame: FrameOut, seq: int) -> FrameOut:
    """A frame with another sequence number (a batch reply's index)."""
    parts = list(frame_parts(frame))
    first = bytes(parts[0])
    length, kind, _ = HEADER.unpack_from(first)
    parts[0] = HEADER.pack(length, kind, seq) + first[HEADER.size :]
    return parts


def _run_request(handler: Handler, slabs: Mapper, body: Payload, seq: int) -> FrameOut:
    """One request; an enveloped one is read from its slab and, when its reply
    fits, answered there (:mod:`poolserve.service.contract.slab`)."""
    try:
        ref, request = take(slabs, body)
        if ref is None:
            return handler(cast(bytes, body), seq)
        frame = handler(cast(bytes, request), seq)  # a view: read as bytes are
        del request
        return put_reply(slabs, ref, seq, frame)
    except ServingError as exc:
        return error_frame(seq, Timings(), exc.failure, exc.message)
    except OSError as exc:  # a slab that cannot be mapped or written
        return error_frame(seq, Timings(), Failure.INTERNAL, f"slab: {exc}")


def send_frame(sock: socket.socket, frame: FrameOut) -> None:
    """Sends all of a frame; parts go out as scatter lists (``sendmsg``), a short
    write resumes from a view of the rest (no join, no copy)."""
    if isinstance(frame, bytes):
        sock.sendall(frame)
        return
    parts = [flat(part) for part in frame if len(part)]
    while parts:
        sent = sock.sendmsg(parts[:IOV_MAX])
        while sent:
            if sent >= len(parts[0]):
                sent -= len(parts.pop(0))
            else:
                parts[0] = parts[0][sent:]
                sent = 0


def self_test(sock: socket.socket, warmups: Sequence[Warmup], send_lock: threading.Lock) -> None:
    """One warm-up prediction per model, then READY.

    A warm-up that raises is no failure: the model answered (zeros may well be
    invalid input for it). Only a hang (the pool's limit) or a death counts.
    """
    raised: dict[str, str] = {}
    for name, predict in warmups:
        with send_lock:
            sock.sendall(warmup_frame(name))
        try:
            predict()
        except Exception as exc:
            raised[name] = f"{type(exc).__name__}: {exc}"[:500]
    with send_lock:
        sock.sendall(ready_frame(json.dumps({"raised": raised}).encode()))


def heartbeat(sock: socket.socket, send_lock: threading.Lock, interval: float) -> None:
    """Runs in its own thread: a worker whose main thread hangs (or holds the GIL
    in C code) stops these, and the pool kills it."""
    frame = heartbeat_frame()
    while True:
        time.sleep(interval)
        try:
            with send_lock:
                sock.sendall(frame)
        except OSError:
            return


def run(
    sock: socket.socket, handler: Handler, heartbeat_s: float, warmups: Sequence[Warmup] = ()
) -> NoReturn:
    """The worker's whole life, called in the child right after fork."""
    run_prepared(sock, heartbeat_s, lambda announce: (handler, warmups))


Prepare = Callable[[Callable[[str], None]], tuple[Handler, Sequence[Warmup]]]
"""Loads what a spawned worker serves, announcing each model: (handler, warm-ups)."""


def run_prepared(sock: socket.socket, heartbeat_s: float, prepare: Prepare) -> NoReturn:
    """A worker's life: heartbeat, ``prepare`` (a spawned worker's loads), self-test, serve."""
    # The pool owns shutdown: a terminal's Ctrl-C or a SIGTERM to the process group
    # is not for us. A worker ends when its socket closes, or dies with the zygote.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    send_lock = threading.Lock()
    beat = threading.Thread(
        target=heartbeat, args=(sock, send_lock, heartbeat_s), name="heartbeat", daemon=True
    )
    beat.start()

    def announce(model: str) -> None:
        with send_lock:
            sock.sendall(loading_frame(model))

    try:
        handler, warmups = prepare(announce)
        self_test(sock, warmups, send_lock)
        serve(sock, handler, send_lock)
    except OSError as exc:
        if not pool_gone(exc):
            # Anything else is a death, said as one: a reply whose bytes cannot be
            # read (EFAULT: a view of a mapping that shrank) once exited 0 here,
            # logged as "exited with code 0" as if the pool had closed us.
            print(f"poolserve worker {os.getpid()}: {type(exc).__name__}: {exc}", file=sys.stderr)
            sys.stderr.flush()
            os._exit(EXIT_OS_ERROR)
    os._exit(0)


EXIT_OS_ERROR = 4  # (3 is a spawned worker's failed load)
LATE_AHEAD = "deadline passed while the request waited on its worker; not started"
_POOL_GONE = {errno.EPIPE, errno.ECONNRESET, errno.ENOTCONN, errno.ESHUTDOWN, errno.EBADF}


def pool_gone(exc: OSError) -> bool:
    """Whether an error on the worker's socket means the pool closed its end."""
    return isinstance(exc, ConnectionError) or exc.errno in _POOL_GONE
