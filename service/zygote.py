"""The zygote: loads a pool's models once, then forks workers that share them.

The pool server forks the zygote before it creates any gRPC object, thread
or exporter. The zygote is single-threaded: it loads the models, calls
``gc.freeze()`` so that workers do not dirty the shared pages by collecting
them, and forks a worker each time the pool asks. Each worker's socket goes
back to the pool server over the control socket (SCM_RIGHTS). The zygote
reaps its workers and reports each exit with its decoded status.

Control messages are JSON over a SOCK_SEQPACKET pair (one message each):
pool -> zygote ``{"op": "spawn"}``, ``{"op": "load", "path": settings}``,
``{"op": "unload", "name": N}``; zygote -> pool ``{"event": "model", ...}``
(one per load, ok or not), ``{"event": "loaded"}`` (the initial models are
in), ``{"event": "worker", "pid": N}`` (with the worker's socket attached),
``{"event": "exit", "pid": N, "status": "..."}`` and ``{"event":
"unloaded", "name": N}``. The zygote handles them in order, so every worker
forked after a load reply holds the loaded model.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import os
import select
import signal
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from poolserve.service import worker
from poolserve.service.model import Model, instantiate, tensor_specs
from poolserve.service.procutil import describe_status, set_process_name, wait_child
from poolserve.service.repository import ModelSettings, TensorSpec, parse_model_settings
from poolserve.service.settings import ConfigError
from poolserve.supervisor.child import die_with_parent

MAX_MESSAGE = 64 * 1024


def _specs_json(specs: Sequence[TensorSpec]) -> list[list[Any]]:
    return [[s.name, s.datatype, list(s.shape)] for s in specs]


def specs_from_json(raw: list[list[Any]]) -> tuple[TensorSpec, ...]:
    return tuple(TensorSpec(str(n), str(d), tuple(int(x) for x in s)) for n, d, s in raw)


def _send(sock: socket.socket, message: dict[str, Any], fds: Sequence[int] = ()) -> None:
    data = json.dumps(message).encode()
    if fds:
        socket.send_fds(sock, [data], list(fds))
    else:
        sock.send(data)


class _Zygote:
    def __init__(
        self, ctrl: socket.socket, settings: Sequence[ModelSettings], heartbeat_s: float
    ) -> None:
        self.ctrl = ctrl
        self.heartbeat_s = heartbeat_s
        self.settings = settings
        self.models: dict[str, Model] = {}
        self.workers: set[int] = set()
        self.wake_r, self.wake_w = os.pipe()

    def load_models(self) -> None:
        for s in self.settings:
            self.load_one(s)
        self.freeze()
        _send(self.ctrl, {"event": "loaded"})

    def load_one(self, settings: ModelSettings) -> None:
        """Loads (or reloads) one model; a failure leaves the previous one in place."""
        try:
            model = instantiate(settings)
            model.load()
        except BaseException as exc:  # a model's load may raise anything, even SystemExit
            reason = f"load failed: {type(exc).__name__}: {exc}"
            _send(
                self.ctrl, {"event": "model", "name": settings.name, "ok": False, "reason": reason}
            )
            return
        self.models[settings.name] = model
        inputs, outputs = tensor_specs(model)
        _send(
            self.ctrl,
            {
                "event": "model",
                "name": settings.name,
                "ok": True,
                "inputs": _specs_json(inputs),
                "outputs": _specs_json(outputs),
            },
        )

    @staticmethod
    def freeze() -> None:
        gc.collect()
        gc.freeze()  # workers must not touch (and so copy) the pages of loaded models

    def live_load(self, path: str) -> None:
        try:
            settings = parse_model_settings(Path(path))
        except ConfigError as exc:
            name = Path(path).parent.name
            _send(self.ctrl, {"event": "model", "name": name, "ok": False, "reason": str(exc)})
            return
        gc.unfreeze()
        self.load_one(settings)
        self.freeze()

    def unload(self, name: str) -> None:
        gc.unfreeze()
        self.models.pop(name, None)
        self.freeze()
        _send(self.ctrl, {"event": "unloaded", "name": name})

    def spawn(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        zygote_pid = os.getpid()
        pid = os.fork()
        if pid == 0:
            ours.close()
            self.ctrl.close()
            os.close(self.wake_r)
            os.close(self.wake_w)
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            die_with_parent(zygote_pid)
            set_process_name("poolserve-wrk")
            worker.run(theirs, self.models, self.heartbeat_s)
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
        self.load_models()
        while True:
            readable, _, _ = select.select([self.ctrl.fileno(), self.wake_r], [], [])
            if self.wake_r in readable:
                os.read(self.wake_r, 512)
                self.reap()
            if self.ctrl.fileno() in readable:
                data = self.ctrl.recv(MAX_MESSAGE)
                if not data:
                    self.stop_workers()  # the pool server is done with us
                    return
                self.handle(json.loads(data))

    def handle(self, message: dict[str, Any]) -> None:
        op = message.get("op")
        if op == "spawn":
            self.spawn()
        elif op == "load":
            self.live_load(str(message["path"]))
        elif op == "unload":
            self.unload(str(message["name"]))


def _zygote_main(
    ctrl: socket.socket, settings: Sequence[ModelSettings], pool_pid: int, heartbeat_s: float
) -> NoReturn:
    code = 0
    try:
        die_with_parent(pool_pid)
        set_process_name("poolserve-zyg")
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        _Zygote(ctrl, settings, heartbeat_s).loop()
    except BaseException:
        code = 1
    os._exit(code)


@dataclass
class ZygoteEvents:
    on_model: Callable[[str, bool, str, tuple[TensorSpec, ...], tuple[TensorSpec, ...]], None]
    on_loaded: Callable[[], None]
    on_worker: Callable[[int, socket.socket], None]
    on_exit: Callable[[int, str], None]
    on_lost: Callable[[], None]
    on_unloaded: Callable[[str], None]


class ZygoteLink:
    """The pool server's end: forks the zygote, then talks to it from asyncio."""

    def __init__(self, settings: Sequence[ModelSettings], heartbeat_s: float = 1.0) -> None:
        self._settings = settings
        self._heartbeat_s = heartbeat_s
        self._sock: socket.socket | None = None
        self.pid = 0

    def start(self, close_in_child: Sequence[int] = ()) -> None:
        """Forks the zygote. Call before any gRPC object or thread exists."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        pool_pid = os.getpid()
        pid = os.fork()
        if pid == 0:
            ours.close()
            for fd in close_in_child:
                with contextlib.suppress(OSError):
                    os.close(fd)
            _zygote_main(theirs, self._settings, pool_pid, self._heartbeat_s)
        theirs.close()
        self.pid = pid
        self._sock = ours

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

    def spawn(self) -> None:
        self._command({"op": "spawn"})

    def load(self, settings_path: Path) -> None:
        """Asks the zygote to (re)load the model of this settings file."""
        self._command({"op": "load", "path": str(settings_path)})

    def unload(self, name: str) -> None:
        self._command({"op": "unload", "name": name})

    def _command(self, message: dict[str, Any]) -> None:
        with contextlib.suppress(OSError):
            _send(self._require(), message)

    def close(self) -> None:
        """Closes the control socket: the zygote exits and its workers die with it."""
        self._detach()
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    async def wait(self, timeout: float) -> str:
        """Reaps the zygote, killing it after ``timeout``; returns its decoded status."""
        if not self.pid:
            return "not started"
        return await wait_child(self.pid, timeout)
