"""A WorkerPool's processes and state on its event loop: the zygote (started
as ``python -m poolserve.service.workerpool.scoring``), the dispatcher and the
fleet of workers, the models as the zygote reports them, the shared-memory
janitor, and how the pool starts, drains, breaks and shuts down.
:class:`~poolserve.service.workerpool.pool.WorkerPool` is the public face.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import enum
import itertools
import logging
import os
import socket
import sys
import threading
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, Literal

from poolserve.service.contract.errors import Unavailable
from poolserve.service.poolcore.dispatcher import Dispatcher
from poolserve.service.poolcore.fleet import Fleet
from poolserve.service.poolcore.jobs import Limits
from poolserve.service.poolcore.threads import thread_environment
from poolserve.service.poolcore.zygote_control import ExecZygote, ZygoteEvents
from poolserve.service.workerpool.loop import LoopBridge
from poolserve.service.workerpool.models import PoolModel
from poolserve.service.workerpool.payload import SegmentDir
from poolserve.service.workerpool.scoring import ModelLoadError, job_of_segment
from poolserve.service.workerpool.status import PoolStatus, ScoreStats, WorkerInfo

# One logger for the whole WorkerPool, whichever of its modules speaks.
log = logging.getLogger("poolserve.service.workerpool.pool")

ZYGOTE_MODULE = "poolserve.service.workerpool.scoring"
JANITOR_PERIOD_S = 1.0  # how often segments of abandoned calls are swept
ZYGOTE_EXIT_S = 5.0  # after the control socket closes, then SIGKILL


class State(enum.Enum):
    NEW = "new"
    STARTING = "starting"
    RUNNING = "running"
    CLOSING = "closing"
    CLOSED = "closed"


class PoolRuntime(LoopBridge):
    """The state of a WorkerPool and what changes it (on the pool's loop).

    The configuration is set by :class:`WorkerPool`'s constructor.
    """

    size: int
    max_queue: int
    default_timeout: float | None
    start_timeout: float
    close_timeout: float
    _shm_threshold: int | None
    _shm_base: Path | None
    _heartbeat_interval: float
    _heartbeat_timeout: float
    _python: str | None
    _threads: int
    _warmup_timeout: float
    _abandon_grace: float

    def __init__(self) -> None:
        self._state = State.NEW
        self._models: dict[str, PoolModel] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._zygote: ExecZygote | None = None
        self._zygote_started = False
        self._dispatcher: Dispatcher | None = None
        self._fleet: Fleet | None = None
        self._segments: SegmentDir | None = None
        self._main: asyncio.Task[None] | None = None
        self._janitor_task: asyncio.Task[None] | None = None
        self._calls: set[asyncio.Task[Any]] = set()
        self._idle = asyncio.Event()
        self._changed = asyncio.Event()
        self._closed = asyncio.Event()
        self._cancel_reason = ""
        self._broken = ""
        self._jobs = itertools.count(1)
        self._live_jobs: set[int] = set()

    # -- models (the zygote loads them) ----------------------------------------

    def _add_in_loop(self, model: PoolModel) -> None:
        if self._state in (State.CLOSING, State.CLOSED):
            log.warning("workerpool %s: add_model(%r) after close ignored", self.name, model.name)
            return
        existing = self._models.get(model.name)
        if existing is not None and not existing.removed:
            existing.code = model.code
            existing.idempotent = model.idempotent
            existing.max_compute_s = model.max_compute_s
            existing.example = model.example
            existing.batch = model.batch
            existing.load_error = ""
            model = existing
        else:
            self._models[model.name] = model
        if self._zygote_started:
            self._send_load(model)
        self._wake()

    def _remove_in_loop(self, name: str) -> None:
        model = self._models.pop(name, None)
        if model is None:
            return
        model.removed = True
        model.serving = False
        if self._zygote is not None and self._zygote_started:
            self._zygote.unload(name)
        self._wake()

    def _send_load(self, model: PoolModel) -> None:
        assert self._zygote is not None
        model.pending += 1
        message = {"op": "load", "name": model.name, "code": base64.b64encode(model.code).decode()}
        if model.example is not None:
            message["example"] = base64.b64encode(model.example).decode()
        self._zygote.command(message)

    # -- lifecycle -------------------------------------------------------------

    async def _launch(self) -> None:
        if self._shm_threshold is not None:
            self._segments = SegmentDir.create(self._shm_base, self._shm_threshold)
        args: list[str] = []
        if self._segments is not None:
            args = ["--shm-dir", str(self._segments.path), "--shm-threshold"]
            args.append(str(self._segments.threshold))
        env = dict(os.environ)
        for variable, value in thread_environment(self._threads, env).items():
            log.info(
                "workerpool %s: %s=%s from the environment wins over threads_per_worker=%d",
                self.name,
                variable,
                value,
                self._threads,
            )
        zygote = ExecZygote(ZYGOTE_MODULE, args, self._heartbeat_interval, self._python, env)
        self._zygote = zygote
        limits = Limits(
            self.max_queue, self._heartbeat_timeout, self._warmup_timeout, self._abandon_grace
        )
        self._fleet = Fleet.with_dispatcher(
            f"workerpool {self.name}",
            self.name,
            self.size,
            zygote.spawn,
            limits,
            mark_failed=self._disable,
            on_change=self._settle,
        )
        self._dispatcher = self._fleet.dispatcher
        started = asyncio.Event()
        self._main = asyncio.create_task(self._run(started.set), name=f"workerpool-{self.name}")
        self._main.add_done_callback(self._main_done)
        await started.wait()
        zygote.start()
        zygote.attach(
            ZygoteEvents(
                self._on_model,
                lambda: None,
                self._on_worker,
                self._on_exit,
                self._on_lost,
                self._on_unloaded,
            )
        )
        zygote.command(self._prepare_message())
        self._zygote_started = True
        for model in self._models.values():
            self._send_load(model)
        self._fleet.start()

    @staticmethod
    def _prepare_message() -> dict[str, Any]:
        main = sys.modules.get("__main__")
        spec = getattr(main, "__spec__", None)
        main_file = getattr(main, "__file__", None)
        return {
            "op": "prepare",
            "sys_path": [os.path.abspath(p) if p else os.getcwd() for p in sys.path],
            "main_path": os.path.abspath(main_file) if main_file else None,
            "main_name": getattr(spec, "name", None),
        }

    async def _until_started(self) -> None:
        assert self._dispatcher is not None
        while True:
            self._raise_if_broken()
            for model in self._models.values():
                if model.pending == 0 and model.load_error and not model.loaded:
                    raise ModelLoadError(model.name, model.load_error)
            # a model disabled by the self-test does not hold up the others
            models_in = all(m.serving or m.disabled for m in self._models.values())
            if models_in and self._dispatcher.live_workers() >= self.size:
                return
            await self._changes()

    async def _run(self, started: Callable[[], None]) -> None:
        assert self._dispatcher is not None
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(self._dispatcher.run(started), name=f"dispatcher-{self.name}")
            if self._segments is not None:
                self._janitor_task = tasks.create_task(self._janitor(), name="segment-janitor")

    def _main_done(self, task: asyncio.Task[None]) -> None:
        if task.cancelled() or task.exception() is None:
            return
        error = task.exception()
        log.error("workerpool %s: internal error: %r", self.name, error, exc_info=error)
        self._break(f"workerpool '{self.name}' stopped on an internal error: {error!r}")

    async def _aclose(self, grace: float) -> None:
        if self._state in (State.CLOSING, State.CLOSED):
            await self._closed.wait()
            return
        self._state = State.CLOSING
        if self._fleet is not None:
            self._fleet.stop()  # no more forks, no respawns while calls drain
        try:
            await self._drain(grace)
        finally:
            await self._shutdown()

    async def _drain(self, grace: float) -> None:
        self._wake()  # calls waiting for a model to load give up now
        if self._calls:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._idle.wait(), grace)
        if self._calls:
            log.warning(
                "workerpool %s: cancelling %d calls still running after %.1f s",
                self.name,
                len(self._calls),
                grace,
            )
            self._cancel_calls(
                f"workerpool '{self.name}' closed before the call finished (close waited {grace} s)"
            )
            await asyncio.wait(set(self._calls))

    async def _shutdown(self) -> None:
        self._state = State.CLOSING
        if self._fleet is not None:
            self._fleet.stop()
        if self._janitor_task is not None:
            self._janitor_task.cancel()
        if self._dispatcher is not None:
            self._dispatcher.close()  # closes every worker's socket: they exit
        if self._main is not None:
            with contextlib.suppress(BaseException):
                await self._main
        if self._zygote is not None:
            self._zygote.close()  # the zygote kills what is left of its workers and exits
            status = await self._zygote.wait(ZYGOTE_EXIT_S)
            log.info("workerpool %s: zygote %s", self.name, status)
        if self._segments is not None:
            self._segments.remove()
        self._state = State.CLOSED
        self._closed.set()

    def _stop_thread(self, loop: asyncio.AbstractEventLoop) -> None:
        with contextlib.suppress(RuntimeError):  # closed already
            loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    # -- zygote and worker events (on the pool's loop) -------------------------

    def _describe_models(self) -> str:
        return ", ".join(f"{n} {m.describe()}" for n, m in self._models.items()) or "none"

    def _on_model(
        self,
        name: str,
        ok: bool,
        reason: str,
        _inputs: object = (),
        _outputs: object = (),
        _policy: object = None,
    ) -> None:
        model = self._models.get(name)
        if model is None or model.removed:
            return
        model.pending = max(0, model.pending - 1)
        if ok:
            assert self._fleet is not None  # models load only in a started pool
            model.loaded = True
            model.load_error = ""
            model.disabled = ""
            self._fleet.respawner.forgive(name)
            # Workers whose event comes after this were forked after the load.
            model.ready_gen = self._fleet.new_generation()
            if reason:
                log.warning("workerpool %s: model %s: %s", self.name, name, reason)
            log.info("workerpool %s: model %s loaded", self.name, name)
        else:
            model.load_error = reason
            kept = "; the previous version keeps serving" if model.loaded else ""
            log.error("workerpool %s: model %s: %s%s", self.name, name, reason, kept)
        self._on_workers_changed()

    def _on_unloaded(self, name: str) -> None:
        if self._fleet is not None:  # fresh forks no longer carry it: replace those that do
            self._fleet.new_generation()
            self._fleet.reconcile()

    def _on_worker(self, pid: int, sock: socket.socket) -> None:
        assert self._fleet is not None
        log.debug("workerpool %s: worker %d started", self.name, pid)
        self._fleet.arrived(pid, sock)

    def _on_workers_changed(self) -> None:
        if self._fleet is not None:
            self._fleet.reconcile()  # then _settle, through the fleet's on_change
        else:
            self._settle()

    def _on_exit(self, pid: int, status: str) -> None:
        if self._dispatcher is not None:
            self._dispatcher.worker_exited(pid, status)

    def _on_lost(self) -> None:
        if self._state in (State.CLOSING, State.CLOSED):
            return
        pid = self._zygote.pid if self._zygote is not None else 0
        self._break(
            f"workerpool '{self.name}': its zygote (pid {pid}) exited unexpectedly, so no "
            "worker can be forked any more: close this pool and start a new one"
        )

    def _disable(self, name: str, reason: str) -> None:
        model = self._models.get(name)
        if model is None:
            return
        log.error("workerpool %s: model %s disabled: %s", self.name, name, reason)
        model.disabled = reason
        model.serving = False
        self._wake()

    def _break(self, reason: str) -> None:
        if self._broken:
            return
        log.error("%s", reason)
        self._broken = reason
        if self._fleet is not None:
            self._fleet.stop()
        self._cancel_calls(reason)
        self._wake()

    def _cancel_calls(self, reason: str) -> None:
        self._cancel_reason = reason
        for call in list(self._calls):
            call.cancel()

    # -- statistics ------------------------------------------------------------

    def _stats(self) -> dict[str, ScoreStats]:
        return {name: dataclasses.replace(m.stats) for name, m in self._models.items()}

    def _status(self) -> PoolStatus:
        d = self._dispatcher
        workers = tuple(
            WorkerInfo(w.pid, str(w.state), w.served, w.generation, w.retiring)
            for w in (d.workers() if d is not None else [])
        )
        return PoolStatus(
            name=self.name,
            state=self._state.value,
            zygote_pid=self._zygote.pid if self._zygote is not None else 0,
            workers=workers,
            queue_depth=d.queue_depth() if d is not None else 0,
            late_replies_dropped=d.late_replies if d is not None else 0,
            expired_in_queue=d.expired_in_queue if d is not None else 0,
            respawns=self._fleet.respawner.respawns if self._fleet is not None else 0,
            segment_dir=str(self._segments.path) if self._segments is not None else "",
            models={name: m.describe() for name, m in self._models.items()},
        )

    # -- worker generations (the rolling replacement is the fleet's) -----------

    def _has_stale(self, generation: int) -> bool:
        return self._fleet is not None and self._fleet.is_stale(generation)

    def _settle(self) -> None:
        for model in self._models.values():
            if model.serving or not model.loaded or model.disabled or model.removed:
                continue
            if not self._has_stale(model.ready_gen):
                model.serving = True
        self._wake()

    # -- shared memory ---------------------------------------------------------

    async def _janitor(self) -> None:
        """Sweeps segments that no live call will read (results of calls given up)."""
        while True:
            await asyncio.sleep(JANITOR_PERIOD_S)  # a periodic sweep, not a readiness wait
            self._sweep()

    def _sweep(self) -> int:
        if self._segments is None:
            return 0
        live = self._live_jobs
        return self._segments.sweep(lambda name: job_of_segment(name) in live)

    # -- plumbing --------------------------------------------------------------

    def _wake(self) -> None:
        self._changed.set()

    def _changes(self) -> Coroutine[Any, Any, Literal[True]]:
        """Waits for the next change of models, workers or pool state.

        Not a coroutine function: the event is cleared now, right after the
        caller checked its condition, not when the returned wait first runs.
        """
        self._changed.clear()
        return self._changed.wait()

    def _raise_if_broken(self) -> None:
        if self._broken:
            raise Unavailable(self._broken)

    def _raise_unless_open(self) -> None:
        self._raise_if_broken()
        if self._state is State.NEW:
            raise RuntimeError(
                f"WorkerPool '{self.name}' is not started: use `async with` or start() first"
            )
        if self._state in (State.CLOSING, State.CLOSED):
            raise Unavailable(f"workerpool '{self.name}' is {self._state.value}")
