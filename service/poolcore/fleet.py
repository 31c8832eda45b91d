"""A pool's workers as a whole: how many, of which generation, replaced how,
and what a worker's death means. One Fleet in a pool server, one in each
WorkerPool: the same rolling replacement and the same death handling for both
doors.

The zygote tells it which worker arrived (:meth:`Fleet.arrived`), the
dispatcher when one changed state (:meth:`Fleet.reconcile`) or died
(:meth:`Fleet.gone`). It keeps ``size`` serving workers of the current
generation. A load or an unload in the zygote starts a generation
(:meth:`Fleet.new_generation`): the fleet then forks one extra worker at a
time, and each time a fresh worker has passed its self-test it retires one
stale worker (after its current job), so capacity never drops. Surplus
workers (a crash replacement racing a roll) are retired the same way, stale
ones and idle ones first. A death is logged once and counted by the
:class:`~poolserve.service.poolcore.respawn.Respawner`, which forks the
replacement after its back-off and disables a model that keeps killing its
workers.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections import Counter
from collections.abc import Callable, Mapping

from poolserve.service.contract.errors import Unavailable
from poolserve.service.poolcore.dispatcher import Dispatcher
from poolserve.service.poolcore.jobs import Limits, Worker, WorkerGone, WorkerState
from poolserve.service.poolcore.respawn import Respawner

log = logging.getLogger(__name__)

SERVING = (WorkerState.IDLE, WorkerState.BUSY)  # self-tested, taking jobs


def death_cause(gone: WorkerGone) -> str:
    """The ``cause`` label of a worker restart: roll (retired on purpose),
    heartbeat or timeout (killed by the dispatcher), signal or exit (its own)."""
    if gone.retired:
        return "roll"
    if gone.reason:
        return "heartbeat" if "heartbeat" in gone.reason else "timeout"
    return "signal" if gone.status.startswith("killed") else "exit"


def _idle_first(workers: list[Worker]) -> list[Worker]:
    return sorted(workers, key=lambda w: w.state is not WorkerState.IDLE)


class Fleet:
    """The workers of one pool (see the module docstring).

    ``spawn(skip)`` forks one worker whose self-test leaves out the models in
    ``skip``; ``mark_failed(model, why)`` is what a model that keeps killing
    its workers (or fails its warm-up) becomes; ``on_change`` runs after every
    reconcile (health, waiters). ``label`` names the pool in logs.
    """

    def __init__(
        self,
        label: str,
        size: int,
        dispatcher: Dispatcher,
        spawn: Callable[[Mapping[str, str]], None],
        *,
        mark_failed: Callable[[str, str], None],
        retry_model: Callable[[str], None] = lambda name: None,
        spawned: bool = False,
        on_change: Callable[[], None] = lambda: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.label = label
        self.size = size
        self.dispatcher = dispatcher
        self._spawn = spawn
        self._on_change = on_change
        self.respawner = Respawner(
            self.spawn, mark_failed, retry_model=retry_model, clock=clock, spawned=spawned
        )
        self.generation = 0  # bumped by every load or unload; workers carry theirs
        self._forking = 0  # the extra worker of a roll, asked for and not arrived yet
        self._active = False
        self._changed: asyncio.Event | None = None
        self.restarts: Counter[str] = Counter()  # workers replaced, by death_cause

    @classmethod
    def with_dispatcher(
        cls,
        label: str,
        name: str,
        size: int,
        spawn: Callable[[Mapping[str, str]], None],
        limits: Limits,
        *,
        mark_failed: Callable[[str, str], None],
        on_worker_gone: Callable[[WorkerGone], None] | None = None,
        retry_model: Callable[[str], None] = lambda name: None,
        spawned: bool = False,
        on_change: Callable[[], None] = lambda: None,
    ) -> Fleet:
        """A fleet and its dispatcher (``fleet.dispatcher``, named ``name``),
        wired as both doors wire them: the dispatcher's changes reconcile the
        fleet, its dead workers go to :meth:`gone` (or to ``on_worker_gone``,
        which then calls it)."""
        fleet: Fleet | None = None

        def changed() -> None:
            assert fleet is not None
            fleet.reconcile()

        def gone(worker: WorkerGone) -> None:
            assert fleet is not None
            fleet.gone(worker)

        dispatcher = Dispatcher(
            name,
            limits.max_queue,
            on_change=changed,
            on_worker_gone=on_worker_gone or gone,
            heartbeat_timeout=limits.heartbeat_timeout,
            warmup_timeout=limits.warmup_timeout,
            abandon_grace=limits.abandon_grace,
        )
        fleet = cls(
            label,
            size,
            dispatcher,
            spawn,
            mark_failed=mark_failed,
            retry_model=retry_model,
            spawned=spawned,
            on_change=on_change,
        )
        return fleet

    # -- life ----------------------------------------------------------------

    def start(self) -> None:
        """Forks the first ``size`` workers; from now on the fleet keeps them."""
        self._active = True
        for _ in range(self.size):
            self.spawn()

    def stop(self) -> None:
        """No more forks (the pool stops or broke): pending respawns are dropped."""
        self._active = False
        self.respawner.close()

    def spawn(self) -> None:
        """Forks a worker whose self-test leaves out models that failed it before."""
        if self._active:
            self._spawn(self.respawner.failed_warmup)

    # -- events ----------------------------------------------------------------

    def arrived(self, pid: int, sock: socket.socket) -> None:
        """The zygote forked ``pid``; its socket goes to the dispatcher."""
        self._forking = max(0, self._forking - 1)
        self.dispatcher.add_worker(pid, sock, self.generation)
        self.reconcile()

    def gone(self, gone: WorkerGone) -> None:
        """A worker is dead (its status known): log it once, count it, respawn."""
        if self._active:
            self.restarts[death_cause(gone)] += 1
        if gone.retired or not self._active:
            return
        running = f" while running model '{gone.tag}'" if gone.tag else ""
        killed = f" (killed: {gone.reason})" if gone.reason else ""
        log.warning(
            "%s: worker %d %s%s%s",
            self.label,
            gone.pid,
            gone.status,
            running,
            killed,
            extra={"worker_pid": gone.pid, "worker_status": gone.status, "model": gone.tag},
        )
        delay = self.respawner.worker_lost(
            gone.tag, gone.reason or gone.status, warmup=gone.warmup, hung=bool(gone.reason)
        )
        if delay:
            log.info("%s: next worker in %.2f s (crash back-off)", self.label, delay)

    # -- generations -------------------------------------------------------------

    def new_generation(self) -> int:
        """A load or unload took effect in the zygote: every worker forked
        before it is stale and gets replaced from the next :meth:`reconcile`
        on (the caller first notes the generation). Returns it."""
        self.generation += 1
        return self.generation

    def is_stale(self, generation: int) -> bool:
        """Whether a worker older than ``generation`` still takes jobs."""
        return any(self._older(generation))

    def _older(self, generation: int) -> list[Worker]:
        return [
            w for w in self.dispatcher.workers() if not w.retiring and w.generation < generation
        ]

    async def roll(self, timeout_s: float) -> None:
        """Starts a generation and returns once no older worker takes jobs.

        Raises Unavailable when ``timeout_s`` passes without one more old
        worker replaced (no fresh worker passed its self-test in that time).
        """
        generation = self.new_generation()
        self.reconcile()
        loop = asyncio.get_running_loop()
        stale = len(self._older(generation))
        deadline = loop.time() + timeout_s
        while stale:
            changed = self._changed = asyncio.Event()
            try:
                await asyncio.wait_for(changed.wait(), max(0.0, deadline - loop.time()))
            except TimeoutError:
                raise Unavailable(f"{self.label}: no new worker within {timeout_s} s") from None
            finally:
                self._changed = None
            now = len(self._older(generation))
            if now < stale:
                deadline = loop.time() + timeout_s
            stale = now

    def reconcile(self) -> None:
        """Keeps ``size`` serving workers of the current generation (see the module)."""
        if self._active:
            d = self.dispatcher
            live = [w for w in d.workers() if not w.retiring and w.state is not WorkerState.DEAD]
            serving = [w for w in live if w.state in SERVING]
            surplus = len(serving) - self.size
            if surplus > 0:
                stale = [w for w in serving if w.generation < self.generation]
                fresh = [w for w in serving if w.generation >= self.generation]
                for worker in (_idle_first(stale) + _idle_first(fresh))[:surplus]:
                    d.retire(worker.pid)
                    live.remove(worker)
            old = any(w.generation < self.generation for w in live)
            if old and self._forking == 0 and len(live) <= self.size:
                self._forking = 1
                self.spawn()
        self._on_change()
        if self._changed is not None:
            self._changed.set()
