"""The dispatcher: the one owner of a pool's queue and of which job is on which worker.

It knows nothing of gRPC or models: it moves opaque request bytes to idle
workers and their replies back. Each worker holds at most one job, so there
is no table of futures keyed by message id that two parties could disagree
about. A job has one state machine (QUEUED -> RUNNING -> DONE, or ABANDONED
when its caller gave up through a deadline or a cancel); a reply for an
abandoned job is counted and dropped. A job whose deadline passes while it is
queued is answered at that moment and never reaches a worker.

Workers are watched four ways: their socket closing (death, noticed at
once), a heartbeat they send from a thread (a worker that stops is hung),
the job's own time limit (a model that runs too long), and the abandon grace:
a worker still in the same job ``abandon_grace`` seconds after its caller
left (deadline or cancel) is stuck, most likely in native code, where the
heartbeat thread cannot see it. A worker found hung, overtime or stuck is
killed (SIGABRT, then SIGKILL) and handled like a death.

A fresh worker takes no job before its self-test is done (the READY frame):
one warm-up prediction per model, each within ``warmup_timeout``. A worker
that hangs in it is killed; its death names the model it was warming up.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import enum
import heapq
import itertools
import json
import logging
import os
import signal
import socket
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from poolserve.service.contract.errors import (
    DeadlineExceeded,
    QueueFull,
    ServingError,
    Unavailable,
    error_for,
)
from poolserve.service.contract.framing import Batcher, Payload
from poolserve.service.poolcore.frames import (
    LOADING,
    SELF_TEST,
    WARMUP,
    Reply,
    ReplyBuffer,
    request_frame,
)
from poolserve.service.poolcore.stats import Timings

log = logging.getLogger(__name__)

DEFAULT_PRIORITY = 1 << 30  # below every explicit priority (1 is the highest)
RETRY_PRIORITY = -(1 << 62)  # a retried job goes before everything else
STATUS_WAIT_S = 1.0  # how long a dead worker's job waits for the exit status
ABORT_GRACE_S = 1.0  # SIGABRT (core dump, traceback) before SIGKILL
RETURN_TRIP_S = 0.002  # a job needs its service time plus the way back through pool and router
STUCK_AFTER_S = 1.0  # a worker this long in a job its caller left counts as stuck (health)


class JobState(enum.Enum):
    QUEUED = 1
    RUNNING = 2
    DONE = 3
    ABANDONED = 4


@dataclass(slots=True, eq=False)
class Job:
    body: Payload  # a large request's body is a view of the lane frame's buffer
    deadline: float
    priority: int
    seq: int
    future: asyncio.Future[Result]
    tag: str = ""
    idempotent: bool = True
    timeout: float | None = None
    state: JobState = JobState.QUEUED
    enqueued: float = 0.0
    started: float = 0.0
    retried: bool = False
    overtime: asyncio.TimerHandle | None = None
    worker: Worker | None = None  # the worker it runs on (RUNNING, ABANDONED)
    key: float = 0.0  # its place in the queue among its priority (see _order_key)
    precision: float = 0.0  # its caller's own deadline may be this much earlier


@dataclass(slots=True)
class Result:
    body: Payload  # a large reply's body is a view of the worker frame's buffer
    timings: Timings
    queue_ns: int
    enqueued: float = 0.0  # loop (monotonic) times, for spans built after the fact
    started: float = 0.0
    finished: float = 0.0


class ServiceTime:
    """A model's recent service time and how much it varies, the way TCP tracks a
    round trip (RFC 6298): a job is given the mean plus four mean deviations.

    On a quiet host the deviation is small and a job needs about the mean; on
    a noisy one (other processes taking the cores, a worker descheduled) the
    deviation grows and jobs start only with room for the slower runs, so that
    what is started finishes in time rather than for a caller already gone.
    """

    __slots__ = ("deviation", "mean")

    GAIN, DEVIATION_GAIN, DEVIATIONS = 1 / 8, 1 / 4, 4

    def __init__(self, first: float) -> None:
        self.mean = first
        self.deviation = first / 4  # until samples say otherwise: twice the first sample

    def add(self, sample: float) -> None:
        self.deviation += self.DEVIATION_GAIN * (abs(sample - self.mean) - self.deviation)
        self.mean += self.GAIN * (sample - self.mean)

    def needs(self) -> float:
        return self.mean + self.DEVIATIONS * self.deviation


class WorkerState(enum.StrEnum):
    STARTING = "starting"
    WARMING = "warming"  # in its self-test: no job yet
    IDLE = "idle"
    BUSY = "busy"
    STUCK = "stuck"  # still in a job whose caller left (killed after the abandon grace)
    DEAD = "dead"


@dataclass(eq=False)
class Worker:
    pid: int
    sock: socket.socket
    pidfd: int = -1
    transport: asyncio.Transport | None = None
    writer: Batcher | None = None  # scatter writes to the worker (never transport.write)
    current: Job | None = None
    served: int = 0
    state: WorkerState = WorkerState.STARTING
    started_at: float = field(default_factory=time.monotonic)
    last_seen: float = field(default_factory=time.monotonic)
    kill_reason: str = ""
    status: str | None = None
    lost_job: Job | None = None
    lost_tag: str = ""
    generation: int = 0
    retiring: bool = False
    warming: str = ""  # the model whose warm-up prediction (or load, if spawned) runs now
    loading: bool = False
    warmup_timer: asyncio.TimerHandle | None = None
    died_warming: bool = False


@dataclass(frozen=True)
class WorkerGone:
    """A dead worker, reported once both its socket closed and its status is known."""

    pid: int
    status: str
    tag: str  # the model it was running when it died, "" if idle
    reason: str  # why we killed it, "" if it died on its own
    retired: bool = False  # we retired it on purpose (rolling replacement)
    warmup: bool = False  # it died (or was killed) in its self-test, warming up ``tag``


@dataclass(frozen=True)
class Limits:
    """A dispatcher's bounds, as both doors configure them (see :class:`Dispatcher`)."""

    max_queue: int
    heartbeat_timeout: float
    warmup_timeout: float
    abandon_grace: float


