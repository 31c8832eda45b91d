"""The lane: ModelInfer from the router to a pool as frames on a unix stream socket.

A second gRPC hop (an HTTP/2 client in the router, an HTTP/2 server in the
pool) cost more CPU per request than a whole single-process server spends on
a light model, so the hot path uses this instead: one stream connection per
pool, length-prefixed frames, many calls in flight on it at once.

Frames are the worker protocol's header (payload length u32, kind u8,
sequence u64, little-endian) and a payload:

- INFER (router -> pool): absolute deadline on CLOCK_MONOTONIC (f64, both
  ends are on one host), the trace context length (u16) and text
  (``traceparent`` and ``tracestate`` as ``key=value`` lines), then the
  serialized ModelInferRequest, untouched.
- CANCEL (router -> pool): no payload; the caller gave up on that sequence.
- PING (router -> pool): no payload; the pool's event loop answers it at once
  with an empty REPLY of the same sequence (the router's liveness check).
- REPLY (pool -> router): the serialized ModelInferResponse.
- ERROR (pool -> router): the :class:`Failure` (u8), the stage length (u8)
  and text, then the message.

One party owns each side's table of calls in flight: the router's protocol
object pops a sequence number when its reply, its cancel or the connection's
end arrives, whichever is first, and a reply for a sequence it no longer
holds is dropped; the pool's connection object cancels the task of a
cancelled sequence. GRPC stays on the pool's other socket for health, model
control, metadata and streaming.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import struct
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

from google.protobuf.message import DecodeError

from poolserve.service.contract.errors import (
    DeadlineExceeded,
    Failure,
    ServingError,
    Unavailable,
    error_for,
)
from poolserve.service.contract.rundir import FileId, claim_socket, file_id, remove_own
from poolserve.service.grpcserver.status import as_serving_error

log = logging.getLogger(__name__)

HEADER = struct.Struct("<IBQ")
INFER_HEAD = struct.Struct("<dH")
ERROR_HEAD = struct.Struct("<BB")

INFER = 1
CANCEL = 2
REPLY = 3
ERROR = 4
PING = 5

MAX_FRAME = (1 << 32) - 1
LANE_OVERHEAD = 64 * 1024  # an INFER frame's head and trace context, beyond the request
Trace = Sequence[tuple[str, str]]
# The pool's side: runs one request; raises ServingError (or anything, mapped to INTERNAL).
Handler = Callable[[bytes, float, Trace], Awaitable[bytes]]
# Optionally, first: the answer on the spot, or None when the call has to wait.
Immediate = Callable[[bytes, float, Trace], bytes | None]


def lane_path(pool_socket: Path) -> Path:
    """The lane socket beside a pool's gRPC socket (same length, so same limit)."""
    return pool_socket.with_name(pool_socket.stem + ".lane")


def infer_frame(seq: int, deadline: float, trace: Trace, body: bytes) -> bytes:
    text = "\n".join(f"{k}={v}" for k, v in trace).encode()
    head = INFER_HEAD.pack(deadline, len(text))
    return HEADER.pack(len(head) + len(text) + len(body), INFER, seq) + head + text + body


def parse_infer(payload: bytes) -> tuple[float, list[tuple[str, str]], bytes]:
    deadline, size = INFER_HEAD.unpack_from(payload)
    start = INFER_HEAD.size
    trace: list[tuple[str, str]] = []
    if size:
        for line in payload[start : start + size].decode("utf-8", "replace").split("\n"):
            key, _, value = line.partition("=")
            trace.append((key, value))
    return deadline, trace, payload[start + size :]


def error_frame(seq: int, error: ServingError) -> bytes:
    stage = error.stage.encode()[:255]
    payload = ERROR_HEAD.pack(int(error.failure), len(stage)) + stage + error.message.encode()
    return HEADER.pack(len(payload), ERROR, seq) + payload


def parse_error(payload: bytes) -> ServingError:
    code, size = ERROR_HEAD.unpack_from(payload)
    start = ERROR_HEAD.size
    try:
        failure = Failure(code)
    except ValueError:
        failure = Failure.INTERNAL
    error = error_for(failure, payload[start + size :].decode("utf-8", "replace"))
    error.stage = payload[start : start + size].decode("utf-8", "replace")
    return error


class FrameBuffer:
    """Cuts a byte stream into frames; keeps an incomplete tail for the next read.

    A frame announcing more than ``max_frame`` bytes is refused (ValueError)
    before any of it is buffered.
    """

    def __init__(self, max_frame: int = MAX_FRAME) -> None:
        self._buf = bytearray()
        self.max_frame = max_frame

    def feed(self, data: bytes) -> list[tuple[int, int, bytes]]:
        buf = self._buf
        buf += data
        frames: list[tuple[int, int, bytes]] = []
        pos, end = 0, len(buf)
        while end - pos >= HEADER.size:
            length, kind, seq = HEADER.unpack_from(buf, pos)
            if length > self.max_frame:
                raise ValueError(f"a frame of {length} bytes is over the limit of {self.max_frame}")
            stop = pos + HEADER.size + length
            if stop > end:
                break
            frames.append((kind, seq, bytes(buf[pos + HEADER.size : stop])))
            pos = stop
        if pos:
            del buf[:pos]
        return frames


