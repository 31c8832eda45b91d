"""A child OS process as a supervised service: spawn, readiness, watch, stop,
reap, and the exit code turned into the supervisor's next move.

- Spawn: ``subprocess.Popen`` in its own process group (``process_group=0``)
  and *without* a pre-exec hook, so CPython takes its vfork+exec path: the
  new process runs no Python code and no ``pthread_atfork`` handler before
  it execs. That is what makes spawning safe in a process that has threads
  (the root serves its gRPC control socket, and grpc.aio starts threads): a
  pre-exec hook means a real ``fork()`` that runs gRPC's fork handlers and
  Python code in a copy of a threaded process, which can deadlock (with
  ``GRPC_ENABLE_FORK_SUPPORT=1`` it does). PR_SET_PDEATHSIG=SIGKILL is set
  instead by a tiny exec trampoline (:data:`TRAMPOLINE`): a ``python -I -S``
  that makes the prctl, checks that its parent is still us, and execs the
  program (the setting survives exec). ``POOLSERVE_PARENT_PID`` lets the
  program close the same race again with
  :func:`~poolserve.service.lifecycle.child.die_with_parent`. Call
  :meth:`ProcessService.serve` from the main thread: PDEATHSIG fires when the
  spawning *thread* exits.
- Readiness: a pipe whose write end is ``$POOLSERVE_READY_FD`` in the child;
  the child writes ``READY=1\\n`` (and may write ``STATUS=...\\n`` lines).
- Watchdog (``watchdog_timeout``): once ready, the child writes ``WATCHDOG=1\\n``
  on the same pipe from its event loop; a child silent for that long (stopped,
  or its loop blocked) is killed (SIGKILL to the group) and ends as a failure.
- Watch: a pidfd in the event loop; then ``waitpid(pid, 0)`` reaps exactly
  our child. Before that reap, SIGKILL goes to the rest of the process group:
  the unreaped leader still holds the group id, so it cannot name anyone else.
- Stop (on cancellation): SIGTERM to the group, ``stop_timeout``, SIGKILL to
  the group; a second cancellation skips the grace. Always reaped.
- Exit code: see :mod:`poolserve.service.lifecycle.exitcodes`.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import logging
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Final

from poolserve.service.lifecycle.child import PARENT_PID_ENV, READY_FD_ENV
from poolserve.service.lifecycle.exitcodes import (
    EXIT_CONFIG,
    EXIT_OK,
    EXIT_UNRECOVERABLE,
    ExitStatus,
)
from poolserve.supervisor.clock import Clock, RealClock, wait_done
from poolserve.supervisor.reaper import OWNED_PIDS, OwnedPids
from poolserve.supervisor.relay import LineSink, PipeRelay
from poolserve.supervisor.spec import (
    ChildSpec,
    Restart,
    SpawnReporter,
    TerminateTree,
    Unrecoverable,
)
from poolserve.supervisor.tree import KILL_GRACE

log = logging.getLogger(__name__)


class ChildFailed(Exception):
    """A child process ended in a way that counts as a failure."""

    def __init__(self, description: str, status: ExitStatus) -> None:
        super().__init__(description)
        self.status = status


# What an exit code makes the service raise: a factory taking the
# description ("pool:a (pid 12) exited with code 3 (...)"), or None for a
# normal return. Exit codes not listed, and deaths by signal, raise ChildFailed.
ExitAction = Callable[[str], Exception] | None

DEFAULT_EXIT_CODES: Final[Mapping[int, ExitAction]] = {
    EXIT_OK: None,
    EXIT_CONFIG: functools.partial(TerminateTree, EXIT_CONFIG),
    EXIT_UNRECOVERABLE: Unrecoverable,
}

_MEANINGS: Final[Mapping[int, str]] = {
    EXIT_CONFIG: "invalid configuration",
    EXIT_UNRECOVERABLE: "cannot work; not restarting",
}

_NO_DEFAULT = object()
_MAX_LINE = 4096  # a readiness line longer than this is garbage, dropped


class ProcessService:
    """Runs ``argv`` as a supervised child process (see the module docstring).

    ``env`` replaces the inherited environment when given (like Popen); the
    two ``POOLSERVE_*`` variables are always added. One instance runs one
    process at a time; a :class:`ChildSpec` factory makes one per start.
    """

    def __init__(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
        stop_timeout: float = 10.0,
        exit_codes: Mapping[int, ExitAction] = DEFAULT_EXIT_CODES,
        name: str | None = None,
        pass_fds: Sequence[int] = (),
        stop_signal: int = signal.SIGTERM,
        clock: Clock | None = None,
        owned: OwnedPids = OWNED_PIDS,
        watchdog_timeout: float | None = None,
        output: LineSink | None = None,
    ) -> None:
        if not argv:
            raise ValueError("argv must not be empty")
        self.argv = tuple(argv)
        self.name = name or os.path.basename(self.argv[0])
        self._env = dict(env) if env is not None else None
        self._cwd = cwd
        self.stop_timeout = stop_timeout
        self._exit_codes = dict(exit_codes)
        self._pass_fds = tuple(pass_fds)
        self._stop_signal = stop_signal
        self._clock = clock or RealClock()
        self._owned = owned
        self._pid: int | None = None
        self.status_text: str | None = None  # the child's latest STATUS= line
        self.last_exit: ExitStatus | None = None
        self.watchdog_timeout = watchdog_timeout
        self._last_beat = 0.0  # clock reading of the latest READY=1 or WATCHDOG=1
        self._hung_for: float | None = None  # set when the watchdog killed it
        # Set: the child's stdout and stderr are one pipe, each line relayed to it.
        self._output = output

    @property
    def pid(self) -> int | None:
        """The child's pid while it runs (and until it is reaped)."""
        return self._pid

    async def serve(self, ready: Callable[[], None]) -> None:
        if self._pid is not None:
            raise RuntimeError(f"{self.name} is already running (pid {self._pid})")
        loop = asyncio.get_running_loop()
        read_fd, write_fd = os.pipe2(os.O_CLOEXEC)
        out_r, out_w = os.pipe2(os.O_CLOEXEC) if self._output is not None else (-1, -1)
        try:
            process = self._spawn(write_fd, out_w)
        except BaseException:
            os.close(read_fd)
            if out_r >= 0:
                os.close(out_r)
            raise
        finally:
            os.close(write_fd)  # the child has its copy; EOF then means it closed or died
            if out_w >= 0:
                os.close(out_w)
        pid = process.pid
        relay: PipeRelay | None = None
        if self._output is not None:
            # Reads until every writer is gone (the child's own children too).
            relay = PipeRelay(out_r, pid, self._output)
            relay.start(loop)
        self._owned.add(pid)
        self._pid = pid
        try:
            await self._watch(loop, pid, read_fd, ready)
        finally:
            # Whatever ended the watch (exit, stop, error), this is the one
            # place that reaps. SIGKILL first reaches stragglers in the group,
            # while the unreaped leader still holds the group id.
            os.close(read_fd)
            _kill_group(pid, signal.SIGKILL)
            status = _reap(pid)
            if relay is not None:
                relay.drain()  # its last lines, before the exit is reported
            process.returncode = status.code if status.code is not None else -(status.signal or 0)
            self.last_exit = status
            self._pid = None
            self._owned.release(pid)
        self._conclude(status)

    def _spawn(self, ready_fd: int, output_fd: int = -1) -> subprocess.Popen[bytes]:
        env = dict(os.environ) if self._env is None else dict(self._env)
        env[PARENT_PID_ENV] = str(os.getpid())
        env[READY_FD_ENV] = str(ready_fd)
        # Resolved here, so a missing program raises in the parent, as with a plain Popen.
        program = _resolve_program(self.argv[0], env, self._cwd)
        return subprocess.Popen(
            trampoline_argv(os.getpid(), program, self.argv),
            env=env,
            cwd=self._cwd,
            stdin=subprocess.DEVNULL,
            stdout=output_fd if output_fd >= 0 else None,
            stderr=output_fd if output_fd >= 0 else None,
            pass_fds=(ready_fd, *self._pass_fds),
            process_group=0,
        )

    async def _watch(
        self, loop: asyncio.AbstractEventLoop, pid: int, read_fd: int, ready: Callable[[], None]
    ) -> None:
        """Returns once the child has exited (not yet reaped); on cancellation,
        stops it first and re-raises."""
        pidfd = os.pidfd_open(pid)
        exited: asyncio.Future[None] = loop.create_future()
        reader = _NotifyReader(read_fd, ready, self._on_status, self._on_beat)

        def on_exit() -> None:
            # A pidfd stays readable after the exit: unregister at once.
            loop.remove_reader(pidfd)
            _set_once(exited)

        loop.add_reader(pidfd, on_exit)
        loop.add_reader(read_fd, reader.on_readable, loop)
        try:
            if isinstance(ready, SpawnReporter):
                ready.spawned(pid)
            try:
                await self._wait_exit(pid, exited, reader)
            except asyncio.CancelledError:
                await self._stop(pid, exited)
                raise
            reader.on_readable(loop)  # a STATUS line written just before the exit
        finally:
            loop.remove_reader(pidfd)
            loop.remove_reader(read_fd)
            os.close(pidfd)

    def _on_beat(self) -> None:
        self._last_beat = self._clock.monotonic()

    async def _wait_exit(
        self, pid: int, exited: asyncio.Future[None], reader: _NotifyReader
    ) -> None:
        """Until the child exits; with a watchdog, kills it once it has been
        silent for ``watchdog_timeout`` after it was ready."""
        limit = self.watchdog_timeout
        if limit is None:
            await asyncio.wait({exited})
            return
        while not exited.done():
            if not reader.ready:  # not armed before READY=1: loading may take long
                await wait_done(self._clock, exited, limit)
                continue
            silent = self._clock.monotonic() - self._last_beat
            if silent >= limit:
                self._hung_for = silent
                log.error(
                    "%s (pid %d) sent no heartbeat for %.1f s (stopped, or its event "
                    "loop is blocked): killing it",
                    self.name,
                    pid,
                    silent,
                )
                _kill_group(pid, signal.SIGKILL)
                await asyncio.wait({exited})
                return
            await wait_done(self._clock, exited, limit - silent)

    async def _stop(self, pid: int, exited: asyncio.Future[None]) -> None:
        """Stop signal, grace, SIGKILL; returns once the child has exited."""
        task = asyncio.current_task()
        kill_now = task is not None and task.cancelling() > 1
        if not kill_now:
            _kill_group(pid, self._stop_signal)
            # Asked again while in grace: kill now.
            with contextlib.suppress(asyncio.CancelledError):
                await wait_done(self._clock, exited, self.stop_timeout)
        if not exited.done():
            _kill_group(pid, signal.SIGKILL)
            await asyncio.wait({exited})

    def _on_status(self, text: str) -> None:
        self.status_text = text

    def _conclude(self, status: ExitStatus) -> None:
        """Returns or raises as the exit-code protocol says."""
        description = f"{self.name} ({status})"
        if self._hung_for is not None:
            description += f" after {self._hung_for:.1f} s without a heartbeat"
        if status.code is not None and status.code in self._exit_codes:
            action = self._exit_codes[status.code]
            if action is None:
                return
            # The meaning of a code is only known while it keeps its default action.
            default = action is DEFAULT_EXIT_CODES.get(status.code, _NO_DEFAULT)
            meaning = _MEANINGS.get(status.code) if default else None
            raise action(f"{description}: {meaning}" if meaning else description)
        raise ChildFailed(description, status)


