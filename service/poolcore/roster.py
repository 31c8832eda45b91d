"""A pool's roster: the workers it has, which of them are idle, and closing
them: all at once (the pool closes), or one once it finished what it holds
(rolling replacement: a retired worker serves the sequences it holds first).

The dispatcher places jobs on the idle workers; the watch and batch forming
read the roster, never change it.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections import deque

from poolserve.service.poolcore.jobs import Worker, WorkerState


class Roster:
    def __init__(self) -> None:
        self.workers: dict[int, Worker] = {}  # the live ones, by pid
        self.idle: deque[Worker] = deque()  # those waiting for a job

    def add(self, pid: int, sock: socket.socket, generation: int) -> Worker:
        worker = Worker(pid, sock, generation=generation)
        with contextlib.suppress(OSError):
            worker.pidfd = os.pidfd_open(pid)  # signals go to this process, never a reused pid
        self.workers[pid] = worker
        return worker

    def drop(self, worker: Worker) -> None:
        """``worker`` died: out of the roster."""
        self.workers.pop(worker.pid, None)
        self.unidle(worker)

    def unidle(self, worker: Worker) -> None:
        with contextlib.suppress(ValueError):
            self.idle.remove(worker)

    def live(self) -> int:
        """Workers that take jobs now: self-tested, not stuck, not retiring."""
        return sum(
            1
            for w in self.workers.values()
            if (w.state is WorkerState.IDLE or w.state is WorkerState.BUSY) and not w.retiring
        )

    def runs(self, tag: str) -> bool:
        """Whether a job of model ``tag`` is on a worker now (more are likely coming)."""
        return any(w.current is not None and w.current.tag == tag for w in self.workers.values())

    def retire(self, pid: int) -> bool:
        """Lets a worker finish its current job, then closes it (rolling replacement)."""
        worker = self.workers.get(pid)
        if worker is None or worker.retiring:
            return False
        worker.retiring = True
        if worker.state is WorkerState.IDLE:
            self.unidle(worker)
            if not worker.sequences:  # else it serves its sequences' jobs until they end
                self.close(worker)
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
            self.close(worker)

    def close_all(self) -> None:
        for worker in list(self.workers.values()):
            self.close(worker)

    @staticmethod
    def close(worker: Worker) -> None:
        """Closing the socket makes the worker exit (EOF); its reader then finishes.

        A worker still connecting (no transport yet) is closed by its reader once
        connected: closing the socket under a pending connect would leave the
        reader waiting on a dead, or reused, descriptor.
        """
        if worker.transport is not None:
            worker.transport.close()
        else:
            worker.retiring = True
