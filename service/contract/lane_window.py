"""Flow control of a stream on the lane: how many of one side's messages the
other has not yet taken (frames: :mod:`poolserve.service.contract.lane`).

The sender counts what it sent and waits when either the count or the bytes
not yet acknowledged reach the window; the receiver acknowledges what its
reader took (STREAM_ACK). One message is always allowed in flight, however
large, so a message larger than the byte budget still goes.
"""

from __future__ import annotations

import asyncio
from collections import deque


class Window:
    """The sender's side: messages and bytes in flight, and a wait for room."""

    __slots__ = ("_room", "_sizes", "count", "max_bytes", "max_count", "size")

    def __init__(self, max_count: int, max_bytes: int) -> None:
        self.max_count = max_count
        self.max_bytes = max_bytes
        self.count = 0
        self.size = 0
        self._sizes: deque[int] = deque()
        self._room: asyncio.Future[None] | None = None

    def full(self) -> bool:
        return self.count >= self.max_count or (self.count > 0 and self.size >= self.max_bytes)

    def sent(self, size: int) -> None:
        self.count += 1
        self.size += size
        self._sizes.append(size)

    def acked(self, count: int) -> None:
        """The receiver took ``count`` more (a count beyond what is in flight is clipped)."""
        sizes = self._sizes
        for _ in range(min(count, len(sizes))):
            self.size -= sizes.popleft()
        self.count = len(sizes)
        room = self._room
        if room is not None and not room.done() and not self.full():
            room.set_result(None)

    async def room(self) -> None:
        """Returns once the window is not full."""
        while self.full():
            self._room = asyncio.get_running_loop().create_future()
            try:
                await self._room
            finally:
                self._room = None
