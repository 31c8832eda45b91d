"""The zygote: loads a pool's models once, then forks workers that share them.

The zygote is single-threaded: it loads its cargo, calls ``gc.freeze()`` so
that workers do not dirty the shared pages by collecting them, and forks a
worker each time the pool asks. Each worker's socket goes back to the pool
over the control socket (SCM_RIGHTS). The zygote reaps its workers and
reports each exit with its decoded status.

What the zygote loads, and what its workers run, is its :class:`Cargo`:

- the pool server's cargo (:mod:`poolserve.service.inference.cargo`): models
  named by their ``model-settings.json``, workers that answer
  ModelInferRequest bytes. The pool server forks this zygote
  (:class:`ForkedZygote`) before it creates any gRPC object, thread or
  exporter; the cargo is built in the child.
- the WorkerPool's cargo (:mod:`poolserve.service.workerpool.scoring`): user ``load``
  callables, workers that run pickled ``score`` calls. That zygote is started
  by a clean exec (:class:`ExecZygote`), never as a fork of a host
  application that may have threads, an event loop or gRPC objects.

Control messages are JSON over a SOCK_SEQPACKET pair (one message each):
pool -> zygote ``{"op": "spawn", "skip": [names]}`` (a worker whose
self-test leaves out the models named: their warm-up failed in earlier
workers), and any other op for the cargo (the inference cargo knows
``{"op": "load", "path": settings}`` and ``{"op": "unload", "name": N}``);
zygote -> pool ``{"event": "model", ...}`` (one per load, ok or not),
``{"event": "loaded"}`` (the initial cargo is in),
``{"event": "worker", "pid": N}`` (with the worker's socket attached),
``{"event": "exit", "pid": N, "status": "..."}`` and ``{"event":
"unloaded", "name": N}``. The zygote handles them in order, so every worker
forked after a load reply holds the loaded model, and every worker whose
event arrives after that reply was forked after the load.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn, Protocol

from poolserve.service.lifecycle.child import die_with_parent
from poolserve.service.lifecycle.procutil import (
    describe_status,
    set_process_name,
    wait_child,
    wait_exit,
)
from poolserve.service.poolcore import worker
from poolserve.service.poolcore.threads import sync_loaded_runtimes

if TYPE_CHECKING:
    from poolserve.service.contract.repository import TensorSpec

log = logging.getLogger(__name__)

MAX_MESSAGE = 64 * 1024
MAX_REASON = 16 * 1024  # a load failure's text, traceback included, fits one message

Emit = Callable[[dict[str, Any]], None]


class Cargo(Protocol):
    """What a zygote holds for its workers, and how they serve it."""

    def load_initial(self, emit: Emit) -> None:
        """Loads what the zygote starts with, one ``model`` event each."""

    def apply(self, message: Mapping[str, Any], emit: Emit) -> None:
        """Carries out one control op other than ``spawn`` (load, unload, ...)."""

    def handler(self) -> worker.Handler:
        """The request handler of a worker forked now."""

    def warmups(self, skip: Collection[str]) -> list[worker.Warmup]:
        """The self-test of a worker forked now: a warm-up per model, but those in ``skip``."""

    def start_fresh(self, sock: socket.socket, skip: Collection[str], heartbeat_s: float) -> int:
        """Starts a worker by exec on ``sock`` (start_method spawn): its pid; 0: fork one."""

    def close(self) -> None:
        """The zygote stops: release what outlives processes (files, ...)."""


def specs_json(specs: Sequence[TensorSpec]) -> list[list[Any]]:
    return [[s.name, s.datatype, list(s.shape)] for s in specs]


def specs_from_json(raw: list[list[Any]]) -> tuple[TensorSpec, ...]:
    from poolserve.service.contract.repository import TensorSpec

    return tuple(TensorSpec(str(n), str(d), tuple(int(x) for x in s)) for n, d, s in raw)


def _send(sock: socket.socket, message: dict[str, Any], fds: Sequence[int] = ()) -> None:
    data = json.dumps(message).encode()
    if fds:
        socket.send_fds(sock, [data], list(fds))
    else:
        sock.send(data)


def truncate_reason(reason: str) -> str:
    if len(reason) <= MAX_REASON:
        return reason
    return reason[: MAX_REASON - 20] + "\n[... truncated]"


class _Zygote:
    def __init__(
        self, ctrl: socket.socket, cargo: Cargo, heartbeat_s: float, stop_on_term: bool = False
    ) -> None:
        self.ctrl = ctrl
        self.heartbeat_s = heartbeat_s
        self.cargo = cargo
        self.stop_on_term = stop_on_term
        self.workers: set[int] = set()
        self.wake_r, self.wake_w = os.pipe()

    def emit(self, message: dict[str, Any]) -> None:
        _send(self.ctrl, message)

    def load_initial(self) -> None:
        self.cargo.load_initial(self.emit)
        self.freeze()
        self.emit({"event": "loaded"})

    @staticmethod
    def freeze() -> None:
        gc.collect()
        gc.freeze()  # workers must not touch (and so copy) the pages of loaded models

    def apply(self, message: Mapping[str, Any]) -> None:
        gc.unfreeze()
        try:
            self.cargo.apply(message, self.emit)
        finally:
            self.freeze()

    def spawn(self, skip: Collection[str] = ()) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        zygote_pid = os.getpid()
        try:
            pid = self.cargo.start_fresh(theirs, skip, self.heartbeat_s) or os.fork()
        except OSError:
            ours.close()
            theirs.close()
            raise
        if pid == 0:
            ours.close()
            self.ctrl.close()
            os.close(self.wake_r)
            os.close(self.wake_w)
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            die_with_parent(zygote_pid)
            set_process_name("poolserve-wrk")
            warmups = self.cargo.warmups(skip)
            worker.run(theirs, self.cargo.handler(), self.heartbeat_s, warmups)
        theirs.close()
        self.workers.add(pid)
        try:
            _send(self.ctrl, {"event": "worker", "pid": pid}, [ours.fileno()])
        finally:
            ours.close()

    def reap(self) -> None:
        while self.workers:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            self.workers.discard(pid)
            _send(self.ctrl, {"event": "exit", "pid": pid, "status": describe_status(status)})

    def stop_workers(self) -> None:
        """Kills and reaps every worker, so none outlives the zygote even briefly."""
        for pid in self.workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for pid in list(self.workers):
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
        self.workers.clear()

    def loop(self) -> None:
        os.set_blocking(self.wake_w, False)
        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        if self.stop_on_term:  # the wakeup byte names the signal: handled in the loop
            signal.signal(signal.SIGTERM, lambda *_: None)
        try:
            self._serve()
        except (BrokenPipeError, ConnectionError):
            pass  # the pool's end is gone: the same as its closing it
        finally:
            self.stop_workers()
            self.cargo.close()

    def _serve(self) -> None:
        self.load_initial()
        while True:
            readable, _, _ = select.select([self.ctrl.fileno(), self.wake_r], [], [])
            if self.wake_r in readable:
                signals = os.read(self.wake_r, 512)
                if self.stop_on_term and signal.SIGTERM in signals:
                    return  # our parent died (PR_SET_PDEATHSIG) or someone asked
                self.reap()
            if self.ctrl.fileno() in readable:
                data = self.ctrl.recv(MAX_MESSAGE)
                if not data:
                    return  # the pool is done with us
                self.handle(json.loads(data))

    def handle(self, message: dict[str, Any]) -> None:
        if message.get("op") == "spawn":
            self.spawn([str(name) for name in message.get("skip", [])])
        else:
            self.apply(message)


def _forked_main(
    ctrl: socket.socket, cargo: Callable[[], Cargo], parent_pid: int, heartbeat_s: float
) -> NoReturn:
    """The life of a zygote forked by :class:`ForkedZygote`: it builds its cargo, then loops."""
    code = 0
    try:
        die_with_parent(parent_pid)
        set_process_name("poolserve-zyg")
        # The pool server owns the stop: a SIGTERM to the whole process group (a
        # supervisor's stop) must not take workers away while the pool drains. The
        # zygote ends when the pool closes its socket, or dies with the pool.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        # The pool set the thread variables; a no-op unless numpy came in first.
        sync_loaded_runtimes("zygote")
        _Zygote(ctrl, cargo(), heartbeat_s).loop()
    except BaseException:
        code = 1
    os._exit(code)


def exec_main(ctrl_fd: int, parent_pid: int, heartbeat_s: float, cargo: Cargo) -> NoReturn:
    """The life of a zygote started by :class:`ExecZygote` (a fresh interpreter).

    It dies with its parent by SIGTERM (PR_SET_PDEATHSIG), which it handles
    in its loop: workers killed and reaped, the cargo closed, then exit.
    """
    code = 0
    try:
        # A host thread may block signals; its mask survives exec, ours must not.
        signal.pthread_sigmask(signal.SIG_SETMASK, [])
        die_with_parent(parent_pid, signal.SIGTERM)
        set_process_name("poolserve-zyg")
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        ctrl = socket.socket(fileno=ctrl_fd)
        _Zygote(ctrl, cargo, heartbeat_s, stop_on_term=True).loop()
    except BaseException:
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def exec_arguments(argv: Sequence[str]) -> argparse.Namespace:
    """Parses the arguments :class:`ExecZygote` passes (plus the cargo's own)."""
    parser = argparse.ArgumentParser(prog="poolserve-zygote", add_help=False)
    parser.add_argument("--ctrl-fd", type=int, required=True)
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--heartbeat", type=float, default=1.0)
    args, _ = parser.parse_known_args(argv)
    return args


@dataclass
class ZygoteEvents:
    on_model: Callable[[str, bool, str, tuple[TensorSpec, ...], tuple[TensorSpec, ...]], None]
    on_loaded: Callable[[], None]
    on_worker: Callable[[int, socket.socket], None]
    on_exit: Callable[[int, str], None]
    on_lost: Callable[[], None]
    on_unloaded: Callable[[str], None]


class ZygoteControl:
    """The pool's end of a zygote's control socket, read from asyncio."""

    def __init__(self) -> None:
        self._sock: socket.socket | None = None
        self.pid = 0

    def attach(self, events: ZygoteEvents) -> None:
        """Starts delivering zygote messages to ``events`` on the running loop."""
        sock = self._require()
        sock.setblocking(False)
        asyncio.get_running_loop().add_reader(sock.fileno(), self._readable, events)

    def _require(self) -> socket.socket:
        if self._sock is None:
            raise RuntimeError("zygote not started")
        return self._sock

    def _readable(self, events: ZygoteEvents) -> None:
        sock = self._require()
        while True:
            try:
                data, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE, 1)
            except BlockingIOError:
                return
            except OSError:
                data, fds = b"", []
            if not data:
                self._detach()
                events.on_lost()
                return
            self._deliver(events, json.loads(data), fds)

    def _deliver(self, events: ZygoteEvents, msg: dict[str, Any], fds: list[int]) -> None:
        kind = msg.get("event")
        if kind == "model":
            events.on_model(
                msg["name"],
                bool(msg["ok"]),
                msg.get("reason", ""),
                specs_from_json(msg.get("inputs", [])),
                specs_from_json(msg.get("outputs", [])),
            )
        elif kind == "loaded":
            events.on_loaded()
        elif kind == "worker" and fds:
            events.on_worker(int(msg["pid"]), socket.socket(fileno=fds[0]))
        elif kind == "exit":
            events.on_exit(int(msg["pid"]), str(msg["status"]))
        elif kind == "unloaded":
            events.on_unloaded(str(msg["name"]))
        for extra in fds[1:]:
            os.close(extra)

    def _detach(self) -> None:
        if self._sock is not None:
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_reader(self._sock.fileno())

    def spawn(self, skip: Collection[str] = ()) -> None:
        """Forks a worker; its self-test leaves out the models in ``skip``."""
        self.command({"op": "spawn", "skip": sorted(skip)})

    def unload(self, name: str) -> None:
        self.command({"op": "unload", "name": name})

    def command(self, message: dict[str, Any]) -> None:
        """Sends one op; a zygote that is gone is reported by ``on_lost``, not here."""
        with contextlib.suppress(OSError):
            _send(self._require(), message)

    def close(self) -> None:
        """Closes the control socket: the zygote exits and its workers die with it."""
        self._detach()
        if self._sock is not None:
            self._sock.close()
            self._sock = None


