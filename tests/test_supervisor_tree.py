"""The supervisor with scripted in-process services and a fake clock.

Readiness and progress are observed through events (a handshake), never by
sleeping; time only moves when a test advances the FakeClock.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import signal
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, TypeVar

import pytest

from poolserve.supervisor.clock import FakeClock
from poolserve.supervisor.events import (
    BackoffPaused,
    BackoffResumed,
    ChildExited,
    ChildReady,
    ChildRestarting,
    ChildStarted,
    Event,
    StopTimeout,
    TreeTerminating,
)
from poolserve.supervisor.spec import (
    ChildSpec,
    ChildState,
    DoNotRestart,
    Restart,
    Service,
    Strategy,
    SupervisorSpec,
    TerminateTree,
    Unrecoverable,
)
from poolserve.supervisor.tree import KILL_GRACE, SAME_STOP_S, Supervisor, run_root

E = TypeVar("E", bound=Event)


def run(main: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(main())


async def settle() -> None:
    """Lets every already-runnable callback run (no time passes)."""
    for _ in range(50):
        await asyncio.sleep(0)


class Recorder:
    """The event hook of the tests: records, and wakes whoever waits for an event."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self._waiters: list[asyncio.Future[None]] = []

    def __call__(self, event: Event) -> None:
        self.events.append(event)
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    def of(self, kind: type[E], child_id: str | None = None) -> list[E]:
        return [
            event
            for event in self.events
            if isinstance(event, kind)
            and (child_id is None or getattr(event, "id", "") == child_id)
        ]

    async def wait_for(self, kind: type[E], child_id: str | None = None, count: int = 1) -> E:
        """Returns the ``count``-th event of that kind (and child), waiting for it."""
        while len(found := self.of(kind, child_id)) < count:
            waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            await waiter
        return found[count - 1]

    def names(self, kind: type[Event]) -> list[str]:
        return [str(getattr(event, "id", "")) for event in self.events if isinstance(event, kind)]


class Scripted:
    """A coroutine service the test drives through its :class:`World`."""

    def __init__(self, world: World, child_id: str, auto_ready: bool) -> None:
        self.world = world
        self.id = child_id
        self.auto_ready = auto_ready
        self.end: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.ready: Callable[[], None] = lambda: None
        self.cancellations = 0

    async def serve(self, ready: Callable[[], None]) -> None:
        self.ready = ready
        self.world.live[self.id] = self
        if self.auto_ready:
            ready()
        try:
            await self.end
        finally:
            if self.world.live.get(self.id) is self:
                del self.world.live[self.id]


class Stubborn(Scripted):
    """Ignores the first stop request; honours the "kill now" (or ``release``)."""

    def __init__(self, world: World, child_id: str, ignore_all: bool = False) -> None:
        super().__init__(world, child_id, auto_ready=True)
        self.ignore_all = ignore_all
        self.release: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.killed_now = False

    async def serve(self, ready: Callable[[], None]) -> None:
        self.world.live[self.id] = self
        ready()
        while True:
            try:
                await asyncio.wait({self.release})
                return
            except asyncio.CancelledError:
                self.cancellations += 1
                task = asyncio.current_task()
                # The contract: more than one cancellation request means "now".
                self.killed_now = task is not None and task.cancelling() > 1
                if self.killed_now and not self.ignore_all:
                    raise


class World:
    """Makes child specs whose every start creates a fresh Scripted service."""

    def __init__(self) -> None:
        self.live: dict[str, Scripted] = {}
        self.starts: dict[str, int] = {}

    def spec(
        self,
        child_id: str,
        *,
        restart: Restart = Restart.PERMANENT,
        auto_ready: bool = True,
        stop_timeout: float | None = 1.0,
        factory: Callable[[], Scripted] | None = None,
    ) -> ChildSpec:
        def start() -> Service:
            self.starts[child_id] = self.starts.get(child_id, 0) + 1
            return factory() if factory else Scripted(self, child_id, auto_ready)

        return ChildSpec(child_id, start, restart=restart, stop_timeout=stop_timeout)

    def end(self, child_id: str, error: BaseException | None = None) -> None:
        """Makes the live incarnation of ``child_id`` return or raise."""
        future = self.live[child_id].end
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)


