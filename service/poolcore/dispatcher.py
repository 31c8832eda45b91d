"""The dispatcher: the pool core's coordinator, the one owner of which workers
a pool has, which of them is idle, and where each job goes (an idle worker,
the queue, or behind the jobs of its sequence's worker). The rest it hands
to its parts, each the one owner of its state:

- admission and the queue (``admission``, ``jobqueue``): refusal, the
  bounded queue in deadline order, jobs that can no longer finish in time,
  a dead worker's job retried once;
- batch forming (``batches``): which queued jobs start together, and when a
  batch short of its size waits for more;
- the worker watch (``watch``): heartbeats, a job's own time limit, the
  abandon grace, a fresh worker's self-test, and the kill;
- a worker's death (``deaths``): what its jobs become, and one
  :class:`WorkerGone` once its socket closed and its exit status is known;
- streams (``streams``): a decoupled model's parts, their window, the CANCEL,
  and how many workers streams may hold (``StreamShare``: ``unary_workers``
  of a pool that also serves other calls are kept for them);
- a worker's socket (``link``): frames in, a job's frame out;
- a light job sent to a busy worker before it answered (``ahead``);
- the job and worker types, and a job's one state machine (``jobs``).

The parts never import this module (import-linter's ``dispatcher-parts``).
It knows nothing of gRPC or models: it moves opaque request bytes to idle
workers and their replies back. Each worker runs one job and holds at most
one more sent ahead, answered in the order sent, so there is no table of
futures keyed by message id that two parties could disagree about. A job
has one state machine (QUEUED -> RUNNING -> DONE, or ABANDONED when its
caller gave up through a deadline or a cancel); a reply for an
abandoned job is counted and dropped. A fresh worker takes no job before its
self-test is done (the READY frame).
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Callable

from poolserve.service.contract.batching import BatchPolicy
from poolserve.service.contract.errors import ServingError
from poolserve.service.contract.framing import Payload
from poolserve.service.poolcore.admission import Admission
from poolserve.service.poolcore.ahead import SendAhead
from poolserve.service.poolcore.batches import BatchForming
from poolserve.service.poolcore.deaths import DeathReports
from poolserve.service.poolcore.frames import PART, Reply
from poolserve.service.poolcore.jobs import (
    Job,
    JobState,
    Result,
    Worker,
    WorkerGone,
    WorkerState,
    answer,
    reply_per_job,
)
from poolserve.service.poolcore.link import send_job, serve_link
from poolserve.service.poolcore.roster import Roster
from poolserve.service.poolcore.started import Started
from poolserve.service.poolcore.streams import (
    Parts,
    StreamShare,
    cancel_stream,
    next_part,
    part_came,
    took_part,
)
from poolserve.service.poolcore.watch import WorkerWatch


class Dispatcher:
    """A pool's queue and workers; see the module's docstring for its parts."""

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
        self._on_change = on_change
        self._on_worker_ready = on_worker_ready
        self.roster = Roster()
        self.share = StreamShare(self.roster.workers)
        self.admission = Admission(name, max_queue, self.share)
        self.watch = WorkerWatch(
            name,
            self.roster.workers,
            on_change,
            heartbeat_timeout=heartbeat_timeout,
            warmup_timeout=warmup_timeout,
            load_timeout=load_timeout,
            abandon_grace=abandon_grace,
        )
        self._tasks: asyncio.TaskGroup | None = None
        self._closing = asyncio.Event()
        self.deaths = DeathReports(name, on_worker_gone, self._closing)
        self.late_replies = 0
        self.batching = BatchForming(self.admission, self.roster, self._fill_idle)
        self.ahead = SendAhead(self.admission.service_mean, self.roster.workers)
        self.sent_ahead = 0  # jobs sent to a busy worker (for tests and the profile)

    # -- lifecycle -------------------------------------------------------

    async def run(self, started: Callable[[], None] = lambda: None) -> None:
        """Owns the worker reader tasks and the heartbeat watch until :meth:`close`."""
        self.admission.loop = asyncio.get_running_loop()
        try:
            async with asyncio.TaskGroup() as tasks:
                self._tasks = tasks
                watch = tasks.create_task(self.watch.watch_heartbeats(), name="heartbeats")
                started()
                await self._closing.wait()
                watch.cancel()
                self.roster.close_all()
        finally:
            self._tasks = None
            self.admission.loop = None

    def close(self) -> None:
        self._closing.set()

    def refuse(self, error: ServingError) -> None:
        """No worker will come back (the zygote is gone): fail what waits, and what comes."""
        self.admission.refuse(error)

    def add_worker(self, pid: int, sock: socket.socket, generation: int = 0) -> None:
        if self._tasks is None or self._closing.is_set():
            sock.close()
            return
        worker = self.roster.add(pid, sock, generation)
        self._tasks.create_task(self._read_replies(worker), name=f"worker-{pid}")

    def worker_exited(self, pid: int, status: str) -> None:
        """The zygote reaped ``pid``: completes the death report if the socket closed."""
        self.deaths.exited(pid, status)

    def retire(self, pid: int) -> bool:
        """Lets a worker finish its current job, then closes it (rolling replacement)."""
        return self.roster.retire(pid)

    def hold_sequences(self, worker: Worker, change: int) -> None:
        """A sequence started (+1) or ended (-1) on ``worker``; a retiring worker
        closes once it holds none and has nothing left to run."""
        self.roster.hold_sequences(worker, change)

    # -- status ----------------------------------------------------------

    def live_workers(self) -> int:
        """Workers that take jobs now: self-tested, not stuck, not retiring."""
        return self.roster.live()

    @property
    def expired_in_queue(self) -> int:
        return self.admission.expired_in_queue

    @property
    def skipped_hopeless(self) -> int:
        return self.admission.skipped_hopeless

    def holds(self, tag: str) -> bool:
        """Some job of ``tag`` (a model's key) is queued, or on a worker: running,
        sent ahead, or waiting for its sequence's worker."""
        if self.admission.queue.holds(tag):
            return True
        for worker in self.roster.workers.values():
            for job in (worker.current, *worker.ahead, *worker.pinned):
                if job is not None and job.tag == tag:
                    return True
        return False

    def queue_depth(self) -> int:
        return len(self.admission.queue)

    def workers(self) -> list[Worker]:
        return list(self.roster.workers.values())

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
        batch: BatchPolicy | None = None,
        rows: int = 1,
        batch_key: bytes = b"",
    ) -> Result:
        """Runs ``body`` on a worker before ``deadline`` (loop time).

        The queue serves the lowest ``priority`` first, then the earliest
        deadline, then the earliest arrival; a deadline within ``precision`` of
        one queued earlier counts as equal to it (deadlines that travelled as
        gRPC timeouts are that coarse), so calls with equal timeouts run in the
        order they came. With ``batch``, the job may run in a batch with queued
        jobs of the same ``tag`` and ``batch_key``, ``rows`` counting its size.
        """
        # With no live worker the job still queues: replacements are on their
        # way (health says NOT_SERVING meanwhile), and its deadline bounds the wait.
        job = self.admission.admit(body, deadline, priority, tag, idempotent, timeout, precision)
        if batch is not None and rows <= batch.max_size:
            job.batch, job.rows, job.batch_key = batch, rows, batch_key
        self._place(job, precision)
        if job.state is JobState.QUEUED and self.roster.idle:
            self._fill_idle()  # a batch waiting for more jobs may be complete now
        return await self._answer(job)

    def begin(
        self,
        body: Payload,
        deadline: float,
        done: Callable[[Result | BaseException], None],
        *,
        priority: int | None = None,
        idempotent: bool = True,
        tag: str = "",
        timeout: float | None = None,
        precision: float = 0.0,
    ) -> Started:
        """:meth:`submit` of a job that is not batched, without a task: ``done``
        gets its result or its error, as ``submit`` would return or raise them,
        unless the call's :meth:`Started.cancel` came first. The same admission,
        queue, deadline (its caller leaves at it) and cancel as ``submit``; the
        refusals are raised here."""
        job = self.admission.admit(body, deadline, priority, tag, idempotent, timeout, precision)
        self._place(job, precision)
        if job.state is JobState.QUEUED and self.roster.idle:
            self._fill_idle()
        return Started(self.admission.running_loop(), job, done, self._expire, self._abandon)

    async def submit_stream(
        self,
        body: Payload,
        deadline: float,
        *,
        window: int,
        priority: int | None = None,
        tag: str = "",
        timeout: float | None = None,
        precision: float = 0.0,
        pinned: Worker | None = None,
        sequence: str = "",
    ) -> AsyncIterator[bytes | Result]:
        """Runs ``body`` on a worker as a stream (a decoupled model): yields each
        part as the worker sends it, then the Result of the whole stream (its
        final frame's body and timings); raises a ServingError instead.

        ``deadline`` and ``timeout`` bound the whole stream; the worker sends at
        most ``window`` parts ahead of what was taken from here. Closing the
        iterator early (the caller went away) cancels the stream on the worker.
        A stream is never retried on another worker: parts may have gone out.
        ``pinned``: the worker of the stream's ``sequence`` (a decoupled sequence
        model), where it runs after the jobs already pinned to it.
        """
        loop = self.admission.running_loop()
        if pinned is not None:
            self.admission.check_arrival(deadline)
            parts = Parts(max(1, window))
            job = self.admission.pinned(
                pinned, body, deadline, sequence, tag, timeout, stream=parts
            )
            self._pin(pinned, job)
        else:
            job = self.admission.admit(body, deadline, priority, tag, False, timeout, precision)
            parts = job.stream = Parts(max(1, window))
            self._place(job, precision)
        timer = loop.call_at(deadline, self._expire, job)
        try:
            while True:
                item = await next_part(parts)
                yield item
                if isinstance(item, Result):
                    return
                took_part(job)
        finally:
            timer.cancel()
            self._abandon(job, "it was cancelled")

    async def submit_pinned(
        self,
        worker: Worker,
        body: Payload,
        deadline: float,
        *,
        sequence: str,
        tag: str = "",
        timeout: float | None = None,
    ) -> Result:
        """Runs ``body`` on ``worker`` (a sequence's), after the jobs already
        pinned to it, in arrival order; never batched, never retried elsewhere."""
        self.admission.check_arrival(deadline)
        job = self.admission.pinned(worker, body, deadline, sequence, tag, timeout)
        return await self._answer(self._pin(worker, job))

    def notify_sequence_end(self, worker: Worker, body: bytes, sequence: str, tag: str) -> None:
        """Tells ``worker`` a sequence ended (a SEQUENCE_END frame), after its
        pinned jobs; nobody waits for the answer."""
        if worker.state is WorkerState.DEAD:
            return
        deadline = self.admission.running_loop().time() + 3600.0
        job = self.admission.pinned(worker, body, deadline, sequence, tag, notice=True)
        self._pin(worker, job)
        job.future.add_done_callback(lambda done: done.exception())

    def _place(self, job: Job, precision: float) -> None:
        """Starts ``job`` on an idle worker if no job waits that could start (nor
        may its batch grow while another of its model runs, nor may it, a
        stream, take one more worker), else queues it."""
        waits = self.admission.waits()
        if (
            self.roster.idle
            and not waits
            and (job.batch is None or not self.roster.runs(job.tag))
            and (job.stream is None or self.share.may_start())
        ):
            self._start(self.roster.idle.pop(), [job])  # a lone caller starts at once
        elif not waits and (worker := self.ahead.worker_for(job)) is not None:
            self._send_ahead(worker, job)
        else:
            self.admission.queue.push(job, precision)

    def _pin(self, worker: Worker, job: Job) -> Job:
        """Starts ``job`` on its sequence's ``worker`` now if that is idle (and
        it is no stream that must wait for another to end), else after the jobs
        already pinned to it."""
        worker.pinned.append(job)
        if worker.state is WorkerState.IDLE and self._start_pinned(worker):
            self.roster.unidle(worker)
        return job

    def _start_pinned(self, worker: Worker) -> bool:
        """Starts the first job pinned to ``worker`` (free) unless that is a
        stream that may not start yet; False if none started."""
        while worker.pinned:
            job = worker.pinned[0]
            if job.state is not JobState.QUEUED:
                worker.pinned.popleft()  # its caller left
            elif job.stream is not None and not self.share.may_start():
                return False  # it starts, before the jobs behind it, once a stream ended
            else:
                worker.pinned.popleft()
                self._start(worker, [job])
                return True
        return False

    def _stream_ended(self) -> None:
        """A worker holds no stream any more (it ended, or the worker died): a
        stream that waited for that may start."""
        for worker in list(self.roster.workers.values()):
            if worker.state is WorkerState.IDLE and worker.pinned and self._start_pinned(worker):
                self.roster.unidle(worker)
        if self.roster.idle and self.admission.streams_may_start():
            self._fill_idle()

    def _abandon(self, job: Job, why: str) -> None:
        """The caller is gone (result, deadline or cancel): no one will read a reply."""
        if job.state is JobState.QUEUED:
            if not job.pinned:  # a pinned one is skipped when its worker comes to it
                self.admission.queue.remove(job)
            job.state = JobState.ABANDONED
        elif job.state is JobState.RUNNING:
            job.state = JobState.ABANDONED
            cancel_stream(job)
            self.watch.caller_left(job, why)

    async def _answer(self, job: Job) -> Result:
        """``job``'s result; its caller leaves at its deadline, or on a cancel."""
        timer = self.admission.running_loop().call_at(job.deadline, self._expire, job)
        try:
            return await job.future
        finally:
            timer.cancel()
            self._abandon(job, "it was cancelled")

    def _expire(self, job: Job) -> None:
        if self.admission.expire(job):
            self._abandon(job, "its deadline passed")

    def _start(self, worker: Worker, jobs: list[Job]) -> None:
        loop = self.admission.running_loop()
        now = loop.time()
        for member in jobs:
            member.state = JobState.RUNNING
            member.started = now
            member.worker = worker
        job = jobs[0]
        job.members = jobs if len(jobs) > 1 else None
        worker.current = job
        worker.state = WorkerState.BUSY
        self.watch.time_job(worker, job)
        if job.members is not None:
            self.batching.batches += 1
        send_job(worker, job)
        self._fill_ahead(worker)

    def _fill_ahead(self, worker: Worker) -> None:
        """Sends busy ``worker`` the queue's head ahead while both are light."""
        while self.admission.queue and self.ahead.takes(worker):
            ahead = self.admission.next_job_if(self.ahead.light)
            if ahead is None:
                return
            self._send_ahead(worker, ahead)

    def _send_ahead(self, worker: Worker, job: Job) -> None:
        """Sends ``job`` to busy ``worker``: it runs when the worker's job ends."""
        job.state = JobState.RUNNING
        job.worker = worker
        worker.ahead.append(job)
        self.sent_ahead += 1
        send_job(worker, job, ahead=True)

    def _run_ahead(self, worker: Worker, now: float) -> None:
        """``worker`` answered its job and goes on with the one sent ahead."""
        job = worker.ahead.popleft()
        job.started = now
        worker.current = job
        worker.state = WorkerState.BUSY
        self.watch.time_job(worker, job)
        self._fill_ahead(worker)

    def _fill_idle(self) -> None:
        """Starts what is worth starting on idle workers (a batch may still wait)."""
        while self.roster.idle:
            worker = self.roster.idle.pop()
            if not self._start_next(worker):
                self.roster.idle.append(worker)
                return

    def _start_next(self, worker: Worker) -> bool:
        """Starts the next job, or batch, on ``worker``; False if none is to start now."""
        job = self.admission.next_job()
        if job is None:
            return False
        jobs = self.batching.gather(job)
        if jobs is None:
            return False
        self._start(worker, jobs)
        return True

    def _worker_free(self, worker: Worker) -> None:
        worker.current = None
        if self._start_pinned(worker):  # its sequences' jobs first, in arrival order
            return
        if worker.retiring:
            # waits, out of the idle list, for its sequences' jobs (a stream of
            # one may wait for another stream to end)
            if worker.sequences or worker.pinned:
                worker.state = WorkerState.IDLE
            else:
                self.roster.close(worker)
            return
        if not self._start_next(worker):
            worker.state = WorkerState.IDLE
            self.roster.idle.append(worker)

    # -- per-worker reader task -----------------------------------------

    async def _read_replies(self, worker: Worker) -> None:
        """Lives as long as the worker's connection; its link delivers its frames."""
        try:
            await serve_link(
                worker,
                self._connected,
                self._warmup_notice,
                self._deliver,
                self.watch.protocol_error,
            )
        except (ConnectionError, OSError):
            pass  # the worker died before we could even connect: handled below
        finally:
            self._lost(worker)

    def _deliver(self, worker: Worker, reply: Reply) -> None:
        job = worker.current
        if job is None or job.seq != reply.seq:
            raise ValueError(f"reply for sequence {reply.seq} that this worker does not hold")
        if reply.kind == PART:
            part_came(job, reply)
            return  # the worker stays in the stream until its final frame
        replies = reply_per_job(job, reply)
        worker.served += 1
        finished = self.admission.running_loop().time()
        self.admission.learn_service_time(job, replies, finished - job.started)
        self.late_replies += answer(job, replies, finished)
        if job.overtime is not None:
            job.overtime.cancel()
            job.overtime = None
        was_stuck = worker.state is WorkerState.STUCK
        if worker.ahead:
            self._run_ahead(worker, finished)
        else:
            self._worker_free(worker)
        if job.stream is not None:
            self._stream_ended()
        if was_stuck:
            self._on_change()

    # -- the self-test of a fresh worker ---------------------------------

    def _connected(self, worker: Worker) -> None:
        if worker.retiring:  # closed (or retired) while it connected
            self.roster.close(worker)
        else:
            self.watch.begin_warmup(worker)
        self._on_change()

    def _warmup_notice(self, worker: Worker, notice: Reply) -> None:
        if not self.watch.self_test_frame(worker, notice):
            return  # the next model's load or warm-up prediction starts
        self._worker_free(worker)
        self._on_worker_ready(worker.pid)
        self._on_change()

    # -- death -----------------------------------------------------------

    def _lost(self, worker: Worker) -> None:
        if worker.state is WorkerState.DEAD:
            return
        worker.died_warming = worker.state is WorkerState.WARMING
        held_stream = worker.current is not None and worker.current.stream is not None
        self.watch.forget(worker)
        worker.state = WorkerState.DEAD
        self.roster.drop(worker)
        if worker.transport is not None:
            worker.transport.close()
        else:
            worker.sock.close()
        retry, requeue = self.admission.retry, self.admission.requeue
        if self.deaths.leaves(worker, retry, requeue) and self.roster.idle:
            self._fill_idle()
        if held_stream:
            self._stream_ended()
        self.deaths.socket_closed(worker)
        self._on_change()
