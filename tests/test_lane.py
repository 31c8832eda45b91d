"""The router->pool lane over a real unix socket, both ends in this process."""

from __future__ import annotations

import asyncio
import random
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import pytest
from google.protobuf.message import DecodeError
from hypothesis import given
from hypothesis import strategies as st

from poolserve.service.contract.errors import (
    DeadlineExceeded,
    Failure,
    InvalidInput,
    ModelNotFound,
    ServingError,
    Unavailable,
)
from poolserve.service.contract.framing import HEADER, Batcher, FrameBuffer
from poolserve.service.contract.lane import (
    CANCEL,
    ERROR,
    INFER,
    Trace,
    infer_frame,
    lane_path,
    parse_infer,
)
from poolserve.service.poolserver.lane_server import LaneServer
from poolserve.service.router.lane_client import LaneClient

from support import held_in_cycles, no_collector

Handler = Callable[[bytes, float, Trace], Awaitable[bytes]]


@pytest.fixture
def sock() -> Iterator[Path]:
    with tempfile.TemporaryDirectory() as folder:
        yield Path(folder) / "pool-x.lane"


async def echo(body: bytes, deadline: float, trace: Trace) -> bytes:
    return body


async def with_lane(
    path: Path, handler: Handler, test: Callable[[LaneClient, LaneServer], Awaitable[None]]
) -> None:
    async with asyncio.TaskGroup() as tasks:
        server = LaneServer(path, handler, "pool 'x'")
        await server.start(tasks)
        client = LaneClient(path, "pool 'x'")
        try:
            await test(client, server)
        finally:
            client.close()
            await server.stop(5.0)


def soon(seconds: float = 10.0) -> float:
    return time.monotonic() + seconds


def test_lane_path_sits_beside_the_pool_socket() -> None:
    assert lane_path(Path("/run/p/pool-a.b.sock")) == Path("/run/p/pool-a.b.lane")


def test_infer_frame_round_trip() -> None:
    head, tail = infer_frame(
        7, 123.5, [("traceparent", "00-ab-cd-01"), ("tracestate", "k=v")], b"xy"
    )
    assert tail == b"xy"  # the body is its own part: written as it is, never joined
    frame = head + tail
    length, kind, seq = HEADER.unpack_from(frame)
    assert (length, kind, seq) == (len(frame) - HEADER.size, INFER, 7)
    deadline, trace, body = parse_infer(frame[HEADER.size :])
    assert deadline == 123.5
    assert trace == [("traceparent", "00-ab-cd-01"), ("tracestate", "k=v")]
    assert body == b"xy"


@given(
    st.lists(st.binary(max_size=300), min_size=1, max_size=20),
    st.lists(st.integers(1, 64), min_size=1, max_size=50),
)
def test_frame_buffer_cuts_any_chunking_into_the_same_frames(
    bodies: list[bytes], cuts: list[int]
) -> None:
    stream = b"".join(HEADER.pack(len(b), INFER, i) + b for i, b in enumerate(bodies))
    buffer = FrameBuffer()
    got: list[tuple[int, int, bytes]] = []
    pos, turn = 0, 0
    while pos < len(stream):
        step = cuts[turn % len(cuts)]
        got.extend(buffer.feed(stream[pos : pos + step]))
        pos, turn = pos + step, turn + 1
    assert got == [(INFER, i, b) for i, b in enumerate(bodies)]


def test_round_trip_carries_body_deadline_and_trace(sock: Path) -> None:
    seen: list[tuple[float, Trace]] = []

    async def handler(body: bytes, deadline: float, trace: Trace) -> bytes:
        seen.append((deadline, trace))
        return body[::-1]

    async def test(client: LaneClient, _: LaneServer) -> None:
        deadline = soon()
        big = bytes(random.Random(1).randbytes(8 << 20))
        assert await client.call(b"abc", deadline, [("traceparent", "00-1-2-01")]) == b"cba"
        assert await client.call(big, deadline, []) == big[::-1]
        assert seen == [(deadline, [("traceparent", "00-1-2-01")]), (deadline, [])]

    asyncio.run(with_lane(sock, handler, test))


