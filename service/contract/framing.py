"""The one frame codec of poolserve's byte streams: the lane (router <-> pool)
and a worker's socket (pool <-> worker) both carry length-prefixed frames with
this header (payload length u32, kind u8, sequence u64, little-endian).

:class:`FrameReader` cuts a stream into frames; :class:`FrameBuffer` (the
lane's) makes each a (kind, sequence, payload) with one copy of the payload,
and the worker socket's reader (:class:`poolserve.service.poolcore.frames.ReplyBuffer`)
unpacks a reply's timings head straight from the buffer instead.
:class:`Batcher` sends the frames written during one event-loop turn in one
write.
"""

from __future__ import annotations

import asyncio
import struct
from typing import Generic, TypeVar

HEADER = struct.Struct("<IBQ")
MAX_FRAME = (1 << 32) - 1


Frame = tuple[int, int, bytes]
"""A frame as :class:`FrameBuffer` cuts it: (kind, sequence, payload)."""

T = TypeVar("T")


class FrameReader(Generic[T]):
    """Cuts a byte stream into frames; keeps an incomplete tail for the next read.

    Each complete frame becomes what :meth:`cut` makes of it, straight from
    the buffer (None: the frame is consumed, e.g. a heartbeat). A frame
    announcing more than ``max_frame`` bytes is refused (ValueError) before
    any of it is buffered.
    """

    def __init__(self, max_frame: int = MAX_FRAME) -> None:
        self._buf = bytearray()
        self.max_frame = max_frame

    def feed(self, data: bytes) -> list[T]:
        buf = self._buf
        buf += data
        frames: list[T] = []
        cut = self.cut
        pos, end = 0, len(buf)
        while end - pos >= HEADER.size:
            length, kind, seq = HEADER.unpack_from(buf, pos)
            if length > self.max_frame:
                raise ValueError(f"a frame of {length} bytes is over the limit of {self.max_frame}")
            start = pos + HEADER.size
            stop = start + length
            if stop > end:
                break
            frame = cut(kind, seq, buf, start, stop)
            if frame is not None:
                frames.append(frame)
            pos = stop
        if pos:
            del buf[:pos]
        return frames

    def cut(self, kind: int, seq: int, buf: bytearray, start: int, stop: int) -> T | None:
        """The frame ``kind``/``seq`` whose payload is ``buf[start:stop]``."""
        raise NotImplementedError


class FrameBuffer(FrameReader[Frame]):
    """Frames as (kind, sequence, payload): one copy of each payload."""

    def cut(self, kind: int, seq: int, buf: bytearray, start: int, stop: int) -> Frame:
        return (kind, seq, bytes(buf[start:stop]))


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
