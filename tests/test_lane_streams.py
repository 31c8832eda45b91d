"""ModelStreamInfer on the router->pool lane over a real unix socket, both ends
in this process: frames, windows both ways, cancel, deadline, failures."""

from __future__ import annotations

import asyncio
import tempfile
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import pytest

from poolserve.service.contract.errors import (
    DeadlineExceeded,
    Failure,
    InvalidInput,
    ServingError,
    StreamStalled,
    Unavailable,
)
from poolserve.service.contract.framing import HEADER, Payload
from poolserve.service.contract.lane import (
    REPLY,
    STREAM_ACK,
    STREAM_CLOSE,
    STREAM_OPEN,
    STREAM_REQUEST,
    STREAM_RESPONSE,
    Trace,
    parse_stream_open,
    stream_ack_frame,
    stream_open_frame,
)
from poolserve.service.contract.lane_window import Window
from poolserve.service.poolserver.lane_server import LaneServer
from poolserve.service.poolserver.lane_stream import RESPONSES
from poolserve.service.router.lane_client import LaneClient
from poolserve.service.router.lane_stream import REQUESTS

Streamer = Callable[[AsyncIterator[Payload], float], AsyncGenerator[bytes, None]]


@pytest.fixture
def sock() -> Iterator[Path]:
    with tempfile.TemporaryDirectory() as folder:
        yield Path(folder) / "pool-x.lane"


async def unary(body: Payload, deadline: float, trace: Trace) -> bytes:
    return bytes(body)


async def repeat(requests: AsyncIterator[Payload], deadline: float) -> AsyncGenerator[bytes, None]:
    """Each request 'n:tag' answered with n responses 'tag0', 'tag1', ..."""
    async for request in requests:
        count, _, tag = bytes(request).partition(b":")
        for i in range(int(count)):
            yield tag + str(i).encode()


def same(body: bytes) -> bytes:
    return body


async def with_streams(
    path: Path, streamer: Streamer, test: Callable[[LaneClient, LaneServer], Awaitable[None]]
) -> None:
    async with asyncio.TaskGroup() as tasks:
        server = LaneServer(path, unary, "pool 'x'", streamer=streamer)
        await server.start(tasks)
        client = LaneClient(path, "pool 'x'")
        try:
            await test(client, server)
        finally:
            client.close()
            await server.stop(5.0)


async def listed(*items: bytes) -> AsyncIterator[bytes]:
    for item in items:
        yield item


def soon(seconds: float = 30.0) -> float:
    return time.monotonic() + seconds


async def until(check: Callable[[], bool], seconds: float = 30.0) -> None:
    end = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < end, "timed out"
        await asyncio.sleep(0.01)


def test_frames_round_trip() -> None:
    frame = stream_open_frame(9, 42.25)
    length, kind, seq = HEADER.unpack_from(frame)
    assert (kind, seq) == (STREAM_OPEN, 9) and parse_stream_open(frame[HEADER.size :]) == 42.25
    assert length == len(frame) - HEADER.size
    ack = stream_ack_frame(3, 17)
    assert HEADER.unpack_from(ack)[1:] == (STREAM_ACK, 3) and ack[HEADER.size :] == b"\x11\0\0\0"


def test_window_counts_and_bytes_and_always_lets_one_go() -> None:
    window = Window(3, 100)
    assert not window.full()
    window.sent(500)  # one larger than the byte budget still goes ...
    assert window.full()  # ... and then nothing more
    window.acked(1)
    assert not window.full() and window.size == 0
    for _ in range(3):
        window.sent(1)
    assert window.full() and window.count == 3
    window.acked(10)  # more than in flight: clipped
    assert window.count == 0 and window.size == 0


def test_a_stream_answers_each_request_in_order_and_ends(sock: Path) -> None:
    seen: list[float] = []

    async def streamer(requests: AsyncIterator[Payload], deadline: float) -> AsyncGenerator[bytes]:
        seen.append(deadline)
        async for reply in repeat(requests, deadline):
            yield reply

    async def test(client: LaneClient, server: LaneServer) -> None:
        deadline = soon()
        got = [item async for item in client.stream(b"2:a", listed(b"0:b", b"3:c"), deadline, same)]
        assert got == [b"a0", b"a1", b"c0", b"c1", b"c2"]
        assert seen == [deadline]

        # 300 streams at once on one connection, each its own
        async def one(k: int) -> list[bytes | ServingError]:
            return [i async for i in client.stream(b"5:%d-" % k, listed(), soon(), same)]

        results = await asyncio.gather(*(one(k) for k in range(300)))
        for k, result in enumerate(results):
            assert result == [b"%d-%d" % (k, i) for i in range(5)]
        await until(lambda: server.in_flight() == 0 and not client.streams)

    asyncio.run(with_streams(sock, streamer, test))