class Harness:
    """One supervisor under test, served in a task."""

    def __init__(
        self,
        children: Sequence[ChildSpec],
        *,
        strategy: Strategy = Strategy.ONE_FOR_ONE,
        backoff_base: float = 0.0,
        failure_threshold: float = 100.0,
        failure_backoff: float = 15.0,
        stop_timeout: float = 60.0,
    ) -> None:
        self.clock = FakeClock()
        self.events = Recorder()
        spec = SupervisorSpec(
            "sup",
            strategy=strategy,
            backoff_base=backoff_base,
            jitter=0.0,
            failure_threshold=failure_threshold,
            failure_backoff=failure_backoff,
            stop_timeout=stop_timeout,
        )
        self.supervisor = Supervisor(
            spec, children, clock=self.clock, events=self.events, rng=random.Random(0)
        )
        self.ready = asyncio.Event()
        self.task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Harness:
        self.task = asyncio.create_task(self.supervisor.serve(self.ready.set))
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.stop()

    async def stop(self) -> None:
        assert self.task is not None
        self.task.cancel()
        await asyncio.wait({self.task})
        assert self.task.cancelled()

    def states(self) -> dict[str, ChildState]:
        return {status.id: status.state for status in self.supervisor.status()}


# -- start order --------------------------------------------------------------


def test_children_start_in_order_each_after_the_previous_is_ready() -> None:
    async def main() -> None:
        world = World()
        children = [world.spec("a", auto_ready=False), world.spec("b"), world.spec("c")]
        async with Harness(children) as h:
            await h.events.wait_for(ChildStarted, "a")
            await settle()
            assert h.events.names(ChildStarted) == ["a"]  # "a" never said ready
            assert h.states() == {
                "a": ChildState.STARTING,
                "b": ChildState.STARTING,
                "c": ChildState.STARTING,
            }
            assert not h.ready.is_set()

            world.live["a"].ready()
            await h.events.wait_for(ChildReady, "c")
            await h.ready.wait()
            assert h.events.names(ChildStarted) == ["a", "b", "c"]
            assert h.events.names(ChildReady) == ["a", "b", "c"]
            assert set(h.states().values()) == {ChildState.RUNNING}

    run(main)


def test_children_stop_in_reverse_order() -> None:
    async def main() -> None:
        world = World()
        h = Harness([world.spec("a"), world.spec("b"), world.spec("c")])
        async with h:
            await h.ready.wait()
        assert h.events.names(ChildExited) == ["c", "b", "a"]
        assert all(event.normal and not event.will_restart for event in h.events.of(ChildExited))
        assert set(h.states().values()) == {ChildState.STOPPED}
        assert world.live == {}

    run(main)


def test_an_empty_supervisor_is_ready_at_once() -> None:
    async def main() -> None:
        async with Harness([]) as h:
            await h.ready.wait()

    run(main)


# -- strategies ---------------------------------------------------------------


async def fail_and_wait_restart(h: Harness, world: World, child_id: str) -> None:
    restarts = len(h.events.of(ChildRestarting, child_id))
    world.end(child_id, RuntimeError("boom"))
    await h.events.wait_for(ChildRestarting, child_id, restarts + 1)


def test_one_for_one_restarts_only_the_failed_child() -> None:
    async def main() -> None:
        world = World()
        async with Harness([world.spec("a"), world.spec("b"), world.spec("c")]) as h:
            await h.ready.wait()
            first = dict(world.live)
            await fail_and_wait_restart(h, world, "b")
            await h.events.wait_for(ChildReady, "b", 2)
            assert world.starts == {"a": 1, "b": 2, "c": 1}
            assert world.live["a"] is first["a"] and world.live["c"] is first["c"]
            exited = h.events.of(ChildExited)
            assert [(e.id, e.will_restart) for e in exited] == [("b", True)]
            assert "RuntimeError: boom" in exited[0].outcome
            assert {s.id: s.restarts for s in h.supervisor.status()} == {"a": 0, "b": 1, "c": 0}

    run(main)


