"""The one frame codec of poolserve's byte streams: the lane (router <-> pool)
and a worker's socket (pool <-> worker) both carry length-prefixed frames with
this header (payload length u32, kind u8, sequence u64, little-endian).

:class:`FrameBuffer` cuts a stream into frames with one copy of each payload;
a reader that wants a frame in another form (a worker's replies, whose timings
head is unpacked straight from the buffer) overrides :meth:`FrameBuffer.cut`.
:class:`Batcher` sends the frames written during one event-loop turn in one
write.
"""

from __future__ import annotations

import asyncio
import struct

HEADER = struct.Struct("<IBQ")
MAX_FRAME = (1 << 32) - 1


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
