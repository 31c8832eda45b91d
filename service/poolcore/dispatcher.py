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

A model with a batching policy (:class:`BatchPolicy`) has its queued jobs
started in batches: when a worker is free, the first job worth starting takes
along the queued jobs of its model with the same batch key (compatible
inputs, see :mod:`poolserve.service.contract.batching`), in queue order, up
to ``max_size`` rows, as one BATCH frame. A lone job on an idle worker starts
at once; a batch short of its size (even of one job, with a worker idle) waits
for more only while another batch of its model runs, and at most ``max_time``
after its first job came, never past the earliest deadline in it minus the
model's service time. Each job of a
batch keeps its own state: a job that expires or is cancelled while the batch
forms leaves the queue, a reply for a job whose caller left is dropped, and a
worker death retries each job of the batch once, as a single job.

A fresh worker takes no job before its self-test is done (the READY frame):
one warm-up prediction per model, each within ``warmup_timeout``. A worker
that hangs in it is killed; its death names the model it was warming up.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import cast

from poolserve.service.contract.batching import BatchPolicy
from poolserve.service.contract.errors import (
    ServingError,
    Unavailable,
    error_for,
)
from poolserve.service.contract.framing import Batcher, Payload
from poolserve.service.poolcore.admission import Admission, ServiceTime
from poolserve.service.poolcore.batches import BatchForming
from poolserve.service.poolcore.deaths import DeathReports
from poolserve.service.poolcore.frames import (
    LOADING,
    PART,
    SELF_TEST,
    WARMUP,
    Reply,
    ReplyBuffer,
    ack_frame,
    batch_frame,
    cancel_frame,
    request_frame,
    sequence_end_frame,
    stream_frame,
)
from poolserve.service.poolcore.jobqueue import JobQueue, take_batch
from poolserve.service.poolcore.jobs import (
    Job,
    JobState,
    Limits,
    Parts,
    Result,
    Worker,
    WorkerGone,
    WorkerState,
    finish,
)
from poolserve.service.poolcore.watch import WorkerWatch

__all__ = [
    "Dispatcher",
    "Job",
    "JobQueue",
    "JobState",
    "Limits",
    "Parts",
    "Result",
    "ServiceTime",
    "Worker",
    "WorkerGone",
    "WorkerState",
    "take_batch",
]

