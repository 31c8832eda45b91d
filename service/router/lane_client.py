"""The router's end of a pool's lane: one connection per pool, many calls in
flight, each with its deadline (the frames: :mod:`poolserve.service.contract.lane`)."""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from pathlib import Path

from poolserve.service.contract import slab
from poolserve.service.contract.errors import DeadlineExceeded, ServingError, Unavailable
from poolserve.service.contract.framing import HEADER, Batcher, FrameBuffer
from poolserve.service.contract.lane import (
    CANCEL,
    PING,
    REPLY,
    Trace,
    infer_frame,
    parse_error,
    stream_open_frame,
)
from poolserve.service.contract.shm import is_wrapped
from poolserve.service.router.lane_stream import LaneStream
from poolserve.service.router.slab_sink import SlabSink

log = logging.getLogger(__name__)

# Given the release of a reply's slab, runs it once the reply was sent (a call's
# done callback): the reply may then be a view of the slab, not a copy.
Lend = Callable[[Callable[[], None]], None]


class _ClientProtocol(asyncio.BufferedProtocol):
    """Receives straight into the frame reader's buffers (a large reply into
    one of its own size); writes through a :class:`Batcher` (scatter writes)."""

    def __init__(self, lane: LaneClient) -> None:
        self.lane = lane
        self.frames = FrameBuffer()
        self.batcher: Batcher | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.batcher = Batcher(transport)

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.frames.get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        pending, streams = self.lane.pending, self.lane.streams
        woke = False
        for kind, seq, payload in self.frames.buffer_updated(nbytes):
            if streams:
                stream = streams.get(seq)
                if stream is not None:
                    stream.feed(kind, payload)
                    continue
            future = pending.pop(seq, None)
            if future is None or future.done():
                continue  # its caller gave up: nobody to tell
            woke = True
            if kind == REPLY:
                # gRPC sends bytes only: the one copy of the reply in the router
                future.set_result(payload if isinstance(payload, bytes) else bytes(payload))
            else:  # the pool's answer (a result: the call did not lose its lane)
                future.set_result(parse_error(payload))
        if woke and self.batcher is not None:  # the woken calls' responses leave in their turn
            self.batcher.turn.arm()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.batcher is not None:
            self.batcher.close()
        self.lane.lost(self)