class Dispatcher:
    def __init__(
        self,
        name: str,
        max_queue: int,
        on_change: Callable[[], None] = lambda: None,
        on_worker_gone: Callable[[WorkerGone], None] = lambda gone: None,
        heartbeat_timeout: float = 30.0,
        *,
        warmup_timeout: float = 10.0,
        load_timeout: float = 300.0,
        abandon_grace: float = 0.0,
        on_worker_ready: Callable[[int], None] = lambda pid: None,
    ) -> None:
        """``abandon_grace`` 0 never kills a worker for a job its caller left;
        ``load_timeout`` bounds each model's load in a spawned worker."""
        self.name = name
        self.max_queue = max_queue
        self.heartbeat_timeout = heartbeat_timeout
        self.warmup_timeout = warmup_timeout
        self.load_timeout = load_timeout
        self.abandon_grace = abandon_grace
        self._on_change = on_change
        self._on_worker_gone = on_worker_gone
        self._on_worker_ready = on_worker_ready
        self._warmup_noted: set[str] = set()  # models whose warm-up raised, logged once
        self._queue = JobQueue(max_queue, f"pool '{name}'")
        self._idle: deque[Worker] = deque()
        self._workers: dict[int, Worker] = {}
        self._dead: dict[int, Worker] = {}
        self._statuses: dict[int, str] = {}
        self._seq = itertools.count(1)
        self._tasks: asyncio.TaskGroup | None = None
        self._closing = asyncio.Event()
        self.late_replies = 0
        self.expired_in_queue = 0
        self.skipped_hopeless = 0
        self._refusal: ServingError | None = None
        self._service: dict[str, ServiceTime] = {}  # per tag: recent worker time per job

    # -- lifecycle -------------------------------------------------------

    async def run(self, started: Callable[[], None] = lambda: None) -> None:
        """Owns the worker reader tasks and the heartbeat watch until :meth:`close`."""
        async with asyncio.TaskGroup() as tasks:
            self._tasks = tasks
            watch = tasks.create_task(self._watch_heartbeats(), name="heartbeats")
            started()
            await self._closing.wait()
            watch.cancel()
            for worker in list(self._workers.values()):
                self._close_worker(worker)
        self._tasks = None

    def close(self) -> None:
        self._closing.set()

    def refuse(self, error: ServingError) -> None:
        """No worker will come back (the zygote is gone): fail what waits, and what comes."""
        self._refusal = error
        while (job := self._next_job()) is not None:
            job.state = JobState.DONE
            self._finish(job, error)

    def add_worker(self, pid: int, sock: socket.socket, generation: int = 0) -> None:
        if self._tasks is None or self._closing.is_set():
            sock.close()
            return
        worker = Worker(pid, sock, generation=generation)
        with contextlib.suppress(OSError):
            worker.pidfd = os.pidfd_open(pid)  # signals go to this process, never a reused pid
        self._workers[pid] = worker
        self._tasks.create_task(self._read_replies(worker), name=f"worker-{pid}")

    def worker_exited(self, pid: int, status: str) -> None:
        """The zygote reaped ``pid``: completes the death report if the socket closed."""
        worker = self._dead.pop(pid, None)
        if worker is None:
            self._statuses[pid] = status  # the socket has not closed yet
            return
        worker.status = status
        self._report_gone(worker)

    def retire(self, pid: int) -> bool:
        """Lets a worker finish its current job, then closes it (rolling replacement)."""
        worker = self._workers.get(pid)
        if worker is None or worker.retiring:
            return False
        worker.retiring = True
        if worker.state is WorkerState.IDLE:
            with contextlib.suppress(ValueError):
                self._idle.remove(worker)
            self._close_worker(worker)
        return True

    # -- status ----------------------------------------------------------

    def live_workers(self) -> int:
        """Workers that take jobs now: self-tested, not stuck, not retiring."""
        return sum(
            1
            for w in self._workers.values()
            if (w.state is WorkerState.IDLE or w.state is WorkerState.BUSY) and not w.retiring
        )

    def queue_depth(self) -> int:
        return len(self._queue)

    def workers(self) -> list[Worker]:
        return list(self._workers.values())

    # -- the request path ------------------------------------------------

    async def submit(
        self,
        body: Payload,
        deadline: float,
        *,
        priority: int | None = None,
        idempotent: bool = True,
        tag: str = "",
        timeout: float | None = None,
        precision: float = 0.0,
    ) -> Result:
        """Runs ``body`` on a worker before ``deadline`` (loop time).

        The queue serves the lowest ``priority`` first, then the earliest
        deadline, then the earliest arrival; a deadline within ``precision`` of
        one queued earlier counts as equal to it (deadlines that travelled as
        gRPC timeouts are that coarse), so calls with equal timeouts run in the
        order they came.
        """
        if self._refusal is not None:
            raise self._refusal
        loop = asyncio.get_running_loop()
        now = loop.time()
        if deadline <= now:
            raise DeadlineExceeded(
                f"deadline already spent on arrival at pool '{self.name}'", stage="pool"
            )
        # With no live worker the job still queues: replacements are on their
        # way (health says NOT_SERVING meanwhile), and its deadline bounds the wait.
        job = Job(
            body,
            deadline,
            DEFAULT_PRIORITY if priority is None else priority,
            next(self._seq),
            loop.create_future(),
            tag,
            idempotent,
            timeout,
        )
        job.enqueued = now
        job.precision = precision
        if self._idle and not self._queue:
            self._start(self._idle.pop(), job)
        else:
            self._queue.push(job, precision)
        timer = loop.call_at(deadline, self._expire, job)
        try:
            return await job.future
        finally:
            timer.cancel()
            self._abandon(job, "it was cancelled")

    def _abandon(self, job: Job, why: str) -> None:
        """The caller is gone (result, deadline or cancel): no one will read a reply."""
        if job.state is JobState.QUEUED:
            self._queue.remove(job)
            job.state = JobState.ABANDONED
        elif job.state is JobState.RUNNING:
            job.state = JobState.ABANDONED
            if self.abandon_grace > 0:
                stuck_after = min(STUCK_AFTER_S, self.abandon_grace)
                loop = asyncio.get_running_loop()
                loop.call_later(stuck_after, self._stuck, job, why)

    def _expire(self, job: Job) -> None:
        if job.future.done():
            return
        if job.state is JobState.QUEUED:
            self.expired_in_queue += 1
            where = f"while queued in pool '{self.name}' (it never reached a worker)"
            stage = "pool queue"
        else:
            where = f"while running on a worker of pool '{self.name}'"
            stage = "worker"
        self._finish(job, DeadlineExceeded(f"deadline exceeded {where}", stage=stage))
        self._abandon(job, "its deadline passed")

    def _finish(self, job: Job, outcome: Result | ServingError) -> None:
        if job.overtime is not None:
            job.overtime.cancel()
            job.overtime = None
        if job.future.done():
            return
        if isinstance(outcome, Result):
            job.future.set_result(outcome)
        else:
            job.future.set_exception(outcome)

    def _start(self, worker: Worker, job: Job) -> None:
        loop = asyncio.get_running_loop()
        job.state = JobState.RUNNING
        job.started = loop.time()
        job.worker = worker
        worker.current = job
        worker.state = WorkerState.BUSY
        if job.timeout is not None:
            job.overtime = loop.call_at(job.started + job.timeout, self._overtime, worker, job)
        assert worker.writer is not None
        worker.writer.write_now(*request_frame(job.seq, job.body))  # header and body: no join

    def _next_job(self) -> Job | None:
        """The next job worth starting.

        A job that can no longer finish before its deadline (less time left than
        its model's recent service time, with room for the slower runs of a
        noisy host and the way back) is answered now instead of run: under
        overload, running it would burn a worker on a reply nobody waits for,
        and make the jobs behind it late too. The deadline counted is the
        earliest its caller may have set (see ``precision``).
        """
        now = asyncio.get_running_loop().time()
        while (job := self._queue.pop()) is not None:
            service = self._service.get(job.tag)
            needs = None if service is None else service.needs() + RETURN_TRIP_S
            left = job.deadline - job.precision - now
            if needs is not None and left < needs and not job.future.done():
                self.skipped_hopeless += 1
                job.state = JobState.DONE
                left = max(0.0, left) * 1000
                self._finish(
                    job,
                    DeadlineExceeded(
                        f"deadline would pass before the request could finish: {left:.1f} ms "
                        f"left in pool '{self.name}', model '{job.tag}' takes about "
                        f"{needs * 1000:.1f} ms",
                        stage="pool queue",
                    ),
                )
                continue
            return job
        return None

    def _learn_service_time(self, tag: str, took: float) -> None:
        """A model's service time: dispatch to reply, as the dispatcher sees it
        (so it includes the hops and any wait for a CPU)."""
        service = self._service.get(tag)
        if service is None:
            self._service[tag] = ServiceTime(took)
        else:
            service.add(took)

    def _worker_free(self, worker: Worker) -> None:
        worker.current = None
        if worker.retiring:
            self._close_worker(worker)
            return
        job = self._next_job()
        if job is None:
            worker.state = WorkerState.IDLE
            self._idle.append(worker)
        else:
            self._start(worker, job)

    # -- per-worker reader task -----------------------------------------

    async def _read_replies(self, worker: Worker) -> None:
        """Lives as long as the worker's connection; the protocol delivers its replies."""
        loop = asyncio.get_running_loop()
        closed: asyncio.Future[None] = loop.create_future()
        try:
            transport, _ = await loop.connect_accepted_socket(
                lambda: _WorkerLink(self, worker, closed), sock=worker.sock
            )
            assert isinstance(transport, asyncio.Transport)
            worker.transport = transport
            self._begin_warmup(worker)
            self._on_change()
            await closed  # the worker died or closed, or we closed it
        except (ConnectionError, OSError):
            pass  # the worker died before we could even connect: handled below
        finally:
            self._lost(worker)

    def _protocol_error(self, worker: Worker, exc: ValueError) -> None:
        log.error("pool %s: worker %d broke the frame protocol: %s", self.name, worker.pid, exc)
        self._kill(worker, f"frame protocol error: {exc}")
        if worker.transport is not None:
            worker.transport.close()

    def _deliver(self, worker: Worker, reply: Reply) -> None:
        job = worker.current
        if job is None or job.seq != reply.seq:
            raise ValueError(f"reply for sequence {reply.seq} that this worker does not hold")
        worker.served += 1
        if reply.failure is None and job.tag:
            self._learn_service_time(job.tag, asyncio.get_running_loop().time() - job.started)
        if job.state is JobState.RUNNING:
            job.state = JobState.DONE
            if reply.failure is None:
                queue_ns = int((job.started - job.enqueued) * 1e9)
                finished = asyncio.get_running_loop().time()
                result = Result(
                    reply.body, reply.timings, queue_ns, job.enqueued, job.started, finished
                )
                self._finish(job, result)
            else:
                self._finish(job, error_for(reply.failure, reply.message))
        else:
            if job.overtime is not None:
                job.overtime.cancel()
            self.late_replies += 1
        was_stuck = worker.state is WorkerState.STUCK
        self._worker_free(worker)
        if was_stuck:
            self._on_change()

    # -- the self-test of a fresh worker ---------------------------------

    def _begin_warmup(self, worker: Worker) -> None:
        if worker.retiring:  # closed (or retired) while it connected
            self._close_worker(worker)
            return
        worker.state = WorkerState.WARMING
        self._warmup_deadline(worker)

    def _warmup_deadline(self, worker: Worker) -> None:
        if worker.warmup_timer is not None:
            worker.warmup_timer.cancel()
        limit = self.load_timeout if worker.loading else self.warmup_timeout
        loop = asyncio.get_running_loop()
        worker.warmup_timer = loop.call_later(limit, self._warmup_overdue, worker)

    def _warmup_notice(self, worker: Worker, notice: Reply) -> None:
        """A WARMUP (the next model's warm-up starts) or READY frame from a fresh worker."""
        if worker.state is not WorkerState.WARMING:
            raise ValueError(f"self-test frame of kind {notice.kind} after the self-test")
        if notice.kind in (WARMUP, LOADING):
            worker.warming = bytes(notice.body).decode("utf-8", "replace")
            worker.loading = notice.kind == LOADING
            self._warmup_deadline(worker)  # each model gets the whole limit
            return
        if worker.warmup_timer is not None:
            worker.warmup_timer.cancel()
            worker.warmup_timer = None
        worker.warming = ""
        self._note_warmup_report(worker, notice.body)
        self._worker_free(worker)
        self._on_worker_ready(worker.pid)
        self._on_change()

    def _note_warmup_report(self, worker: Worker, body: Payload) -> None:
        try:
            raised = json.loads(bytes(body)).get("raised", {})
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
            self._kill(
                worker,
                f"self-test: loading model '{worker.warming}' in a fresh worker did not finish "
                f"within {self.load_timeout:g} s",
            )
            return
        what = f"of model '{worker.warming}' " if worker.warming else ""
        self._kill(
            worker,
            f"self-test: the warm-up prediction {what}did not finish within "
            f"{self.warmup_timeout:g} s after the fork",
        )

    # -- hung and overtime workers ---------------------------------------

    async def _watch_heartbeats(self) -> None:
        loop = asyncio.get_running_loop()
        period = max(0.05, self.heartbeat_timeout / 4)
        while True:
            expected = loop.time() + period
            await asyncio.sleep(period)  # a periodic check, not a readiness wait
            self._check_heartbeats(loop.time(), late_by=loop.time() - expected, period=period)

    def _check_heartbeats(self, now: float, late_by: float, period: float) -> None:
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
                self._kill(worker, f"stopped heartbeating for {silent:.1f} s")

    def _stuck(self, job: Job, why: str) -> None:
        """The job's caller left a while ago and its worker is still in it."""
        worker = job.worker
        if worker is None or worker.current is not job or job.state is not JobState.ABANDONED:
            return
        worker.state = WorkerState.STUCK
        self._on_change()
        left = self.abandon_grace - min(STUCK_AFTER_S, self.abandon_grace)
        asyncio.get_running_loop().call_later(left, self._abandon_overdue, job, why)

    def _abandon_overdue(self, job: Job, why: str) -> None:
        worker = job.worker
        if worker is not None and worker.current is job:
            self._kill(
                worker,
                f"model '{job.tag}' was still running {self.abandon_grace:g} s after its "
                f"caller left ({why}): stuck, most likely in native code",
            )

    def _overtime(self, worker: Worker, job: Job) -> None:
        job.overtime = None
        if worker.current is job:
            self._kill(worker, f"model '{job.tag}' ran longer than its timeout of {job.timeout} s")

    def _kill(self, worker: Worker, reason: str) -> None:
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

    # -- death -----------------------------------------------------------

    def _lost(self, worker: Worker) -> None:
        if worker.state is WorkerState.DEAD:
            return
        worker.died_warming = worker.state is WorkerState.WARMING
        if worker.warmup_timer is not None:
            worker.warmup_timer.cancel()
            worker.warmup_timer = None
        worker.state = WorkerState.DEAD
        self._workers.pop(worker.pid, None)
        with contextlib.suppress(ValueError):
            self._idle.remove(worker)
        if worker.transport is not None:
            worker.transport.close()
        else:
            worker.sock.close()
        job, worker.current = worker.current, None
        worker.lost_tag = job.tag if job is not None else worker.warming
        if (
            job is not None
            and job.state is JobState.RUNNING
            and (worker.kill_reason or not self._retry(job))
        ):
            worker.lost_job = job  # answered once the exit status is known
        status = self._statuses.pop(worker.pid, None)
        if status is not None:
            worker.status = status
            self._report_gone(worker)
        else:
            self._dead[worker.pid] = worker
            asyncio.get_running_loop().call_later(STATUS_WAIT_S, self._status_overdue, worker)
        self._on_change()

    def _status_overdue(self, worker: Worker) -> None:
        if self._dead.pop(worker.pid, None) is not None:
            worker.status = "exit status unknown"
            self._report_gone(worker)

    def _report_gone(self, worker: Worker) -> None:
        if worker.pidfd >= 0:
            os.close(worker.pidfd)
            worker.pidfd = -1
        job, worker.lost_job = worker.lost_job, None
        if job is not None:
            self._fail_lost_job(job, worker)
        if not self._closing.is_set():
            self._on_worker_gone(
                WorkerGone(
                    worker.pid,
                    worker.status or "",
                    worker.lost_tag,
                    worker.kill_reason,
                    retired=worker.retiring and not worker.lost_tag,
                    warmup=worker.died_warming,
                )
            )

    def _fail_lost_job(self, job: Job, worker: Worker) -> None:
        job.state = JobState.DONE
        if worker.kill_reason.startswith("model"):
            error: ServingError = DeadlineExceeded(
                f"{worker.kill_reason}; worker pid {worker.pid} was killed", stage="worker"
            )
        else:
            why = worker.kill_reason or worker.status
            error = Unavailable(
                f"worker pid {worker.pid} of pool '{self.name}' died while running the "
                f"request ({why})"
            )
        self._finish(job, error)

    def _retry(self, job: Job) -> bool:
        """Requeues a dead worker's job once, if it may run twice and still has time."""
        loop = asyncio.get_running_loop()
        if not job.idempotent or job.retried or job.deadline <= loop.time():
            return False
        if job.overtime is not None:
            job.overtime.cancel()
            job.overtime = None
        job.retried = True
        job.state = JobState.QUEUED
        job.priority = RETRY_PRIORITY
        self._queue.push(job, 0.0, bounded=False)
        if self._idle:
            worker = self._idle.pop()
            next_job = self._next_job()
            if next_job is None:
                self._idle.append(worker)
            else:
                self._start(worker, next_job)
        return True

    def _close_worker(self, worker: Worker) -> None:
        """Closing the socket makes the worker exit (EOF); its reader then finishes.

        A worker still connecting (no transport yet) is closed by its reader once
        connected: closing the socket under a pending connect would leave the
        reader waiting on a dead, or reused, descriptor.
        """
        if worker.transport is not None:
            worker.transport.close()
        else:
            worker.retiring = True


