"""Batch forming: which queued jobs of a batching model start together, and
when a batch short of its size waits for more.

A model with a batching policy (:class:`BatchPolicy`) has its queued jobs
started in batches: when a worker is free, the first job worth starting takes
along the queued jobs of its model with the same batch key (compatible
inputs, see :mod:`poolserve.service.contract.batching`), in queue order, up
to ``max_size`` rows, as one BATCH frame. A lone job on an idle worker starts
at once; a batch short of its size (even of one job, with a worker idle) waits
for more only while another batch of its model runs, and at most ``max_time``
after its first job came, never past the earliest deadline in it minus the
model's service time. Each job of a batch keeps its own state: a job that
expires or is cancelled while the batch forms leaves the queue, a reply for a
job whose caller left is dropped, and a worker death retries each job of the
batch once, as a single job.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from poolserve.service.poolcore.admission import Admission
from poolserve.service.poolcore.jobqueue import gather_batch
from poolserve.service.poolcore.jobs import Job
from poolserve.service.poolcore.roster import Roster

BATCH_WAIT_MIN_S = 0.0002  # a batch does not wait for less than this


class BatchForming:
    def __init__(self, admission: Admission, roster: Roster, due: Callable[[], None]) -> None:
        """``due``: look again at the queue (a waiting batch's time is up)."""
        self.batches = 0  # executions of more than one job
        self._admission = admission
        self._roster = roster  # read only
        self._due = due
        self._timer: asyncio.TimerHandle | None = None

    def gather(self, job: Job) -> list[Job] | None:
        """``job`` and the queued jobs that join its batch; None: the batch waits
        for more (``job`` is back in the queue, a timer will look again)."""
        policy = job.batch
        if policy is None or job.rows >= policy.max_size:
            return [job]
        admission = self._admission
        now = asyncio.get_running_loop().time()
        jobs = gather_batch(admission.queue, job, lambda other: not admission.hopeless(other, now))
        rows = sum(j.rows for j in jobs)
        if not policy.full(rows) and policy.max_time > 0 and self._roster.runs(job.tag):
            needs = admission.needs(job.tag)
            until = min(
                job.enqueued + policy.max_time,
                min(j.deadline - j.precision for j in jobs) - needs,
            )
            if until > now + BATCH_WAIT_MIN_S:
                admission.queue.push(job, 0.0, bounded=False, key=job.key)
                self._wake_at(until)
                return None
        for other in jobs[1:]:
            admission.queue.remove(other)
        return jobs

    def _wake_at(self, when: float) -> None:
        timer = self._timer
        if timer is not None and timer.when() <= when:
            return
        if timer is not None:
            timer.cancel()
        self._timer = asyncio.get_running_loop().call_at(when, self._wake)

    def _wake(self) -> None:
        self._timer = None
        self._due()
