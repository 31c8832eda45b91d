"""Time as the supervision tree sees it: a monotonic reading and an async sleep.

Everything that waits (restart backoff, the failure pause, stop timeouts, the
systemd watchdog) takes a :class:`Clock`, so tests drive time with
:class:`FakeClock` instead of sleeping.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from typing import Any, Protocol


class Clock(Protocol):
    def monotonic(self) -> float: ...

    async def sleep(self, seconds: float) -> None: ...


class RealClock:
    """The process's monotonic clock and the event loop's timers."""

    def monotonic(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(max(0.0, seconds))


class FakeClock:
    """A clock that only moves when a test calls :meth:`advance`.

    ``sleep`` parks the caller until the fake time reaches its deadline. Tests
    wait for the code under test to be parked with :meth:`wait_for_sleepers`
    (a handshake, not a real sleep) and then move time forward.
    """

    def __init__(self, start: float = 0.0) -> None:
        self._now = start
        self._seq = itertools.count()
        # (deadline, tie-breaker, future): the heap pops the earliest sleeper.
        self._sleepers: list[tuple[float, int, asyncio.Future[None]]] = []
        self._watchers: list[asyncio.Future[None]] = []

    def monotonic(self) -> float:
        return self._now

    async def sleep(self, seconds: float) -> None:
        if seconds <= 0:
            await asyncio.sleep(0)
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._sleepers, (self._now + seconds, next(self._seq), future))
        self._wake_watchers()
        await future

    @property
    def sleepers(self) -> int:
        """How many sleeps are pending (cancelled ones no longer count)."""
        return sum(1 for _, _, future in self._sleepers if not future.done())

    def next_deadline(self) -> float | None:
        pending = [deadline for deadline, _, future in self._sleepers if not future.done()]
        return min(pending, default=None)

    def advance(self, seconds: float) -> None:
        """Moves time forward and wakes every sleeper whose deadline has come."""
        self._now += seconds
        while self._sleepers and self._sleepers[0][0] <= self._now:
            _, _, future = heapq.heappop(self._sleepers)
            if not future.done():
                future.set_result(None)

    def advance_to_next(self) -> float:
        """Jumps to the earliest pending deadline; returns how far time moved."""
        deadline = self.next_deadline()
        if deadline is None:
            raise RuntimeError("FakeClock.advance_to_next: nobody is sleeping")
        step = max(0.0, deadline - self._now)
        self.advance(step)
        return step

    async def wait_for_sleepers(self, count: int = 1) -> None:
        """Returns once at least ``count`` sleeps are pending."""
        while self.sleepers < count:
            watcher: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._watchers.append(watcher)
            try:
                await watcher
            finally:
                if watcher in self._watchers:
                    self._watchers.remove(watcher)

    def _wake_watchers(self) -> None:
        watchers, self._watchers = self._watchers, []
        for watcher in watchers:
            if not watcher.done():
                watcher.set_result(None)


async def wait_done(clock: Clock, future: asyncio.Future[Any], seconds: float) -> bool:
    """Waits until ``future`` is done or ``seconds`` of ``clock`` have passed.

    Never cancels ``future``; returns whether it is done. The timer task is
    always awaited, so nothing is left behind.
    """
    if future.done():
        return True
    timer = asyncio.ensure_future(clock.sleep(seconds))
    try:
        await asyncio.wait({future, timer}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        timer.cancel()
        await asyncio.wait({timer})
    return future.done()
