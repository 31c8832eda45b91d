"""Writes made by the callbacks one read woke leave in the turn they ran in.

A writer of poolserve's (a lane's or a worker socket's :class:`Batcher`, the
router's HTTP/2 connection) queues what it is given and sends it all at the
end of the turn: ``call_soon(flush)``. That flush runs in the loop's next
turn, and every turn of an asyncio loop polls the selector first. A reply
read from a pool's lane woke its call's task (one turn later), the task
wrote the response, and the flush ran one turn after that: two turns, two
``epoll_wait`` system calls and the loop's bookkeeping, per request whenever
a process is too lightly loaded for other requests to share them (a router
of ``routers: 2`` serving a share of the calls polled 2.1 times per request
where one router polled 1.0 times).

:meth:`TurnEnd.arm` is called by whoever just scheduled the callbacks that
will write (a protocol that resolved futures or started tasks): it schedules
one flush right behind them, in the same turn, and a writer that gets
something to send while it is armed hands its flush to it (:meth:`TurnEnd.take`)
instead of scheduling its own. Nothing waits longer than before: an armed
flush is already in the loop's ready queue; a writer that finds none armed
schedules its own as it always did.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable

_BY_LOOP: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, TurnEnd] = (
    weakref.WeakKeyDictionary()
)


class TurnEnd:
    """The flushes that run right after the callbacks of this turn."""

    __slots__ = ("_armed", "_flushes", "loop")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._armed = False
        self._flushes: list[Callable[[], None]] = []

    def arm(self) -> None:
        """Runs the flushes handed over from now on right after what is already scheduled."""
        if not self._armed:
            self._armed = True
            self.loop.call_soon(self._run)

    def take(self, flush: Callable[[], None]) -> bool:
        """Whether an armed turn end will call ``flush`` (False: schedule it yourself)."""
        if self._armed:
            self._flushes.append(flush)
            return True
        return False

    def _run(self) -> None:
        self._armed = False
        flushes, self._flushes = self._flushes, []
        for flush in flushes:
            flush()


def turn_end(loop: asyncio.AbstractEventLoop) -> TurnEnd:
    """The loop's :class:`TurnEnd` (one per loop)."""
    found = _BY_LOOP.get(loop)
    if found is None:
        found = _BY_LOOP[loop] = TurnEnd(loop)
    return found