class JobQueue:
    """Jobs waiting to run: by priority (lowest first), then deadline, then arrival.

    A job leaves it by :meth:`pop` or :meth:`remove`; removal is lazy in the
    heap (a job that is no longer QUEUED is skipped when it comes up).
    """

    def __init__(self, limit: int, where: str) -> None:
        self.limit = limit
        self.where = where
        self._heap: list[tuple[int, float, int, Job]] = []
        self._keys: dict[int, list[float]] = {}  # per priority: queued jobs' keys, sorted
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def push(self, job: Job, precision: float, bounded: bool = True) -> None:
        """Queues ``job``, QueueFull past the limit; see :func:`_order_key` for ``precision``."""
        if bounded and self._count >= self.limit:
            raise QueueFull(f"{self.where} queue is full ({self.limit} requests waiting)")
        keys = self._keys.setdefault(job.priority, [])
        job.key = _order_key(keys, job.deadline, precision)
        bisect.insort(keys, job.key)
        heapq.heappush(self._heap, (job.priority, job.key, job.seq, job))
        self._count += 1
        if len(self._heap) > 2 * self.limit + 64:
            self._heap = [e for e in self._heap if e[3].state is JobState.QUEUED]
            heapq.heapify(self._heap)

    def pop(self) -> Job | None:
        """The first queued job, out of the queue (still in state QUEUED)."""
        while self._heap:
            job = heapq.heappop(self._heap)[3]
            if job.state is JobState.QUEUED:
                self._forget(job)
                return job
        return None

    def remove(self, job: Job) -> None:
        """A queued job leaves for good (the caller sets its new state)."""
        self._forget(job)

    def _forget(self, job: Job) -> None:
        self._count -= 1
        keys = self._keys[job.priority]
        del keys[bisect.bisect_left(keys, job.key)]
        if not keys:
            del self._keys[job.priority]


