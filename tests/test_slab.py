"""The router's slabs (contract/slab.py) and a worker's side of them
(poolcore/slabs.py), in one process: formats, ownership, mapping checks."""

from __future__ import annotations

import asyncio
import contextlib
import os
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from poolserve.protos import inference_pb2 as pb
from poolserve.service.contract import slab
from poolserve.service.contract.errors import Failure, InvalidInput, Unavailable
from poolserve.service.contract.framing import HEADER, Part, Payload
from poolserve.service.contract.lane import Trace
from poolserve.service.contract.shm import unwrap
from poolserve.service.poolcore.frames import REPLY, TIMINGS, error_frame, reply_frame
from poolserve.service.poolcore.slabs import put_reply, take
from poolserve.service.poolcore.stats import Timings
from poolserve.service.poolserver.lane_server import LaneServer
from poolserve.service.router.lane_client import LaneClient
from poolserve.service.router.slab_sink import MODEL_INFER, slab_sinks

from support import infer_request


@contextlib.asynccontextmanager
async def lane(
    path: Path, pool: Callable[[Payload, float, Trace], Awaitable[bytes]], arena: slab.Arena
) -> AsyncIterator[tuple[LaneClient, asyncio.TaskGroup]]:
    """A pool's lane server and the router's client of it, in this process."""
    async with asyncio.TaskGroup() as tasks:
        server = LaneServer(path, pool, "pool 'x'")
        await server.start(tasks)
        client = LaneClient(path, "pool 'x'", arena)
        try:
            yield client, tasks
        finally:
            client.close()
            await server.stop(5.0)


def test_when_workers_cannot_open_slabs_the_router_sends_inline_from_then_on() -> None:
    """A host where a worker cannot open the router's memfd through /proc: the
    call is sent again inline, and every later one goes inline at once."""
    seen: list[bool] = []

    async def pool(body: Payload, deadline: float, trace: Trace) -> bytes:
        seen.append(slab.is_enveloped(body))
        if slab.is_enveloped(body):
            raise Unavailable(f"slab 'x' {slab.UNREACHABLE}: Permission denied")
        return bytes(body)

    async def main(path: Path) -> None:
        arena = slab.Arena(max_reply=1 << 30)
        async with lane(path, pool, arena) as (client, _tasks):
            body = big_request() + b"\x3a\x80\x80\x04" + bytes(1 << 16)  # raw: 64 KiB
            assert len(body) > slab.THRESHOLD
            assert await client.call(body, time.monotonic() + 30, [], "m") == body
            assert await client.call(body, time.monotonic() + 30, [], "m") == body
        assert seen == [True, False, False]
        assert arena.disabled and not arena.leased and not arena.idle

    with tempfile.TemporaryDirectory() as folder:
        asyncio.run(main(Path(folder) / "pool-x.lane"))


def fd_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def big_request() -> bytes:
    message = pb.ModelInferRequest(model_name="echo", id="r1")
    for k in range(2):
        message.inputs.add(name=f"INPUT{k}", datatype="FP32", shape=[3])
        message.raw_input_contents.append(np.arange(3, dtype=np.float32).tobytes() * (k + 1))
    message.parameters["priority"].int64_param = 2
    message.outputs.add(name="OUTPUT0")
    return message.SerializeToString()


def test_the_head_is_the_request_without_its_raw_contents_and_malformed_bytes_give_none() -> None:
    body = big_request()
    head = slab.without_raw_inputs(body)
    assert head is not None
    expected = pb.ModelInferRequest.FromString(body)
    del expected.raw_input_contents[:]
    assert pb.ModelInferRequest.FromString(head) == expected
    assert len(head) < len(body) - 18
    assert slab.without_raw_inputs(body[:-3]) is None  # a field runs past the end
    assert slab.without_raw_inputs(b"\x0f") is None  # wire type 7
    plain = infer_request("echo", np.zeros(4, np.float32), raw=False)
    assert slab.without_raw_inputs(plain) == plain


def test_an_envelope_carries_its_reference_and_the_pool_peeks_at_its_head() -> None:
    head = slab.without_raw_inputs(big_request())
    assert head is not None
    ref = slab.Ref("poolserve-slab-1-ab-3", 1234, 7, 10_000, 12_288, 99_999)
    data = slab.envelope(ref, head)
    assert slab.is_enveloped(data) and not slab.is_enveloped(head)
    assert slab.parse(data) == (ref, head)
    assert slab.head(data) == head and slab.head(head) == head
    assert unwrap(data) == ({}, head)  # what the pool's peeks read
    assert unwrap(memoryview(data))[1] == head
    with pytest.raises(InvalidInput, match="cut short"):
        slab.parse(data[:10])
    assert slab.reply_length(slab.reply_ref(4321)) == 4321
    assert slab.reply_length(b"\x0a\x04echo") is None
    assert slab.reply_length(slab.reply_ref(5) + b"x") is None


