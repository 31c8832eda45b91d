"""The child's side of process supervision: the environment a
:class:`~poolserve.supervisor.process.ProcessService` passes, and the two
calls a supervised process makes.

- :func:`die_with_parent` first thing at start-up, so the child never outlives
  the supervisor (PR_SET_PDEATHSIG, then a parent check that closes the race
  with a parent that died before the prctl).
- :func:`notify_ready` once the child can do its job: writes ``READY=1`` on
  the readiness pipe (the same line format as systemd's notify protocol).
- Or :func:`take_ready_pipe` and :meth:`ReadyPipe.keep_beating` for a child
  whose supervisor watches it: ``READY=1``, then ``WATCHDOG=1`` from its event
  loop every interval, so a process that is stopped or whose loop is blocked
  is noticed (systemd's watchdog protocol, over the same pipe).

Both are no-ops, or nearly, when the process was not started by a supervisor.
Importing this module is cheap (no asyncio), for processes that fork early.
"""

from __future__ import annotations

import contextlib
import os
import signal
import stat
from collections.abc import Awaitable
from typing import TypeVar

from poolserve.service.lifecycle.linux import set_pdeathsig

READY_FD_ENV = "POOLSERVE_READY_FD"  # write end of the readiness pipe
PARENT_PID_ENV = "POOLSERVE_PARENT_PID"  # the supervisor's pid

# Exit code of a child whose parent was already gone at start-up.
EXIT_PARENT_GONE = 1


T = TypeVar("T")


def die_with_parent(parent_pid: int | None = None, signal_number: int = signal.SIGKILL) -> None:
    """Gets ``signal_number`` when the parent dies; exits now if it already has.

    ``parent_pid`` defaults to ``$POOLSERVE_PARENT_PID``, which is taken out of
    the environment: it names our supervisor, and a process we start must
    never compare its own parent with it. A process that forks its own
    workers (a zygote) passes its pid to them explicitly.
    """
    raw = os.environ.pop(PARENT_PID_ENV, "")
    if parent_pid is None:
        parent_pid = int(raw) if raw.isdigit() else None
    set_pdeathsig(signal_number)
    # The parent may have died between our fork and the prctl: we were then
    # reparented already, and the signal will never come.
    if parent_pid is not None and os.getppid() != parent_pid:
        os._exit(EXIT_PARENT_GONE)


class ReadyPipe:
    """The write end of the readiness pipe, kept open for heartbeats."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def ready(self, status: str | None = None) -> bool:
        message = (f"STATUS={_one_line(status)}\n" if status else "") + "READY=1\n"
        return self._write(message)

    def beat(self) -> bool:
        return self._write("WATCHDOG=1\n")

    async def keep_beating(self, interval_s: float) -> None:
        """Beats every ``interval_s`` from this event loop, until cancelled: a
        beat that does not come means the loop did not turn."""
        import asyncio  # here: importing this module stays cheap for early forks

        while True:
            self.beat()
            await asyncio.sleep(interval_s)

    def _write(self, message: str) -> bool:
        # One write below PIPE_BUF is atomic: the supervisor never sees half. The
        # pipe is non-blocking: a beat the supervisor has not read yet is dropped
        # rather than stall our event loop.
        try:
            os.write(self.fd, message.encode())
        except OSError:
            return False  # full, or the supervisor is gone (PDEATHSIG ends us)
        return True

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)


async def beating(main: Awaitable[T], pipe: ReadyPipe | None, interval_s: float) -> T:
    """Runs ``main`` while a heartbeat goes to the supervisor from this event loop
    (its watchdog kills a process whose loop stops turning)."""
    if pipe is None:
        return await main
    import asyncio  # here: importing this module stays cheap for early forks

    # Not a TaskGroup: it would wrap a ConfigError from main in an ExceptionGroup.
    beat = asyncio.create_task(pipe.keep_beating(interval_s), name="heartbeat")
    try:
        return await main
    finally:
        beat.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await beat


def announce_ready(pipe: ReadyPipe | None, status: str) -> None:
    """``READY=1`` with ``status`` on the readiness pipe, if there is one."""
    if pipe is not None:
        pipe.ready(status)


def take_ready_pipe() -> ReadyPipe | None:
    """The readiness pipe our supervisor passed, or None.

    Takes ``$POOLSERVE_READY_FD`` out of the environment, so the processes we
    start never write to a stale fd number.
    """
    raw = os.environ.pop(READY_FD_ENV, "")
    if not raw.isdigit():
        return None
    fd = int(raw)
    try:
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
            return None  # not our pipe: never write into someone else's fd
        os.set_blocking(fd, False)
    except OSError:
        return None
    return ReadyPipe(fd)


def notify_ready(status: str | None = None) -> bool:
    """Tells the supervisor this process is ready; returns whether it was told.

    One-shot: takes the pipe (:func:`take_ready_pipe`) and closes it.
    """
    pipe = take_ready_pipe()
    if pipe is None:
        return False
    told = pipe.ready(status)
    pipe.close()
    return told


def _one_line(text: str) -> str:
    return " ".join(text.split())[:1000]
