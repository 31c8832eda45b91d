"""The worker watch: which worker is hung, overtime, stuck or slow to self-test,
and the kill that follows (SIGABRT, then SIGKILL; the death is handled like
any other).

Workers are watched four ways besides their socket closing: a heartbeat they
send from a thread (a worker that stops is hung), the job's own time limit (a
model that runs too long), the abandon grace (a worker still in the same job
``abandon_grace`` seconds after its caller left, through a deadline or a
cancel, is stuck, most likely in native code, where the heartbeat thread
cannot see it), and the self-test of a fresh worker: each model's load (in a
spawned worker) within ``load_timeout``, each warm-up prediction within
``warmup_timeout``.

A worker that breaks the frame protocol is killed too. The watch owns the
timers of these watches and the kill; it marks a worker (warming, stuck, why
it was killed) but never adds, drops or places one: the roster and the
dispatcher do.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
from collections.abc import Callable, Mapping

from poolserve.service.contract.framing import Payload
from poolserve.service.poolcore.frames import LOADING, WARMUP, Reply
from poolserve.service.poolcore.jobs import Job, JobState, Worker, WorkerState

log = logging.getLogger(__name__)

ABORT_GRACE_S = 1.0  # SIGABRT (core dump, traceback) before SIGKILL
STUCK_AFTER_S = 1.0  # a worker this long in a job its caller left counts as stuck (health)


class WorkerWatch:
    def __init__(
        self,
        name: str,
        workers: Mapping[int, Worker],
        on_change: Callable[[], None],
        *,
        heartbeat_timeout: float,
        warmup_timeout: float,
        load_timeout: float,
        abandon_grace: float,
    ) -> None:
        self.name = name
        self.heartbeat_timeout = heartbeat_timeout
        self.warmup_timeout = warmup_timeout
        self.load_timeout = load_timeout
        self.abandon_grace = abandon_grace
        self._workers = workers  # the roster's live workers, read only
        self._on_change = on_change
        self._warmup_noted: set[str] = set()  # models whose warm-up raised, logged once

    # -- heartbeats ------------------------------------------------------

    async def watch_heartbeats(self) -> None:
        loop = asyncio.get_running_loop()
        period = max(0.05, self.heartbeat_timeout / 4)
        while True:
            expected = loop.time() + period
            await asyncio.sleep(period)  # a periodic check, not a readiness wait
            self.check_heartbeats(loop.time(), late_by=loop.time() - expected, period=period)

    def check_heartbeats(self, now: float, late_by: float, period: float) -> None:
        """Kills workers silent past the timeout, unless this pool was itself
        stalled (SIGSTOP, a blocked event loop): then the workers' heartbeats may
        sit unread in their sockets, and the next check, after a read, judges."""
        if late_by > period:
            log.warning(
                "pool %s: its own event loop stalled for %.1f s; heartbeats judged next round",
                self.name,
                late_by,
            )
            return
        for worker in list(self._workers.values()):
            silent = now - worker.last_seen
            if worker.state is not WorkerState.STARTING and silent > self.heartbeat_timeout:
                self.kill(worker, f"stopped heartbeating for {silent:.1f} s")

    # -- a job's time limit ----------------------------------------------

    def time_job(self, worker: Worker, job: Job) -> None:
        """Starts ``job``'s own time limit, if it has one (cancelled by ``finish``)."""
        if job.timeout is not None:
            loop = asyncio.get_running_loop()
            job.overtime = loop.call_at(job.started + job.timeout, self._overtime, worker, job)

    def _overtime(self, worker: Worker, job: Job) -> None:
        job.overtime = None
        if worker.current is job:
            self.kill(worker, f"model '{job.tag}' ran longer than its timeout of {job.timeout} s")

    # -- the abandon grace -----------------------------------------------

    def caller_left(self, job: Job, why: str) -> None:
        """``job`` runs and its caller left: its worker is watched for being stuck in it."""
        if self.abandon_grace > 0:
            stuck_after = min(STUCK_AFTER_S, self.abandon_grace)
            asyncio.get_running_loop().call_later(stuck_after, self._stuck, job, why)

    @staticmethod
    def _holds(worker: Worker | None, job: Job) -> bool:
        """Whether ``worker`` runs ``job`` now (alone or in a batch)."""
        current = None if worker is None else worker.current
        return current is not None and (current is job or job in (current.members or ()))

    def _stuck(self, job: Job, why: str) -> None:
        """The job's caller left a while ago and its worker is still in it (and
        in no job of a caller still waiting: a batch counts once all left)."""
        worker = job.worker
        if worker is None or not self._holds(worker, job) or job.state is not JobState.ABANDONED:
            return
        assert worker.current is not None
        if any(m.state is JobState.RUNNING for m in worker.current.members or ()):
            return
        worker.state = WorkerState.STUCK
        self._on_change()
        left = self.abandon_grace - min(STUCK_AFTER_S, self.abandon_grace)
        asyncio.get_running_loop().call_later(left, self._abandon_overdue, job, why)

    def _abandon_overdue(self, job: Job, why: str) -> None:
        worker = job.worker
        if worker is not None and self._holds(worker, job):
            self.kill(
                worker,
                f"model '{job.tag}' was still running {self.abandon_grace:g} s after its "
                f"caller left ({why}): stuck, most likely in native code",
            )

    # -- the self-test of a fresh worker ---------------------------------

    def begin_warmup(self, worker: Worker) -> None:
        """``worker`` connected: its self-test begins (it takes no job before READY)."""
        worker.state = WorkerState.WARMING
        self._time_warmup(worker)

    def self_test_frame(self, worker: Worker, notice: Reply) -> bool:
        """A LOADING or WARMUP (the next model's load or warm-up starts) or READY
        frame from a fresh worker; True for READY: its self-test passed."""
        if worker.state is not WorkerState.WARMING:
            raise ValueError(f"self-test frame of kind {notice.kind} after the self-test")
        if notice.kind in (WARMUP, LOADING):
            worker.warming = bytes(notice.body).decode("utf-8", "replace")
            worker.loading = notice.kind == LOADING
            self._time_warmup(worker)  # each model gets the whole limit
            return False
        self._passed(worker, notice.body)
        return True

    def forget(self, worker: Worker) -> None:
        """``worker`` died: no more self-test deadline."""
        if worker.warmup_timer is not None:
            worker.warmup_timer.cancel()
            worker.warmup_timer = None

    def _time_warmup(self, worker: Worker) -> None:
        """Gives the model ``worker`` loads or warms up now the whole limit."""
        if worker.warmup_timer is not None:
            worker.warmup_timer.cancel()
        limit = self.load_timeout if worker.loading else self.warmup_timeout
        loop = asyncio.get_running_loop()
        worker.warmup_timer = loop.call_later(limit, self._warmup_overdue, worker)

    def _passed(self, worker: Worker, report: Payload) -> None:
        """``worker`` passed its self-test; logs (once per model) a warm-up that raised."""
        self.forget(worker)
        worker.warming = ""
        try:
            raised = json.loads(bytes(report)).get("raised", {})
        except (ValueError, AttributeError):
            raised = {}
        for model, error in raised.items():
            if model not in self._warmup_noted:  # the same in every worker: said once
                self._warmup_noted.add(model)
                log.info(
                    "pool %s: worker %d: the warm-up prediction of model '%s' raised %s; "
                    "the model answered, so its self-test passed",
                    self.name,
                    worker.pid,
                    model,
                    error,
                )

    def _warmup_overdue(self, worker: Worker) -> None:
        worker.warmup_timer = None
        if worker.state is not WorkerState.WARMING:
            return
        if worker.loading:
            self.kill(
                worker,
                f"self-test: loading model '{worker.warming}' in a fresh worker did not finish "
                f"within {self.load_timeout:g} s",
            )
            return
        what = f"of model '{worker.warming}' " if worker.warming else ""
        self.kill(
            worker,
            f"self-test: the warm-up prediction {what}did not finish within "
            f"{self.warmup_timeout:g} s after the fork",
        )

    def protocol_error(self, worker: Worker, exc: ValueError) -> None:
        log.error("pool %s: worker %d broke the frame protocol: %s", self.name, worker.pid, exc)
        self.kill(worker, f"frame protocol error: {exc}")
        if worker.transport is not None:
            worker.transport.close()

    # -- the kill --------------------------------------------------------

    def kill(self, worker: Worker, reason: str) -> None:
        if worker.kill_reason or worker.pidfd < 0:
            return
        worker.kill_reason = reason
        log.warning("pool %s: killing worker %d: %s", self.name, worker.pid, reason)
        self._signal(worker, signal.SIGABRT)
        asyncio.get_running_loop().call_later(ABORT_GRACE_S, self._signal, worker, signal.SIGKILL)

    @staticmethod
    def _signal(worker: Worker, number: int) -> None:
        if worker.pidfd >= 0:
            with contextlib.suppress(OSError):
                signal.pidfd_send_signal(worker.pidfd, number)
