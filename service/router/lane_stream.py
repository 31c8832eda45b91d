"""The router's end of one ModelStreamInfer on a pool's lane (frames:
:mod:`poolserve.service.contract.lane`): the client's requests go down as
STREAM_REQUEST frames, within the pool's window, from a task of the stream;
the pool's responses come up as STREAM_RESPONSE frames and go to the client
as they are, acknowledged as the client's call takes them.

A client that stops reading stops the stream: gRPC's window to it fills, the
router stops acknowledging, the pool's window fills, and the worker waits,
taken from every other caller of its pool. So a stream whose response has
waited ``stall_s`` (the ``stream_stall_s`` setting) to be taken by the client
is ended: a CANCEL goes to the pool at once (its worker closes the model's
generator and is free), the responses still here are dropped, and the call
ends with RESOURCE_EXHAUSTED (:class:`StreamStalled`) after whatever gRPC
already holds for the client. One timer per stream, re-armed every
``stall_s`` at most, watches for it; a client that takes anything restarts the
count. A stream the pool has ended holds no worker, and is left to its reader."""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import AsyncIterator, Callable

from poolserve.service.contract.errors import ServingError, StreamStalled
from poolserve.service.contract.framing import HEADER, Batcher, Payload
from poolserve.service.contract.lane import (
    CANCEL,
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

log = logging.getLogger(__name__)

REQUESTS = 8  # requests the pool has not taken yet, at most ...
REQUEST_BYTES = 4 << 20  # ... and their bytes (one always goes, however large)
ACK_EVERY = 16  # responses taken before an ACK (and whenever nothing more is there)
_FAILED = -1  # a frame kind of our own: the stream failed here (connection, deadline)


class LaneStream:
    """One stream's frames from the pool, queued for the stream's reader."""

    __slots__ = (
        "_arrived",
        "_failed",
        "_offered",
        "_watch",
        "ended",
        "frames",
        "on_stall",
        "requests",
        "seq",
        "stall_s",
    )

    def __init__(
        self, seq: int, stall_s: float = 0.0, on_stall: Callable[[], None] | None = None
    ) -> None:
        self.seq = seq
        self.on_stall = on_stall  # counts it (poolserve_streams_stalled_total)
        self.frames: deque[tuple[int, Payload | ServingError]] = deque()
        self.requests = Window(REQUESTS, REQUEST_BYTES)
        self.ended = False  # nothing to cancel in the pool: it ended it, or we cancelled it
        self.stall_s = stall_s  # 0: a client may leave its responses unread until its deadline
        self._arrived: asyncio.Future[None] | None = None
        self._failed = False  # its end is queued already (the lane lost, the deadline)
        self._offered: float | None = None  # when the response gRPC is sending was handed over
        self._watch: asyncio.TimerHandle | None = None

    def feed(self, kind: int, payload: Payload) -> None:
        if kind == STREAM_ACK:
            self.requests.acked(parse_count(payload))
            return
        if kind != STREAM_RESPONSE:
            self.ended = True  # REPLY or ERROR: the pool ended it, nothing to cancel there
        self.frames.append((kind, payload))
        self._wake()

    def fail(self, error: ServingError) -> None:
        self._failed = True
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
        loop = asyncio.get_running_loop()
        if self.stall_s > 0 and self._watch is None:
            self._watch = loop.call_later(self.stall_s, self._check, transport)
        taken = 0
        while True:
            while frames:
                kind, payload = frames.popleft()
                if kind == STREAM_RESPONSE:
                    assert not isinstance(payload, ServingError)
                    # gRPC sends bytes only: the one copy of a large response here
                    self._offered = loop.time()
                    yield payload if isinstance(payload, bytes) else bytes(payload)
                    self._offered = None  # gRPC sent it: the client's window had room
                    taken += 1
                    if taken >= ACK_EVERY:
                        transport.write(stream_ack_frame(seq, taken))
                        taken = 0
                    continue
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

    def _check(self, transport: Batcher) -> None:
        """The stall timer: ends the stream if the response being sent has waited
        ``stall_s`` for the client's window; else looks again when it could."""
        self._watch = None
        if self.ended or self._failed:
            return  # the pool is done with it (an unread rest holds no worker), or it failed
        offered = self._offered
        loop = asyncio.get_running_loop()
        if offered is not None and loop.time() - offered >= self.stall_s:
            self._stalled(transport)
            return
        since = loop.time() if offered is None else offered
        self._watch = loop.call_at(since + self.stall_s, self._check, transport)

    def _stalled(self, transport: Batcher) -> None:
        # Operators see why a stream ended, and that its worker went back to the pool.
        log.warning(
            "router: stream %d ended: its client took none of its responses for %g s "
            "(stream_stall_s); its worker is freed",
            self.seq,
            self.stall_s,
        )
        if self.on_stall is not None:
            self.on_stall()
        transport.write(HEADER.pack(0, CANCEL, self.seq))  # the worker is free at once
        self.ended = True
        self.frames.clear()  # what the client will not read goes now, not at its deadline
        self.fail(StreamStalled.after(self.stall_s))

    def stop(self) -> None:
        """The stream is over here: no more stall checks."""
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None
