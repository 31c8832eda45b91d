"""The bounded queue of jobs waiting for a worker, in schedule order, and the
batches taken from it (:func:`gather_batch`, :func:`take_batch`)."""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Callable

from poolserve.service.contract.errors import QueueFull
from poolserve.service.poolcore.jobs import Job, JobState


class JobQueue:
    """Jobs waiting to run: by priority (lowest first), then deadline, then arrival.

    A job leaves it by :meth:`pop` or :meth:`remove`; removal is lazy in the
    heap (a job that is no longer QUEUED is skipped when it comes up).
    """

    def __init__(self, limit: int, where: str) -> None:
        self.limit = limit
        self.where = where
        self._heap: list[tuple[int, float, int, int, Job]] = []
        self._keys: dict[int, list[float]] = {}  # per priority: queued jobs' keys, sorted
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def push(
        self, job: Job, precision: float, bounded: bool = True, key: float | None = None
    ) -> None:
        """Queues ``job``, QueueFull past the limit; see :func:`_order_key` for
        ``precision``; ``key``: its place as before (a batch that waits puts its
        first job back where it was)."""
        if bounded and self._count >= self.limit:
            raise QueueFull(f"{self.where} queue is full ({self.limit} requests waiting)")
        keys = self._keys.setdefault(job.priority, [])
        job.key = _order_key(keys, job.deadline, precision) if key is None else key
        bisect.insort(keys, job.key)
        job.entry += 1
        heapq.heappush(self._heap, (job.priority, job.key, job.seq, job.entry, job))
        self._count += 1
        if len(self._heap) > 2 * self.limit + 64:
            self._heap = [e for e in self._heap if _live(e)]
            heapq.heapify(self._heap)

    def pop(self) -> Job | None:
        """The first queued job, out of the queue (still in state QUEUED)."""
        while self._heap:
            entry = heapq.heappop(self._heap)
            if _live(entry):
                job = entry[4]
                self._forget(job)
                return job
        return None

    def peek(self) -> Job | None:
        """The first queued job, left in the queue."""
        while self._heap:
            if _live(self._heap[0]):
                return self._heap[0][4]
            heapq.heappop(self._heap)
        return None

    def compatible(self, lead: Job) -> list[Job]:
        """The queued jobs that may join ``lead``'s batch, in queue order."""
        found = [
            e
            for e in self._heap
            if _live(e)
            and e[4] is not lead
            and e[4].batch is not None
            and e[4].tag == lead.tag
            and e[4].batch_key == lead.batch_key
        ]
        found.sort(key=lambda e: e[:3])
        return [e[4] for e in found]

    def remove(self, job: Job) -> None:
        """A queued job leaves for good (the caller sets its new state)."""
        self._forget(job)

    def _forget(self, job: Job) -> None:
        self._count -= 1
        keys = self._keys[job.priority]
        del keys[bisect.bisect_left(keys, job.key)]
        if not keys:
            del self._keys[job.priority]


def gather_batch(queue: JobQueue, job: Job, worth: Callable[[Job], bool]) -> list[Job]:
    """``job`` (already out of ``queue``) and, in queue order, the queued jobs
    that join its batch (``worth`` them; still in the queue), up to its
    policy's ``max_size`` rows."""
    policy = job.batch
    jobs, rows = [job], job.rows
    if policy is None:
        return jobs
    for other in queue.compatible(job):
        if rows + other.rows > policy.max_size or not worth(other):
            continue
        jobs.append(other)
        rows += other.rows
        if rows >= policy.max_size:
            break
    return jobs


def take_batch(queue: JobQueue, job: Job) -> list[Job]:
    """As :func:`gather_batch`, the batch out of the queue at once (no wait)."""
    jobs = gather_batch(queue, job, lambda other: True)
    for other in jobs[1:]:
        queue.remove(other)
    return jobs


def _live(entry: tuple[int, float, int, int, Job]) -> bool:
    """A heap entry of a queued job that was not removed (nor queued again since)."""
    job = entry[4]
    return job.state is JobState.QUEUED and job.entry == entry[3]


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