def test_one_for_all_restarts_everyone_in_order() -> None:
    async def main() -> None:
        world = World()
        children = [world.spec("a"), world.spec("b"), world.spec("c")]
        async with Harness(children, strategy=Strategy.ONE_FOR_ALL) as h:
            await h.ready.wait()
            world.end("b", RuntimeError("boom"))
            await h.events.wait_for(ChildReady, "c", 2)
            assert world.starts == {"a": 2, "b": 2, "c": 2}
            # b failed; the others stopped in reverse order, then all started in order.
            assert h.events.names(ChildExited) == ["b", "c", "a"]
            assert all(event.will_restart for event in h.events.of(ChildExited))
            assert h.events.names(ChildStarted) == ["a", "b", "c", "a", "b", "c"]

    run(main)


def test_a_temporary_sibling_stops_with_the_group_but_stays_down() -> None:
    async def main() -> None:
        world = World()
        children = [world.spec("a"), world.spec("temp", restart=Restart.TEMPORARY)]
        async with Harness(children, strategy=Strategy.ONE_FOR_ALL) as h:
            await h.ready.wait()
            world.end("a", RuntimeError("boom"))
            await h.events.wait_for(ChildReady, "a", 2)
            await settle()
            assert world.starts == {"a": 2, "temp": 1}
            assert h.states() == {"a": ChildState.RUNNING, "temp": ChildState.STOPPED}
            [temp] = h.events.of(ChildExited, "temp")
            assert not temp.will_restart

    run(main)


def test_rest_for_one_restarts_the_failed_child_and_those_after_it() -> None:
    async def main() -> None:
        world = World()
        children = [world.spec("a"), world.spec("b"), world.spec("c")]
        async with Harness(children, strategy=Strategy.REST_FOR_ONE) as h:
            await h.ready.wait()
            first_a = world.live["a"]
            world.end("b", RuntimeError("boom"))
            await h.events.wait_for(ChildReady, "c", 2)
            assert world.starts == {"a": 1, "b": 2, "c": 2}
            assert world.live["a"] is first_a
            assert h.events.names(ChildExited) == ["b", "c"]
            assert h.events.names(ChildStarted)[3:] == ["b", "c"]

    run(main)


# -- restart types and special outcomes ----------------------------------------


def test_restart_types() -> None:
    async def main() -> None:
        world = World()
        children = [
            world.spec("perm"),
            world.spec("trans", restart=Restart.TRANSIENT),
            world.spec("trans2", restart=Restart.TRANSIENT),
            world.spec("temp", restart=Restart.TEMPORARY),
        ]
        async with Harness(children) as h:
            await h.ready.wait()
            world.end("perm")  # a permanent child that returns is restarted
            await h.events.wait_for(ChildReady, "perm", 2)

            world.end("trans")  # a normal return: done
            await h.events.wait_for(ChildExited, "trans")
            world.end("trans2", RuntimeError("abnormal"))  # restarted
            await h.events.wait_for(ChildReady, "trans2", 2)
            world.end("temp", RuntimeError("abnormal"))  # never restarted
            await h.events.wait_for(ChildExited, "temp")
            await settle()

            assert world.starts == {"perm": 2, "trans": 1, "trans2": 2, "temp": 1}
            assert h.states() == {
                "perm": ChildState.RUNNING,
                "trans": ChildState.STOPPED,
                "trans2": ChildState.RUNNING,
                "temp": ChildState.FAILED,
            }
            [trans] = h.events.of(ChildExited, "trans")
            assert trans.normal and not trans.will_restart

    run(main)


def test_do_not_restart_leaves_the_others_running() -> None:
    async def main() -> None:
        world = World()
        children = [world.spec("a"), world.spec("done"), world.spec("broken")]
        async with Harness(children, strategy=Strategy.ONE_FOR_ALL) as h:
            await h.ready.wait()
            world.end("done", DoNotRestart("finished its job"))
            world.end("broken", Unrecoverable("model cannot load"))
            await h.events.wait_for(ChildExited, "broken")
            await settle()
            assert world.starts == {"a": 1, "done": 1, "broken": 1}
            assert h.states() == {
                "a": ChildState.RUNNING,
                "done": ChildState.STOPPED,
                "broken": ChildState.FAILED,
            }
            statuses = {status.id: status for status in h.supervisor.status()}
            assert "model cannot load" in (statuses["broken"].last_exit or "")

    run(main)