def process_child(
    id: str,
    argv: Sequence[str],
    *,
    restart: Restart = Restart.PERMANENT,
    stop_timeout: float = 10.0,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    exit_codes: Mapping[int, ExitAction] = DEFAULT_EXIT_CODES,
    watchdog_timeout: float | None = None,
    output: LineSink | None = None,
) -> ChildSpec:
    """A ChildSpec for a process, with the two stop bounds in the right order.

    The process gets ``stop_timeout`` between SIGTERM and SIGKILL; the
    supervisor waits :data:`KILL_GRACE` longer before reporting a stop
    timeout, so the normal escalation never races the supervisor's.
    """

    def start() -> ProcessService:
        return ProcessService(
            argv,
            env=env,
            cwd=cwd,
            stop_timeout=stop_timeout,
            exit_codes=exit_codes,
            name=id,
            watchdog_timeout=watchdog_timeout,
            output=output,
        )

    return ChildSpec(id, start, restart=restart, stop_timeout=stop_timeout + KILL_GRACE)


class _NotifyReader:
    """Reads ``KEY=value`` lines from the readiness pipe (non-blocking)."""

    def __init__(
        self,
        fd: int,
        on_ready: Callable[[], None],
        on_status: Callable[[str], None],
        on_beat: Callable[[], None] | None = None,
    ) -> None:
        os.set_blocking(fd, False)
        self._fd = fd
        self._on_ready = on_ready
        self._on_status = on_status
        self._on_beat = on_beat
        self._buffer = bytearray()
        self.ready = False
        self._eof = False

    def on_readable(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._eof:
            return
        try:
            data = os.read(self._fd, 4096)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._eof = True
            loop.remove_reader(self._fd)
            return
        self._buffer += data
        while (end := self._buffer.find(b"\n")) >= 0:
            line = bytes(self._buffer[:end]).decode(errors="replace")
            del self._buffer[: end + 1]
            self._handle(line)
        if len(self._buffer) > _MAX_LINE:
            self._buffer.clear()

    def _handle(self, line: str) -> None:
        key, _, value = line.partition("=")
        if key == "READY" and value == "1" and not self.ready:
            self.ready = True
            if self._on_beat is not None:
                self._on_beat()
            self._on_ready()
        elif key == "STATUS":
            self._on_status(value)
        elif key == "WATCHDOG" and value == "1" and self._on_beat is not None:
            self._on_beat()


# The exec trampoline: argv[1] is the parent's pid, argv[2] the program's
# path, argv[3:] its argv. Exit codes: 1 the parent died before the prctl
# (EXIT_PARENT_GONE: the signal would never come), 126 the prctl failed,
# 127 the exec failed (as a shell reports them).
TRAMPOLINE: Final = """\
import ctypes, os, signal, sys
prctl = ctypes.CDLL(None, use_errno=True).prctl
prctl.argtypes = [ctypes.c_int] + [ctypes.c_ulong] * 4
if prctl(1, 9, 0, 0, 0) != 0:  # PR_SET_PDEATHSIG, SIGKILL
    os._exit(126)
if os.getppid() != int(sys.argv[1]):
    os._exit(1)
# An ignored signal stays ignored across exec, and a blocked one blocked: Python
# ignores SIGPIPE and SIGXFSZ at start-up, and a root started in the background
# of a shell (or by nohup) ignores SIGINT (SIGHUP). The program starts as a
# service under systemd does: every disposition the default, nothing blocked.
for number in signal.valid_signals():
    if number not in (signal.SIGKILL, signal.SIGSTOP):
        try:
            signal.signal(number, signal.SIG_DFL)
        except (OSError, ValueError):
            pass  # one the C library reserves (the real-time signals glibc uses)
signal.pthread_sigmask(signal.SIG_SETMASK, ())
try:
    os.execv(sys.argv[2], sys.argv[3:])
except OSError as error:
    sys.stderr.write(f"poolserve: cannot run {sys.argv[2]}: {error}\\n")
    os._exit(127)
"""


def trampoline_argv(parent_pid: int, program: str, argv: Sequence[str]) -> list[str]:
    """The command line that runs ``argv`` (found at ``program``) with
    PR_SET_PDEATHSIG=SIGKILL, which exec preserves; ``-I -S`` keeps the
    trampoline's start-up to the interpreter and ctypes."""
    return [sys.executable, "-I", "-S", "-c", TRAMPOLINE, str(parent_pid), program, *argv]


def _resolve_program(name: str, env: Mapping[str, str], cwd: str | os.PathLike[str] | None) -> str:
    """The absolute path exec will run, found like Popen finds it (``PATH`` of ``env``)."""
    if os.sep in name:
        path = name if cwd is None else os.path.join(cwd, name)
        if not os.path.exists(path):
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), name)
    else:
        found = shutil.which(name, path=env.get("PATH", os.defpath))
        if found is None:
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), name)
        path = found
    if not os.access(path, os.X_OK) or os.path.isdir(path):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), name)
    return os.path.abspath(path)


def _set_once(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _kill_group(pgid: int, signal_number: int) -> None:
    # ESRCH: the group is empty; EPERM: what is left changed user, not ours to kill.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal_number)


def _reap(pid: int) -> ExitStatus:
    try:
        _, status = os.waitpid(pid, 0)
    except ChildProcessError:
        return ExitStatus(pid)  # reaped by code that ignored OWNED_PIDS: status lost
    return ExitStatus.from_wait_status(pid, status)
