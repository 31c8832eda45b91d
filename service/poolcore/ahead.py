"""A worker's next jobs, sent before it answered the one it runs.

Measured on a 2-core VM (bench/profile_path.py): a process that sleeps on a
socket and is woken from another CPU spends 20-60 microseconds of CPU on it,
as much as a light model's whole prediction. A worker that answered a light
job found its next one only after the pool server had read the reply and
written the next job: a sleep and a wake per request. With its next job
already in its socket, a busy worker goes from one reply to the next request
without sleeping, and the pool's write does not have to wake it.

One job ahead was not enough on a loaded 2-core host: a light job (an echo,
about 30 microseconds of Python) ends before the pool server, which shares
the cores with the router and the other worker, has read the reply and sent
the next one, and the worker still slept on most requests (0.9 context
switches per request). With up to :data:`AHEAD_JOBS` ahead it sleeps on
0.6, and the tree spends about a tenth less CPU per light request
(bench/profile_path.py, docs/request-path.md).

What goes ahead, and where:

- a job that runs alone (not batched, not a stream, not a sequence's, not a
  notice) of a model whose mean service time, as the dispatcher measures it,
  is at most :data:`AHEAD_MAX_S`: a job sent ahead waits behind its worker's
  job and those ahead of it, about that long each, where another worker
  might have taken it a little sooner;
- to a worker that runs such a job, is not retiring, has no sequence job
  waiting and holds fewer than :data:`AHEAD_JOBS` ahead: of those, the one
  with the fewest ahead, then the one whose job started first;
- a new arrival only when the queue is empty, else the queue's head when a
  worker starts a job (as many as it takes): the queue's order (priority,
  deadline) decides what goes ahead, as it decides what starts.

What stays as for any job on a worker: the queue bound (a job ahead is not
queued, as a running one), the deadline (the pool answers the caller at it;
the AHEAD frame carries it and the worker does not start the job once it
passed), a cancel (the reply is dropped; a light job already on the worker
may still run, as a started one does), a death (the jobs ahead never
started: they go back to the front of the queue in their order, even those
that may not run twice).
"""

from __future__ import annotations

from collections.abc import Callable

from poolserve.service.poolcore.jobs import Job, Worker, WorkerState

AHEAD_MAX_S = 0.005  # a model this fast (mean service time) has its jobs sent ahead
AHEAD_JOBS = 3  # jobs a worker holds ahead at most


def runs_alone(job: Job) -> bool:
    """A job that is not batched, not a stream, not a sequence's, not a notice."""
    return (
        job.batch is None
        and job.stream is None
        and job.members is None
        and not job.pinned
        and not job.notice
    )


class SendAhead:
    """Which jobs go ahead, and to which worker."""

    def __init__(
        self, service_mean: Callable[[str], float | None], workers: dict[int, Worker]
    ) -> None:
        self._service_mean = service_mean
        self._workers = workers  # the roster's live workers, by pid

    def light(self, job: Job) -> bool:
        """Whether ``job`` may wait on a worker behind another light job."""
        if not runs_alone(job):
            return False
        mean = self._service_mean(job.tag)
        return mean is not None and mean <= AHEAD_MAX_S

    def takes(self, worker: Worker) -> bool:
        """Whether ``worker`` takes a job ahead now."""
        current = worker.current
        return (
            len(worker.ahead) < AHEAD_JOBS
            and current is not None
            and worker.state is WorkerState.BUSY
            and not worker.retiring
            and not worker.pinned
            and self.light(current)
        )

    def worker_for(self, job: Job) -> Worker | None:
        """The busy worker ``job`` goes ahead to (of those with the fewest jobs
        ahead, the one whose job started first); None: it does not go ahead."""
        if not self.light(job):
            return None
        found: Worker | None = None
        for worker in self._workers.values():
            if self.takes(worker) and (
                found is None
                or (len(worker.ahead), worker.current.started)  # type: ignore[union-attr]
                < (len(found.ahead), found.current.started)  # type: ignore[union-attr]
            ):
                found = worker
        return found
