"""The one frame codec of poolserve's byte streams: the lane (router <-> pool)
and a worker's socket (pool <-> worker) both carry length-prefixed frames with
this header (payload length u32, kind u8, sequence u64, little-endian).

Tensor bytes cross these streams on every request, so both directions move
them without copies in user space (issue 20; README "Large tensors"):

- :class:`FrameReader` is fed by an :class:`asyncio.BufferedProtocol`: the
  event loop receives (``recv_into``) straight into the reader's buffers.
  Headers and small frames land in one reused chunk and are copied out (they
  are small); a frame announcing more than :data:`SMALL_FRAME` bytes gets a
  buffer of exactly its size, and the loop receives the rest of it straight
  there. That buffer is then handed over whole, as a :class:`memoryview`:
  no copy of the payload, and slicing it (the INFER head, a reply's timings)
  copies nothing either. :class:`FrameBuffer` (the lane's) makes each frame a
  (kind, sequence, payload); the worker socket's reader
  (:class:`poolserve.service.poolcore.frames.ReplyBuffer`) unpacks a reply's
  timings head from the buffer instead.
- :class:`Batcher` sends frames given as parts (a header, a body view) with
  scatter lists (``writev``, a socket's ``sendmsg`` without flags): the
  frames written during one event-loop turn leave in one system call
  (right after that turn's callbacks when the reader that woke them armed
  :mod:`~poolserve.service.contract.turns`), without being joined, and a
  short write keeps views of what is left, never a copy.
"""

from __future__ import annotations

import asyncio
import os
import struct
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Generic, TypeVar

from poolserve.service.contract.turns import turn_end

HEADER = struct.Struct("<IBQ")
MAX_FRAME = (1 << 32) - 1
CHUNK = 256 * 1024  # the reused receive buffer (asyncio reads 256 KiB at a time too)
SMALL_FRAME = 64 * 1024  # a larger payload is received into a buffer of its own
IOV_MAX = 1024  # parts per sendmsg (Linux's UIO_MAXIOV)

Payload = bytes | memoryview
"""A frame's payload: a small frame's own bytes, or a view of a large frame's buffer."""
Frame = tuple[int, int, Payload]
"""A frame as :class:`FrameBuffer` cuts it: (kind, sequence, payload)."""

T = TypeVar("T")


class FrameReader(Generic[T]):
    """Cuts a byte stream into frames, receiving large payloads in place.

    Use as the buffer side of a BufferedProtocol: :meth:`get_buffer` says where
    the next bytes go, :meth:`buffer_updated` returns the frames they completed.
    :meth:`feed` does both for bytes received elsewhere (tests, other readers).
    Each complete frame becomes what :meth:`cut` (a small frame, out of the
    reused chunk: copy what you keep) or :meth:`whole` (a large frame's own
    buffer: keep it, no copy) makes of it (None: the frame is consumed, e.g. a
    heartbeat). A frame announcing more than ``max_frame`` bytes is refused
    (ValueError) before any of it is buffered.
    """

    def __init__(self, max_frame: int = MAX_FRAME) -> None:
        self.max_frame = max_frame
        self._buf = bytearray(CHUNK)
        self._start = 0  # unparsed bytes are self._buf[self._start : self._end]
        self._end = 0
        self._big: bytearray | None = None  # the large frame being received
        self._filled = 0
        self._kind = 0
        self._seq = 0

    def get_buffer(self, sizehint: int = -1) -> memoryview:
        if self._big is not None:
            return memoryview(self._big)[self._filled :]
        if self._end == len(self._buf):  # room at the end: move the unparsed tail to the front
            tail = self._end - self._start
            self._buf[:tail] = self._buf[self._start : self._end]
            self._start, self._end = 0, tail
        return memoryview(self._buf)[self._end :]

    def buffer_updated(self, nbytes: int) -> list[T]:
        frames: list[T] = []
        if self._big is not None:
            self._filled += nbytes
            self._finish_big(frames)
            return frames
        self._end += nbytes
        self._parse(frames)
        return frames

    def feed(self, data: bytes | bytearray | memoryview) -> list[T]:
        frames: list[T] = []
        view = memoryview(data)
        while view:
            target = self.get_buffer()
            size = min(len(target), len(view))
            target[:size] = view[:size]
            frames += self.buffer_updated(size)
            view = view[size:]
        return frames

    def _parse(self, frames: list[T]) -> None:
        buf, pos, end = self._buf, self._start, self._end
        while end - pos >= HEADER.size:
            length, kind, seq = HEADER.unpack_from(buf, pos)
            if length > self.max_frame:
                raise ValueError(f"a frame of {length} bytes is over the limit of {self.max_frame}")
            start = pos + HEADER.size
            if length > SMALL_FRAME:
                # Its own buffer: what already arrived (at most a chunk) is copied
                # over, the rest is received straight into it.
                have = min(end - start, length)
                self._big = bytearray(length)
                self._big[:have] = buf[start : start + have]
                self._filled, self._kind, self._seq = have, kind, seq
                pos = start + have
                self._start = self._end = 0
                if not self._finish_big(frames):  # more to come: the chunk is empty
                    return
                # complete already: keep cutting what followed it in the chunk
                tail = end - pos
                buf[:tail] = buf[pos:end]
                self._start, self._end = 0, tail
                pos, end = 0, tail
                continue
            stop = start + length
            if stop > end:
                break
            frame = self.cut(kind, seq, buf, start, stop)
            if frame is not None:
                frames.append(frame)
            pos = stop
        if pos == end:
            self._start = self._end = 0
        else:
            self._start = pos

    def _finish_big(self, frames: list[T]) -> bool:
        """Delivers the large frame if it is complete; says whether it was."""
        big = self._big
        if big is None or self._filled < len(big):
            return False
        self._big = None
        frame = self.whole(self._kind, self._seq, big)
        if frame is not None:
            frames.append(frame)
        return True

    def cut(self, kind: int, seq: int, buf: bytearray, start: int, stop: int) -> T | None:
        """The small frame ``kind``/``seq`` whose payload is ``buf[start:stop]``
        (the buffer is reused: copy what is kept)."""
        raise NotImplementedError

    def whole(self, kind: int, seq: int, payload: bytearray) -> T | None:
        """The large frame ``kind``/``seq`` whose payload is all of ``payload``
        (a buffer of its own: keep views of it, no copy)."""
        return self.cut(kind, seq, payload, 0, len(payload))


