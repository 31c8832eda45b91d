"""Small process facts shared by pools, zygotes and workers (Linux only)."""

from __future__ import annotations

import ctypes
import os
import signal

PR_SET_PDEATHSIG = 1
PR_SET_NAME = 15
_libc = ctypes.CDLL(None, use_errno=True)


def set_pdeathsig(sig: int = signal.SIGKILL) -> None:
    if _libc.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def die_with(parent_pid: int, sig: int = signal.SIGKILL) -> None:
    """Dies with ``parent_pid``; the check after prctl closes the race with its exit."""
    set_pdeathsig(sig)
    if os.getppid() != parent_pid:
        os._exit(1)


def set_process_name(name: str) -> None:
    _libc.prctl(PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)


def describe_status(status: int) -> str:
    """A wait status as people read it: 'exited with code 1', 'killed by SIGKILL'."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = f"signal {sig}"
        return f"killed by {name}"
    if os.WIFEXITED(status):
        return f"exited with code {os.WEXITSTATUS(status)}"
    return f"wait status {status}"


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


READY_FD_ENV = "POOLSERVE_READY_FD"
PARENT_PID_ENV = "POOLSERVE_PARENT_PID"


def die_with_parent() -> None:
    """In a supervised child: die with the supervisor that started us."""
    raw = os.environ.get(PARENT_PID_ENV)
    if raw:
        die_with(int(raw))


def take_ready_fd() -> int | None:
    """Removes the readiness fd from the environment (so grandchildren never see it)."""
    raw = os.environ.pop(READY_FD_ENV, None)
    return int(raw) if raw else None


def notify_ready(fd: int | None, status: str | None = None) -> None:
    """Tells the supervisor we are ready (the readiness handshake), then closes the fd."""
    if fd is None:
        return
    message = "READY=1\n" + (f"STATUS={status}\n" if status else "")
    try:
        os.write(fd, message.encode())
        os.close(fd)
    except OSError:
        pass  # the supervisor is gone; PDEATHSIG will end us


async def wait_child(pid: int, timeout: float) -> str:
    """Waits for our child ``pid`` through its pidfd; SIGKILL after ``timeout``. Reaps it."""
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
    _, status = os.waitpid(pid, 0)  # noqa: ASYNC222 (the pidfd said it exited: no wait)
    return describe_status(status)