class LaneClient:
    """The router's connection to one pool's lane, opened on first use."""

    def __init__(
        self,
        path: Path,
        where: str,
        arena: slab.Arena | None = None,
        on_down: Callable[[], None] | None = None,
    ) -> None:
        self.path = path
        self.where = where
        self.on_down = on_down  # called when the connection ends or is refused (not closed)
        self.arena = arena  # large bodies go through its slabs (None: all inline)
        self.reply_sizes: dict[str, int] = {}  # per model: its last reply's size
        self.pending: dict[int, asyncio.Future[bytes | ServingError]] = {}
        self.streams: dict[int, LaneStream] = {}
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
                _, protocol = await loop.create_unix_connection(
                    lambda: _ClientProtocol(self), str(self.path)
                )
            except OSError as exc:
                if self.on_down is not None:
                    self.on_down()
                raise Unavailable(f"{self.where} is not reachable: {exc.strerror}") from None
            finally:
                self._connecting.set_result(None)
                self._connecting = None
            assert protocol.batcher is not None
            self._transport, self._protocol = protocol.batcher, protocol
        return self._transport

    async def call(
        self,
        body: bytes | memoryview,
        deadline: float,
        trace: Trace,
        model: str = "",
        head: bytes | None = None,
        lend: Lend | None = None,
        sunk: SlabSink | None = None,
    ) -> bytes | memoryview:
        """Runs one ModelInfer in the pool, waiting for it until ``deadline`` (monotonic).

        The pool ends its own part a margin earlier and answers DEADLINE_EXCEEDED
        itself, saying where the time went; this timer only fires when it cannot.
        A body over :data:`slab.THRESHOLD` travels in a slab of the arena
        (:mod:`poolserve.service.contract.slab`), freed when the worker's REPLY
        is back, retired on any other end. With ``lend``, a reply the worker
        wrote into the slab is returned as a view of it (no copy), the slab
        freed when ``lend``'s callback runs; without, as ``bytes``. ``sunk``:
        the slab ``body`` was received into (router/slab_sink.py), taken over
        here instead of copying the body into a slab of its own.
        """
        transport = self._transport or await self._connect()
        leased = self._lease(body, model, head, sunk)
        loop = transport.loop  # (asyncio.get_running_loop() costs a getpid system call)
        seq = next(self._seq)
        future: asyncio.Future[bytes | ServingError] = loop.create_future()
        self.pending[seq] = future
        if leased is None:
            transport.write(*infer_frame(seq, deadline, trace, body))  # the body is not copied
        else:
            transport.write(*infer_frame(seq, deadline, trace, leased[2]))
        timer = loop.call_at(deadline, _time_out, future)  # asyncio's clock is time.monotonic
        try:
            result = await future
        except asyncio.CancelledError:
            self._cancel(seq)
            if leased is not None and _replied(future):
                # answered in the turn its caller was cancelled: the worker is done
                # with the slab, and nothing else frees it (issue 42 §4)
                self.arena.free(leased[0])  # type: ignore[union-attr]
            raise
        except _Timeout as timeout:
            # the future keeps it, and its traceback this frame (the body): a cycle
            # only the garbage collector would free (issue 42 §4)
            timeout.__traceback__ = None
            self._cancel(seq)
            raise DeadlineExceeded(
                f"deadline exceeded waiting for {self.where} to answer", stage="pool"
            ) from None
        finally:
            timer.cancel()
            if leased is not None and not _replied(future):
                # no REPLY: a worker may still read it (the pool answers a deadline
                # or a cancel without waiting for it), or the lane is gone
                self.arena.retire(leased[0])  # type: ignore[union-attr]
        if isinstance(result, ServingError):
            if leased is not None and slab.UNREACHABLE in result.message and self.arena:
                # this host's workers cannot map the router's slabs (/proc
                # restricted?): large bodies go inline from now on, this one too
                log.warning("router: large bodies go inline: %s", result.message)
                self.arena.disable(result.message)
                return await self.call(body, deadline, trace, model, head, lend)
            # raised, its traceback holds this frame (the body), whose locals would
            # hold the error: a cycle only the garbage collector frees (issue 42 §4)
            error = result
            del result, future
            try:
                raise error
            finally:
                del error
        if leased is None:
            return result
        return self._reply(leased[0], leased[1], result, model, lend)

    def _lease(
        self, body: bytes | memoryview, model: str, head: bytes | None, sunk: SlabSink | None
    ) -> tuple[slab.Slab, slab.Ref, bytes] | None:
        """(slab, reference, envelope) for a large body written into a slab; None: inline.
        ``head``: the body without its raw contents, when the caller has it;
        ``sunk``: the slab the body is in already."""
        if self.arena is None or not slab.THRESHOLD < len(body) <= slab.MAX_BODY:
            return None
        if is_wrapped(body):
            return None
        if head is None:
            head = slab.without_raw_inputs(body)
        if head is None:
            return None
        taken = None if sunk is None or sunk.view is not body else sunk.take()
        if taken is not None:
            return taken[0], taken[1], slab.envelope(taken[1], head)
        got = self.arena.lease(len(body), max(len(body), self.reply_sizes.get(model, 0)))
        if got is None:
            return None
        where, ref = got
        where.view[: len(body)] = body  # the one copy of the request in the router
        return where, ref, slab.envelope(ref, head)

    def _reply(
        self, where: slab.Slab, ref: slab.Ref, result: bytes, model: str, lend: Lend | None
    ) -> bytes | memoryview:
        assert self.arena is not None
        if where.closed:  # the router stopped meanwhile
            raise Unavailable(f"{self.where}: the router is stopping")
        size = slab.reply_length(result)
        if size is not None and lend is not None:  # sent from the slab, freed once sent
            self.reply_sizes[model] = size
            arena = self.arena
            lend(lambda: arena.free(where))
            return where.view[ref.reply_at : ref.reply_at + size]
        # inline (too large for the reply area, or answered by the pool), or in the
        # slab: grpcio sends bytes only, the one copy of the reply in the router
        reply = result if size is None else bytes(where.view[ref.reply_at : ref.reply_at + size])
        self.arena.free(where)
        self.reply_sizes[model] = len(reply)
        return reply

    async def stream(
        self,
        first: bytes,
        requests: AsyncIterator[bytes],
        deadline: float,
        attach: Callable[[bytes], bytes],
        stall_s: float = 0.0,
        on_stall: Callable[[], None] | None = None,
    ) -> AsyncGenerator[bytes | ServingError, None]:
        """Runs one ModelStreamInfer in the pool until ``deadline`` (monotonic):
        its serialized responses as they come, then a ServingError if the stream
        failed as a whole. Leaving early (the client went away) cancels it there;
        so does a client that takes none of its responses for ``stall_s`` (0: no
        limit), and the stream then fails with StreamStalled (``on_stall`` is
        called then: the router's count)."""
        transport = self._transport or await self._connect()
        loop = asyncio.get_running_loop()
        seq = next(self._seq)
        stream = self.streams[seq] = LaneStream(seq, stall_s, on_stall)
        transport.write(stream_open_frame(seq, deadline))
        pump = loop.create_task(stream.pump(transport, first, requests, attach))
        late = DeadlineExceeded(f"deadline exceeded waiting for {self.where} to answer", "pool")
        timer = loop.call_at(deadline, stream.fail, late)
        try:
            async for item in stream.responses(transport):
                yield item
        finally:
            timer.cancel()
            stream.stop()
            pump.cancel()
            if self.streams.pop(seq, None) is not None and not stream.ended:
                transport.write(HEADER.pack(0, CANCEL, seq))
            await asyncio.wait((pump,))  # it ends at once, cancelled

    async def ping(self) -> None:
        """Returns once the pool's event loop has answered a PING (no timeout here:
        the caller bounds it). Raises Unavailable when the lane is down."""
        transport = self._transport or await self._connect()
        seq = next(self._seq)
        future: asyncio.Future[bytes | ServingError] = asyncio.get_running_loop().create_future()
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
        if self.on_down is not None and not self._closed:
            self.on_down()
        pending, self.pending = self.pending, {}
        streams, self.streams = self.streams, {}
        for stream in streams.values():
            stream.fail(Unavailable(f"{self.where} closed its lane while the stream was open"))
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


def _replied(future: asyncio.Future[bytes | ServingError]) -> bool:
    """Whether the pool answered with a REPLY (the worker is done with the slab)."""
    if not future.done() or future.cancelled() or future.exception() is not None:
        return False
    return isinstance(future.result(), bytes)


def _time_out(future: asyncio.Future[bytes | ServingError]) -> None:
    if not future.done():
        future.set_exception(_Timeout())
