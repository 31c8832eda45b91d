"""The supervisor: runs children, restarts them by strategy and policy, stops
them in reverse order within bounded time; and :func:`run_root` for the tree's
root.

Ownership: all of a supervisor's state belongs to the task running its
``serve`` (the main loop). Child tasks, ``ready()`` handshakes, ``add_child``,
``remove_child`` and ``restart_child`` only post messages to its inbox. The
supervisor owns every task it creates (one per child incarnation, one resume
timer) and waits for each before it returns. A child task is never restarted in place: it
returns an outcome and the main loop decides.

Why not ``asyncio.TaskGroup``: a TaskGroup waits for every task without bound,
and a service that ignores cancellation would then hang the whole tree. Here a
child that ignores both the stop request and the "kill now" request (a second
cancellation) is reported and abandoned, so a stop is always bounded.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import random
import signal
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from poolserve.supervisor.clock import Clock, RealClock, wait_done
from poolserve.supervisor.events import (
    BackoffPaused,
    BackoffResumed,
    ChildExited,
    ChildReady,
    ChildRestarting,
    ChildStarted,
    Event,
    EventHook,
    StopTimeout,
    TreeTerminating,
    event_logger,
)
from poolserve.supervisor.policy import RestartPolicy
from poolserve.supervisor.spec import (
    ChildSpec,
    ChildState,
    ChildStatus,
    DoNotRestart,
    HasPid,
    Restart,
    Service,
    Strategy,
    SupervisorSpec,
    TerminateTree,
    Unrecoverable,
)

log = logging.getLogger(__name__)

# After the "kill now" request, how long to wait before abandoning a child
# task. A process child has been SIGKILLed by then and only needs reaping.
KILL_GRACE = 5.0
# A stop signal this soon after the first is the same request sent twice, not "force it".
SAME_STOP_S = 1.0


class _Kind(enum.Enum):
    STOPPED = "stopped"  # stopped by its supervisor
    RETURNED = "returned"
    RAISED = "raised"
    DO_NOT_RESTART = "do_not_restart"
    UNRECOVERABLE = "unrecoverable"
    TERMINATE = "terminate"


@dataclass(frozen=True)
class _Outcome:
    kind: _Kind
    text: str
    error: BaseException | None = None
    relayed: bool = False  # a TerminateTree passed up by a nested supervisor


@dataclass(eq=False)
class _Run:
    """One incarnation of a child. The child task writes ``state``, ``service``
    and ``started_at``; the main loop writes the rest."""

    state: ChildState = ChildState.STARTING
    service: Service | None = None
    started_at: float | None = None
    task: asyncio.Task[_Outcome] | None = None
    stopping: bool = False
    ready: bool = False


@dataclass(eq=False)
class _Child:
    spec: ChildSpec
    run: _Run | None = None
    # Meaningful while ``run`` is None.
    state: ChildState = ChildState.STOPPED
    # Should be running (started, or waiting in the plan or the pause).
    wanted: bool = False
    restarts: int = 0
    restarting: bool = False  # the next start is a restart
    pending_delay: float = 0.0
    last_exit: str | None = None


@dataclass(frozen=True)
class _Ready:
    child: _Child
    run: _Run


@dataclass(frozen=True)
class _Exited:
    child: _Child
    run: _Run
    outcome: _Outcome


@dataclass(frozen=True)
class _Resume:
    pass


@dataclass(frozen=True)
class _Add:
    spec: ChildSpec
    done: asyncio.Future[None] = field(compare=False)


@dataclass(frozen=True)
class _Remove:
    id: str
    done: asyncio.Future[None] = field(compare=False)


@dataclass(frozen=True)
class _RestartChild:
    id: str
    spec: ChildSpec | None
    done: asyncio.Future[None] = field(compare=False)


_Message = _Ready | _Exited | _Resume | _Add | _Remove | _RestartChild


class _Handshake:
    """The ``ready`` callable handed to one child incarnation."""

    def __init__(self, supervisor: Supervisor, child: _Child, run: _Run) -> None:
        self._supervisor = supervisor
        self._child = child
        self._run = run
        self._called = False

    def __call__(self) -> None:
        if not self._called:
            self._called = True
            self._supervisor._post(_Ready(self._child, self._run))

    def spawned(self, pid: int) -> None:
        self._supervisor._emit(ChildStarted(self._child.spec.id, pid, self._supervisor.id))


class Supervisor:
    """A node of the tree; a :class:`Service` itself, so trees nest.

    Children start in spec order, each once the previous one called ``ready``;
    the supervisor calls its own ``ready`` when all have. The constructor only
    records; everything starts in :meth:`serve`.
    """

    def __init__(
        self,
        spec: SupervisorSpec,
        children: Sequence[ChildSpec] = (),
        *,
        clock: Clock | None = None,
        events: EventHook | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.spec = spec
        self._clock = clock or RealClock()
        self._hook = events or event_logger()
        self._policy = RestartPolicy(spec, self._clock, rng or random.Random())
        self._children: list[_Child] = []
        for child_spec in children:
            self._insert(child_spec)
        self._inbox: asyncio.Queue[_Message] | None = None
        self._plan: list[_Child] = []  # children to start in order, head first
        self._held: list[_Child] = []  # restarts waiting for the pause to end
        self._resume_task: asyncio.Task[None] | None = None
        self._abandoned: set[asyncio.Task[_Outcome]] = set()
        self._removals: list[tuple[_Child, asyncio.Future[None]]] = []
        self._ready: Callable[[], None] | None = None
        self._hurry = False

    @property
    def id(self) -> str:
        return self.spec.id

    # -- the contract -------------------------------------------------------

    async def serve(self, ready: Callable[[], None]) -> None:
        if self._inbox is not None:
            raise RuntimeError(f"supervisor {self.id} is already serving")
        self._inbox = asyncio.Queue()
        self._ready = ready
        self._hurry = False
        for child in self._children:
            self._want(child)
        self._plan = list(self._children)
        try:
            while True:
                self._advance_plan()
                await self._handle(await self._inbox.get())
        finally:
            await self._shutdown()
            self._inbox = None

    # -- runtime changes ----------------------------------------------------

    async def add_child(self, spec: ChildSpec) -> None:
        """Adds a child after the others; while serving it starts at once
        (after any child still waiting for readiness)."""
        if self._inbox is None:
            self._insert(spec)
            return
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._inbox.put_nowait(_Add(spec, done))
        await done

    async def remove_child(self, child_id: str) -> None:
        """Stops a child (bounded by its stop_timeout) and forgets it."""
        if self._inbox is None:
            self._children.remove(self._find(child_id))
            return
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._inbox.put_nowait(_Remove(child_id, done))
        await done

    async def restart_child(self, child_id: str, spec: ChildSpec | None = None) -> None:
        """Stops a child (bounded by its stop_timeout) and starts it again in
        its place, with ``spec`` when given (same id), for a change of
        configuration: not a failure, so the restart policy is not charged,
        but ``restarts`` counts it. A child that had stopped or failed for good
        is started again. Returns once the new incarnation is planned; its
        ``ChildReady`` event tells when it is ready.
        """
        if spec is not None and spec.id != child_id:
            raise ValueError(f"restart_child({child_id!r}) got a spec for {spec.id!r}")
        if self._inbox is None:
            raise RuntimeError(f"supervisor {self.id} is not serving")
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._inbox.put_nowait(_RestartChild(child_id, spec, done))
        await done

    # -- status -------------------------------------------------------------

    def status(self) -> list[ChildStatus]:
        return [self._child_status(child) for child in self._children]

    def _child_status(self, child: _Child) -> ChildStatus:
        run = child.run
        if run is None:
            # Waiting to (re)start while restarts are paused reads as backoff.
            paused = child.wanted and self._policy.paused
            state = ChildState.BACKOFF if paused else child.state
            return ChildStatus(
                child.spec.id, state, restarts=child.restarts, last_exit=child.last_exit
            )
        service = run.service
        pid = service.pid if isinstance(service, HasPid) else None
        nested = tuple(service.status()) if isinstance(service, Supervisor) else ()
        return ChildStatus(
            child.spec.id,
            run.state,
            pid=pid,
            restarts=child.restarts,
            started_at=run.started_at,
            last_exit=child.last_exit,
            children=nested,
        )

    # -- the main loop ------------------------------------------------------

    async def _handle(self, message: _Message) -> None:
        match message:
            case _Ready(child, run):
                self._on_ready(child, run)
            case _Exited(child, run, outcome):
                if child.run is run and not run.stopping:
                    await self._on_exit(child, outcome)
            case _Resume():
                self._on_resume()
            case _Add(spec, done):
                self._on_add(spec, done)
            case _Remove(child_id, done):
                await self._on_remove(child_id, done)
            case _RestartChild(child_id, spec, done):
                await self._on_restart_child(child_id, spec, done)

    def _on_ready(self, child: _Child, run: _Run) -> None:
        if child.run is not run or run.stopping or run.ready:
            return
        run.ready = True
        run.state = ChildState.RUNNING
        self._emit(ChildReady(child.spec.id, self.id))

    async def _on_exit(self, child: _Child, outcome: _Outcome) -> None:
        child.run = None
        child.last_exit = outcome.text
        if outcome.kind is _Kind.TERMINATE:
            assert isinstance(outcome.error, TerminateTree)
            self._settle(child, ChildState.FAILED)
            self._emit(ChildExited(child.spec.id, outcome.text, False, self.id))
            error = outcome.error
            if not outcome.relayed:  # announce once, where it started
                self._emit(TreeTerminating(error.reason, error.exit_code, child.spec.id))
            raise error
        restart = _should_restart(child.spec.restart, outcome.kind)
        normal = outcome.kind in (_Kind.DO_NOT_RESTART, _Kind.RETURNED) and not restart
        self._emit(ChildExited(child.spec.id, outcome.text, restart, self.id, normal))
        if not restart:
            failed = outcome.kind in (_Kind.RAISED, _Kind.UNRECOVERABLE)
            self._settle(child, ChildState.FAILED if failed else ChildState.STOPPED)
            return
        decision = self._policy.on_failure(child.spec.id)
        if decision.pause_started:
            self._emit(BackoffPaused(self.id, decision.resume_in))
            self._resume_task = asyncio.create_task(self._resume_after(decision.resume_in))
        group = self._restart_group(child)
        for other in reversed(group):
            if other is not child:
                # Like OTP: a temporary sibling is stopped with the group, not restarted.
                again = other.spec.restart is not Restart.TEMPORARY
                await self._stop_child(other, will_restart=again)
        group = [each for each in group if each is child or each.wanted]
        for each in group:
            self._want(each)
            each.restarting = True
            each.restarts += 1
        group[0].pending_delay = decision.delay
        if len(group) == 1 and child not in self._plan:
            self._start_or_hold(child)
        else:
            self._held = [each for each in self._held if each not in group]
            planned = set(self._plan) | set(group)
            self._plan = [each for each in self._children if each in planned]

    def _restart_group(self, failed: _Child) -> list[_Child]:
        """The children that restart with ``failed``, in spec order."""
        strategy = self.spec.strategy
        if strategy is Strategy.ONE_FOR_ONE:
            return [failed]
        siblings = self._children
        if strategy is Strategy.REST_FOR_ONE:
            siblings = siblings[siblings.index(failed) :]
        return [each for each in siblings if each is failed or each.wanted]

    def _on_resume(self) -> None:
        self._resume_task = None
        self._policy.resume()
        self._emit(BackoffResumed(self.id))
        for child in self._plan:
            child.pending_delay = 0.0  # the pause was the backoff
        held, self._held = self._held, []
        for child in held:
            child.pending_delay = 0.0
            self._start_or_hold(child)

    def _on_add(self, spec: ChildSpec, done: asyncio.Future[None]) -> None:
        try:
            child = self._insert(spec)
        except ValueError as error:
            _resolve(done, error)
            return
        self._want(child)
        self._plan.append(child)
        _resolve(done)

    async def _on_remove(self, child_id: str, done: asyncio.Future[None]) -> None:
        try:
            child = self._find(child_id)
        except KeyError as error:
            _resolve(done, error)
            return
        child.wanted = False
        self._plan = [each for each in self._plan if each is not child]
        self._held = [each for each in self._held if each is not child]
        try:
            await self._stop_child(child, will_restart=False)
        except BaseException:
            # Cancelled mid-stop: the shutdown stops the child and resolves this.
            self._removals.append((child, done))
            raise
        self._children.remove(child)
        self._policy.forget(child_id)
        _resolve(done)

    async def _on_restart_child(
        self, child_id: str, spec: ChildSpec | None, done: asyncio.Future[None]
    ) -> None:
        try:
            child = self._find(child_id)
        except KeyError as error:
            _resolve(done, error)
            return
        self._held = [each for each in self._held if each is not child]
        try:
            await self._stop_child(child, will_restart=True)
        except BaseException:
            # Cancelled mid-stop: the shutdown stops the child; nothing restarts.
            _resolve(done, RuntimeError(f"supervisor {self.id} stopped"))
            raise
        if spec is not None:
            child.spec = spec
        self._want(child)
        child.restarting = True
        child.restarts += 1
        planned = set(self._plan) | {child}
        self._plan = [each for each in self._children if each in planned]
        _resolve(done)

    async def _resume_after(self, seconds: float) -> None:
        await self._clock.sleep(seconds)
        self._post(_Resume())

    # -- starting -----------------------------------------------------------

    def _advance_plan(self) -> None:
        """Starts the next planned child once the one before it is ready."""
        while self._plan:
            head = self._plan[0]
            if head.run is None and not head.wanted:
                self._plan.pop(0)  # finished for good, or removed
                continue
            if head.run is not None and head.run.ready:
                self._plan.pop(0)
                continue
            if head.run is None and not self._policy.paused:
                self._start(head)
            return
        if self._ready is not None:
            ready, self._ready = self._ready, None
            ready()

    def _start_or_hold(self, child: _Child) -> None:
        if self._policy.paused:
            child.state = ChildState.BACKOFF
            self._held.append(child)
        else:
            self._start(child)

    def _start(self, child: _Child) -> None:
        delay, child.pending_delay = child.pending_delay, 0.0
        if child.restarting:
            child.restarting = False
            self._emit(ChildRestarting(child.spec.id, delay, self.id))
        run = _Run(state=ChildState.BACKOFF if delay > 0 else ChildState.STARTING)
        run.task = asyncio.create_task(
            self._run_child(child, run, delay), name=f"{self.id}/{child.spec.id}"
        )
        child.run = run

    async def _run_child(self, child: _Child, run: _Run, delay: float) -> _Outcome:
        """One incarnation. Never raises: the outcome goes to the main loop
        (or, when the supervisor stopped it, to the stopper)."""
        outcome = await self._serve_child(child, run, delay)
        if not run.stopping:
            self._post(_Exited(child, run, outcome))
        return outcome

    async def _serve_child(self, child: _Child, run: _Run, delay: float) -> _Outcome:
        try:
            if delay > 0:
                await self._clock.sleep(delay)
            run.state = ChildState.STARTING
            service = child.spec.start()
            run.service = service
            run.started_at = self._clock.monotonic()
            if not isinstance(service, HasPid):
                self._emit(ChildStarted(child.spec.id, None, self.id))
            await service.serve(_Handshake(self, child, run))
        except asyncio.CancelledError as error:
            if run.stopping:
                return _Outcome(_Kind.STOPPED, "stopped")
            return _Outcome(_Kind.RAISED, "failed: cancelled by someone else", error)
        except TerminateTree as error:
            relayed = isinstance(run.service, Supervisor)
            return _Outcome(_Kind.TERMINATE, f"asked to {error}", error, relayed)
        except Unrecoverable as error:
            return _Outcome(_Kind.UNRECOVERABLE, f"failed for good: {_describe(error)}", error)
        except DoNotRestart as error:
            return _Outcome(_Kind.DO_NOT_RESTART, f"finished: {_describe(error)}", error)
        except Exception as error:
            return _Outcome(_Kind.RAISED, f"failed: {_describe(error)}", error)
        if run.stopping:
            return _Outcome(_Kind.STOPPED, "stopped")
        return _Outcome(_Kind.RETURNED, "returned")

    # -- stopping -----------------------------------------------------------

    async def _stop_child(
        self, child: _Child, *, will_restart: bool, grace: float | None = None
    ) -> None:
        """Cancel, wait ``grace`` (default: the child's stop_timeout), then
        cancel again ("kill now") and wait :data:`KILL_GRACE`; abandon after that.

        Re-entrant: called again for the same child after our own task was
        cancelled mid-wait, it goes straight to "kill now".
        """
        run = child.run
        if run is None or run.task is None:
            return
        task = run.task
        limit = child.spec.stop_timeout if grace is None else grace
        if run.stopping or self._hurry or limit is None:
            run.stopping = True
            task.cancel()
            task.cancel()  # twice: a brutal kill, no grace
        else:
            run.stopping = True
            task.cancel()
            if not await wait_done(self._clock, task, limit):
                self._emit(StopTimeout(child.spec.id, limit, self.id))
                task.cancel()
        if not await wait_done(self._clock, task, KILL_GRACE):
            self._abandon(child, task)
            return
        child.run = None
        outcome = _result(task)
        child.last_exit = outcome.text
        if not will_restart:
            failed = outcome.kind in (_Kind.RAISED, _Kind.UNRECOVERABLE, _Kind.TERMINATE)
            self._settle(child, ChildState.FAILED if failed else ChildState.STOPPED)
        normal = outcome.kind is _Kind.STOPPED
        self._emit(ChildExited(child.spec.id, outcome.text, will_restart, self.id, normal))

    def _abandon(self, child: _Child, task: asyncio.Task[_Outcome]) -> None:
        # Restarting it would run two copies (two pools for one gid), so it
        # stays down. The task stays referenced until it ends, so it is never
        # garbage-collected while pending.
        self._abandoned.add(task)
        task.add_done_callback(self._abandoned.discard)
        child.run = None
        child.last_exit = "abandoned: ignored the stop and the kill request"
        self._settle(child, ChildState.FAILED)
        log.error("%s: child %s ignored stop requests; abandoned", self.id, child.spec.id)
        self._emit(ChildExited(child.spec.id, child.last_exit, False, self.id))

    async def _shutdown(self) -> None:
        """Stops everything in reverse order within ``spec.stop_timeout``.

        A cancellation of our own task meanwhile (the parent's "kill now")
        is absorbed: the remaining children are killed without grace, and the
        exception already on its way out (the first cancellation or a
        TerminateTree) still propagates.
        """
        if self._resume_task is not None:
            self._resume_task.cancel()
            await asyncio.wait({self._resume_task})
            self._resume_task = None
        self._plan, self._held = [], []
        deadline = self._clock.monotonic() + self.spec.stop_timeout
        for child in reversed(self._children):
            child.wanted = False
            while child.run is not None:
                budget = max(0.0, deadline - self._clock.monotonic())
                own = child.spec.stop_timeout
                grace = None if own is None else min(own, budget)  # None: brutal
                self._hurry = self._hurry or budget <= 0
                try:
                    await self._stop_child(child, will_restart=False, grace=grace)
                except asyncio.CancelledError:
                    self._hurry = True
            if child.state is ChildState.STARTING or child.state is ChildState.BACKOFF:
                child.state = ChildState.STOPPED
        removals, self._removals = self._removals, []
        for child, done in removals:
            self._children.remove(child)
            _resolve(done)
        self._drain_inbox()

    def _drain_inbox(self) -> None:
        assert self._inbox is not None
        while not self._inbox.empty():
            message = self._inbox.get_nowait()
            if isinstance(message, _Add):
                _resolve(message.done, RuntimeError(f"supervisor {self.id} has stopped"))
            elif isinstance(message, _Remove):
                try:
                    self._children.remove(self._find(message.id))
                except KeyError as error:
                    _resolve(message.done, error)
                else:
                    _resolve(message.done)
            elif isinstance(message, _RestartChild):
                _resolve(message.done, RuntimeError(f"supervisor {self.id} has stopped"))

    # -- small helpers ------------------------------------------------------

    def _insert(self, spec: ChildSpec) -> _Child:
        if any(child.spec.id == spec.id for child in self._children):
            raise ValueError(f"supervisor {self.id} already has a child {spec.id!r}")
        child = _Child(spec)
        self._children.append(child)
        return child

    def _find(self, child_id: str) -> _Child:
        for child in self._children:
            if child.spec.id == child_id:
                return child
        raise KeyError(child_id)

    def _want(self, child: _Child) -> None:
        child.wanted = True
        child.state = ChildState.STARTING

    def _settle(self, child: _Child, state: ChildState) -> None:
        child.wanted = False
        child.state = state

    def _post(self, message: _Message) -> None:
        if self._inbox is not None:
            self._inbox.put_nowait(message)

    def _emit(self, event: Event) -> None:
        try:
            self._hook(event)
        except Exception:
            # A broken log or metrics hook must not take the tree down.
            log.exception("%s: event hook failed on %r", self.id, event)


def _should_restart(restart: Restart, kind: _Kind) -> bool:
    if kind in (_Kind.DO_NOT_RESTART, _Kind.UNRECOVERABLE, _Kind.TERMINATE):
        return False
    if restart is Restart.PERMANENT:
        return True
    if restart is Restart.TRANSIENT:
        return kind is _Kind.RAISED
    return False


def _describe(error: BaseException) -> str:
    text = str(error)
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def _result(task: asyncio.Task[_Outcome]) -> _Outcome:
    if task.cancelled():
        return _Outcome(_Kind.STOPPED, "stopped before it started")
    error = task.exception()
    if error is not None:  # a bug in the runner itself; report, do not hide
        return _Outcome(_Kind.RAISED, f"failed: {_describe(error)}", error)
    return task.result()


def _resolve(future: asyncio.Future[None], error: BaseException | None = None) -> None:
    if future.done():
        return  # the caller gave up waiting
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)


async def run_root(
    root: Service,
    *,
    ready: Callable[[], None] | None = None,
    stop_signals: Iterable[int] = (signal.SIGTERM, signal.SIGINT),
) -> int:
    """Runs the root of a tree until a stop signal, cancellation or TerminateTree.

    Returns the process exit code: 0 after a stop signal, the code of a
    ``TerminateTree``, 1 if the root failed. The first stop signal starts a
    graceful stop; a second one cancels again, which means "kill now",
    unless it came within :data:`SAME_STOP_S` of the first: that is the same
    request sent twice (``timeout`` signals the process and its group, a
    terminal's Ctrl-C reaches the whole group), not an impatient person.
    Cancelling ``run_root`` itself stops the tree and re-raises.
    """
    loop = asyncio.get_running_loop()
    task = asyncio.create_task(root.serve(ready or _nothing), name="root")
    signals = tuple(stop_signals)
    first_stop: float | None = None

    def request_stop(number: int) -> None:
        nonlocal first_stop
        name = signal.Signals(number).name
        now = time.monotonic()
        if first_stop is None:
            first_stop = now
            log.info("%s: stopping the tree (another stop signal forces it)", name)
        elif now - first_stop < SAME_STOP_S:
            log.info("%s %.3f s after the first: the same stop request", name, now - first_stop)
            return
        else:
            log.warning("%s again: forcing the stop (no more waiting for drains)", name)
        task.cancel()

    for number in signals:
        loop.add_signal_handler(number, request_stop, number)
    try:
        await task
    except TerminateTree as error:
        return error.exit_code
    except asyncio.CancelledError:
        current = asyncio.current_task()
        if first_stop is not None and (current is None or current.cancelling() == 0):
            return 0
        raise
    except Exception:
        log.exception("the root of the supervision tree failed")
        return 1
    finally:
        for number in signals:
            loop.remove_signal_handler(number)
    return 0


def _nothing() -> None:
    pass