def test_a_child_that_gives_up_before_ready_does_not_block_the_next() -> None:
    async def main() -> None:
        world = World()
        children = [world.spec("a", auto_ready=False), world.spec("b")]
        async with Harness(children) as h:
            await h.events.wait_for(ChildStarted, "a")
            world.end("a", Unrecoverable("no model"))
            await h.events.wait_for(ChildReady, "b")
            await h.ready.wait()

    run(main)


def test_terminate_tree_stops_everything_and_returns_the_exit_code() -> None:
    async def main() -> None:
        world = World()
        events = Recorder()
        root = Supervisor(
            SupervisorSpec("root"),
            [world.spec("a"), world.spec("b"), world.spec("c")],
            events=events,
            clock=FakeClock(),
        )
        root_task = asyncio.create_task(run_root(root, stop_signals=()))
        await events.wait_for(ChildReady, "c")
        world.end("b", TerminateTree(2, "invalid configuration"))
        assert await root_task == 2
        assert world.live == {}
        [terminating] = events.of(TreeTerminating)
        assert (terminating.exit_code, terminating.id) == (2, "b")
        assert events.names(ChildExited) == ["b", "c", "a"]

    run(main)


def test_run_root_cancelled_stops_the_tree_and_reraises() -> None:
    async def main() -> None:
        world = World()
        events = Recorder()
        root = Supervisor(SupervisorSpec("root"), [world.spec("a")], events=events)
        root_task = asyncio.create_task(run_root(root, stop_signals=()))
        await events.wait_for(ChildReady, "a")
        root_task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await root_task
        assert world.live == {}

    run(main)


WAIT = 30.0


class _Said(logging.Handler):
    """Sets ``said`` when a record with ``words`` is logged (on the loop's thread)."""

    def __init__(self, words: str) -> None:
        super().__init__()
        self.words = words
        self.said = asyncio.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if self.words in record.getMessage():
            self.said.set()


class _Draining:
    """A root whose stop drains until released; a second cancel is "force it"."""

    def __init__(self) -> None:
        self.draining = asyncio.Event()
        self.release = asyncio.Event()
        self.forced = False

    async def serve(self, ready: Callable[[], None]) -> None:
        ready()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.draining.set()
            try:
                await self.release.wait()
            except asyncio.CancelledError:
                self.forced = True
            raise


@pytest.mark.parametrize("apart", ["at_once", "later"])
def test_a_second_stop_signal_forces_the_stop_unless_it_is_the_same_request(apart: str) -> None:
    """`timeout` and a terminal send a stop signal to the process and to its group:
    a second one within SAME_STOP_S of the first is the same request (the drain
    goes on); one after that is someone who wants it to stop now."""

    async def main() -> None:
        same = _Said("the same stop request")
        tree_log = logging.getLogger("poolserve.supervisor.tree")
        tree_log.addHandler(same)
        level, tree_log.level = tree_log.level, logging.INFO
        try:
            await stops(same)
        finally:
            tree_log.removeHandler(same)
            tree_log.setLevel(level)

    async def stops(same: _Said) -> None:
        root = _Draining()
        task = asyncio.create_task(run_root(root, stop_signals=(signal.SIGUSR2,)))
        await asyncio.sleep(0)  # run_root installs its handler
        first = time.monotonic()
        os.kill(os.getpid(), signal.SIGUSR2)
        await asyncio.wait_for(root.draining.wait(), WAIT)
        if apart == "later":
            await asyncio.sleep(max(0.0, first + SAME_STOP_S + 0.05 - time.monotonic()))
            os.kill(os.getpid(), signal.SIGUSR2)
            assert await asyncio.wait_for(task, WAIT) == 0
            assert root.forced
            return
        os.kill(os.getpid(), signal.SIGUSR2)
        await asyncio.wait_for(same.said.wait(), WAIT)
        if time.monotonic() - first >= SAME_STOP_S:
            pytest.skip("the host stalled past SAME_STOP_S between the two signals")
        assert not root.forced and not task.done()
        root.release.set()  # the drain ends by itself
        assert await asyncio.wait_for(task, WAIT) == 0
        assert not root.forced

    run(main)


# -- backoff and the pause ----------------------------------------------------