def test_a_freed_slab_is_reused_a_retired_one_never_and_close_releases_all() -> None:
    arena = slab.Arena(max_reply=3 << 20)
    first, ref = arena.lease(100_000, 100_000)  # type: ignore[misc]
    assert ref.length == 100_000 and ref.reply_at % slab.ALIGN == 0 and ref.reply_at >= 100_000
    assert ref.reply_at + ref.reply_capacity <= first.size and first.size == slab.MIN_SLAB
    assert ref.pid == os.getpid() and ref.fd == first.fd
    arena.free(first)
    again, _ = arena.lease(200_000, 200_000)  # type: ignore[misc]
    assert again is first  # same size: the idle one
    arena.retire(again)
    assert not fd_open(first.fd) or os.readlink(f"/proc/self/fd/{first.fd}") != (
        f"/memfd:{first.name} (deleted)"
    )
    fresh, _ = arena.lease(100_000, 100_000)  # type: ignore[misc]
    assert fresh is not first and fresh.name != first.name
    big, big_ref = arena.lease(5 << 20, 50 << 20)  # type: ignore[misc]
    assert big_ref.reply_capacity == 3 << 20  # never more than max_reply
    fds = [fresh.fd, big.fd]
    arena.close()
    arena.retire(big)  # a call that ends after the stop: closed once only
    assert big.closed and fresh.closed
    assert not any(
        fd_open(fd) and os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:poolserve-slab")
        for fd in fds
    )
    assert arena.lease(10, 10) is None


def test_the_arena_is_bounded() -> None:
    arena = slab.Arena(max_reply=1 << 20)
    held = [arena.lease(1000, 1000) for _ in range(slab.MAX_SLABS)]
    assert all(held)
    assert arena.lease(1000, 1000) is None  # the body goes inline
    arena.close()


def test_an_idle_slab_not_leased_again_within_idle_s_is_closed() -> None:
    """A burst's slabs go back a moment after it, whatever the load: CI saw
    four to nine kept idle for good (120 to 240 MiB) when they went only with
    the router's idle trim, which a loaded router never reached."""
    now = [0.0]
    arena = slab.Arena(max_reply=1 << 20, idle_s=2.0, clock=lambda: now[0])
    try:
        old, _ = arena.lease(1000, 1000)  # type: ignore[misc]
        recent, _ = arena.lease(1000, 1000)  # type: ignore[misc]
        arena.free(old)
        now[0] = 1.5
        arena.free(recent)
        now[0] = 2.0
        arena.age()
        assert old.closed and not recent.closed
        assert arena.idle_bytes == recent.size
        again, _ = arena.lease(1000, 1000)  # type: ignore[misc]
        assert again is recent  # steady traffic reuses what is idle
        now[0] = 3.0
        arena.free(again)
        now[0] = 4.9
        arena.age()
        assert not again.closed  # used 1.9 s ago
        now[0] = 5.0
        arena.age()
        assert again.closed and arena.idle_bytes == 0 and not arena.idle and not arena.leased
    finally:
        arena.close()


def test_the_running_loop_ages_idle_slabs_by_itself_and_close_stops_it() -> None:
    async def main() -> None:
        arena = slab.Arena(max_reply=1 << 20, idle_s=0.05)
        first, _ = arena.lease(1000, 1000)  # type: ignore[misc]
        arena.free(first)
        assert not first.closed
        for _ in range(2000):  # generous: a loaded machine
            if first.closed:
                break
            await asyncio.sleep(0.01)
        assert first.closed and arena.idle_bytes == 0
        second, _ = arena.lease(1000, 1000)  # type: ignore[misc]
        assert second is not first
        arena.free(second)
        arena.close()  # the timer goes with it
        assert second.closed
        assert not [h for h in asyncio.get_running_loop()._scheduled if not h.cancelled()]  # type: ignore[attr-defined]

    asyncio.run(main())


