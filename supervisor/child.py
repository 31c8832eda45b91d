"""The child's side of process supervision: the environment a
:class:`~poolserve.supervisor.process.ProcessService` passes, and the two
calls a supervised process makes.

- :func:`die_with_parent` first thing at start-up, so the child never outlives
  the supervisor (PR_SET_PDEATHSIG, then a parent check that closes the race
  with a parent that died before the prctl).
- :func:`notify_ready` once the child can do its job: writes ``READY=1`` on
  the readiness pipe (the same line format as systemd's notify protocol).

Both are no-ops, or nearly, when the process was not started by a supervisor.
Importing this module is cheap (no asyncio), for processes that fork early.
"""

from __future__ import annotations

import os
import signal
import stat

from poolserve.supervisor.linux import set_pdeathsig

READY_FD_ENV = "POOLSERVE_READY_FD"  # write end of the readiness pipe
PARENT_PID_ENV = "POOLSERVE_PARENT_PID"  # the supervisor's pid

# Exit code of a child whose parent was already gone at start-up.
EXIT_PARENT_GONE = 1


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


def notify_ready(status: str | None = None) -> bool:
    """Tells the supervisor this process is ready; returns whether it was told.

    One-shot: takes ``$POOLSERVE_READY_FD`` out of the environment (so the
    processes we start never write to a stale fd number) and closes the pipe.
    """
    raw = os.environ.pop(READY_FD_ENV, "")
    if not raw.isdigit():
        return False
    fd = int(raw)
    try:
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
            return False  # not our pipe: never write into someone else's fd
        message = (f"STATUS={_one_line(status)}\n" if status else "") + "READY=1\n"
        # One write below PIPE_BUF is atomic: the supervisor never sees half.
        os.write(fd, message.encode())
        os.close(fd)
    except OSError:
        return False  # the supervisor is gone; PDEATHSIG ends us
    return True


def _one_line(text: str) -> str:
    return " ".join(text.split())[:1000]