@pytest.mark.parametrize(
    ("raised", "kind", "message", "stage"),
    [
        (
            DeadlineExceeded("queued too long", stage="pool queue"),
            DeadlineExceeded,
            "queued",
            "pool queue",
        ),
        (ModelNotFound("no model 'm'"), ModelNotFound, "no model 'm'", ""),
        (DecodeError("bad bytes"), InvalidInput, "cannot be parsed: bad bytes", ""),
        (RuntimeError("boom"), ServingError, "internal error: RuntimeError: boom", ""),
    ],
)
def test_errors_cross_the_lane_with_their_kind_message_and_stage(
    sock: Path, raised: Exception, kind: type[ServingError], message: str, stage: str
) -> None:
    async def handler(body: bytes, deadline: float, trace: Trace) -> bytes:
        raise raised

    async def test(client: LaneClient, _: LaneServer) -> None:
        with pytest.raises(kind) as caught:
            await client.call(b"x", soon(), [])
        assert message in caught.value.message
        assert caught.value.stage == stage
        if kind is ServingError:
            assert caught.value.failure is Failure.INTERNAL
        assert client.pending == {}

    asyncio.run(with_lane(sock, handler, test))


def test_a_cancelled_call_cancels_the_pools_work(sock: Path) -> None:
    started = asyncio.Event()
    stopped = asyncio.Event()

    async def handler(body: bytes, deadline: float, trace: Trace) -> bytes:
        if body == b"slow":
            started.set()
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                stopped.set()
                raise
        return body

    async def test(client: LaneClient, server: LaneServer) -> None:
        async with asyncio.TaskGroup() as tasks:
            call = tasks.create_task(client.call(b"slow", soon(), []))
            await started.wait()
            call.cancel()
        assert client.pending == {}
        await asyncio.wait_for(stopped.wait(), 10)  # the CANCEL frame reached the pool
        assert server.in_flight() == 0
        assert await client.call(b"next", soon(), []) == b"next"

    asyncio.run(with_lane(sock, handler, test))


def test_the_routers_timer_answers_when_the_pool_does_not(sock: Path) -> None:
    cancelled = asyncio.Event()

    async def handler(body: bytes, deadline: float, trace: Trace) -> bytes:
        try:
            await asyncio.sleep(3600)  # a stuck pool: never answers by itself
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return body

    async def test(client: LaneClient, server: LaneServer) -> None:
        with pytest.raises(DeadlineExceeded) as caught:
            await client.call(b"x", time.monotonic() + 0.2, [])
        assert caught.value.stage == "pool"
        assert "waiting for pool 'x'" in caught.value.message
        await asyncio.wait_for(cancelled.wait(), 10)  # the pool was told to stop

    asyncio.run(with_lane(sock, handler, test))


def test_replies_for_abandoned_calls_are_dropped_and_every_other_call_gets_its_own(
    sock: Path,
) -> None:
    """The KeyError-on-message-id failure: 200 calls, 30 concurrent, a third cancelled
    while the pool still answers them (it ignores the cancel); every surviving call
    must get exactly its own reply, and the lane must keep working."""

    async def handler(body: bytes, deadline: float, trace: Trace) -> bytes:
        await asyncio.shield(asyncio.sleep(random.random() * 0.01))  # answers despite a cancel
        return b"reply:" + body

    async def test(client: LaneClient, _: LaneServer) -> None:
        limit = asyncio.Semaphore(30)
        rng = random.Random(7)
        outcomes: dict[int, str] = {}

        async def one(i: int) -> None:
            async with limit:
                body = str(i).encode()
                call = asyncio.ensure_future(client.call(body, soon(), []))
                if rng.random() < 0.33:
                    await asyncio.sleep(rng.random() * 0.005)
                    call.cancel()
                try:
                    reply = await call
                except asyncio.CancelledError:
                    outcomes[i] = "cancelled"
                    return
                assert reply == b"reply:" + body
                outcomes[i] = "ok"

        async with asyncio.TaskGroup() as tasks:
            for i in range(200):
                tasks.create_task(one(i))
        assert len(outcomes) == 200
        assert "ok" in outcomes.values() and "cancelled" in outcomes.values()
        assert client.pending == {}
        assert await client.call(b"last", soon(), []) == b"reply:last"

    asyncio.run(with_lane(sock, handler, test))