def test_a_slow_reader_holds_the_pool_within_the_window(sock: Path) -> None:
    produced = 0

    async def endless(requests: AsyncIterator[Payload], deadline: float) -> AsyncGenerator[bytes]:
        nonlocal produced
        async for _ in requests:
            while True:
                produced += 1
                yield b"%d" % produced

    async def test(client: LaneClient, server: LaneServer) -> None:
        replies = client.stream(b"go", listed(), soon(), same)
        taken = [await anext(replies) for _ in range(3)]
        assert taken == [b"1", b"2", b"3"]
        await until(lambda: produced >= RESPONSES)
        for _ in range(50):  # the pool waits for the router's ACK now: no further
            await asyncio.sleep(0.01)
        assert produced <= 3 + RESPONSES + 1, produced
        # reading on, the stream goes on
        more = [await anext(replies) for _ in range(1000)]
        assert more[-1] == b"1003"
        await replies.aclose()
        await until(lambda: server.in_flight() == 0)

    asyncio.run(with_streams(sock, endless, test))


def test_a_pool_that_does_not_take_requests_holds_the_router_within_its_window(
    sock: Path,
) -> None:
    release = asyncio.Event()

    async def one_at_a_time(
        requests: AsyncIterator[Payload], deadline: float
    ) -> AsyncGenerator[bytes]:
        async for request in requests:
            await release.wait()
            yield bytes(request)

    pulled = 0

    async def flood() -> AsyncIterator[bytes]:
        nonlocal pulled
        for i in range(1, 200):
            pulled += 1
            yield b"%d" % i

    async def test(client: LaneClient, server: LaneServer) -> None:
        replies = client.stream(b"0", flood(), soon(), same)
        first = asyncio.ensure_future(anext(replies))
        await until(lambda: pulled >= REQUESTS)
        for _ in range(50):
            await asyncio.sleep(0.01)
        # the pool took one request; the router sent REQUESTS more and reads no further
        assert pulled <= REQUESTS + 2, pulled
        release.set()
        assert await first == b"0"
        rest = [await anext(replies) for _ in range(199)]
        assert rest[-1] == b"199"
        assert await anext(replies, None) is None

    asyncio.run(with_streams(sock, one_at_a_time, test))


def test_leaving_a_stream_cancels_it_in_the_pool(sock: Path) -> None:
    closed = asyncio.Event()

    async def endless(requests: AsyncIterator[Payload], deadline: float) -> AsyncGenerator[bytes]:
        try:
            async for _ in requests:
                while True:
                    yield b"x"
                    await asyncio.sleep(0)
        finally:
            closed.set()

    async def test(client: LaneClient, server: LaneServer) -> None:
        replies = client.stream(b"go", listed(), soon(), same)
        assert await anext(replies) == b"x"
        await replies.aclose()  # the client went away
        await asyncio.wait_for(closed.wait(), 30)
        await until(lambda: server.in_flight() == 0 and not client.streams)
        # the connection serves on
        assert [i async for i in client.stream(b"go", listed(), soon(), same)] == [b"done"]

    async def finite_after_first(
        requests: AsyncIterator[Payload], deadline: float
    ) -> AsyncGenerator[bytes]:
        if closed.is_set():
            async for _ in requests:
                yield b"done"
            return
        async for item in endless(requests, deadline):
            yield item

    asyncio.run(with_streams(sock, finite_after_first, test))


def test_a_deadline_ends_the_stream_and_cancels_it_in_the_pool(sock: Path) -> None:
    cancelled = asyncio.Event()

    async def stuck(requests: AsyncIterator[Payload], deadline: float) -> AsyncGenerator[bytes]:
        async for _ in requests:
            yield b"first"
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                cancelled.set()
                raise

    async def test(client: LaneClient, server: LaneServer) -> None:
        got = [i async for i in client.stream(b"go", listed(), soon(3), same)]
        assert got[0] == b"first" and len(got) == 2
        assert isinstance(got[1], DeadlineExceeded)
        assert "waiting for pool 'x'" in got[1].message
        await asyncio.wait_for(cancelled.wait(), 30)
        await until(lambda: server.in_flight() == 0)

    asyncio.run(with_streams(sock, stuck, test))


def test_a_stream_whose_reader_takes_nothing_for_stall_s_is_cancelled_in_the_pool(
    sock: Path,
) -> None:
    """A reader that takes responses, however slowly, keeps its stream; a model
    slow to produce is no stall; a reader that leaves a response untaken for
    stall_s has its stream cancelled in the pool (the worker's generator closes
    while the reader still takes nothing) and then reads StreamStalled."""
    closed = asyncio.Event()
    produced = 0

    async def endless(requests: AsyncIterator[Payload], deadline: float) -> AsyncGenerator[bytes]:
        nonlocal produced
        try:
            async for _ in requests:
                while True:
                    produced += 1
                    if produced == 50:
                        await asyncio.sleep(2.0)  # slow to produce: the reader waits
                    yield b"%d" % produced
        finally:
            closed.set()

    async def test(client: LaneClient, server: LaneServer) -> None:
        replies = client.stream(b"go", listed(), soon(), same, stall_s=0.5)
        taken = []
        for _ in range(60):  # 2 s of reading, a response every 20 ms, then 2 s waiting
            taken.append(await anext(replies))
            await asyncio.sleep(0.02)
        assert taken == [b"%d" % i for i in range(1, 61)]
        assert not closed.is_set()
        # the reader takes nothing more: the pool's generator is closed without it
        await asyncio.wait_for(closed.wait(), 30)
        stalled = await anext(replies)
        assert isinstance(stalled, StreamStalled), stalled
        assert stalled.failure is Failure.QUEUE_FULL and "(stream_stall_s)" in stalled.message
        assert await anext(replies, None) is None
        await until(lambda: server.in_flight() == 0 and not client.streams)

    asyncio.run(with_streams(sock, endless, test))