def test_a_worker_maps_the_slab_it_is_named_and_refuses_anything_else() -> None:
    arena = slab.Arena(max_reply=1 << 20)
    try:
        leased, ref = arena.lease(5, 100)  # type: ignore[misc]
        leased.view[:5] = b"hello"
        mapper = slab.Mapper()
        assert bytes(mapper.request(ref)) == b"hello"
        assert mapper.request(ref).readonly
        leased.view[:5] = b"HELLO"  # one memory: the mapping sees the router's writes
        assert bytes(mapper.request(ref)) == b"HELLO"
        with pytest.raises(InvalidInput, match="not a poolserve slab"):
            mapper.view(slab.Ref("../etc", ref.pid, ref.fd, 5, 4096, 10))
        with pytest.raises(InvalidInput, match="is gone"):  # the descriptor holds another slab
            slab.Mapper().view(slab.Ref(ref.name + "9", ref.pid, ref.fd, 5, 4096, 10))
        with pytest.raises(InvalidInput, match="smaller than"):
            slab.Mapper().view(slab.Ref(ref.name, ref.pid, ref.fd, 5, 4096, 1 << 30))
        with pytest.raises(Unavailable, match="cannot be opened"):
            slab.Mapper().view(slab.Ref(ref.name, ref.pid, 100_000, 5, 4096, 10))
    finally:
        arena.close()