def test_stopping_pool_finishes_running_calls_and_refuses_new_ones(sock: Path) -> None:
    release = asyncio.Event()
    started = asyncio.Event()

    async def handler(body: bytes, deadline: float, trace: Trace) -> bytes:
        if body == b"running":
            started.set()
            await release.wait()
        return body

    async def test(client: LaneClient, server: LaneServer) -> None:
        async with asyncio.TaskGroup() as tasks:
            running = tasks.create_task(client.call(b"running", soon(), []))
            await started.wait()
            stopping = tasks.create_task(server.stop(30.0))
            await asyncio.sleep(0)  # one turn: stop() marks the lane draining at once
            assert server.draining
            with pytest.raises(Unavailable, match="pool 'x' is stopping"):
                await client.call(b"new", soon(), [])
            release.set()
            assert await running == b"running"
            await stopping
        with pytest.raises(Unavailable, match="not reachable"):
            await LaneClient(sock, "pool 'x'").call(b"x", soon(), [])

    asyncio.run(with_lane(sock, handler, test))


def test_calls_in_flight_fail_unavailable_when_the_pool_goes_and_the_lane_reconnects(
    sock: Path,
) -> None:
    started = asyncio.Event()

    async def stuck(body: bytes, deadline: float, trace: Trace) -> bytes:
        started.set()
        await asyncio.sleep(3600)
        return body

    async def main() -> None:
        client = LaneClient(sock, "pool 'x'")
        async with asyncio.TaskGroup() as tasks:
            first = LaneServer(sock, stuck, "pool 'x'")
            await first.start(tasks)

            async def lost_call() -> None:
                with pytest.raises(Unavailable, match="closed its lane"):
                    await client.call(b"x", soon(), [])

            call = tasks.create_task(lost_call())
            await started.wait()
            await first.stop(0.05)  # grace over: the connection closes under the call
            await call
            second = LaneServer(sock, echo, "pool 'x'")  # the pool restarted
            await second.start(tasks)
            assert await client.call(b"again", soon(), []) == b"again"
            client.close()
            await second.stop(5.0)

    asyncio.run(main())


def test_a_pool_that_is_not_there_is_unavailable(sock: Path) -> None:
    async def main() -> None:
        with pytest.raises(Unavailable, match="pool 'x' is not reachable"):
            await LaneClient(sock, "pool 'x'").call(b"x", soon(), [])

    asyncio.run(main())


def test_a_cancel_for_an_unknown_sequence_and_garbage_kinds_do_not_hurt_the_pool(
    sock: Path,
) -> None:
    async def test(client: LaneClient, _: LaneServer) -> None:
        reader, writer = await asyncio.open_unix_connection(str(sock))
        writer.write(HEADER.pack(0, CANCEL, 999))  # never sent: ignored
        writer.writelines(infer_frame(1, soon(), [], b"raw"))
        length, _, seq = HEADER.unpack(await reader.readexactly(HEADER.size))
        assert seq == 1 and await reader.readexactly(length) == b"raw"
        writer.write(HEADER.pack(3, INFER, 5) + b"abc")  # too short for an INFER head
        length, kind, seq = HEADER.unpack(await reader.readexactly(HEADER.size))
        assert (kind, seq) == (ERROR, 5)
        assert b"malformed INFER frame" in await reader.readexactly(length)
        writer.writelines(infer_frame(6, soon(), [], b"still served"))
        length, _, seq = HEADER.unpack(await reader.readexactly(HEADER.size))
        assert seq == 6 and await reader.readexactly(length) == b"still served"
        writer.write(HEADER.pack(0, 77, 2))  # not a lane frame: that connection ends
        assert await reader.read() == b""
        writer.close()
        assert await client.call(b"others", soon(), []) == b"others"

    asyncio.run(with_lane(sock, echo, test))


