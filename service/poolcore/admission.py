"""Admission and the queue: which job comes in, waits, and is worth starting.

A job comes in unless the pool refuses all (its zygote is gone) or its
deadline is already spent; it waits in the bounded :class:`JobQueue`
(QueueFull past ``max_queue``); a job whose deadline passes while it is
queued is answered at that moment and never reaches a worker. A job that
can no longer finish in time (less time left than its model's recent
service time, :class:`ServiceTime`) is answered instead of started. A dead
worker's job is requeued once, first in line, if it may run twice. A
sequence's job (pinned to the worker that holds its state) is admitted here
too, and never queued here: it waits behind its worker's other pinned jobs.
A stream waits in the queue, in its order, while the pool's streams hold all
the workers they may (:class:`StreamShare`); the jobs behind it start meanwhile.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable

from poolserve.service.contract.errors import DeadlineExceeded, ServingError, Unavailable
from poolserve.service.contract.framing import Payload
from poolserve.service.poolcore.frames import Reply
from poolserve.service.poolcore.jobqueue import JobQueue
from poolserve.service.poolcore.jobs import (
    DEFAULT_PRIORITY,
    RETRY_PRIORITY,
    Job,
    JobState,
    Worker,
    WorkerState,
    finish,
)
from poolserve.service.poolcore.streams import Parts, StreamShare

RETURN_TRIP_S = 0.002  # a job needs its service time plus the way back through pool and router


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


class Admission:
    def __init__(self, name: str, max_queue: int, share: StreamShare) -> None:
        self.name = name
        self.queue = JobQueue(max_queue, f"pool '{name}'")
        self.share = share  # the workers streams may hold (read only)
        self.expired_in_queue = 0
        self.skipped_hopeless = 0
        self._seq = itertools.count(1)
        self._refusal: ServingError | None = None
        self._service: dict[str, ServiceTime] = {}  # per tag: recent worker time per job
        # The dispatcher's loop while it runs: asyncio.get_running_loop() costs a
        # getpid system call in Python 3.11, and a request asked for it 6 times.
        self.loop: asyncio.AbstractEventLoop | None = None

    def running_loop(self) -> asyncio.AbstractEventLoop:
        """The event loop (the dispatcher's, kept while it runs: no system call)."""
        return self.loop or asyncio.get_running_loop()

    def refuse(self, error: ServingError) -> None:
        """No worker will come back (the zygote is gone): fail what waits, and what comes."""
        self._refusal = error
        while (job := self.next_job(streams=True)) is not None:
            job.state = JobState.DONE
            finish(job, error)

    def admit(
        self,
        body: Payload,
        deadline: float,
        priority: int | None,
        tag: str,
        idempotent: bool,
        timeout: float | None,
        precision: float,
    ) -> Job:
        """A new job, or the refusal: the pool's own, or a deadline already spent."""
        if self._refusal is not None:
            raise self._refusal
        now = self.check_arrival(deadline)
        job = self._job(body, deadline, priority, tag, idempotent, now)
        job.timeout = timeout
        job.precision = precision
        return job

    def check_arrival(self, deadline: float) -> float:
        """The time now, or DeadlineExceeded if ``deadline`` is spent already."""
        now = self.running_loop().time()
        if deadline <= now:
            raise DeadlineExceeded(
                f"deadline already spent on arrival at pool '{self.name}'", stage="pool"
            )
        return now

    def _job(
        self,
        body: Payload,
        deadline: float,
        priority: int | None,
        tag: str,
        idempotent: bool,
        enqueued: float,
    ) -> Job:
        """A new job that arrived at ``enqueued`` (numbered in arrival order)."""
        loop = self.running_loop()
        job = Job(
            body,
            deadline,
            DEFAULT_PRIORITY if priority is None else priority,
            next(self._seq),
            loop.create_future(),
            tag,
            idempotent,
        )
        job.enqueued = enqueued
        return job

    def pinned(
        self,
        worker: Worker,
        body: Payload,
        deadline: float,
        sequence: str,
        tag: str,
        timeout: float | None = None,
        *,
        notice: bool = False,
        stream: Parts | None = None,
    ) -> Job:
        """A new job of ``sequence``, to run on ``worker``, which holds its state
        (Unavailable if it died: the sequence is lost); never batched, never
        retried elsewhere. ``notice``: a SEQUENCE_END notice, not a request."""
        if worker.state is WorkerState.DEAD:
            raise Unavailable(
                f"sequence {sequence} of model '{tag}' is lost: worker pid {worker.pid} of "
                f"pool '{self.name}' that held its state died"
            )
        now = self.running_loop().time()
        job = self._job(body, deadline, None, tag, False, now)
        job.timeout, job.pinned, job.sequence = timeout, True, sequence
        job.notice, job.stream = notice, stream
        return job

    def expire(self, job: Job) -> bool:
        """Answers ``job`` whose deadline passed (False: it was answered already)."""
        if job.future.done():
            return False
        if job.state is JobState.QUEUED:
            self.expired_in_queue += 1
            where = f"while queued in pool '{self.name}' (it never reached a worker)"
            stage = "pool queue"
        else:
            where = f"while running on a worker of pool '{self.name}'"
            stage = "worker"
        finish(job, DeadlineExceeded(f"deadline exceeded {where}", stage=stage))
        return True

    def next_job(self, streams: bool = False) -> Job | None:
        """The next job worth starting, out of the queue (a stream only if it may
        start now, or if ``streams``).

        A job that can no longer finish before its deadline (less time left than
        its model's recent service time, with room for the slower runs of a
        noisy host and the way back) is answered now instead of run: under
        overload, running it would burn a worker on a reply nobody waits for,
        and make the jobs behind it late too. The deadline counted is the
        earliest its caller may have set (see ``precision``).
        """
        now = self.running_loop().time()
        while (job := self.queue.pop(streams or self.streams_may_start())) is not None:
            if self.hopeless(job, now, queued=False):
                continue
            return job
        return None

    def streams_may_start(self) -> bool:
        """Whether a queued stream may start now (there is one, and the pool's
        streams hold fewer workers than they may)."""
        return self.queue.streams > 0 and self.share.may_start()

    def waits(self) -> bool:
        """Whether a queued job could start on a free worker now (not a stream
        that waits for another stream to end)."""
        return self.queue.others() > 0 or self.streams_may_start()

    def next_job_if(self, wanted: Callable[[Job], bool]) -> Job | None:
        """As :meth:`next_job`, while the queue's head is ``wanted``; None at the
        first that is not (it stays queued)."""
        now = self.running_loop().time()
        while (job := self.queue.peek(self.streams_may_start())) is not None and wanted(job):
            self.queue.pop()
            if self.hopeless(job, now, queued=False):
                continue
            return job
        return None

    def service_mean(self, tag: str) -> float | None:
        """Model ``tag``'s mean service time; None before its first answer."""
        service = self._service.get(tag)
        return None if service is None else service.mean

    def hopeless(self, job: Job, now: float, queued: bool = True) -> bool:
        """Answers a job that cannot finish in time (``queued``: it leaves the queue)."""
        service = self._service.get(job.tag)
        needs = None if service is None else service.needs() + RETURN_TRIP_S
        left = job.deadline - job.precision - now
        if needs is None or left >= needs or job.future.done():
            return False
        if queued:
            self.queue.remove(job)
        self.skipped_hopeless += 1
        job.state = JobState.DONE
        left = max(0.0, left) * 1000
        finish(
            job,
            DeadlineExceeded(
                f"deadline would pass before the request could finish: {left:.1f} ms "
                f"left in pool '{self.name}', model '{job.tag}' takes about "
                f"{needs * 1000:.1f} ms",
                stage="pool queue",
            ),
        )
        return True

    def needs(self, tag: str) -> float:
        """The time a job of model ``tag`` needs to start, run and come back."""
        service = self._service.get(tag)
        return RETURN_TRIP_S + (service.needs() if service is not None else 0.0)

    def learn_service_time(self, lead: Job, replies: list[Reply], took: float) -> None:
        """A model's service time: dispatch to reply, as the dispatcher sees it
        (so it includes the hops and any wait for a CPU). Only an execution of
        requests (not a stream's, not a notice's) with an answer counts."""
        if not lead.tag or lead.stream is not None or lead.notice:
            return
        if all(reply.failure is not None for reply in replies):
            return
        service = self._service.get(lead.tag)
        if service is None:
            self._service[lead.tag] = ServiceTime(took)
        else:
            service.add(took)

    def requeue(self, job: Job) -> bool:
        """Queues a job that never started (it was sent ahead to a worker that
        died) at the front again, if it still has time; else it is lost with
        the worker (answered with its exit status)."""
        if job.deadline <= self.running_loop().time():
            return False
        job.state = JobState.QUEUED
        job.priority = RETRY_PRIORITY
        self.queue.push(job, 0.0, bounded=False)
        return True

    def retry(self, job: Job) -> bool:
        """Requeues a dead worker's job once, if it may run twice and still has time."""
        loop = self.running_loop()
        if not job.idempotent or job.retried or job.deadline <= loop.time():
            return False
        if job.overtime is not None:
            job.overtime.cancel()
            job.overtime = None
        job.retried = True
        job.state = JobState.QUEUED
        job.priority = RETRY_PRIORITY
        job.members = None
        self.queue.push(job, 0.0, bounded=False)
        return True