def test_restart_waits_the_backoff_on_the_clock() -> None:
    async def main() -> None:
        world = World()
        async with Harness([world.spec("a")], backoff_base=2.0) as h:
            await h.ready.wait()
            await fail_and_wait_restart(h, world, "a")
            assert h.events.of(ChildRestarting, "a")[0].backoff_s == pytest.approx(2.0)
            await h.clock.wait_for_sleepers()
            assert h.states() == {"a": ChildState.BACKOFF}
            assert world.starts == {"a": 1}
            h.clock.advance(1.9)
            await settle()
            assert world.starts == {"a": 1}
            h.clock.advance(0.1)
            await h.events.wait_for(ChildReady, "a", 2)

            await fail_and_wait_restart(h, world, "a")  # the second: about doubled
            recent = 1 + 0.5 ** (2.0 / 30.0)  # the first failure decayed for 2 s
            expected = 2.0 * 2 ** (recent - 1)
            assert h.events.of(ChildRestarting, "a")[1].backoff_s == pytest.approx(expected)

    run(main)


def test_too_many_failures_pause_restarts_then_resume() -> None:
    async def main() -> None:
        world = World()
        children = [world.spec("a"), world.spec("b")]
        async with Harness(children, failure_threshold=2.0, failure_backoff=15.0) as h:
            await h.ready.wait()
            await fail_and_wait_restart(h, world, "a")
            await h.events.wait_for(ChildReady, "a", 2)
            await fail_and_wait_restart(h, world, "a")
            await h.events.wait_for(ChildReady, "a", 3)
            world.end("a", RuntimeError("third"))  # 3 > 2: pause
            paused = await h.events.wait_for(BackoffPaused)
            assert paused.resume_in_s == 15.0
            await settle()
            assert world.starts["a"] == 3
            assert h.states() == {"a": ChildState.BACKOFF, "b": ChildState.RUNNING}

            await h.clock.wait_for_sleepers()
            h.clock.advance(14.0)
            await settle()
            assert not h.events.of(BackoffResumed)
            h.clock.advance(1.0)
            await h.events.wait_for(BackoffResumed)
            await h.events.wait_for(ChildReady, "a", 4)
            assert world.starts == {"a": 4, "b": 1}

    run(main)


# -- stopping -----------------------------------------------------------------


def test_stop_timeout_is_reported_and_the_second_request_stops_the_child() -> None:
    async def main() -> None:
        world = World()
        stubborn: list[Stubborn] = []

        def make() -> Stubborn:
            stubborn.append(Stubborn(world, "stubborn"))
            return stubborn[-1]

        children = [world.spec("a"), world.spec("stubborn", stop_timeout=3.0, factory=make)]
        h = Harness(children)
        async with h:
            await h.ready.wait()
            assert h.task is not None
            h.task.cancel()
            await h.clock.wait_for_sleepers()
            h.clock.advance(3.0)
            timeout = await h.events.wait_for(StopTimeout, "stubborn")
            assert timeout.timeout_s == 3.0
            await asyncio.wait({h.task})
        assert stubborn[0].cancellations == 2
        assert h.events.names(ChildExited) == ["stubborn", "a"]

    run(main)


def test_a_child_that_ignores_every_stop_is_abandoned_not_waited_for() -> None:
    async def main() -> None:
        world = World()
        stubborn: list[Stubborn] = []

        def make() -> Stubborn:
            stubborn.append(Stubborn(world, "deaf", ignore_all=True))
            return stubborn[-1]

        children = [world.spec("a"), world.spec("deaf", stop_timeout=1.0, factory=make)]
        h = Harness(children)
        await h.__aenter__()
        await h.ready.wait()
        assert h.task is not None
        h.task.cancel()
        await h.clock.wait_for_sleepers()
        h.clock.advance(1.0)
        await h.events.wait_for(StopTimeout, "deaf")
        await h.clock.wait_for_sleepers()
        h.clock.advance(KILL_GRACE)
        await asyncio.wait({h.task})  # returns: the supervisor never hangs
        assert h.task.cancelled()
        [deaf] = h.events.of(ChildExited, "deaf")
        assert "abandoned" in deaf.outcome
        assert h.events.names(ChildExited) == ["deaf", "a"]
        # The test's own cleanup: let the deaf service finish.
        stubborn[0].release.set_result(None)
        await settle()

    run(main)