def test_a_frame_over_the_limit_ends_only_that_connection(sock: Path) -> None:
    async def main() -> None:
        async with asyncio.TaskGroup() as tasks:
            server = LaneServer(sock, echo, "pool 'x'", max_frame=1024)
            await server.start(tasks)
            client = LaneClient(sock, "pool 'x'")
            reader, writer = await asyncio.open_unix_connection(str(sock))
            writer.write(HEADER.pack(1 << 31, INFER, 1))  # announces 2 GiB: refused unread
            assert await reader.read() == b""
            writer.close()
            assert await client.call(b"fits", soon(), []) == b"fits"
            with pytest.raises(Unavailable, match="closed its lane"):
                await client.call(b"x" * 2048, soon(), [])
            assert await client.call(b"fits again", soon(), []) == b"fits again"
            client.close()
            await server.stop(5.0)

    asyncio.run(main())


def test_frames_of_one_loop_turn_leave_in_one_write_in_order() -> None:
    """The Batcher on a real socket pair: parts of one turn leave in one writev,
    nothing before the turn ends, nothing once the transport is closing."""
    import os
    import socket
    from unittest import mock

    async def main() -> None:
        loop = asyncio.get_running_loop()
        left, right = socket.socketpair()
        right.setblocking(False)
        transport, _ = await loop.connect_accepted_socket(asyncio.Protocol, sock=left)
        assert isinstance(transport, asyncio.Transport)
        batcher = Batcher(transport)
        try:
            with mock.patch("os.writev", side_effect=os.writev) as writev:
                for frame in (b"a", b"bb", memoryview(b"ccc")):
                    batcher.write(frame)
                assert writev.call_count == 0  # nothing before the turn ends
                await asyncio.sleep(0)
                assert writev.call_count == 1
            assert right.recv(100) == b"abbccc"
            batcher.write(b"al", b"one")
            await asyncio.sleep(0)
            assert right.recv(100) == b"alone"
            batcher.write(b"too late")
            transport.close()
            await asyncio.sleep(0)
            await asyncio.sleep(0)
        finally:
            batcher.close()
            right.close()

    asyncio.run(main())


def test_immediate_answers_on_the_spot_and_falls_back_to_the_handler(sock: Path) -> None:
    handled: list[bytes] = []

    def immediate(body: bytes, deadline: float, trace: Trace) -> bytes | None:
        if body == b"bad":
            raise InvalidInput("bad input, said on the spot")
        return b"now:" + body if body.startswith(b"fast") else None

    async def handler(body: bytes, deadline: float, trace: Trace) -> bytes:
        handled.append(body)
        return b"later:" + body

    async def main() -> None:
        async with asyncio.TaskGroup() as tasks:
            server = LaneServer(sock, handler, "pool 'x'", immediate=immediate)
            await server.start(tasks)
            client = LaneClient(sock, "pool 'x'")
            assert await client.call(b"fast1", soon(), []) == b"now:fast1"
            assert await client.call(b"slow1", soon(), []) == b"later:slow1"
            with pytest.raises(InvalidInput, match="said on the spot"):
                await client.call(b"bad", soon(), [])
            assert handled == [b"slow1"]
            client.close()
            await server.stop(5.0)

    asyncio.run(main())


