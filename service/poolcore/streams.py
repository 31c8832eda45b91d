"""Streams, the pool's side (a request to a decoupled model): its parts on
their way to the caller, the window the worker may not run past, and the
CANCEL when the caller leaves. The worker's side is :mod:`streaming`.

A stream's job runs on one worker until its final frame; each PART goes to
the caller's queue as it comes (a part for a caller that left is dropped).
The worker keeps at most ``window`` parts unacknowledged; the caller
acknowledges each part it took, half a window at a time. A stream is never
retried on another worker: parts may have gone out.

A stream holds its worker for as long as it runs, and its model's generator
(its state) lives there, so a worker cannot be taken back from a stream whose
client stopped reading. :class:`StreamShare` keeps ``reserve`` of a pool's
live workers out of its streams' reach, for the pool's other calls: a stream
starts only where that many workers are left that hold no stream, or where
no stream runs at all (streams always get one worker); the others wait in the
queue, in its order, for a stream to end.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from poolserve.service.contract.errors import ServingError
from poolserve.service.poolcore.frames import Reply, ack_frame, cancel_frame
from poolserve.service.poolcore.jobs import Job, JobState, Result, Worker, WorkerState


@dataclass(slots=True, eq=False)
class Parts:
    """A stream job's way to its caller: the parts as they come, then its end
    (a Result or a ServingError). The worker keeps at most ``window`` parts
    unacknowledged; the caller acknowledges each part it took."""

    window: int
    queue: asyncio.Queue[bytes | Result | ServingError] = field(default_factory=asyncio.Queue)
    taken: int = 0  # parts taken and not yet acknowledged to the worker
    ended: bool = False


async def next_part(parts: Parts) -> bytes | Result:
    """The next part, or the Result of the whole stream; raises its ServingError."""
    item = await parts.queue.get()
    if isinstance(item, ServingError):
        raise item
    return item


def took_part(job: Job) -> None:
    """The caller took a part. Tells the worker the parts its caller took, half
    a window at a time: a worker that waits has a whole window out, so its
    caller takes at least that many and the worker hears of them."""
    parts, worker = job.stream, job.worker
    assert parts is not None
    parts.taken += 1
    if job.state is not JobState.RUNNING:
        return
    if parts.taken < max(1, parts.window // 2):
        return
    if worker is not None and worker.current is job and worker.writer is not None:
        worker.writer.write_now(ack_frame(job.seq, parts.taken))
    parts.taken = 0


def part_came(job: Job, part: Reply) -> None:
    """A PART frame for ``job`` (a ValueError if it is no stream)."""
    if job.stream is None:
        raise ValueError(f"a stream's part for request {part.seq}, not a stream")
    if job.state is JobState.RUNNING:
        job.stream.queue.put_nowait(bytes(part.body))  # a PART's body is bytes


def cancel_stream(job: Job) -> None:
    """The caller of a running stream left: the worker closes the model's generator."""
    worker = job.worker
    if job.stream is not None and worker is not None and worker.current is job:
        assert worker.writer is not None  # it runs a job: connected
        worker.writer.write_now(cancel_frame(job.seq))


class StreamShare:
    """How many of a pool's workers its streams may hold: all but ``reserve``
    of the live ones, and at least one. ``reserve`` 0 (the default, and a pool
    that serves only decoupled models): all of them."""

    def __init__(self, workers: dict[int, Worker]) -> None:
        self.reserve = 0
        self._workers = workers  # the roster's, by pid (read only)

    def may_start(self) -> bool:
        """Whether a stream may start on a worker that holds none now."""
        if self.reserve <= 0:
            return True
        holding = free = 0
        for worker in self._workers.values():
            if worker.current is not None and worker.current.stream is not None:
                holding += 1
            elif worker.state in _TAKES_JOBS and not worker.retiring:
                free += 1
        return holding == 0 or free - 1 >= self.reserve


_TAKES_JOBS = (WorkerState.IDLE, WorkerState.BUSY)
