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
The pool's end is :mod:`poolserve.service.poolcore.zygote_control`.
pool -> zygote ``{"op": "spawn", "skip": [names]}`` (a worker whose
self-test leaves out the models named: their warm-up failed in earlier
workers), and any other op for the cargo (the inference cargo knows
``{"op": "load", "path": settings}`` (with ``"version": V``: that version
folder of a numbered model) and ``{"op": "unload", "name": N}``, N a model's
key: its name, or ``name:version``);
zygote -> pool ``{"event": "model", ...}`` (one per load, ok or not; a
loaded one says its specs and its transaction policy, ``decoupled`` and
``unary``, as the loaded model declares them),
``{"event": "loaded"}`` (the initial cargo is in),
``{"event": "worker", "pid": N}`` (with the worker's socket attached),
``{"event": "exit", "pid": N, "status": "..."}`` and ``{"event":
"unloaded", "name": N}``. The zygote handles them in order, so every worker
forked after a load reply holds the loaded model, and every worker whose
event arrives after that reply was forked after the load.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import os
import select
import signal
import socket
import sys
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NoReturn, Protocol

from poolserve.service.lifecycle.child import die_with_parent
from poolserve.service.lifecycle.logs import (
    inherited_format,
    set_role_kind,
    setup_inherited_logging,
)
from poolserve.service.lifecycle.procutil import (
    describe_status,
    set_process_name,
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
    """[name, datatype, shape, format, label_filename] per tensor."""
    return [[s.name, s.datatype, list(s.shape), s.format, s.label_filename] for s in specs]


def specs_from_json(raw: list[list[Any]]) -> tuple[TensorSpec, ...]:
    from poolserve.service.contract.repository import TensorSpec

    return tuple(
        TensorSpec(str(n), str(d), tuple(int(x) for x in s), str(f), str(label))
        for n, d, s, f, label in raw
    )


def send(sock: socket.socket, message: dict[str, Any], fds: Sequence[int] = ()) -> None:
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
        send(self.ctrl, message)

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
            set_role_kind("worker")
            warmups = self.cargo.warmups(skip)
            worker.run(theirs, self.cargo.handler(), self.heartbeat_s, warmups)
        theirs.close()
        self.workers.add(pid)
        try:
            send(self.ctrl, {"event": "worker", "pid": pid}, [ours.fileno()])
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
            send(self.ctrl, {"event": "exit", "pid": pid, "status": describe_status(status)})

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


def forked_main(
    ctrl: socket.socket, cargo: Callable[[], Cargo], parent_pid: int, heartbeat_s: float
) -> NoReturn:
    """The life of a zygote forked by :class:`ForkedZygote`: it builds its cargo, then loops."""
    code = 0
    try:
        die_with_parent(parent_pid)
        set_process_name("poolserve-zyg")
        set_role_kind("zygote")
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
        if inherited_format() is not None:  # started inside a poolserve process
            setup_inherited_logging("zygote")
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
