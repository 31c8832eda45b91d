"""The pool's end of its zygote: start it, send it ops, hear its events.

A pool server forks its zygote (:class:`ForkedZygote`, before any gRPC object
or thread exists; the cargo is built in the child); WorkerPool starts it by a
clean exec (:class:`ExecZygote`). Either way :class:`ZygoteControl` reads the
zygote's events from asyncio and hands them to :class:`ZygoteEvents`. The
messages are described in :mod:`poolserve.service.poolcore.zygote`.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from poolserve.service.contract.repository import TransactionPolicy
from poolserve.service.lifecycle.procutil import interpreter_flags, wait_child, wait_exit
from poolserve.service.poolcore.zygote import (
    MAX_MESSAGE,
    Cargo,
    forked_main,
    send,
    specs_from_json,
)

if TYPE_CHECKING:
    from poolserve.service.contract.repository import TensorSpec


@dataclass
class ZygoteEvents:
    on_model: Callable[
        [str, bool, str, tuple[TensorSpec, ...], tuple[TensorSpec, ...], TransactionPolicy], None
    ]
    on_loaded: Callable[[], None]
    on_worker: Callable[[int, socket.socket], None]
    on_exit: Callable[[int, str], None]
    on_lost: Callable[[], None]
    on_unloaded: Callable[[str], None]
    # A load that failed, with its traceback (name, traceback), before its on_model.
    on_load_traceback: Callable[[str, str], None] | None = None
    # a loaded model's own ModelMetadata answer (an adapter's), before its on_model
    on_metadata: Callable[[str, bytes], None] | None = None
    # a loaded MLServer model's @custom_handler endpoints ((method, path) pairs),
    # before its on_model
    on_custom_routes: Callable[[str, tuple[tuple[str, str], ...]], None] | None = None


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
            trace = msg.get("traceback")
            if trace and events.on_load_traceback is not None:
                events.on_load_traceback(str(msg["name"]), str(trace))
            if events.on_metadata is not None and "metadata" in msg:
                events.on_metadata(msg["name"], base64.b64decode(msg["metadata"]))
            if events.on_custom_routes is not None and "custom_routes" in msg:
                pairs = tuple((str(m), str(p)) for m, p in msg["custom_routes"])
                events.on_custom_routes(msg["name"], pairs)
            events.on_model(
                msg["name"],
                bool(msg["ok"]),
                msg.get("reason", ""),
                specs_from_json(msg.get("inputs", [])),
                specs_from_json(msg.get("outputs", [])),
                TransactionPolicy(bool(msg.get("decoupled")), bool(msg.get("unary", True))),
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
            send(self._require(), message)

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
            forked_main(theirs, self._cargo, parent_pid, self._heartbeat_s)
        theirs.close()
        self.pid = pid
        self._sock = ours

    async def wait(self, timeout: float) -> str:
        """Reaps the zygote, killing it after ``timeout``; returns its decoded status."""
        if not self.pid:
            return "not started"
        return await wait_child(self.pid, timeout)


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
