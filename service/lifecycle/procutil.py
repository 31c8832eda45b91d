"""Small process facts shared by pools, zygotes and workers (Linux only)."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
from collections.abc import Callable

from poolserve.service.lifecycle.exitcodes import ExitStatus

PR_SET_NAME = 15
_libc = ctypes.CDLL(None, use_errno=True)


def set_process_name(name: str) -> None:
    _libc.prctl(PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)


def describe_status(status: int) -> str:
    """A wait status as people read it: 'exited with code 1', 'killed by SIGKILL'."""
    return ExitStatus.from_wait_status(0, status).describe()


def pss_bytes(pid: int) -> int:
    """Proportional set size of one process, from /proc/PID/smaps_rollup (0 if gone)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup", encoding="ascii") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return 0
    return 0


async def wait_exit(pid: int, timeout: float) -> None:
    """Waits for ``pid`` to exit, through its pidfd; SIGKILL after ``timeout``.

    It does not reap: the caller does (waitpid, or Popen.wait), at once.
    """
    import asyncio

    loop = asyncio.get_running_loop()
    exited = asyncio.Event()
    pidfd = os.pidfd_open(pid)
    try:
        loop.add_reader(pidfd, exited.set)
        try:
            await asyncio.wait_for(exited.wait(), timeout)
        except TimeoutError:
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            await exited.wait()
        finally:
            loop.remove_reader(pidfd)
    finally:
        os.close(pidfd)


async def wait_child(pid: int, timeout: float) -> str:
    """Waits for our child ``pid`` (SIGKILL after ``timeout``), reaps it, decodes its status."""
    await wait_exit(pid, timeout)
    _, status = os.waitpid(pid, 0)  # noqa: ASYNC222 (the pidfd said it exited: no wait)
    return describe_status(status)


def interpreter_flags() -> list[str]:
    """The host interpreter's flags (-O, -B, -X ..., -W ...), as multiprocessing passes them."""
    flags: Callable[[], list[str]] = getattr(subprocess, "_args_from_interpreter_flags", lambda: [])
    return list(flags())