log = logging.getLogger(__name__)


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
        self._on_worker_ready = on_worker_ready
        self.admission = Admission(name, max_queue)
        self._idle: deque[Worker] = deque()
        self._workers: dict[int, Worker] = {}
        self.watch = WorkerWatch(
            name,
            self._workers,
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
        self.batching = BatchForming(self.admission, self._workers, self._fill_idle)

    # -- lifecycle -------------------------------------------------------

    async def run(self, started: Callable[[], None] = lambda: None) -> None:
        """Owns the worker reader tasks and the heartbeat watch until :meth:`close`."""
        async with asyncio.TaskGroup() as tasks:
            self._tasks = tasks
            watch = tasks.create_task(self.watch.watch_heartbeats(), name="heartbeats")
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
        self.admission.refuse(error)

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
        self.deaths.exited(pid, status)

    def retire(self, pid: int) -> bool:
        """Lets a worker finish its current job, then closes it (rolling replacement)."""
        worker = self._workers.get(pid)
        if worker is None or worker.retiring:
            return False
        worker.retiring = True
        if worker.state is WorkerState.IDLE:
            with contextlib.suppress(ValueError):
                self._idle.remove(worker)
            if not worker.sequences:  # else it serves its sequences' jobs until they end
                self._close_worker(worker)
        return True

    def hold_sequences(self, worker: Worker, change: int) -> None:
        """A sequence started (+1) or ended (-1) on ``worker``; a retiring worker
        closes once it holds none and has nothing left to run."""
        worker.sequences += change
        if (
            worker.retiring
            and worker.sequences <= 0
            and worker.state is WorkerState.IDLE
            and worker.current is None
            and not worker.pinned
        ):
            self._close_worker(worker)

    # -- status ----------------------------------------------------------

    def live_workers(self) -> int:
        """Workers that take jobs now: self-tested, not stuck, not retiring."""
        return sum(
            1
            for w in self._workers.values()
            if (w.state is WorkerState.IDLE or w.state is WorkerState.BUSY) and not w.retiring
        )

    @property
    def expired_in_queue(self) -> int:
        return self.admission.expired_in_queue

    @property
    def skipped_hopeless(self) -> int:
        return self.admission.skipped_hopeless

    @property
    def batches(self) -> int:
        return self.batching.batches

    def queue_depth(self) -> int:
        return len(self.admission.queue)

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
        loop = asyncio.get_running_loop()
        if batch is not None and rows <= batch.max_size:
            job.batch, job.rows, job.batch_key = batch, rows, batch_key
        if (
            self._idle
            and not self.admission.queue
            and (job.batch is None or not self.batching.runs(tag))
        ):
            self._start(self._idle.pop(), [job])  # a lone caller starts at once
        else:
            self.admission.queue.push(job, precision)
            if self._idle:
                self._fill_idle()  # a batch waiting for more jobs may be complete now
        timer = loop.call_at(deadline, self._expire, job)
        try:
            return await job.future
        finally:
            timer.cancel()
            self._abandon(job, "it was cancelled")

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
        loop = asyncio.get_running_loop()
        if pinned is not None:
            self.admission.check_arrival(deadline)
            parts = Parts(max(1, window))
            job = self._pin(pinned, body, deadline, sequence, tag, timeout, stream=parts)
        else:
            job = self.admission.admit(body, deadline, priority, tag, False, timeout, precision)
            parts = job.stream = Parts(max(1, window))
            if self._idle and not self.admission.queue:
                self._start(self._idle.pop(), [job])
            else:
                self.admission.queue.push(job, precision)
        timer = loop.call_at(deadline, self._expire, job)
        try:
            while True:
                item = await parts.queue.get()
                if isinstance(item, ServingError):
                    raise item
                yield item
                if isinstance(item, Result):
                    return
                parts.taken += 1
                self._acknowledge(job)
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
        loop = asyncio.get_running_loop()
        self.admission.check_arrival(deadline)
        job = self._pin(worker, body, deadline, sequence, tag, timeout)
        timer = loop.call_at(deadline, self._expire, job)
        try:
            return await job.future
        finally:
            timer.cancel()
            self._abandon(job, "it was cancelled")

    def notify_sequence_end(self, worker: Worker, body: bytes, sequence: str, tag: str) -> None:
        """Tells ``worker`` a sequence ended (a SEQUENCE_END frame), after its
        pinned jobs; nobody waits for the answer."""
        if worker.state is WorkerState.DEAD:
            return
        deadline = asyncio.get_running_loop().time() + 3600.0
        job = self._pin(worker, body, deadline, sequence, tag, None, notice=True)
        job.future.add_done_callback(lambda done: done.exception())

    def _pin(
        self,
        worker: Worker,
        body: Payload,
        deadline: float,
        sequence: str,
        tag: str,
        timeout: float | None,
        notice: bool = False,
        stream: Parts | None = None,
    ) -> Job:
        if worker.state is WorkerState.DEAD:
            raise Unavailable(
                f"sequence {sequence} of model '{tag}' is lost: worker pid {worker.pid} of "
                f"pool '{self.name}' that held its state died"
            )
        now = asyncio.get_running_loop().time()
        job = self.admission.job(body, deadline, None, tag, False, now)
        job.timeout, job.pinned, job.sequence, job.notice = timeout, True, sequence, notice
        job.stream = stream
        if worker.state is WorkerState.IDLE and not worker.pinned:
            with contextlib.suppress(ValueError):
                self._idle.remove(worker)
            self._start(worker, [job])
        else:
            worker.pinned.append(job)
        return job

    def _acknowledge(self, job: Job) -> None:
        """Tells the worker the parts its caller took, half a window at a time: a
        worker that waits has a whole window out, so its caller takes at least
        that many and the worker hears of them."""
        parts, worker = job.stream, job.worker
        if parts is None or job.state is not JobState.RUNNING:
            return
        if parts.taken < max(1, parts.window // 2):
            return
        if worker is not None and worker.current is job and worker.writer is not None:
            worker.writer.write_now(ack_frame(job.seq, parts.taken))
        parts.taken = 0

    def _abandon(self, job: Job, why: str) -> None:
        """The caller is gone (result, deadline or cancel): no one will read a reply."""
        if job.state is JobState.QUEUED:
            if not job.pinned:  # a pinned one is skipped when its worker comes to it
                self.admission.queue.remove(job)
            job.state = JobState.ABANDONED
        elif job.state is JobState.RUNNING:
            job.state = JobState.ABANDONED
            worker = job.worker
            if job.stream is not None and worker is not None and worker.current is job:
                assert worker.writer is not None  # it runs a job: connected
                worker.writer.write_now(cancel_frame(job.seq))  # it closes the model's generator
            self.watch.caller_left(job, why)

    def _expire(self, job: Job) -> None:
        if self.admission.expire(job):
            self._abandon(job, "its deadline passed")

    def _start(self, worker: Worker, jobs: list[Job]) -> None:
        loop = asyncio.get_running_loop()
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
        # Frames go out as parts (header, body views: no join), at once: a
        # worker's socket carries one job at a time.
        assert worker.writer is not None
        if job.stream is not None:
            worker.writer.write_now(*stream_frame(job.seq, job.stream.window, job.body))
        elif job.notice:
            worker.writer.write_now(*sequence_end_frame(job.seq, job.body))
        elif job.members is None:
            worker.writer.write_now(*request_frame(job.seq, job.body))
        else:
            self.batching.batches += 1
            worker.writer.write_now(*batch_frame(job.seq, [m.body for m in jobs]))

    def _fill_idle(self) -> None:
        """Starts what is worth starting on idle workers (a batch may still wait)."""
        while self._idle:
            worker = self._idle.pop()
            if not self._start_next(worker):
                self._idle.append(worker)
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
        while worker.pinned:  # its sequences' jobs first, in arrival order
            job = worker.pinned.popleft()
            if job.state is JobState.QUEUED:
                self._start(worker, [job])
                return
        if worker.retiring:
            if worker.sequences:  # waits, out of the idle list, for its sequences' jobs
                worker.state = WorkerState.IDLE
            else:
                self._close_worker(worker)
            return
        if not self._start_next(worker):
            worker.state = WorkerState.IDLE
            self._idle.append(worker)

    # -- per-worker reader task -----------------------------------------

    async def _read_replies(self, worker: Worker) -> None:
        """Lives as long as the worker's connection; the protocol delivers its replies."""
        loop = asyncio.get_running_loop()
        closed: asyncio.Future[None] = loop.create_future()
        try:
            transport, _ = await loop.connect_accepted_socket(
                lambda: _WorkerLink(self, worker, closed), sock=worker.sock
            )
            # uvloop's transports (uvicorn picks uvloop when installed) have the
            # asyncio.Transport interface without subclassing it: no isinstance check.
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
        self.watch.kill(worker, f"frame protocol error: {exc}")
        if worker.transport is not None:
            worker.transport.close()

    def _deliver(self, worker: Worker, reply: Reply) -> None:
        job = worker.current
        if job is None or job.seq != reply.seq:
            raise ValueError(f"reply for sequence {reply.seq} that this worker does not hold")
        if reply.kind == PART:
            if job.stream is None:
                raise ValueError(f"a stream's part for request {reply.seq}, not a stream")
            if job.state is JobState.RUNNING:
                job.stream.queue.put_nowait(bytes(reply.body))  # a PART's body is bytes
            return  # the worker stays in the stream until its final frame
        members = job.members or [job]
        parts = reply.parts if reply.parts is not None else [reply]
        if (reply.parts is None) != (job.members is None) or len(parts) != len(members):
            raise ValueError(f"{len(parts)} replies for a batch of {len(members)} requests")
        worker.served += 1
        finished = asyncio.get_running_loop().time()
        if (
            job.tag
            and job.stream is None
            and not job.notice
            and any(part.failure is None for part in parts)
        ):
            self.admission.learn_service_time(job.tag, finished - job.started)
        rows = sum(m.rows for m in members)
        report = True
        for member, part in zip(members, parts, strict=True):
            if member.state is not JobState.RUNNING:
                self.late_replies += 1
                continue
            member.state = JobState.DONE
            if part.failure is None:
                queue_ns = int((member.started - member.enqueued) * 1e9)
                result = Result(
                    part.body,
                    part.timings,
                    queue_ns,
                    member.enqueued,
                    member.started,
                    finished,
                    batch_size=rows,
                    batch_report=report,
                )
                report = False
                finish(member, result)
            else:
                finish(member, error_for(part.failure, part.message))
        if job.overtime is not None:
            job.overtime.cancel()
            job.overtime = None
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
        self.watch.time_warmup(worker)

    def _warmup_notice(self, worker: Worker, notice: Reply) -> None:
        """A WARMUP (the next model's warm-up starts) or READY frame from a fresh worker."""
        if worker.state is not WorkerState.WARMING:
            raise ValueError(f"self-test frame of kind {notice.kind} after the self-test")
        if notice.kind in (WARMUP, LOADING):
            worker.warming = bytes(notice.body).decode("utf-8", "replace")
            worker.loading = notice.kind == LOADING
            self.watch.time_warmup(worker)  # each model gets the whole limit
            return
        self.watch.warmup_done(worker, notice.body)
        self._worker_free(worker)
        self._on_worker_ready(worker.pid)
        self._on_change()

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
        if self.deaths.leaves(worker, self.admission.retry) and self._idle:
            self._fill_idle()
        self.deaths.socket_closed(worker)
        self._on_change()

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
        # uvloop's transports have asyncio.Transport's interface without subclassing it
        self.worker.writer = Batcher(cast(asyncio.Transport, transport))

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
