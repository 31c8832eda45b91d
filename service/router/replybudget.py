"""Reply bytes the router holds for clients that have not read them.

A unary call in grpc.aio ends (its done callbacks run) only once the client
has taken the whole reply through HTTP/2 flow control, or has gone. Until
then the router holds the reply twice (grpc core's copy and grpc.aio's) and
the call's request too. A client that sends large calls and never reads the
answers would make the router hold memory without bound.

So the router counts the bytes of each large reply from the moment it hands
it to grpc until the call ends, per client connection (grpc's peer string:
address and port) and in total. A reply that would take its connection past
``max_unread_reply_bytes`` (or all of them past
``max_unread_reply_bytes_total``) is not handed to grpc yet: it waits until
enough of what is held has been read. A client that reads promptly only
waits for its own earlier replies to go out, at any concurrency (8 threads
sending 9 MiB echo calls on one connection are 72 MiB of replies in flight,
more than the 32 MiB a connection may hold; issue 28 §11). A connection that
reads none of its held replies for ``unread_reply_grace_s`` (for the total
bound: while no connection reads any) is not reading: its waiting replies
are not sent, their calls end with RESOURCE_EXHAUSTED, and from then on,
while that connection still holds replies, its new calls end so at once,
before any work. With a grace of 0, a reply past a bound is refused at once. A waiting reply
is not counted: a connection that does not read makes the router hold, on
top of its bound, at most the replies of the calls it has in flight
(max_concurrent_streams) for one grace, as it held their requests before.
On the router's own HTTP/2 a waiting reply is counted with its call's
request (``max_request_bytes_held``, http2/budget.py) until the handler returns.
The total bound holds back large replies only, so that clients who read keep
their small calls. One reply is always let through when nothing is held, so
a reply of up to max_message_size can always be sent.

Once a refused call has ended (at most once a second), and when everything
held is released after a bound was reached, the router asks malloc to give
freed memory back (``give_back``): what grpc core's many small buffers leave
behind would stay in malloc's arenas otherwise.

Replies under :data:`TRACKED_REPLY` are not counted: they cost the hot path
nothing, and a connection can hold at most max_concurrent_streams of them.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import grpc

from poolserve.service.contract.errors import QueueFull

TRACKED_REPLY = 64 * 1024
GIVE_BACK_EVERY_S = 1.0


class RepliesUnread(QueueFull):
    """RESOURCE_EXHAUSTED: a client is not reading the replies it asked for."""


class Wait(Exception):
    """The reply does not fit yet, but its readers are reading: it waits, until
    a release or, with none, until ``until`` (then it is judged again)."""

    def __init__(self, until: float) -> None:
        super().__init__(until)
        self.until = until


class ReplyBudget:
    def __init__(
        self,
        per_connection: int,
        total: int,
        give_back: Callable[[], object] | None = None,
        clock: Callable[[], float] = time.monotonic,
        grace: float = 0.0,
    ) -> None:
        self.per_connection = per_connection
        self.total_limit = total
        self.give_back = give_back
        self.clock = clock
        self.grace = grace
        self.read_at: dict[str, float] = {}  # per peer holding replies: its last release
        self.any_read_at = clock()  # the last release of any peer
        self._released = asyncio.Event()  # set (and replaced) at each release
        self._gave_back_at = -GIVE_BACK_EVERY_S
        self.held: dict[str, int] = {}
        self.total = 0
        self.pressed = False  # a bound was reached since everything was last released
        self.full: set[str] = set()  # peers with a reply refused, still holding others

    def admit(self, peer: str) -> None:
        """Refuses a new call while its connection is at its bound. (The total
        bound is applied to replies only: calls with small answers still pass.)"""
        held = self.held.get(peer, 0)
        if held >= self.per_connection or peer in self.full:
            raise self._refusal(held, "this connection", "max_unread_reply_bytes")

    def hold(self, peer: str, size: int, since: float | None = None) -> None:
        """Counts ``size`` bytes for ``peer`` until :meth:`release`; raises, counting
        nothing, when that would pass a bound. With ``since`` (when the reply began
        to wait) it raises only once the bound's readers have read nothing for
        ``grace`` since then; before that it raises :class:`Wait`."""
        held = self.held.get(peer, 0)
        if held and held + size > self.per_connection:
            if since is not None and self._reading(self.read_at.get(peer, since), since):
                raise Wait(max(self.read_at.get(peer, since), since) + self.grace)
            self.full.add(peer)
            self.pressed = True
            raise self._refusal(held, "this connection", "max_unread_reply_bytes")
        if self.total and self.total + size > self.total_limit:
            if since is not None and self._reading(self.any_read_at, since):
                raise Wait(max(self.any_read_at, since) + self.grace)
            self.pressed = True
            raise self._refusal(self.total, "all connections", "max_unread_reply_bytes_total")
        if not held:
            self.read_at[peer] = self.clock()  # its grace starts with its first reply
        self.held[peer] = held + size
        self.total += size
        self.pressed = self.pressed or held + size >= self.per_connection

    def _reading(self, read_at: float, since: float) -> bool:
        """Whether a reply waiting since ``since`` may wait on: something was read
        (released) within the grace, counted from its wait at the earliest."""
        return self.clock() - max(read_at, since) < self.grace

    async def reserve(
        self, peer: str, size: int, waits: Callable[[int], object] | None = None
    ) -> None:
        """:meth:`hold`, waiting while the bound's readers read (see the module);
        ``waits`` is told the size once, when the reply has to wait."""
        since = self.clock()
        while True:
            try:
                self.hold(peer, size, since)
                return
            except Wait as wait:
                until = wait.until
            if waits is not None:
                waits(size)
                waits = None
            try:
                async with asyncio.timeout(max(0.0, until - self.clock())):
                    await self._released.wait()
            except TimeoutError:
                pass  # judged again: refused unless something was read meanwhile

    def release(self, peer: str, size: int) -> None:
        left = self.held.get(peer, 0) - size
        self.full.discard(peer)  # it read (or left): let it try again
        now = self.clock()
        if left > 0:
            self.held[peer] = left
            self.read_at[peer] = now
        else:
            self.held.pop(peer, None)
            self.read_at.pop(peer, None)
        self.any_read_at = now
        self.total -= size
        self._released.set()  # the replies waiting look again
        self._released = asyncio.Event()
        if self.total == 0 and self.pressed:
            self.pressed = False
            self._give_back(force=True)

    def _give_back(self, force: bool = False) -> None:
        now = self.clock()
        if self.give_back is not None and (force or now - self._gave_back_at >= GIVE_BACK_EVERY_S):
            self._gave_back_at = now
            self.give_back()

    def check(self, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        """:meth:`admit` for this call's connection."""
        try:
            self.admit(context.peer())
        except RepliesUnread:
            self._after(context, self._give_back)
            raise

    async def track(self, context: grpc.aio.ServicerContext[Any, Any], size: int) -> None:
        """Holds a reply of ``size`` bytes for this call until the call ends,
        once it fits (:meth:`reserve`)."""
        peer = context.peer()
        try:
            # the router's own HTTP/2 counts a waiting reply with its call's request
            await self.reserve(peer, size, getattr(context, "reply_waits", None))
        except RepliesUnread:
            self._after(context, self._give_back)
            raise
        self._after(context, lambda: self.release(peer, size))

    @staticmethod
    def _after(context: grpc.aio.ServicerContext[Any, Any], action: Callable[[], None]) -> None:
        # (the stubs type the callback as a private class no function can match)
        context.add_done_callback(lambda _: action())  # type: ignore[arg-type]

    def _refusal(self, held: int, whose: str, setting: str) -> RepliesUnread:
        limit = self.per_connection if setting == "max_unread_reply_bytes" else self.total_limit
        return RepliesUnread(
            f"the router holds {held} bytes of replies that {whose} has not read yet "
            f"({setting} is {limit}): read the replies before sending more calls"
        )
