"""The pool's end of its lane: every INFER frame runs as a task of the pool's
task group; CANCEL cancels it, PING is answered at once from the event loop
(the frames: :mod:`poolserve.service.contract.lane`). A STREAM_OPEN frame
starts a stream's task the same way; that stream's other frames go to it
(:mod:`poolserve.service.poolserver.lane_stream`)."""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import struct
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Protocol

from google.protobuf.message import DecodeError

from poolserve.service.contract.errors import ServingError, Unavailable
from poolserve.service.contract.framing import (
    HEADER,
    MAX_FRAME,
    Batcher,
    FrameBuffer,
    Part,
    Payload,
)
from poolserve.service.contract.lane import (
    CANCEL,
    INFER,
    PING,
    REPLY,
    STREAM_ACK,
    STREAM_CLOSE,
    STREAM_OPEN,
    STREAM_REQUEST,
    Trace,
    error_frame,
    parse_infer,
    parse_stream_open,
)
from poolserve.service.contract.rundir import FileId, claim_socket, file_id, remove_own
from poolserve.service.grpcserver.status import as_serving_error
from poolserve.service.poolserver.lane_stream import LaneStream, StreamHandler

log = logging.getLogger(__name__)

# Runs one request; raises ServingError (or anything, mapped to INTERNAL). The
# request is a view of the INFER frame's buffer when large, the reply may be one.
Handler = Callable[[Payload, float, Trace], Awaitable[Payload]]
# Optionally, first: the answer on the spot, or None when the call has to wait.
Immediate = Callable[[Payload, float, Trace], bytes | None]


class Cancellable(Protocol):
    def cancel(self) -> object: ...


# Optionally, next: the call started without a task; its reply (bytes, or the error
# as from Handler) goes to the function given, once, unless cancelled first. Returns
# what cancels it, or None when the call needs the Handler's task.
Begin = Callable[[Payload, float, Trace, Callable[[Payload | Exception], None]], Cancellable | None]


_STREAM_FRAMES = frozenset((STREAM_REQUEST, STREAM_CLOSE, STREAM_ACK))


class _ServerProtocol(asyncio.BufferedProtocol):
    """Receives straight into the frame reader's buffers (a large INFER frame
    into one of its own size, whose request body is then a view: the pool
    forwards it to a worker without a copy); writes scatter lists."""

    def __init__(self, server: LaneServer) -> None:
        self.server = server
        self.frames = FrameBuffer(server.max_frame)
        self.running: dict[int, Cancellable] = {}  # tasks, and calls begun without one
        self.streams: dict[int, LaneStream] = {}
        self.transport: asyncio.Transport | None = None
        self.batcher: Batcher | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.batcher = Batcher(transport)
        self.server.connections.add(self)

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.frames.get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        try:
            frames = self.frames.buffer_updated(nbytes)
        except ValueError as exc:
            return self._refuse(str(exc))
        for kind, seq, payload in frames:
            if kind == INFER:
                self._start(seq, payload)
            elif kind == CANCEL:
                task = self.running.pop(seq, None)
                if task is not None:
                    task.cancel()
                    if not isinstance(task, asyncio.Task):  # (a task settles as it ends)
                        self.server.settle()
            elif kind == PING:
                self._send(HEADER.pack(0, REPLY, seq))
            elif kind in _STREAM_FRAMES:
                stream = self.streams.get(seq)
                if stream is not None:  # else: a stream that ended already
                    stream.feed(kind, payload)
            elif kind == STREAM_OPEN:
                self._open(seq, payload)
            else:
                return self._refuse(f"unexpected frame kind {kind}")

    def _refuse(self, why: str) -> None:
        """Whoever sent this is not our router: end that connection, nothing else."""
        log.warning("%s lane: %s; closing the connection", self.server.where, why)
        if self.transport is not None:
            self.transport.close()

    def _start(self, seq: int, payload: Payload) -> None:
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
                self._send(HEADER.pack(len(reply), REPLY, seq), reply)
                return
        if server.begin is not None:
            try:
                begun = server.begin(body, deadline, trace, functools.partial(self._done, seq))
            except Exception as exc:
                self._send(self._error(seq, exc))
                return
            if begun is not None:  # running without a task: its reply comes to _done
                self.running[seq] = begun
                return
        self.running[seq] = server.tasks.create_task(self._run(seq, body, deadline, trace))

    def _done(self, seq: int, outcome: Payload | Exception) -> None:
        """The reply of a call begun without a task (none once it was cancelled)."""
        if self.running.pop(seq, None) is None:
            return  # cancelled, or its connection went: nobody to answer
        self.server.settle()
        if isinstance(outcome, Exception):
            self._send(self._error(seq, outcome))
        else:
            self._send(HEADER.pack(len(outcome), REPLY, seq), outcome)

    def _open(self, seq: int, payload: Payload) -> None:
        server = self.server
        if server.draining:
            self._send(error_frame(seq, Unavailable(f"{server.where} is stopping")))
            return
        if server.streamer is None:
            self._send(error_frame(seq, ServingError("lane: this pool does not serve streams")))
            return
        try:
            deadline = parse_stream_open(payload)
        except struct.error:
            self._send(error_frame(seq, ServingError("lane: malformed STREAM_OPEN frame")))
            return
        stream = self.streams[seq] = LaneStream(seq, self._send)
        task = server.tasks.create_task(self._stream(stream, server.streamer, deadline))
        self.running[seq] = task

    async def _stream(self, stream: LaneStream, handler: StreamHandler, deadline: float) -> None:
        seq = stream.seq
        try:
            await stream.run(handler, deadline)
            frame = HEADER.pack(0, REPLY, seq)  # every request answered
        except asyncio.CancelledError:
            return  # the caller gave up or the connection went: nobody to answer
        except Exception as exc:
            frame = self._error(seq, exc)
        finally:
            self.running.pop(seq, None)
            self.streams.pop(seq, None)
            self.server.settle()
        self._send(frame)

    async def _run(self, seq: int, body: Payload, deadline: float, trace: Trace) -> None:
        try:
            reply = await self.server.handler(body, deadline, trace)
            frame: tuple[Part, ...] = (HEADER.pack(len(reply), REPLY, seq), reply)  # no join
        except asyncio.CancelledError:
            return  # the caller gave up or the connection went: nobody to answer
        except Exception as exc:
            frame = (self._error(seq, exc),)
        finally:
            self.running.pop(seq, None)
            self.server.settle()
        self._send(*frame)

    @staticmethod
    def _error(seq: int, exc: Exception) -> bytes:
        if not isinstance(exc, (ServingError, DecodeError)):
            log.exception("lane: unexpected error running a request")
        return error_frame(seq, as_serving_error(exc))

    def _send(self, *parts: Part) -> None:
        if self.batcher is not None and not self.batcher.transport.is_closing():
            self.batcher.write(*parts)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if self.batcher is not None:
            self.batcher.close()
        self.server.connections.discard(self)
        running, self.running = self.running, {}
        self.streams = {}
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
        streamer: StreamHandler | None = None,
        begin: Begin | None = None,
    ) -> None:
        self.path = path
        self.handler = handler
        self.immediate = immediate
        self.begin = begin
        self.streamer = streamer
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