def test_brutal_kill_skips_the_grace() -> None:
    async def main() -> None:
        world = World()
        stubborn: list[Stubborn] = []

        def make() -> Stubborn:
            stubborn.append(Stubborn(world, "brutal"))
            return stubborn[-1]

        children = [world.spec("brutal", stop_timeout=None, factory=make)]
        async with Harness(children) as h:
            await h.ready.wait()
        # One delivered CancelledError, but the task saw both requests.
        assert stubborn[0].cancellations == 1
        assert stubborn[0].killed_now
        assert not h.events.of(StopTimeout)

    run(main)


def test_the_shutdown_budget_bounds_the_whole_stop() -> None:
    async def main() -> None:
        world = World()
        made: list[Stubborn] = []

        def make(child_id: str) -> Callable[[], Stubborn]:
            def factory() -> Stubborn:
                made.append(Stubborn(world, child_id))
                return made[-1]

            return factory

        children = [
            world.spec("x", stop_timeout=10.0, factory=make("x")),
            world.spec("y", stop_timeout=10.0, factory=make("y")),
        ]
        h = Harness(children, stop_timeout=4.0)
        async with h:
            await h.ready.wait()
            assert h.task is not None
            h.task.cancel()
            await h.clock.wait_for_sleepers()
            h.clock.advance(4.0)  # the whole budget goes to "y"
            timeout = await h.events.wait_for(StopTimeout, "y")
            assert timeout.timeout_s == 4.0
            await asyncio.wait({h.task})
        # "x" got no grace left: killed at once, no second timeout.
        assert [event.id for event in h.events.of(StopTimeout)] == ["y"]
        assert [(m.id, m.cancellations, m.killed_now) for m in made] == [
            ("x", 1, True),
            ("y", 2, True),
        ]
        assert h.events.names(ChildExited) == ["y", "x"]

    run(main)


# -- nesting ------------------------------------------------------------------


def test_nested_supervisors() -> None:
    async def main() -> None:
        world = World()
        inner_events = Recorder()
        clock = FakeClock()

        def inner() -> Service:
            spec = SupervisorSpec("inner", backoff_base=0.0)
            children = [world.spec("x"), world.spec("y", auto_ready=False)]
            return Supervisor(spec, children, clock=clock, events=inner_events)

        children = [ChildSpec("inner", inner), world.spec("z")]
        async with Harness(children) as h:
            await inner_events.wait_for(ChildStarted, "y")
            await settle()
            assert h.events.names(ChildReady) == []  # inner waits for y
            assert "z" not in world.starts
            world.live["y"].ready()
            await h.ready.wait()
            assert h.events.names(ChildReady) == ["inner", "z"]

            [inner_status, _] = h.supervisor.status()
            assert [(s.id, s.state) for s in inner_status.children] == [
                ("x", ChildState.RUNNING),
                ("y", ChildState.RUNNING),
            ]

            world.end("x", RuntimeError("boom"))  # handled inside: inner is not restarted
            await inner_events.wait_for(ChildReady, "x", 2)
            assert world.starts == {"x": 2, "y": 1, "z": 1}
            assert h.events.names(ChildExited) == []

            world.end("y", TerminateTree(3, "stop everything"))
            assert h.task is not None
            with pytest.raises(TerminateTree):
                await h.task
            # Announced once, where it started; the outer tree stopped too.
            assert len(inner_events.of(TreeTerminating)) == 1
            assert h.events.of(TreeTerminating) == []
            assert world.live == {}
            h.task = asyncio.create_task(asyncio.sleep(0))  # nothing left to stop

    run(main)


# -- runtime changes ----------------------------------------------------------


def test_add_and_remove_children_while_running() -> None:
    async def main() -> None:
        world = World()
        async with Harness([world.spec("a")]) as h:
            await h.ready.wait()
            await h.supervisor.add_child(world.spec("b"))
            await h.events.wait_for(ChildReady, "b")
            with pytest.raises(ValueError, match="already has"):
                await h.supervisor.add_child(world.spec("b"))

            await h.supervisor.remove_child("a")
            assert [status.id for status in h.supervisor.status()] == ["b"]
            assert "a" not in world.live
            with pytest.raises(KeyError):
                await h.supervisor.remove_child("a")

    run(main)


