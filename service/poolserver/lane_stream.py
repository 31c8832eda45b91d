"""The pool's end of one ModelStreamInfer on the lane (frames:
:mod:`poolserve.service.contract.lane`): the requests the router forwards,
queued for the stream's task, and the responses it sends back within the
router's window."""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Callable

from poolserve.service.contract.framing import HEADER, Part, Payload
from poolserve.service.contract.lane import (
    STREAM_ACK,
    STREAM_CLOSE,
    STREAM_REQUEST,
    STREAM_RESPONSE,
    parse_count,
    stream_ack_frame,
)
from poolserve.service.contract.lane_window import Window

# Runs a stream: the requests in, the serialized ModelStreamInferResponses out.
StreamHandler = Callable[[AsyncIterator[Payload], float], AsyncGenerator[bytes, None]]

RESPONSES = 64  # responses the router has not taken yet, at most ...
RESPONSE_BYTES = 1 << 20  # ... and their bytes (one always goes, however large)


class LaneStream:
    """One stream: fed by the connection's frames, run as one task."""

    __slots__ = ("_arrived", "closed", "requests", "send", "seq", "window")

    def __init__(self, seq: int, send: Callable[..., None]) -> None:
        self.seq = seq
        self.send = send  # writes one frame, given as parts
        self.requests: deque[Payload] = deque()
        self.closed = False  # the client sent its last request
        self.window = Window(RESPONSES, RESPONSE_BYTES)
        self._arrived: asyncio.Future[None] | None = None

    def feed(self, kind: int, payload: Payload) -> None:
        if kind == STREAM_ACK:
            self.window.acked(parse_count(payload))
            return
        if kind == STREAM_REQUEST:
            self.requests.append(payload)
        elif kind == STREAM_CLOSE:
            self.closed = True
        arrived = self._arrived
        if arrived is not None and not arrived.done():
            arrived.set_result(None)

    async def _requests(self) -> AsyncIterator[Payload]:
        """The stream's requests as they come, each acknowledged as it is taken."""
        requests = self.requests
        while True:
            while requests:
                self.send(stream_ack_frame(self.seq, 1))
                yield requests.popleft()
            if self.closed:
                return
            self._arrived = asyncio.get_running_loop().create_future()
            try:
                await self._arrived
            finally:
                self._arrived = None

    async def run(self, handler: StreamHandler, deadline: float) -> None:
        """Sends each response as it comes; waits while the router's window is full.
        Raises what the handler raises (the caller answers the stream's end)."""
        seq, send, window = self.seq, self.send, self.window
        replies = handler(self._requests(), deadline)
        async with contextlib.aclosing(replies):
            async for message in replies:
                head: Part = HEADER.pack(len(message), STREAM_RESPONSE, seq)
                send(head, message)
                window.sent(len(message))
                if window.full():
                    await window.room()