def test_calls_begun_without_a_task_answer_once_and_a_cancel_reaches_them(sock: Path) -> None:
    """The ``begin`` hook: its reply (bytes or error) is answered on the lane; a call it
    declines goes to the handler; a CANCEL frame cancels a begun call, which then
    answers nothing; a stopping pool waits for begun calls as for tasks."""
    handled: list[bytes] = []
    begun: dict[bytes, Callable[[bytes | Exception], None]] = {}
    cancelled: list[bytes] = []

    class Begun:
        def __init__(self, body: bytes) -> None:
            self.body = body

        def cancel(self) -> None:
            cancelled.append(self.body)

    def begin(
        body: bytes, deadline: float, trace: Trace, reply: Callable[[bytes | Exception], None]
    ) -> Begun | None:
        if body == b"refused":
            raise InvalidInput("refused on arrival")
        if body.startswith(b"task"):
            return None
        begun[body] = reply
        return Begun(body)

    async def handler(body: bytes, deadline: float, trace: Trace) -> bytes:
        handled.append(body)
        return b"task:" + body

    async def main() -> None:
        async with asyncio.TaskGroup() as tasks:
            server = LaneServer(sock, handler, "pool 'x'", begin=begin)
            await server.start(tasks)
            client = LaneClient(sock, "pool 'x'")
            assert await client.call(b"task1", soon(), []) == b"task:task1"
            with pytest.raises(InvalidInput, match="refused on arrival"):
                await client.call(b"refused", soon(), [])
            ok = tasks.create_task(client.call(b"ok", soon(), []))
            bad = tasks.create_task(caught(client.call(b"bad", soon(), [])))
            gone = tasks.create_task(client.call(b"gone", soon(), []))
            await until_true(lambda: len(begun) == 3)
            assert server.in_flight() == 3
            begun[b"ok"](b"reply:ok")
            begun[b"bad"](InvalidInput("the model said no"))
            assert await ok == b"reply:ok"
            error = await bad
            assert isinstance(error, InvalidInput) and "the model said no" in str(error)
            gone.cancel()
            await until_true(lambda: cancelled == [b"gone"])  # the CANCEL frame reached it
            assert server.in_flight() == 0
            begun[b"gone"](b"too late")  # answers nothing: nobody waits
            assert handled == [b"task1"]
            assert await client.call(b"task2", soon(), []) == b"task:task2"
            client.close()
            await server.stop(5.0)

    asyncio.run(main())


async def caught(call: Awaitable[bytes]) -> bytes | Exception:
    try:
        return await call
    except Exception as exc:
        return exc


async def until_true(predicate: Callable[[], bool]) -> None:
    for _ in range(100_000):
        if predicate():
            return
        await asyncio.sleep(0.001 if _ > 1000 else 0)
    raise AssertionError("condition never held")


def test_a_stopping_pool_does_not_wait_for_a_begun_call_its_caller_cancelled(sock: Path) -> None:
    begun: list[bytes] = []

    class Begun:
        def cancel(self) -> None:
            pass

    def begin(
        body: bytes, deadline: float, trace: Trace, reply: Callable[[bytes | Exception], None]
    ) -> Begun:
        begun.append(body)
        return Begun()

    async def main() -> None:
        async with asyncio.TaskGroup() as tasks:
            server = LaneServer(sock, echo, "pool 'x'", begin=begin)
            await server.start(tasks)
            client = LaneClient(sock, "pool 'x'")
            call = tasks.create_task(client.call(b"held", soon(), []))
            await until_true(lambda: begun == [b"held"])
            stopping = tasks.create_task(server.stop(3600.0))
            await asyncio.sleep(0)
            call.cancel()  # the CANCEL frame ends the last call in flight
            await asyncio.wait_for(stopping, 60)  # not the 3600 s grace
            assert server.in_flight() == 0
            client.close()

    asyncio.run(main())


def test_a_timed_out_or_refused_call_leaves_no_cycle_holding_its_body(sock: Path) -> None:
    """Issue 42 §4: a call the router's timer ended, and one the pool answered
    with an error, raised their exception from LaneClient.call, whose frame
    kept the error (through the future, or its own local) and the error's
    traceback the frame: the body stayed until the garbage collector ran (a
    15 MiB request each, hundreds of MiB after bursts with short deadlines)."""
    body = b"x" * (2 << 20)

    async def handler(body: bytes, deadline: float, trace: Trace) -> bytes:
        if bytes(body[:1]) == b"x":
            await asyncio.sleep(3600)  # never answers: the router's timer does
        raise InvalidInput("no")

    async def test(client: LaneClient, _: LaneServer) -> None:
        with pytest.raises(DeadlineExceeded):
            await client.call(body, time.monotonic() + 0.1, [])
        with pytest.raises(InvalidInput):
            await client.call(b"y" + body, soon(), [])

    with no_collector():
        asyncio.run(with_lane(sock, handler, test))
        assert held_in_cycles() == []