class ForkedZygote(ZygoteControl):
    """A zygote forked from this process, with the cargo ``cargo()`` builds in the child.

    For the pool server, whose process has no thread or gRPC object yet when
    it forks (the cargo factory runs after the fork, so the cargo's imports
    and loads happen in the zygote only).
    """

    def __init__(self, cargo: Callable[[], Cargo], heartbeat_s: float = 1.0) -> None:
        super().__init__()
        self._cargo = cargo
        self._heartbeat_s = heartbeat_s

    def start(self, close_in_child: Sequence[int] = ()) -> None:
        """Forks the zygote. Call before any gRPC object or thread exists."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        parent_pid = os.getpid()
        pid = os.fork()
        if pid == 0:
            ours.close()
            for fd in close_in_child:
                with contextlib.suppress(OSError):
                    os.close(fd)
            _forked_main(theirs, self._cargo, parent_pid, self._heartbeat_s)
        theirs.close()
        self.pid = pid
        self._sock = ours

    async def wait(self, timeout: float) -> str:
        """Reaps the zygote, killing it after ``timeout``; returns its decoded status."""
        if not self.pid:
            return "not started"
        return await wait_child(self.pid, timeout)


def interpreter_flags() -> list[str]:
    """The host interpreter's flags (-O, -B, -X ..., -W ...), as multiprocessing passes them."""
    flags: Callable[[], list[str]] = getattr(subprocess, "_args_from_interpreter_flags", lambda: [])
    return list(flags())


