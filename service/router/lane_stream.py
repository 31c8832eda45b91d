"""The router's end of one ModelStreamInfer on a pool's lane (frames:
:mod:`poolserve.service.contract.lane`): the client's requests go down as
STREAM_REQUEST frames, within the pool's window, from a task of the stream;
the pool's responses come up as STREAM_RESPONSE frames and go to the client
as they are, acknowledged as the client's call takes them."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Callable

from poolserve.service.contract.errors import ServingError
from poolserve.service.contract.framing import HEADER, Batcher, Payload
from poolserve.service.contract.lane import (
    ERROR,
    REPLY,
    STREAM_ACK,
    STREAM_CLOSE,
    STREAM_REQUEST,
    STREAM_RESPONSE,
    parse_count,
    parse_error,
    stream_ack_frame,
)
from poolserve.service.contract.lane_window import Window
from poolserve.service.grpcserver.status import as_serving_error

REQUESTS = 8  # requests the pool has not taken yet, at most ...
REQUEST_BYTES = 4 << 20  # ... and their bytes (one always goes, however large)
ACK_EVERY = 16  # responses taken before an ACK (and whenever nothing more is there)
_FAILED = -1  # a frame kind of our own: the stream failed here (connection, deadline)


class LaneStream:
    """One stream's frames from the pool, queued for the stream's reader."""

    __slots__ = ("_arrived", "ended", "frames", "requests", "seq")

    def __init__(self, seq: int) -> None:
        self.seq = seq
        self.frames: deque[tuple[int, Payload | ServingError]] = deque()
        self.requests = Window(REQUESTS, REQUEST_BYTES)
        self.ended = False  # the pool ended it (REPLY or ERROR) or it failed here
        self._arrived: asyncio.Future[None] | None = None

    def feed(self, kind: int, payload: Payload) -> None:
        if kind == STREAM_ACK:
            self.requests.acked(parse_count(payload))
            return
        self.frames.append((kind, payload))
        self._wake()

    def fail(self, error: ServingError) -> None:
        self.frames.append((_FAILED, error))
        self._wake()

    def _wake(self) -> None:
        arrived = self._arrived
        if arrived is not None and not arrived.done():
            arrived.set_result(None)

    async def pump(
        self,
        transport: Batcher,
        first: bytes,
        requests: AsyncIterator[bytes],
        attach: Callable[[bytes], bytes],
    ) -> None:
        """Sends the client's requests (the first one already read), then STREAM_CLOSE."""
        seq, window = self.seq, self.requests
        try:
            message: bytes | None = first
            while message is not None:
                body = attach(message)
                if window.full():
                    await window.room()
                transport.write(HEADER.pack(len(body), STREAM_REQUEST, seq), body)
                window.sent(len(body))
                message = await anext(requests, None)
            transport.write(HEADER.pack(0, STREAM_CLOSE, seq))
        except Exception as exc:  # the client's call broke, or a request is refused
            self.fail(as_serving_error(exc))

    async def responses(self, transport: Batcher) -> AsyncIterator[bytes | ServingError]:
        """The pool's responses as they come; a ServingError last if the stream failed."""
        seq, frames = self.seq, self.frames
        taken = 0
        while True:
            while frames:
                kind, payload = frames.popleft()
                if kind == STREAM_RESPONSE:
                    assert not isinstance(payload, ServingError)
                    # gRPC sends bytes only: the one copy of a large response here
                    yield payload if isinstance(payload, bytes) else bytes(payload)
                    taken += 1
                    if taken >= ACK_EVERY:
                        transport.write(stream_ack_frame(seq, taken))
                        taken = 0
                    continue
                self.ended = kind != _FAILED  # the pool ended it: nothing to cancel there
                if kind == REPLY:
                    return
                if kind == ERROR:
                    assert not isinstance(payload, ServingError)
                    yield parse_error(payload)
                elif isinstance(payload, ServingError):
                    yield payload
                return
            if taken:
                transport.write(stream_ack_frame(seq, taken))
                taken = 0
            self._arrived = asyncio.get_running_loop().create_future()
            try:
                await self._arrived
            finally:
                self._arrived = None
