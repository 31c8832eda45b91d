"""A job started without a task of its own (:meth:`Dispatcher.begin`): the
lane's light requests, where a task per call (its creation, two steps, the
coroutines between the lane and the future) was the largest share of the pool
server's own time per request.

It keeps what ``Dispatcher._answer`` keeps for an awaiting caller: the caller
leaves at the job's deadline (a timer answers the job then, and the queue
drops it), a cancel abandons the job (out of the queue, or its worker's reply
dropped), and either way the outcome is delivered once, or not at all after a
cancel.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from poolserve.service.poolcore.jobs import Job, Result


class Started:
    """A job in flight whose outcome goes to ``done``; :meth:`cancel` abandons it."""

    __slots__ = ("_abandon", "_cancelled", "_done", "_timer", "job")

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        job: Job,
        done: Callable[[Result | BaseException], None],
        expire: Callable[[Job], None],
        abandon: Callable[[Job, str], None],
    ) -> None:
        self.job = job
        self._done = done
        self._abandon = abandon
        self._cancelled = False
        self._timer = loop.call_at(job.deadline, expire, job)
        job.future.add_done_callback(self._finished)

    def _finished(self, future: asyncio.Future[Result]) -> None:
        self._timer.cancel()
        if self._cancelled:  # cancelled after the outcome came, before this ran
            return
        self._abandon(self.job, "it was cancelled")  # (nothing once answered, as _answer)
        error = future.exception()  # a ServingError: finish() sets nothing else
        self._done(future.result() if error is None else error)

    def cancel(self) -> None:
        """The caller is gone: the job leaves the queue (or its reply is dropped)."""
        if self._cancelled:
            return
        self._cancelled = True
        self._timer.cancel()
        self.job.future.remove_done_callback(self._finished)
        self._abandon(self.job, "it was cancelled")