class FrameBuffer(FrameReader[Frame]):
    """Frames as (kind, sequence, payload): a small payload's own bytes (one
    copy, of a small frame), a large one's buffer as a read-only view (none)."""

    def cut(self, kind: int, seq: int, buf: bytearray, start: int, stop: int) -> Frame:
        return (kind, seq, bytes(buf[start:stop]))

    def whole(self, kind: int, seq: int, payload: bytearray) -> Frame:
        return (kind, seq, memoryview(payload).toreadonly())


Part = bytes | bytearray | memoryview


def flat(part: Part) -> memoryview:
    """A part as a flat byte view: of its own memory when contiguous (a copy otherwise)."""
    view = memoryview(part)
    if not view.c_contiguous:
        view = memoryview(view.tobytes())
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


class Batcher:
    """Frames written during one turn of the event loop leave in one ``writev``.

    Calls finish in bunches (several replies become ready in one turn), and a
    system call per frame was a tenth of the pool's CPU per light request. A
    frame is written as its parts (header, body): they go out as a scatter
    list, never joined, and what a short write leaves waits as views of the
    same buffers until the socket is writable again.

    It writes on its own duplicate of the transport's socket descriptor (the
    transport itself keeps reading; nothing else writes to it): the protocol
    calls :meth:`close` from ``connection_lost``, so the socket ends with the
    transport (a socket outlives its transport while the duplicate is open).
    An error while sending drops what is queued and closes the transport (the
    peer is gone or broken; its calls learn it from ``connection_lost``).
    """

    __slots__ = ("_fd", "_pending", "_waiting", "frames", "loop", "transport", "turn")

    def __init__(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        self.loop = asyncio.get_running_loop()
        self.turn = turn_end(self.loop)  # armed by the reader that woke the writers
        self.frames: list[Part] = []  # parts written during this turn
        self._pending: deque[memoryview] = deque()  # left by a short write
        self._waiting = False
        # a plain descriptor: non-blocking as the transport's (one open file)
        self._fd = os.dup(transport.get_extra_info("socket").fileno())

    def write(self, *parts: Part) -> None:
        """Queues one frame, given as one or more parts; they are not copied."""
        if not self.frames and not self.turn.take(self._flush):
            self.loop.call_soon(self._flush)
        self.frames.extend(parts)

    def writelines(self, parts: Iterable[Part]) -> None:
        self.write(*parts)

    def write_now(self, *parts: Part) -> None:
        """Sends one frame at once (after what waits): for a socket that carries one
        frame at a time (a worker's), where waiting for the turn's end gains nothing."""
        if self.frames:  # frames of this turn go first
            self.write(*parts)
            return
        if self._fd < 0 or self.transport.is_closing():
            return
        if self._write_bytes(parts):
            return
        self._pending.extend(flat(part) for part in parts if len(part))
        if not self._waiting:
            self._send()

    def _flush(self) -> None:
        frames, self.frames = self.frames, []
        if self._fd < 0 or self.transport.is_closing():
            return
        if self._write_bytes(frames):
            return
        self._pending.extend(flat(part) for part in frames if len(part))
        if not self._waiting:
            self._send()

    def _write_bytes(self, parts: Sequence[Part]) -> bool:
        """The common case, small frames of ``bytes`` parts and nothing waiting:
        one writev of the parts as they are, without views or the queue; what a
        short write leaves waits as views of the rest. False: not taken."""
        if self._pending or len(parts) > IOV_MAX or any(type(p) is not bytes for p in parts):
            return False
        try:
            sent = os.writev(self._fd, parts)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:
            self.transport.close()
            return True
        for part in parts:
            if sent >= len(part):
                sent -= len(part)
            else:
                self._pending.append(memoryview(part)[sent:])
                sent = 0
        if self._pending and not self._waiting:
            self._waiting = True
            self.loop.add_writer(self._fd, self._writable)
        return True

    def _send(self) -> None:
        pending, fd = self._pending, self._fd
        try:
            while pending:
                parts = [pending[i] for i in range(min(len(pending), IOV_MAX))]
                sent = os.writev(fd, parts)
                while sent:  # drop what went out; keep a view of a part's unsent rest
                    head = pending[0]
                    if sent >= len(head):
                        sent -= len(head)
                        pending.popleft()
                    else:
                        pending[0] = head[sent:]
                        sent = 0
        except (BlockingIOError, InterruptedError):
            if not self._waiting:
                self._waiting = True
                self.loop.add_writer(fd, self._writable)
            return
        except OSError:
            pending.clear()
            self.transport.close()
        if self._waiting:
            self._waiting = False
            self.loop.remove_writer(fd)

    def _writable(self) -> None:
        if self._fd >= 0:
            self._send()

    def close(self) -> None:
        """Ends the duplicate descriptor (from the transport's connection_lost)."""
        fd, self._fd = self._fd, -1
        self._pending.clear()
        self.frames = []
        if fd >= 0:
            if self._waiting:
                self._waiting = False
                self.loop.remove_writer(fd)
            os.close(fd)