def _order_key(keys: list[float], deadline: float, precision: float) -> float:
    """A job's place among the sorted keys of its priority's queued jobs: its
    deadline, or the latest queued key at most ``precision`` after it.

    The later of two deadlines closer than their precision may be the earlier
    call's (see poolserve.service.contract.schedule), so the newcomer takes that key and
    the sequence number puts it behind; a key is never more than ``precision``
    past its deadline, and the expiry timer keeps the deadline itself.
    """
    if precision <= 0.0 or not keys:
        return deadline
    i = bisect.bisect_right(keys, deadline + precision)
    return keys[i - 1] if i and keys[i - 1] > deadline else deadline


class _WorkerLink(asyncio.BufferedProtocol):
    """One worker's socket: every byte counts as a sign of life, every frame is delivered.

    Replies are received straight into the reader's buffers (a large one into a
    buffer of its own size, whose body goes on to the lane as a view);
    requests leave as scatter writes of (header, body view).
    """

    def __init__(self, dispatcher: Dispatcher, worker: Worker, closed: asyncio.Future[None]):
        self.dispatcher = dispatcher
        self.worker = worker
        self.closed = closed
        self.replies = ReplyBuffer()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.worker.writer = Batcher(transport)

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.replies.get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        worker = self.worker
        worker.last_seen = time.monotonic()
        try:
            for reply in self.replies.buffer_updated(nbytes):
                if reply.kind in SELF_TEST:
                    self.dispatcher._warmup_notice(worker, reply)
                else:
                    self.dispatcher._deliver(worker, reply)
        except ValueError as exc:
            self.dispatcher._protocol_error(worker, exc)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.worker.writer is not None:
            self.worker.writer.close()
        if not self.closed.done():
            self.closed.set_result(None)
