"""The dispatcher: the one owner of a pool's queue and of which job is on which worker.

It knows nothing of gRPC or models: it moves opaque request bytes to idle
workers and their replies back. Each worker holds at most one job, so there
is no table of futures keyed by message id that two parties could disagree
about. A job has one state machine (QUEUED -> RUNNING -> DONE, or ABANDONED
when its caller gave up through a deadline or a cancel); a reply for an
abandoned job is counted and dropped. A job whose deadline passes while it is
queued is answered at that moment and never reaches a worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import heapq
import itertools
import logging
import socket
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from poolserve.service.errors import DeadlineExceeded, QueueFull, Unavailable, error_for
from poolserve.service.frames import HEADER, parse_reply, request_frame
from poolserve.service.stats import Timings

log = logging.getLogger(__name__)

DEFAULT_PRIORITY = 1 << 30  # below every explicit priority (1 is the highest)
RETRY_PRIORITY = 0  # a retried job goes before everything else


class JobState(enum.Enum):
    QUEUED = 1
    RUNNING = 2
    DONE = 3
    ABANDONED = 4


@dataclass(slots=True, eq=False)
class Job:
    body: bytes
    deadline: float
    priority: int
    seq: int
    future: asyncio.Future[Result]
    idempotent: bool = True
    state: JobState = JobState.QUEUED
    enqueued: float = 0.0
    started: float = 0.0
    retried: bool = False


@dataclass(slots=True)
class Result:
    body: bytes
    timings: Timings
    queue_ns: int


class WorkerState(enum.StrEnum):
    IDLE = "idle"
    BUSY = "busy"
    DEAD = "dead"


@dataclass(eq=False)
class Worker:
    pid: int
    sock: socket.socket
    writer: asyncio.StreamWriter | None = None
    current: Job | None = None
    served: int = 0
    state: WorkerState = WorkerState.IDLE
    started_at: float = field(default_factory=time.monotonic)


class Dispatcher:
    def __init__(
        self,
        name: str,
        max_queue: int,
        on_change: Callable[[], None] = lambda: None,
        on_worker_lost: Callable[[Worker], None] = lambda w: None,
    ) -> None:
        self.name = name
        self.max_queue = max_queue
        self._on_change = on_change
        self._on_worker_lost = on_worker_lost
        self._heap: list[tuple[int, float, int, Job]] = []
        self._queued = 0
        self._idle: deque[Worker] = deque()
        self._workers: dict[int, Worker] = {}
        self._seq = itertools.count(1)
        self._tasks: asyncio.TaskGroup | None = None
        self._closing = asyncio.Event()
        self.late_replies = 0
        self.expired_in_queue = 0

    # -- lifecycle -------------------------------------------------------

    async def run(self, started: Callable[[], None] = lambda: None) -> None:
        """Owns the worker reader tasks until :meth:`close`."""
        async with asyncio.TaskGroup() as tasks:
            self._tasks = tasks
            started()
            await self._closing.wait()
            for worker in list(self._workers.values()):
                self._close_worker(worker)
        self._tasks = None

    def close(self) -> None:
        self._closing.set()

    def add_worker(self, pid: int, sock: socket.socket) -> None:
        if self._tasks is None or self._closing.is_set():
            sock.close()
            return
        worker = Worker(pid, sock)
        self._workers[pid] = worker
        self._tasks.create_task(self._read_replies(worker), name=f"worker-{pid}")

    # -- status ----------------------------------------------------------

    def live_workers(self) -> int:
        return sum(1 for w in self._workers.values() if w.state is not WorkerState.DEAD)

    def queue_depth(self) -> int:
        return self._queued

    def workers(self) -> list[Worker]:
        return list(self._workers.values())

    # -- the request path ------------------------------------------------

    async def submit(
        self,
        body: bytes,
        deadline: float,
        priority: int = DEFAULT_PRIORITY,
        idempotent: bool = True,
    ) -> Result:
        loop = asyncio.get_running_loop()
        now = loop.time()
        if deadline <= now:
            raise DeadlineExceeded(f"deadline already spent on arrival at pool '{self.name}'")
        if not self._workers:
            raise Unavailable(f"pool '{self.name}' has no live worker")
        job = Job(body, deadline, priority, next(self._seq), loop.create_future(), idempotent)
        job.enqueued = now
        if self._idle and not self._queued:
            self._start(self._idle.pop(), job)
        else:
            self._enqueue(job)
        timer = loop.call_at(deadline, self._expire, job)
        try:
            return await job.future
        finally:
            timer.cancel()
            self._abandon(job)

    def _enqueue(self, job: Job) -> None:
        if self._queued >= self.max_queue:
            raise QueueFull(f"pool '{self.name}' queue is full ({self.max_queue} requests waiting)")
        heapq.heappush(self._heap, (job.priority, job.deadline, job.seq, job))
        self._queued += 1
        if len(self._heap) > 2 * self.max_queue + 64:
            self._compact()

    def _compact(self) -> None:
        self._heap = [e for e in self._heap if e[3].state is JobState.QUEUED]
        heapq.heapify(self._heap)

    def _abandon(self, job: Job) -> None:
        """The caller is gone (result, deadline or cancel): no one will read a reply."""
        if job.state is JobState.QUEUED:
            self._queued -= 1
            job.state = JobState.ABANDONED
        elif job.state is JobState.RUNNING:
            job.state = JobState.ABANDONED

    def _expire(self, job: Job) -> None:
        if job.future.done():
            return
        if job.state is JobState.QUEUED:
            self.expired_in_queue += 1
            where = f"while queued in pool '{self.name}'"
        else:
            where = f"while running on a worker of pool '{self.name}'"
        job.future.set_exception(DeadlineExceeded(f"deadline exceeded {where}"))
        self._abandon(job)

    def _start(self, worker: Worker, job: Job) -> None:
        job.state = JobState.RUNNING
        job.started = asyncio.get_running_loop().time()
        worker.current = job
        worker.state = WorkerState.BUSY
        assert worker.writer is not None
        worker.writer.write(request_frame(job.seq, job.body))

    def _next_job(self) -> Job | None:
        while self._heap:
            job = heapq.heappop(self._heap)[3]
            if job.state is JobState.QUEUED:
                self._queued -= 1
                return job
        return None

    def _worker_free(self, worker: Worker) -> None:
        worker.current = None
        job = self._next_job()
        if job is None:
            worker.state = WorkerState.IDLE
            self._idle.append(worker)
        else:
            self._start(worker, job)

    # -- per-worker reader task -----------------------------------------

    async def _read_replies(self, worker: Worker) -> None:
        try:
            reader, worker.writer = await asyncio.open_connection(sock=worker.sock)
            self._worker_free(worker)
            self._on_change()
            while True:
                header = await reader.readexactly(HEADER.size)
                length, kind, seq = HEADER.unpack(header)
                payload = await reader.readexactly(length)
                self._deliver(worker, parse_reply(kind, seq, payload))
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            pass  # the worker died or closed: handled below
        except ValueError as exc:
            log.error("pool %s: worker %d broke the frame protocol: %s", self.name, worker.pid, exc)
        finally:
            self._lost(worker)

    def _deliver(self, worker: Worker, reply: object) -> None:
        from poolserve.service.frames import Reply

        assert isinstance(reply, Reply)
        job = worker.current
        if job is None or job.seq != reply.seq:
            raise ValueError(f"reply for sequence {reply.seq} that this worker does not hold")
        worker.served += 1
        if job.state is JobState.RUNNING:
            job.state = JobState.DONE
            if reply.failure is None:
                queue_ns = int((job.started - job.enqueued) * 1e9)
                job.future.set_result(Result(reply.body, reply.timings, queue_ns))
            else:
                job.future.set_exception(error_for(reply.failure, reply.message))
        else:
            self.late_replies += 1
        self._worker_free(worker)

    def _lost(self, worker: Worker) -> None:
        if worker.state is WorkerState.DEAD:
            return
        worker.state = WorkerState.DEAD
        self._workers.pop(worker.pid, None)
        with contextlib.suppress(ValueError):
            self._idle.remove(worker)
        if worker.writer is not None:
            worker.writer.close()
        else:
            worker.sock.close()
        job, worker.current = worker.current, None
        if job is not None and job.state is JobState.RUNNING:
            self._retry_or_fail(job, worker)
        if not self._closing.is_set():
            self._on_worker_lost(worker)
        self._on_change()

    def _retry_or_fail(self, job: Job, worker: Worker) -> None:
        loop = asyncio.get_running_loop()
        if job.idempotent and not job.retried and self._workers and job.deadline > loop.time():
            job.retried = True
            job.state = JobState.QUEUED
            heapq.heappush(self._heap, (RETRY_PRIORITY, job.deadline, job.seq, job))
            self._queued += 1
            if self._idle:
                self._worker_free_job(self._idle.pop())
            return
        job.state = JobState.DONE
        job.future.set_exception(
            Unavailable(
                f"worker pid {worker.pid} of pool '{self.name}' died while running the request"
            )
        )

    def _worker_free_job(self, worker: Worker) -> None:
        job = self._next_job()
        if job is None:
            self._idle.append(worker)
        else:
            self._start(worker, job)

    def _close_worker(self, worker: Worker) -> None:
        """Closing the socket makes the worker exit (EOF); its reader then finishes."""
        if worker.writer is not None:
            worker.writer.close()
        else:
            worker.sock.close()
