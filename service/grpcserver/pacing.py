"""Pacing of model control, so that RepositoryModelLoad cannot be a denial of service.

Anyone who reaches the port may send loads. Two things keep them cheap:

- :class:`Rescanner`: the repository scan that answers "is there a model of
  this name?" runs on a thread, never on an event loop, one at a time, and
  starts at most once per interval. Every caller waiting for a fresh answer
  shares the next scan, so a flood of loads for unknown names costs one scan
  per interval, whatever its size.
- :class:`Pacer` (with :func:`~poolserve.service.contract.repository.fingerprint`):
  a load of a model that is already loaded from the same settings and files
  does nothing; a real reload of one model starts at most once per interval.

Both take a clock and a sleep, so tests drive them without waiting.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

T = TypeVar("T")
Clock = Callable[[], float]
Sleep = Callable[[float], Awaitable[None]]
RunInThread = Callable[[Callable[[], T]], Awaitable[T]]


class Rescanner(Generic[T]):
    """Runs ``job`` (a repository scan) off the loop, one at a time, at most once
    per ``interval_s``; callers of :meth:`fresh` share the next run.

    :meth:`serve` is the one task that owns the runs; it must be running (in
    its owner's task group) for :meth:`fresh` to return.
    """

    def __init__(
        self,
        job: Callable[[], T],
        interval_s: float,
        *,
        clock: Clock = time.monotonic,
        sleep: Sleep = asyncio.sleep,
        run_in_thread: RunInThread[T] | None = None,
        initial: T | None = None,
    ) -> None:
        self._job = job
        self.interval_s = interval_s
        self._clock = clock
        self._sleep = sleep
        self._run_in_thread: RunInThread[T] = run_in_thread or asyncio.to_thread
        self.latest = initial
        self.latest_at = clock() if initial is not None else -math.inf
        self.runs = 0
        self._waiters: list[asyncio.Future[T]] = []
        self._wake: asyncio.Event | None = None

    def _event(self) -> asyncio.Event:
        if self._wake is None:
            self._wake = asyncio.Event()
        return self._wake

    async def fresh(self) -> T:
        """The result of a run that starts after this call (it may wait for its turn)."""
        waiter: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        self._event().set()
        return await waiter

    async def serve(self) -> None:
        """Runs until cancelled: each wake-up is one run, for every caller waiting."""
        wake = self._event()
        while True:
            await wake.wait()
            delay = self.latest_at + self.interval_s - self._clock()
            if delay > 0:
                await self._sleep(delay)  # callers arriving meanwhile join this run
            wake.clear()
            waiters = [w for w in self._waiters if not w.done()]
            self._waiters = []
            if not waiters:
                continue  # every caller went away: nothing to scan for
            self.latest_at = self._clock()
            self.runs += 1
            try:
                result = await self._run_in_thread(self._job)
            except Exception as exc:
                for waiter in waiters:
                    if not waiter.done():
                        waiter.set_exception(exc)
                continue
            self.latest = result
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_result(result)


class Pacer:
    """At most one start per key per ``interval_s``; a start that comes sooner
    waits for its turn."""

    def __init__(
        self, interval_s: float, *, clock: Clock = time.monotonic, sleep: Sleep = asyncio.sleep
    ) -> None:
        self.interval_s = interval_s
        self._clock = clock
        self._sleep = sleep
        self._started: dict[str, float] = {}

    async def turn(self, key: str) -> bool:
        """Returns once ``key`` may start (and marks it started); True if it had to wait."""
        waited = False
        while (delay := self._started.get(key, -math.inf) + self.interval_s - self._clock()) > 0:
            await self._sleep(delay)
            waited = True
        self._started[key] = self._clock()
        return waited
