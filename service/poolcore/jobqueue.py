"""The bounded queue of jobs waiting for a worker, in schedule order, and the
batches taken from it (:func:`gather_batch`, :func:`take_batch`).

Streams (jobs of a decoupled model) wait in the same order, in a heap of
their own, so that the queue's first job that is not a stream is at hand when
the pool's streams may hold no more workers (``unary_workers``,
:class:`poolserve.service.poolcore.streams.StreamShare`); each kind has the
bound to itself, so that streams waiting for a worker never fill the queue of
the pool's other calls."""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Callable

from poolserve.service.contract.errors import QueueFull
from poolserve.service.poolcore.jobs import Job, JobState

_Entry = tuple[int, float, int, int, Job]
"""A heap entry: (priority, key, arrival, which entry of the job, the job)."""


class JobQueue:
    """Jobs waiting to run: by priority (lowest first), then deadline, then arrival.

    A job leaves it by :meth:`pop` or :meth:`remove`; removal is lazy in the
    heaps (a job that is no longer QUEUED is skipped when it comes up).
    Streams wait in a heap of their own (:meth:`pop` may pass them by).
    """

    def __init__(self, limit: int, where: str) -> None:
        self.limit = limit
        self.where = where
        self._heap: list[_Entry] = []
        self._streams: list[_Entry] = []  # the queued streams (decoupled models' jobs)
        self._keys: dict[int, list[float]] = {}  # per priority: queued jobs' keys, sorted
        self._count = 0
        self.streams = 0  # of the count: streams

    def __len__(self) -> int:
        return self._count

    def others(self) -> int:
        """Queued jobs that are not streams."""
        return self._count - self.streams

    def holds(self, tag: str) -> bool:
        """Some job of ``tag`` waits here."""
        return any(_live(e) and e[4].tag == tag for e in (*self._heap, *self._streams))

    def push(
        self, job: Job, precision: float, bounded: bool = True, key: float | None = None
    ) -> None:
        """Queues ``job``, QueueFull past the limit (streams and the others
        each); see :func:`_order_key` for ``precision``; ``key``: its place as
        before (a batch that waits puts its first job back where it was)."""
        if bounded and job.stream is None and self.others() >= self.limit:
            raise QueueFull(f"{self.where} queue is full ({self.limit} requests waiting)")
        if bounded and job.stream is not None and self.streams >= self.limit:
            raise QueueFull(f"{self.where} queue is full ({self.limit} streams waiting)")
        keys = self._keys.setdefault(job.priority, [])
        job.key = _order_key(keys, job.deadline, precision) if key is None else key
        bisect.insort(keys, job.key)
        job.entry += 1
        heap = self._heap if job.stream is None else self._streams
        heapq.heappush(heap, (job.priority, job.key, job.seq, job.entry, job))
        self._count += 1
        self.streams += job.stream is not None
        if len(heap) > 2 * self.limit + 64:
            heap[:] = [e for e in heap if _live(e)]
            heapq.heapify(heap)

    def pop(self, streams: bool = True) -> Job | None:
        """The first queued job, out of the queue (still in state QUEUED);
        ``streams`` False: the first that is not a stream."""
        heap = self._first(streams)
        if heap is None:
            return None
        job = heapq.heappop(heap)[4]
        self._forget(job)
        return job

    def peek(self, streams: bool = True) -> Job | None:
        """The first queued job (``streams`` False: that is not a stream), left in the queue."""
        heap = self._first(streams)
        return None if heap is None else heap[0][4]

    def _first(self, streams: bool) -> list[_Entry] | None:
        """The heap whose head is the first live job (of the others, unless
        ``streams``); None: there is none."""
        first = _live_head(self._heap)
        if not streams or not self.streams:
            return first
        stream = _live_head(self._streams)
        if stream is None or (first is not None and first[0][:3] < stream[0][:3]):
            return first
        return stream

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
        self.streams -= job.stream is not None
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


def _live_head(heap: list[_Entry]) -> list[_Entry] | None:
    """``heap``, its dead head entries dropped; None once it is empty."""
    while heap:
        if _live(heap[0]):
            return heap
        heapq.heappop(heap)
    return None


def _live(entry: _Entry) -> bool:
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
