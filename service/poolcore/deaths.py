"""A dead worker's report: what it leaves (its running jobs retried once or
answered, its sequences' jobs lost), and one :class:`WorkerGone` once both
its socket closed and its exit status is known.

The socket closing is noticed at once; the exit status comes from the zygote
(it reaps the worker), in either order. A job lost with the worker is answered
only with the status, so its caller reads why (a signal, an exit code, the
reason we killed it); past ``STATUS_WAIT_S`` without one it is answered anyway.
"""

from __future__ import annotations

import asyncio
import os
from collections import deque
from collections.abc import Callable

from poolserve.service.contract.errors import DeadlineExceeded, ServingError, Unavailable
from poolserve.service.poolcore.jobs import Job, JobState, Worker, WorkerGone, finish

STATUS_WAIT_S = 1.0  # how long a dead worker's job waits for the exit status


class DeathReports:
    def __init__(
        self, name: str, on_worker_gone: Callable[[WorkerGone], None], closing: asyncio.Event
    ) -> None:
        self.name = name
        self._on_worker_gone = on_worker_gone
        self._closing = closing  # the dispatcher's: a closing pool reports no deaths
        self._dead: dict[int, Worker] = {}  # socket closed, exit status not yet known
        self._statuses: dict[int, str] = {}  # exit status known, socket not yet closed

    def leaves(
        self, worker: Worker, retry: Callable[[Job], bool], requeue: Callable[[Job], bool]
    ) -> bool:
        """Sorts the jobs of ``worker``, whose socket closed: a running job its
        own death did not doom is requeued once (``retry``), the others wait
        for the exit status; a job sent ahead, which never started, is queued
        again (``requeue``). True if a job was requeued."""
        lead, worker.current = worker.current, None
        ahead, worker.ahead = worker.ahead, deque()
        worker.lost_tag = lead.tag if lead is not None else worker.warming
        members = [] if lead is None else lead.members or [lead]
        pinned, worker.pinned = worker.pinned, deque()
        for job in pinned:  # their sequences' state died with the worker
            if job.state is JobState.QUEUED:
                job.state = JobState.RUNNING  # answered with the lost jobs
                worker.lost_jobs.append(job)
        # A job sent ahead never started (it runs only after the reply to the
        # worker's job, which did not come): it may run anywhere, even once more.
        retried = False
        for job in ahead:  # back to the front of the queue (retry priority), in order
            if job.state is JobState.RUNNING:
                if requeue(job):
                    retried = True
                else:
                    worker.lost_jobs.append(job)
        for job in members:
            if job.state is not JobState.RUNNING:
                continue
            if not worker.kill_reason and retry(job):
                retried = True
            else:
                worker.lost_jobs.append(job)  # answered once the exit status is known
        return retried

    def socket_closed(self, worker: Worker) -> None:
        """Reports ``worker`` now if the zygote already reaped it, else soon."""
        status = self._statuses.pop(worker.pid, None)
        if status is not None:
            worker.status = status
            self._report(worker)
        else:
            self._dead[worker.pid] = worker
            asyncio.get_running_loop().call_later(STATUS_WAIT_S, self._status_overdue, worker)

    def exited(self, pid: int, status: str) -> None:
        """The zygote reaped ``pid``: completes the death report if the socket closed."""
        worker = self._dead.pop(pid, None)
        if worker is None:
            self._statuses[pid] = status  # the socket has not closed yet
            return
        worker.status = status
        self._report(worker)

    def _status_overdue(self, worker: Worker) -> None:
        if self._dead.pop(worker.pid, None) is not None:
            worker.status = "exit status unknown"
            self._report(worker)

    def _report(self, worker: Worker) -> None:
        if worker.pidfd >= 0:
            os.close(worker.pidfd)
            worker.pidfd = -1
        jobs, worker.lost_jobs = worker.lost_jobs, []
        for job in jobs:
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
            if job.sequence:
                error = Unavailable(
                    f"sequence {job.sequence} of model '{job.tag}' is lost: worker pid "
                    f"{worker.pid} of pool '{self.name}' that held its state died ({why})"
                )
        finish(job, error)