class Batcher:
    """Frames written during one turn of the event loop leave in one write.

    Calls finish in bunches (several replies become ready in one turn), and a
    system call per frame was a tenth of the pool's CPU per light request.
    """

    __slots__ = ("frames", "loop", "transport")

    def __init__(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        self.frames: list[bytes] = []
        self.loop = asyncio.get_running_loop()

    def write(self, frame: bytes) -> None:
        if not self.frames:
            self.loop.call_soon(self._flush)
        self.frames.append(frame)

    def _flush(self) -> None:
        frames, self.frames = self.frames, []
        if not self.transport.is_closing():
            self.transport.write(frames[0] if len(frames) == 1 else b"".join(frames))


# -- the router's side ---------------------------------------------------------


class _ClientProtocol(asyncio.Protocol):
    def __init__(self, lane: LaneClient) -> None:
        self.lane = lane
        self.frames = FrameBuffer()

    def data_received(self, data: bytes) -> None:
        pending = self.lane.pending
        for kind, seq, payload in self.frames.feed(data):
            future = pending.pop(seq, None)
            if future is None or future.done():
                continue  # its caller gave up: nobody to tell
            if kind == REPLY:
                future.set_result(payload)
            else:
                future.set_exception(parse_error(payload))

    def connection_lost(self, exc: Exception | None) -> None:
        self.lane.lost(self)


class LaneClient:
    """The router's connection to one pool's lane, opened on first use."""

    def __init__(self, path: Path, where: str) -> None:
        self.path = path
        self.where = where
        self.pending: dict[int, asyncio.Future[bytes]] = {}
        self._seq = itertools.count(1)
        self._transport: Batcher | None = None
        self._protocol: _ClientProtocol | None = None
        self._connecting: asyncio.Future[None] | None = None
        self._closed = False

    async def _connect(self) -> Batcher:
        while self._transport is None:
            if self._closed:
                raise Unavailable(f"{self.where} is no longer routed")
            if self._connecting is not None:  # one connect at a time; the rest wait for it
                await asyncio.shield(self._connecting)
                continue
            loop = asyncio.get_running_loop()
            self._connecting = loop.create_future()
            try:
                transport, protocol = await loop.create_unix_connection(
                    lambda: _ClientProtocol(self), str(self.path)
                )
            except OSError as exc:
                raise Unavailable(f"{self.where} is not reachable: {exc.strerror}") from None
            finally:
                self._connecting.set_result(None)
                self._connecting = None
            self._transport, self._protocol = Batcher(transport), protocol
        return self._transport

    async def call(self, body: bytes, deadline: float, trace: Trace) -> bytes:
        """Runs one ModelInfer in the pool, waiting for it until ``deadline`` (monotonic).

        The pool ends its own part a margin earlier and answers DEADLINE_EXCEEDED
        itself, saying where the time went; this timer only fires when it cannot.
        """
        transport = self._transport or await self._connect()
        loop = asyncio.get_running_loop()
        seq = next(self._seq)
        future: asyncio.Future[bytes] = loop.create_future()
        self.pending[seq] = future
        transport.write(infer_frame(seq, deadline, trace, body))
        timer = loop.call_at(deadline, _time_out, future)  # asyncio's clock is time.monotonic
        try:
            return await future
        except asyncio.CancelledError:
            self._cancel(seq)
            raise
        except _Timeout:
            self._cancel(seq)
            raise DeadlineExceeded(
                f"deadline exceeded waiting for {self.where} to answer", stage="pool"
            ) from None
        finally:
            timer.cancel()

    async def ping(self) -> None:
        """Returns once the pool's event loop has answered a PING (no timeout here:
        the caller bounds it). Raises Unavailable when the lane is down."""
        transport = self._transport or await self._connect()
        seq = next(self._seq)
        future: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self.pending[seq] = future
        transport.write(HEADER.pack(0, PING, seq))
        try:
            await future
        finally:
            self.pending.pop(seq, None)

    def _cancel(self, seq: int) -> None:
        if self.pending.pop(seq, None) is not None and self._transport is not None:
            self._transport.write(HEADER.pack(0, CANCEL, seq))

    def lost(self, protocol: _ClientProtocol) -> None:
        if protocol is not self._protocol:
            return
        self._transport = self._protocol = None
        pending, self.pending = self.pending, {}
        for future in pending.values():
            if not future.done():
                future.set_exception(
                    Unavailable(f"{self.where} closed its lane while the call was in flight")
                )

    def close(self) -> None:
        self._closed = True
        if self._transport is not None:
            self._transport.transport.close()


class _Timeout(Exception):
    pass


def _time_out(future: asyncio.Future[bytes]) -> None:
    if not future.done():
        future.set_exception(_Timeout())


# -- the pool's side -----------------------------------------------------------


class _ServerProtocol(asyncio.Protocol):
    def __init__(self, server: LaneServer) -> None:
        self.server = server
        self.frames = FrameBuffer(server.max_frame)
        self.running: dict[int, asyncio.Task[None]] = {}
        self.transport: asyncio.Transport | None = None
        self.batcher: Batcher | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.batcher = Batcher(transport)
        self.server.connections.add(self)

    def data_received(self, data: bytes) -> None:
        try:
            frames = self.frames.feed(data)
        except ValueError as exc:
            return self._refuse(str(exc))
        for kind, seq, payload in frames:
            if kind == INFER:
                self._start(seq, payload)
            elif kind == CANCEL:
                task = self.running.pop(seq, None)
                if task is not None:
                    task.cancel()
            elif kind == PING:
                self._send(HEADER.pack(0, REPLY, seq))
            else:
                return self._refuse(f"unexpected frame kind {kind}")

    def _refuse(self, why: str) -> None:
        """Whoever sent this is not our router: end that connection, nothing else."""
        log.warning("%s lane: %s; closing the connection", self.server.where, why)
        if self.transport is not None:
            self.transport.close()

    def _start(self, seq: int, payload: bytes) -> None:
        server = self.server
        if server.draining:
            self._send(error_frame(seq, Unavailable(f"{server.where} is stopping")))
            return
        try:
            deadline, trace, body = parse_infer(payload)
        except (struct.error, ValueError):
            self._send(error_frame(seq, ServingError("lane: malformed INFER frame")))
            return
        if server.immediate is not None:
            try:
                reply = server.immediate(body, deadline, trace)
            except Exception as exc:
                self._send(self._error(seq, exc))
                return
            if reply is not None:  # answered on the spot: no task, no await
                self._send(HEADER.pack(len(reply), REPLY, seq) + reply)
                return
        self.running[seq] = server.tasks.create_task(self._run(seq, body, deadline, trace))

    async def _run(self, seq: int, body: bytes, deadline: float, trace: Trace) -> None:
        try:
            reply = await self.server.handler(body, deadline, trace)
            frame = HEADER.pack(len(reply), REPLY, seq) + reply
        except asyncio.CancelledError:
            return  # the caller gave up or the connection went: nobody to answer
        except Exception as exc:
            frame = self._error(seq, exc)
        finally:
            self.running.pop(seq, None)
            self.server.settle()
        self._send(frame)

    @staticmethod
    def _error(seq: int, exc: Exception) -> bytes:
        if not isinstance(exc, (ServingError, DecodeError)):
            log.exception("lane: unexpected error running a request")
        return error_frame(seq, as_serving_error(exc))

    def _send(self, frame: bytes) -> None:
        if self.batcher is not None and not self.batcher.transport.is_closing():
            self.batcher.write(frame)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.server.connections.discard(self)
        running, self.running = self.running, {}
        for task in running.values():
            task.cancel()
        self.server.settle()


class LaneServer:
    """The pool's lane: every request runs as a task of the pool's task group."""

    def __init__(
        self,
        path: Path,
        handler: Handler,
        where: str,
        max_frame: int = MAX_FRAME,
        immediate: Immediate | None = None,
    ) -> None:
        self.path = path
        self.handler = handler
        self.immediate = immediate
        self.where = where
        self.max_frame = max_frame
        self.connections: set[_ServerProtocol] = set()
        self.draining = False
        self._server: asyncio.base_events.Server | None = None
        self._tasks: asyncio.TaskGroup | None = None
        self._idle: asyncio.Event | None = None
        self._bound: FileId | None = None  # the socket we bound, the one we remove

    @property
    def tasks(self) -> asyncio.TaskGroup:
        assert self._tasks is not None
        return self._tasks

    async def start(self, tasks: asyncio.TaskGroup) -> None:
        self._tasks = tasks
        claim_socket(self.path)  # a live lane of another process: SocketInUse
        old = os.umask(0o177)  # 0600 from its first instant, as the gRPC socket
        try:
            self._server = await asyncio.get_running_loop().create_unix_server(
                lambda: _ServerProtocol(self), str(self.path)
            )
        finally:
            os.umask(old)
        self._bound = file_id(self.path)

    def in_flight(self) -> int:
        return sum(len(c.running) for c in self.connections)

    def settle(self) -> None:
        if self._idle is not None and self.in_flight() == 0:
            self._idle.set()

    async def stop(self, grace_s: float) -> None:
        """Refuses new calls, lets running ones finish within ``grace_s``, then closes."""
        self.draining = True
        if self._server is not None:
            self._server.close()
        self._idle = asyncio.Event()
        self.settle()
        try:
            await asyncio.wait_for(self._idle.wait(), grace_s)
        except TimeoutError:
            log.warning("lane: %d calls still running after %.1f s", self.in_flight(), grace_s)
        for connection in list(self.connections):
            if connection.transport is not None:
                connection.transport.close()
        remove_own(self.path, self._bound)
