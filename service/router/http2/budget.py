"""Request bytes the router's own HTTP/2 port holds, per connection and in total.

A request's bytes are counted from the DATA frame that brings them until the
call no longer holds them: its handler returned (the request was forwarded
and answered; the reply is counted from then by ``max_unread_reply_bytes``)
or the call ended. A client that sends large calls and never reads their
replies keeps its handlers waiting, and each holds its whole request: 8
connections of 32 such 8 MiB calls were 2.6 GiB in the router (issue 42 §1).

Past ``max_request_bytes_held`` for its connection, or past
``max_request_bytes_held_total`` for all while the connection holds at least
:data:`SMALL` (connections of small calls are not held back by others'
bytes), a connection's window is not given back (the connection's and its
streams': the client waits, not the router) and its new streams are refused
with RESOURCE_EXHAUSTED naming the setting. Windows are given back as bytes
are released, on any connection (the total's waiters).

The connection's window is given back only while the client may send all
of it (16 MiB) within the bounds, so a connection holds at most
``max_request_bytes_held``, and all of them ``max_request_bytes_held_total``
plus a window for each connection that was under :data:`SMALL`.

One request always comes: a connection whose bytes are all one call's is
not held back by its own bound, so a request of up to ``max_message_size``
arrives whatever the setting; and while every byte held by all connections
is in requests still coming (nothing a handler holds would be released),
one connection (the first to ask) is not held back by the total. Requests
of one connection that together pass its bound before any of them is whole
wait for one of its calls to end (their deadline), as before.

Once :data:`TRIM_AFTER` (or a connection's bound) was held and then no
request byte came for :data:`IDLE_S`, malloc is asked to give the freed
memory back (at most once per :data:`TRIM_EVERY_S`, and again after each
wait of :data:`AGAIN_S` while still none came): requests and replies
under 16 MiB come from the heap (limits.return_large_frees), whose free
chunks glibc returns only from its top, and the heap trimmer
(limits.HeapTrimmer) waits 10 s between trims. Six reps of 3 x 16 concurrent
15 MiB calls with short deadlines left the router 100 to 250 MiB larger
after each (issue 42 §4); a router under steady load is not trimmed (a
request comes within IDLE_S), so its buffers are reused.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from poolserve.service.router.http2.connection import Http2Connection

SMALL = 1 << 20  # a connection holding less is not held back by the total bound
TRIM_AFTER = 64 << 20  # held at once: freed memory is given back when all is released
TRIM_EVERY_S = 1.0
IDLE_S = 0.5  # no request byte for this long after TRIM_AFTER was held: trimmed
# and again after each of these, while still no request came: what the last calls'
# ends free later (replies a loaded pool answers late, connections); idle slabs
# go by themselves (slab.IDLE_S)
AGAIN_S = (2.0, 5.0, 15.0)
PER_CONNECTION = "max_request_bytes_held"
TOTAL = "max_request_bytes_held_total"


class Holder(Protocol):
    """A call as the budget sees it."""

    held: int  # request bytes it holds
    partial: int  # of those, in a message still coming


class RequestBudget:
    """The request bytes held by one router's HTTP/2 connections."""

    def __init__(
        self,
        per_connection: int,
        total: int,
        trim: Callable[[], object] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.per_connection = per_connection
        self.total_limit = total
        self.trim = trim
        self.clock = clock
        self.total = 0
        self.partial = 0  # of the total, in messages still coming
        self.peak = 0  # the most held since the last trim
        self.withheld = 0  # windows not given back because of a bound (a count, for tests)
        self.refused = 0  # streams refused past a bound
        self.waiting: dict[Http2Connection, None] = {}  # windows withheld, to look at again
        self.going_on: Http2Connection | None = None  # see _goes_on
        self._trimmed_at = -TRIM_EVERY_S
        self._timer: asyncio.TimerHandle | None = None
        self.arrivals = 0  # times request bytes came (idleness, for the trim)
        self.trimmed = 0  # times freed memory was given back
        self._waking = False

    def change(self, conn: Http2Connection, call: Holder, held: int, partial: int) -> None:
        """``call`` holds ``held`` more bytes (less when negative), ``partial`` more
        of them in a message still coming."""
        was = call.held
        call.held += held
        call.partial += partial
        conn.held += held
        conn.partial += partial
        conn.holders += (call.held > 0) - (was > 0)
        self.total += held
        self.partial += partial
        if held >= 0:
            if held:
                self.arrivals += 1
                self.peak = max(self.peak, self.total)
            return
        if self.waiting:
            self._wake()
        if self.total == 0 and self.peak >= min(TRIM_AFTER, self.per_connection):
            self._when_idle()

    def past(self, conn: Http2Connection, room: int = 0) -> str:
        """The setting ``conn`` would be past with ``room`` more bytes ('' when
        within both, or when it is the one that goes on: see the module)."""
        if conn.holders > 1 and conn.held + room > self.per_connection:
            return PER_CONNECTION  # (one call alone is not held back: its request comes)
        if self.total + room > self.total_limit and conn.held >= SMALL:
            if self.total == self.partial and self._goes_on(conn):
                return ""  # nothing held would be released: one connection goes on
            return TOTAL
        return ""

    def _goes_on(self, conn: Http2Connection) -> bool:
        """Whether ``conn`` is the one connection whose requests go on while
        every byte held is in requests still coming (the first to ask)."""
        chosen = self.going_on
        if chosen is None or chosen.closed or not chosen.partial:
            self.going_on = chosen = conn
        return chosen is conn

    def window_open(self, conn: Http2Connection, window: int) -> bool:
        """Whether the connection's window may be given back: whether the
        client may send a whole ``window`` more within the bounds."""
        if not self.past(conn, window):
            return True
        self._wait(conn)
        return False

    def may_grant(self, conn: Http2Connection, call: Holder) -> bool:
        """Whether ``call``'s stream may be given back its window now."""
        if not self.past(conn):
            return True
        self._wait(conn)
        return False

    def refusal(self, conn: Http2Connection) -> str:
        """Why a new stream of ``conn`` is refused ('' when it is not)."""
        setting = self.past(conn)
        if not setting:
            return ""
        self.refused += 1
        if setting == PER_CONNECTION:
            whose, held, limit = "this connection", conn.held, self.per_connection
        else:
            whose, held, limit = "all connections", self.total, self.total_limit
        return (
            f"the router holds {held} bytes of requests for {whose} ({setting} is {limit}): "
            "wait for calls in flight to end before sending more"
        )

    def forget(self, conn: Http2Connection) -> None:
        self.waiting.pop(conn, None)
        if self.going_on is conn:
            self.going_on = None

    def _wait(self, conn: Http2Connection) -> None:
        self.withheld += 1
        self.waiting[conn] = None

    def _wake(self) -> None:
        """Bytes were released: the connections waiting get their windows, as far
        as the bounds allow (a connection still past its bound waits again)."""
        if self._waking:
            return
        self._waking = True
        try:
            waiting, self.waiting = self.waiting, {}
            for conn in waiting:
                conn.resume_window()
        finally:
            self._waking = False

    def _when_idle(self) -> None:
        """Gives freed memory back once no request byte came for :data:`IDLE_S`
        (the replies of the last calls have gone meanwhile); not under load."""
        if self.trim is None or self._timer is not None:
            return
        wait = max(IDLE_S, self._trimmed_at + TRIM_EVERY_S - self.clock())
        self._timer = asyncio.get_running_loop().call_later(wait, self._idle, self.arrivals)

    def _idle(self, arrivals: int, again: int = 0) -> None:
        self._timer = None
        if self.total:
            return  # busy again: the next release of everything looks again
        if self.arrivals != arrivals:  # requests came and went meanwhile
            self._when_idle()
            return
        assert self.trim is not None
        self._trimmed_at = self.clock()
        self.peak = 0
        self.trimmed += 1
        self.trim()
        if again < len(AGAIN_S):  # what the last calls' ends free later: look again
            loop = asyncio.get_running_loop()
            self._timer = loop.call_later(AGAIN_S[again], self._idle, arrivals, again + 1)
