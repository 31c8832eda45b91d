"""The fleet (one rolling replacement and one death handling for the pool server
and WorkerPool) with the real dispatcher and fake workers over socketpairs."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable, Collection

import pytest

from poolserve.service.contract.errors import Unavailable
from poolserve.service.poolcore.dispatcher import Dispatcher
from poolserve.service.poolcore.fleet import Fleet
from poolserve.service.poolcore.frames import ready_frame
from poolserve.service.poolcore.jobs import Limits, WorkerState


class FakeZygote:
    """Records fork requests; the test decides when each fork arrives."""

    def __init__(self) -> None:
        self.asked = 0
        self.next_pid = 100
        self.workers: dict[int, tuple[asyncio.StreamReader, asyncio.StreamWriter]] = {}

    def spawn(self, skip: Collection[str]) -> None:
        self.asked += 1

    async def fork(self, fleet: Fleet, ready: bool = True) -> int:
        """One asked-for fork arrives (and passes its self-test if ``ready``)."""
        self.next_pid += 1
        pid = self.next_pid
        ours, theirs = socket.socketpair()
        fleet.arrived(pid, ours)
        reader, writer = await asyncio.open_connection(sock=theirs)
        self.workers[pid] = (reader, writer)
        if ready:
            self.pass_self_test(pid)
        return pid

    def pass_self_test(self, pid: int) -> None:
        self.workers[pid][1].write(ready_frame(b'{"raised": {}}'))

    def kill(self, pid: int) -> None:
        self.workers[pid][1].close()

    async def close(self) -> None:
        for _, writer in self.workers.values():
            writer.close()


async def until(predicate: Callable[[], bool]) -> None:
    for _ in range(10_000):
        if predicate():
            return
        await asyncio.sleep(0)  # let the dispatcher's reader tasks run
    raise AssertionError("condition never held")


def serving(d: Dispatcher) -> list[int]:
    return [
        w.pid
        for w in d.workers()
        if w.state in (WorkerState.IDLE, WorkerState.BUSY) and not w.retiring
    ]


def with_fleet(body: Callable[[Fleet, FakeZygote, Dispatcher], Awaitable[None]]) -> None:
    async def main() -> None:
        zygote = FakeZygote()
        failed: list[tuple[str, str]] = []
        fleet = Fleet.with_dispatcher(
            "pool p",
            "p",
            2,
            zygote.spawn,
            Limits(max_queue=100, heartbeat_timeout=30.0, warmup_timeout=10.0, abandon_grace=0.0),
            mark_failed=lambda name, why: failed.append((name, why)),
        )
        d = fleet.dispatcher
        started = asyncio.Event()
        runner = asyncio.create_task(d.run(started.set))
        await started.wait()
        try:
            await body(fleet, zygote, d)
        finally:
            fleet.stop()
            d.close()
            await runner
            await zygote.close()

    asyncio.run(main())


def test_start_forks_size_workers_and_a_roll_keeps_capacity_until_each_fresh_one_is_ready() -> None:
    async def body(fleet: Fleet, zygote: FakeZygote, d: Dispatcher) -> None:
        fleet.start()
        assert zygote.asked == 2
        old = [await zygote.fork(fleet), await zygote.fork(fleet)]
        await until(lambda: len(serving(d)) == 2)

        roll = asyncio.create_task(fleet.roll(timeout_s=60))
        await until(lambda: zygote.asked == 3)  # one extra fork at a time
        fresh = await zygote.fork(fleet, ready=False)
        for _ in range(100):
            await asyncio.sleep(0)
        assert sorted(serving(d)) == sorted(old), (
            "no old worker retires before a fresh one is ready"
        )
        assert zygote.asked == 3, "never two forks of a roll at once"
        zygote.pass_self_test(fresh)
        await until(lambda: zygote.asked == 4)  # one old one retired, the next fork asked
        assert len(serving(d)) == 2 and fresh in serving(d)
        second = await zygote.fork(fleet)
        await asyncio.wait_for(roll, 60)
        assert sorted(serving(d)) == sorted([fresh, second])
        assert not fleet.is_stale(fleet.generation)
        assert zygote.asked == 4

    with_fleet(body)


def test_a_fresh_worker_that_dies_in_its_roll_is_replaced_and_no_old_one_retires_for_it() -> None:
    async def body(fleet: Fleet, zygote: FakeZygote, d: Dispatcher) -> None:
        fleet.start()
        old = [await zygote.fork(fleet), await zygote.fork(fleet)]
        await until(lambda: len(serving(d)) == 2)
        roll = asyncio.create_task(fleet.roll(timeout_s=60))
        await until(lambda: zygote.asked == 3)
        doomed = await zygote.fork(fleet, ready=False)
        zygote.kill(doomed)
        d.worker_exited(doomed, "killed by SIGSEGV")
        await until(lambda: doomed not in [w.pid for w in d.workers()])
        await until(lambda: zygote.asked >= 4)  # the roll asks again (and the respawner may)
        assert sorted(serving(d)) == sorted(old)
        assert fleet.respawner.respawns + zygote.asked >= 4
        while not roll.done():
            if zygote.asked > zygote.next_pid - 100:
                await zygote.fork(fleet)
            await asyncio.sleep(0.01)
        await roll
        assert len(serving(d)) == 2
        assert not set(serving(d)) & set(old)

    with_fleet(body)


def test_a_surplus_worker_from_a_racing_respawn_is_retired_once_ready() -> None:
    async def body(fleet: Fleet, zygote: FakeZygote, d: Dispatcher) -> None:
        fleet.start()
        await zygote.fork(fleet)
        await zygote.fork(fleet)
        await until(lambda: len(serving(d)) == 2)
        extra = await zygote.fork(fleet, ready=False)  # a respawn that raced
        for _ in range(100):
            await asyncio.sleep(0)
        assert len([w for w in d.workers() if not w.retiring]) == 3, "kept while not ready"
        zygote.pass_self_test(extra)
        await until(lambda: len([w for w in d.workers() if not w.retiring]) == 2)
        assert len(serving(d)) == 2
        assert zygote.asked == 2, "a surplus is retired, nothing forked"

    with_fleet(body)


def test_a_roll_without_a_fresh_worker_fails_unavailable() -> None:
    async def body(fleet: Fleet, zygote: FakeZygote, d: Dispatcher) -> None:
        fleet.start()
        await zygote.fork(fleet)
        await zygote.fork(fleet)
        await until(lambda: len(serving(d)) == 2)
        with pytest.raises(Unavailable, match="no new worker within"):
            await fleet.roll(timeout_s=0.2)  # the fork it asks for never arrives
        assert len(serving(d)) == 2, "the old workers keep serving"

    with_fleet(body)


def test_a_stopped_fleet_forks_nothing_and_counts_no_death() -> None:
    async def body(fleet: Fleet, zygote: FakeZygote, d: Dispatcher) -> None:
        fleet.start()
        pid = await zygote.fork(fleet)
        await until(lambda: len(serving(d)) == 1)
        fleet.stop()
        zygote.kill(pid)
        d.worker_exited(pid, "killed by SIGKILL")
        await until(lambda: not d.workers())
        assert zygote.asked == 2
        assert fleet.respawner.respawns == 0

    with_fleet(body)