def test_children_added_before_serve_start_with_it() -> None:
    async def main() -> None:
        world = World()
        h = Harness([])
        await h.supervisor.add_child(world.spec("late"))
        async with h:
            await h.events.wait_for(ChildReady, "late")

    run(main)


def test_event_hook_errors_do_not_break_the_tree(caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        world = World()

        def broken(event: Event) -> None:
            raise RuntimeError("hook bug")

        supervisor = Supervisor(SupervisorSpec("sup"), [world.spec("a")], events=broken)
        ready = asyncio.Event()
        task = asyncio.create_task(supervisor.serve(ready.set))
        await ready.wait()
        task.cancel()
        await asyncio.wait({task})
        assert world.live == {}

    run(main)
    assert "event hook failed" in caplog.text


def test_events_render_as_text_and_json() -> None:
    event = ChildExited("pool:a", "failed: ChildFailed: pid 7 exited with code 1", True, "pools")
    assert str(event) == (
        "pools: child pool:a failed: ChildFailed: pid 7 exited with code 1; will restart"
    )
    assert event.to_json() == {
        "event": "child_exited",
        "id": "pool:a",
        "outcome": "failed: ChildFailed: pid 7 exited with code 1",
        "will_restart": True,
        "supervisor": "pools",
        "normal": False,
    }
    assert str(ChildStarted("router", 42)) == "child router started (pid 42)"
    assert BackoffPaused("pools", 15.0).to_json()["resume_in_s"] == 15.0


def test_a_child_failing_before_ready_is_restarted_before_the_next_starts() -> None:
    async def main() -> None:
        world = World()
        children = [world.spec("a", auto_ready=False), world.spec("b")]
        async with Harness(children, backoff_base=1.0) as h:
            await h.events.wait_for(ChildStarted, "a")
            world.end("a", RuntimeError("crashed while loading"))
            await h.events.wait_for(ChildRestarting, "a")
            await h.clock.wait_for_sleepers()
            h.clock.advance_to_next()
            await h.events.wait_for(ChildStarted, "a", 2)
            await settle()
            assert "b" not in world.starts
            world.live["a"].ready()
            await h.ready.wait()
            assert h.events.names(ChildStarted) == ["a", "a", "b"]

    run(main)


def test_removing_the_child_the_start_waits_for_lets_the_next_start() -> None:
    async def main() -> None:
        world = World()
        children = [world.spec("a", auto_ready=False), world.spec("b")]
        async with Harness(children) as h:
            await h.events.wait_for(ChildStarted, "a")
            await h.supervisor.remove_child("a")
            await h.ready.wait()
            assert h.events.names(ChildStarted) == ["a", "b"]

    run(main)


def test_a_group_restart_during_the_pause_waits_for_the_resume() -> None:
    async def main() -> None:
        world = World()
        children = [world.spec("a"), world.spec("b")]
        async with Harness(
            children, strategy=Strategy.ONE_FOR_ALL, failure_threshold=0.5, failure_backoff=5.0
        ) as h:
            await h.ready.wait()
            world.end("b", RuntimeError("boom"))  # 1 > 0.5: pause at once
            await h.events.wait_for(BackoffPaused)
            await h.events.wait_for(ChildExited, "a")  # stopped for the group restart
            await settle()
            assert h.states() == {"a": ChildState.BACKOFF, "b": ChildState.BACKOFF}
            assert world.live == {}
            await h.clock.wait_for_sleepers()
            h.clock.advance(5.0)
            await h.events.wait_for(ChildReady, "b", 2)
            assert h.events.names(ChildStarted) == ["a", "b", "a", "b"]
            assert [s.restarts for s in h.supervisor.status()] == [1, 1]

    run(main)


def test_status_snapshot() -> None:
    async def main() -> None:
        world = World()
        async with Harness([world.spec("a")]) as h:
            h.clock.advance(42.0)
            await h.ready.wait()
            [status] = h.supervisor.status()
            assert status.started_at == 42.0
            assert status.to_json() == {
                "id": "a",
                "state": "running",
                "pid": None,
                "restarts": 0,
                "started_at": 42.0,
                "last_exit": None,
                "children": [],
            }

    run(main)