def test_a_stream_the_pool_ended_is_left_to_its_reader(sock: Path) -> None:
    """No worker is held once the pool has ended the stream: its responses wait
    for the reader, however long past stall_s, and none is dropped."""

    async def test(client: LaneClient, server: LaneServer) -> None:
        replies = client.stream(b"3:r", listed(), soon(), same, stall_s=0.5)
        assert await anext(replies) == b"r0"
        (stream,) = client.streams.values()
        await until(lambda: stream.ended)  # the pool's REPLY is here
        await asyncio.sleep(1.5)  # three times stall_s, reading nothing
        assert [i async for i in replies] == [b"r1", b"r2"]

    asyncio.run(with_streams(sock, repeat, test))


def test_errors_end_a_stream_with_their_kind(sock: Path) -> None:
    async def failing(requests: AsyncIterator[Payload], deadline: float) -> AsyncGenerator[bytes]:
        async for request in requests:
            yield b"ok"
            raise InvalidInput(f"bad {bytes(request).decode()}")

    async def test(client: LaneClient, server: LaneServer) -> None:
        got = [i async for i in client.stream(b"one", listed(), soon(), same)]
        assert got[0] == b"ok" and isinstance(got[1], ServingError)
        assert got[1].failure is Failure.INVALID_INPUT and got[1].message == "bad one"

        def refuse(body: bytes) -> bytes:  # the router refuses the second request
            if body == b"forged":
                raise InvalidInput("forged")
            return body

        slow = [i async for i in client.stream(b"a", listed(b"forged"), soon(), refuse)]
        assert any(isinstance(i, InvalidInput) and i.message == "forged" for i in slow)
        await until(lambda: server.in_flight() == 0 and not client.streams)

    asyncio.run(with_streams(sock, failing, test))


def test_streams_fail_unavailable_when_the_pool_goes_and_stopping_refuses_new_ones(
    sock: Path,
) -> None:
    started = asyncio.Event()

    async def stuck(requests: AsyncIterator[Payload], deadline: float) -> AsyncGenerator[bytes]:
        async for _ in requests:
            started.set()
            yield b"one"
            await asyncio.sleep(3600)

    async def main() -> None:
        client = LaneClient(sock, "pool 'x'")
        async with asyncio.TaskGroup() as tasks:
            server = LaneServer(sock, unary, "pool 'x'", streamer=stuck)
            await server.start(tasks)
            replies = client.stream(b"go", listed(), soon(), same)
            assert await anext(replies) == b"one"
            stopping = tasks.create_task(server.stop(0.5))
            await until(lambda: server.draining)
            refused = [i async for i in client.stream(b"new", listed(), soon(), same)]
            assert isinstance(refused[0], Unavailable) and "stopping" in refused[0].message
            await stopping  # grace over: the connection closes under the stream
            lost = await anext(replies)
            assert isinstance(lost, Unavailable) and "closed its lane" in lost.message
            assert await anext(replies, None) is None
            client.close()

    asyncio.run(main())


def test_stream_frames_for_unknown_streams_do_not_hurt_the_pool(sock: Path) -> None:
    async def test(client: LaneClient, _: LaneServer) -> None:
        reader, writer = await asyncio.open_unix_connection(str(sock))
        writer.write(stream_ack_frame(77, 3))  # for no stream: ignored
        writer.write(HEADER.pack(2, STREAM_REQUEST, 78) + b"1:")
        writer.write(HEADER.pack(0, STREAM_CLOSE, 79))
        writer.write(stream_open_frame(5, soon()))
        writer.write(HEADER.pack(4, STREAM_REQUEST, 5) + b"2:ab")
        writer.write(HEADER.pack(0, STREAM_CLOSE, 5))
        kinds = []
        while True:
            length, kind, seq = HEADER.unpack(await reader.readexactly(HEADER.size))
            payload = await reader.readexactly(length)
            assert seq == 5
            kinds.append((kind, payload))
            if kind == REPLY:
                break
        responses = [p for k, p in kinds if k == STREAM_RESPONSE]
        assert responses == [b"ab0", b"ab1"]
        assert (STREAM_ACK, b"\x01\0\0\0") in kinds  # the pool took the request
        writer.close()
        got = [i async for i in client.stream(b"1:z", listed(), soon(), same)]
        assert got == [b"z0"]

    asyncio.run(with_streams(sock, repeat, test))
