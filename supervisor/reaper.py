"""The root's duty toward processes it did not start: as the tree's child
subreaper, it inherits every orphan below it and must reap them, without
stealing the exit status of the children a ProcessService waits for.

Design: :data:`OWNED_PIDS` lists the pids whose owner reaps them itself. On
SIGCHLD the :class:`OrphanReaper` peeks at the next exited child with
``waitid(P_ALL, WNOHANG | WNOWAIT)``; a pid nobody owns is reaped, an owned
one stops the scan (its owner reaps it, then releases the pid, which triggers
a new scan). Signal handlers only schedule work: the scan runs in the loop,
and it loops until nothing is left, because SIGCHLDs coalesce.

Other code in the root process must not spawn processes outside this scheme
(``subprocess.run`` would lose its exit status to the reaper).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import Callable
from types import TracebackType

from poolserve.service.lifecycle.exitcodes import ExitStatus
from poolserve.service.lifecycle.linux import set_child_subreaper
from poolserve.supervisor.events import EventHook, OrphanReaped

log = logging.getLogger(__name__)


class OwnedPids:
    """Child pids that their owner reaps itself.

    Process-wide by nature (see :data:`OWNED_PIDS`): ``waitpid`` is.
    """

    def __init__(self) -> None:
        self._pids: set[int] = set()
        self._listeners: list[Callable[[], None]] = []

    def __contains__(self, pid: object) -> bool:
        return pid in self._pids

    def add(self, pid: int) -> None:
        self._pids.add(pid)

    def release(self, pid: int) -> None:
        """Call after reaping ``pid``: orphans queued behind it can now be seen."""
        self._pids.discard(pid)
        for listener in list(self._listeners):
            listener()

    def subscribe(self, listener: Callable[[], None]) -> Callable[[], None]:
        """Calls ``listener`` after each release; returns the unsubscribe call."""
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener)


# The kernel keeps one child table per process, so the list of children
# with an owner is one per process too.
OWNED_PIDS = OwnedPids()


def become_subreaper() -> None:
    """Makes orphans below us reparent to us rather than to PID 1.

    Call once in the root process (``poolserve serve``) before starting
    children, and run an :class:`OrphanReaper` so they do not stay zombies.
    """
    set_child_subreaper(True)


class OrphanReaper:
    """Reaps exited children nobody owns, on every SIGCHLD.

    Use as ``async with OrphanReaper(): ...`` in the root; it installs a
    SIGCHLD handler on the running loop for its lifetime.
    """

    def __init__(self, *, owned: OwnedPids = OWNED_PIDS, events: EventHook | None = None) -> None:
        self._owned = owned
        self._events = events
        self._loop: asyncio.AbstractEventLoop | None = None
        self._unsubscribe: Callable[[], None] | None = None

    def reap(self) -> list[ExitStatus]:
        """Reaps every exited orphan that is not queued behind an owned child."""
        reaped: list[ExitStatus] = []
        while True:
            try:
                peeked = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                break  # no children at all
            if peeked is None or peeked.si_pid == 0:
                break  # none has exited
            if peeked.si_pid in self._owned:
                break  # its owner reaps it, then release() scans again
            try:
                pid, status = os.waitpid(peeked.si_pid, os.WNOHANG)
            except ChildProcessError:
                continue  # reaped meanwhile by someone else
            if pid == 0:
                break
            exit_status = ExitStatus.from_wait_status(pid, status)
            reaped.append(exit_status)
            self._emit(OrphanReaped(pid, exit_status.describe()))
        return reaped

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._loop = loop
        loop.add_signal_handler(signal.SIGCHLD, self._schedule)
        self._unsubscribe = self._owned.subscribe(self._schedule)
        self.reap()  # orphans that exited before the handler was installed

    def close(self) -> None:
        if self._loop is not None:
            self._loop.remove_signal_handler(signal.SIGCHLD)
            self._loop = None
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None

    async def __aenter__(self) -> OrphanReaper:
        self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def _schedule(self) -> None:
        # A signal handler and release() both only schedule the scan.
        if self._loop is not None:
            self._loop.call_soon(self.reap)

    def _emit(self, event: OrphanReaped) -> None:
        if self._events is None:
            log.info("%s", event)
            return
        try:
            self._events(event)
        except Exception:
            log.exception("event hook failed on %r", event)