def test_a_worker_keeps_its_mappings_bounded_by_count_and_size(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(slab.LIMITS, "slab_mapped_bytes", 3 * slab.MIN_SLAB)
    arena = slab.Arena(max_reply=1 << 20)
    try:
        refs = [arena.lease(10, 10)[1] for _ in range(5)]  # type: ignore[index]
        mapper = slab.Mapper()
        for ref in refs:
            mapper.view(ref)
        assert len(mapper) == 3 and mapper.mapped_bytes == 3 * slab.MIN_SLAB
        mapper.view(refs[2])  # used again: the most recent, kept
        mapper.view(refs[0])
        assert len(mapper) == 3 and mapper.mapped_bytes == 3 * slab.MIN_SLAB
    finally:
        arena.close()


def test_a_reply_that_fits_goes_into_the_slab_the_rest_inline() -> None:
    arena = slab.Arena(max_reply=1 << 20)
    try:
        leased, ref = arena.lease(10, 1000)  # type: ignore[misc]
        mapper = slab.Mapper()
        envelope = slab.envelope(ref, b"")
        got_ref, view = take(mapper, envelope)
        assert got_ref == ref and len(view) == 10
        assert take(mapper, b"\x0a\x01x") == (None, b"\x0a\x01x")
        timings = Timings(1, 2, 3)
        body: list[Part] = [b"abc", memoryview(b"defg"), bytearray(b"h")]
        frame = put_reply(mapper, ref, 7, reply_frame(7, timings, body))
        whole = b"".join(bytes(p) for p in frame)
        _, kind, seq = HEADER.unpack_from(whole)
        assert (kind, seq) == (REPLY, 7)
        assert Timings(*TIMINGS.unpack_from(whole, HEADER.size)) == timings
        reply = whole[HEADER.size + TIMINGS.size :]
        assert slab.reply_length(reply) == 8
        assert bytes(leased.view[ref.reply_at : ref.reply_at + 8]) == b"abcdefgh"
        too_big = reply_frame(8, timings, b"x" * (ref.reply_capacity + 1))
        assert put_reply(mapper, ref, 8, too_big) is too_big
        error = error_frame(9, timings, Failure.INVALID_INPUT, "no")
        assert put_reply(mapper, ref, 9, error) is error
    finally:
        arena.close()


def test_a_batch_reads_its_large_requests_from_slabs_and_refuses_only_a_bad_one() -> None:
    from poolserve.service.poolcore.frames import batch_frame, join_frames, parse_batch_reply
    from poolserve.service.poolcore.worker import _run_batch

    def handler(body: bytes, seq: int) -> list[Part]:
        return reply_frame(seq, Timings(), b"got:" + bytes(body))

    arena = slab.Arena(max_reply=1 << 20)
    try:
        leased, ref = arena.lease(4, 100)  # type: ignore[misc]
        leased.view[:4] = b"big!"
        bad = slab.Ref(slab.PREFIX + "nope", ref.pid, ref.fd, 4, 4096, 10)
        bodies = [b"small", slab.envelope(ref, b""), slab.envelope(bad, b""), b"last"]
        payload = b"".join(bytes(p) for p in batch_frame(1, bodies)[1:])
        frames = _run_batch(handler, slab.Mapper(), payload)
        reply = parse_batch_reply(1, join_frames(frames))
        assert reply.parts is not None
        assert [bytes(p.body) for p in reply.parts] == [b"got:small", b"got:big!", b"", b"got:last"]
        assert reply.parts[2].failure == Failure.INVALID_INPUT, reply.parts[2]
        assert "is gone" in reply.parts[2].message
    finally:
        arena.close()


def test_a_call_cancelled_in_the_turn_its_reply_came_frees_its_slab() -> None:
    """Issue 42 §4: a call whose caller was cancelled (its deadline at the
    door) in the turn the worker's REPLY came kept its slab leased for good:
    neither freed (the reply was never read) nor retired (the worker had
    replied). Bursts of 15 MiB calls with short deadlines left such slabs
    behind, 32 MiB each."""

    async def pool(body: Payload, deadline: float, trace: Trace) -> bytes:
        return b"answered"

    class Racing(dict[int, Any]):
        """The lane's calls in flight; the caller is cancelled in the turn its reply comes."""

        task: asyncio.Task[bytes] | None = None

        def pop(self, key: int, default: Any = None) -> Any:
            if self.task is not None:
                asyncio.get_running_loop().call_soon(self.task.cancel)
            return super().pop(key, default)

    async def main(path: Path) -> None:
        arena = slab.Arena(max_reply=1 << 20)
        async with lane(path, pool, arena) as (client, tasks):
            body = big_request() + b"\x3a\x80\x80\x04" + bytes(1 << 16)  # raw: 64 KiB
            racing = Racing()
            client.pending = racing
            call = racing.task = tasks.create_task(
                client.call(body, time.monotonic() + 30, [], "m")
            )
            await asyncio.wait([call])
            assert call.cancelled()
            assert not arena.leased

    with tempfile.TemporaryDirectory() as folder:
        asyncio.run(main(Path(folder) / "pool-x.lane"))


def test_a_reply_lent_from_its_slab_keeps_the_slab_leased_until_it_was_sent() -> None:
    """With ``lend`` (the router's own HTTP/2 door), a reply the worker wrote
    into the slab comes back as a view of it, not a copy, and the slab stays
    leased (no other call gets it) until the lent release runs; without, the
    reply is ``bytes`` and the slab is free at once."""
    mapper = slab.Mapper()

    async def pool(body: Payload, deadline: float, trace: Trace) -> bytes:
        ref, view = take(mapper, body)
        assert ref is not None
        reply = bytes(view)[::-1]
        mapper.view(ref)[ref.reply_at : ref.reply_at + len(reply)] = reply
        return slab.reply_ref(len(reply))

    async def main(path: Path) -> None:
        arena = slab.Arena(max_reply=1 << 20)
        async with lane(path, pool, arena) as (client, _tasks):
            body = big_request() + b"\x3a\x80\x80\x04" + os.urandom(1 << 16)
            releases: list[Any] = []
            deadline = time.monotonic() + 30
            lent = await client.call(body, deadline, [], "m", None, releases.append)
            assert isinstance(lent, memoryview) and bytes(lent) == body[::-1]
            assert len(arena.leased) == 1 and not arena.idle
            other = body[:-8] + b"different"[:8]
            copied = await client.call(other, time.monotonic() + 30, [], "m")
            assert isinstance(copied, bytes) and copied == other[::-1]
            assert bytes(lent) == body[::-1]  # its slab was not the second call's
            assert len(arena.leased) == 1 and sum(map(len, arena.idle.values())) == 1
            (release,) = releases
            release()
            assert not arena.leased and sum(map(len, arena.idle.values())) == 2
        arena.close()

    with tempfile.TemporaryDirectory() as folder:
        asyncio.run(main(Path(folder) / "pool-x.lane"))


def test_a_request_received_into_a_slab_goes_to_the_worker_in_that_slab() -> None:
    """router/slab_sink.py: a large ModelInfer received into a slab is taken over
    by the lane (no second slab, no copy: the envelope names it) and freed on
    the worker's REPLY; a sink the lane never took is freed by its drop."""
    named: list[str] = []

    async def pool(body: Payload, deadline: float, trace: Trace) -> bytes:
        ref, _ = slab.parse(body)
        named.append(ref.name)
        return b"answered"

    async def main(path: Path) -> None:
        arena = slab.Arena(max_reply=1 << 20)
        sinks = slab_sinks(arena)
        async with lane(path, pool, arena) as (client, _tasks):
            body = big_request() + b"\x3a\x80\x80\x04" + os.urandom(1 << 16)
            assert sinks("/inference.GRPCInferenceService/ModelReady", len(body)) is None
            assert sinks(MODEL_INFER, 1000) is None  # small: inline
            sink = sinks(MODEL_INFER, len(body))
            assert sink is not None and len(arena.leased) == 1
            sink.view[:] = body
            reply = await client.call(sink.view, time.monotonic() + 30, [], "m", sunk=sink)
            assert reply == b"answered" and named == [sink.slab.name]
            assert not arena.leased  # freed on the REPLY: no second lease
            sink.drop()  # the call ends: a no-op, the lane took it
            assert sum(map(len, arena.idle.values())) == 1
            unused = sinks(MODEL_INFER, len(body))
            assert unused is not None and len(arena.leased) == 1
            unused.drop()
            assert not arena.leased
        arena.close()

    with tempfile.TemporaryDirectory() as folder:
        asyncio.run(main(Path(folder) / "pool-x.lane"))