class ExecZygote(ZygoteControl):
    """A zygote started by a clean exec of ``python -m <module>``.

    Safe from any host process: the child is a fresh interpreter, so it
    inherits no threads, locks held by other threads, event loop or gRPC
    state. ``module`` calls :func:`exec_main` with its cargo; it receives its
    end of the control socket as ``--ctrl-fd`` (the only descriptor passed).
    """

    def __init__(
        self,
        module: str,
        args: Sequence[str] = (),
        heartbeat_s: float = 1.0,
        python: str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__()
        self._module = module
        self._args = list(args)
        self._heartbeat_s = heartbeat_s
        self._python = python or sys.executable
        self._env = env
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        if not self._python:
            raise RuntimeError("sys.executable is empty: pass python= to start the zygote")
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            fd = theirs.fileno()
            argv = [
                self._python,
                *interpreter_flags(),
                "-m",
                self._module,
                "--ctrl-fd",
                str(fd),
                "--parent-pid",
                str(os.getpid()),
                "--heartbeat",
                str(self._heartbeat_s),
                *self._args,
            ]
            # Popen's fork and exec run no Python code in the child: safe in a
            # host with threads. pass_fds makes only this one fd inheritable.
            self._proc = subprocess.Popen(
                argv, pass_fds=(fd,), stdin=subprocess.DEVNULL, env=self._env
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self.pid = self._proc.pid
        self._sock = ours

    async def wait(self, timeout: float) -> str:
        """Waits for the zygote to exit (SIGKILL after ``timeout``); reaps it."""
        proc = self._proc
        if proc is None:
            return "not started"
        if proc.poll() is None:
            await wait_exit(proc.pid, timeout)
        code = proc.wait()  # exited already (the pidfd said so): reaps without blocking
        if code < 0:
            return f"killed by {signal.Signals(-code).name}"
        return f"exited with code {code}"

    def kill(self) -> None:
        """SIGKILL now (a start that failed half-way); the caller still waits."""
        if self._proc is not None and self._proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self._proc.kill()
