"""WorkerPool: pre-forked scoring inside your own application (the MLPool use case).

A library API over the pool core that ``poolserve serve`` runs (zygote,
workers, frames, :class:`~poolserve.service.poolcore.dispatcher.Dispatcher`,
:class:`~poolserve.service.poolcore.respawn.Respawner`), without gRPC::

    from functools import partial
    from poolserve.service import WorkerPool

    async with WorkerPool(workers=4) as pool:
        pool.add_model("xgb", load=partial(load_model, "xgb.json"), score=score_model)
        result = await pool.score("xgb", features, timeout=0.2)

``load()`` runs once, in the pool's zygote; workers forked from it share the
model copy-on-write. ``score(model, *args, **kwargs)`` runs in a worker.
Adding a model to a running pool loads it in the zygote and replaces the
workers one at a time by fresh forks (the previous workers finish their
current call first), as a live load does in the server.

Semantics are the server pool's: a deadline (``timeout``) drops work that
has not started in time, before it runs (:class:`DeadlineExceeded`); a
cancelled caller's call leaves the queue at once; the queue is bounded
(:class:`QueueFull`); a worker's death is noticed at once (its socket
closes), its one call is retried once on another worker when the model is
idempotent (the default) or fails with :class:`Unavailable`; replacements are
forked from the zygote with crash back-off, and a model that keeps killing
its workers is disabled; a reply whose caller has gone is dropped (and its
shared-memory segments swept); close drains, then cancels, within a bound.
Native runtimes get ``threads_per_worker`` threads (the zygote's environment
sets OMP_NUM_THREADS and the like, a variable the host set wins); a fresh
worker runs each model's ``example`` (if given) once before it takes calls,
and a model whose warm-up hangs or crashes in fresh workers is disabled; a
worker still in a call ``abandon_grace`` seconds after its caller left
(timeout or cancel) is killed and replaced.
What ``score`` raises reaches the caller as :class:`ScoreError` with the
original type name, message and traceback text.

Fork safety: the zygote is started by a clean exec (``python -m
poolserve.service.workerpool.scoring``), never forked from the host, so a host with
threads, a running event loop or gRPC objects is safe. The price: ``load`` and
``score`` are pickled by reference and imported by name in that fresh
interpreter, so they must be module-level functions (or ``functools.partial``
of them); lambdas and nested functions are refused by :meth:`add_model` with
an explanation. Functions in the main script work as with multiprocessing's
spawn start method: the script is imported as ``__mp_main__`` in the zygote,
so keep the code that starts the pool under ``if __name__ == "__main__":``.
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
import pickle
import socket
import sys
import threading
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, TypeVar

from poolserve.service.contract.errors import (
    Cancelled,
    DeadlineExceeded,
    ModelNotFound,
    ModelNotReady,
    QueueFull,
    Unavailable,
)
from poolserve.service.poolcore.dispatcher import Dispatcher, Limits, Result
from poolserve.service.poolcore.fleet import Fleet
from poolserve.service.poolcore.threads import thread_environment
from poolserve.service.poolcore.zygote_control import ExecZygote, ZygoteEvents
from poolserve.service.workerpool.loop import LoopBridge, run_loop
from poolserve.service.workerpool.models import PoolModel, pickle_callables, pickle_example
from poolserve.service.workerpool.payload import SHM_THRESHOLD, SegmentDir
from poolserve.service.workerpool.scoring import (
    ModelLoadError,
    ScoreError,
    decode_outcome,
    encode_call,
    in_zygote,
    job_of_segment,
)
from poolserve.service.workerpool.status import PoolStatus, ScoreStats, WorkerInfo

__all__ = [
    "ModelLoadError",
    "PoolStatus",
    "ScoreError",
    "ScoreStats",
    "WorkerInfo",
    "WorkerPool",
]

log = logging.getLogger(__name__)

T = TypeVar("T")

ZYGOTE_MODULE = "poolserve.service.workerpool.scoring"
NO_DEADLINE_S = 10 * 365 * 86400.0  # "no timeout": a deadline no call lives to see
JANITOR_PERIOD_S = 1.0  # how often segments of abandoned calls are swept
ZYGOTE_EXIT_S = 5.0  # after the control socket closes, then SIGKILL


class _State(enum.Enum):
    NEW = "new"
    STARTING = "starting"
    RUNNING = "running"
    CLOSING = "closing"
    CLOSED = "closed"


class WorkerPool(LoopBridge):
    """A zygote and ``workers`` pre-forked worker processes that run ``score`` calls.

    Constructing one has no side effect; processes start in :meth:`astart`
    (``async with``) or :meth:`start` (``with``, for scripts: the pool then
    runs its own event loop on a thread). Methods are safe to call from any
    thread; ``await pool.score(...)`` from any event loop.
    """

    def __init__(
        self,
        workers: int = 2,
        *,
        name: str = "workerpool",
        max_queue: int = 1000,
        default_timeout: float | None = None,
        shm_threshold: int | None = SHM_THRESHOLD,
        shm_dir: str | Path | None = None,
        heartbeat_interval: float = 1.0,
        heartbeat_timeout: float = 30.0,
        start_timeout: float = 60.0,
        close_timeout: float = 10.0,
        python: str | None = None,
        threads_per_worker: int = 1,
        warmup_timeout: float = 10.0,
        abandon_grace: float = 5.0,
    ) -> None:
        """
        ``max_queue``: calls waiting for a worker beyond this raise QueueFull.
        ``default_timeout``: seconds, for calls made without ``timeout``
        (None: no deadline). ``shm_threshold``: out-of-band buffers of at
        least this many bytes go through shared memory (None: never).
        ``shm_dir``: where the segment folder goes (default /dev/shm, or
        $POOLSERVE_SHM_DIR). A worker silent for ``heartbeat_timeout`` s is
        killed. ``close_timeout``: how long close drains before cancelling.
        ``python``: the interpreter for the zygote (default sys.executable).
        ``threads_per_worker``: OMP_NUM_THREADS, MKL_NUM_THREADS... in the
        zygote and workers (a variable set in the environment wins).
        ``warmup_timeout``: a fresh worker's warm-up of each model (see
        :meth:`add_model`'s ``example``) must finish within it.
        ``abandon_grace``: a worker still running a call this long after its
        caller left (timeout, cancel) is killed and replaced (0: never).
        """
        if workers < 1:
            raise ValueError("a WorkerPool needs at least one worker")
        if threads_per_worker < 1:
            raise ValueError("threads_per_worker must be >= 1")
        if max_queue < 0:
            raise ValueError("max_queue must be >= 0")
        self.name = name
        self.size = workers
        self.max_queue = max_queue
        self.default_timeout = default_timeout
        self.start_timeout = start_timeout
        self.close_timeout = close_timeout
        self._shm_threshold = shm_threshold
        self._shm_base = Path(shm_dir) if shm_dir is not None else None
        self._heartbeat_interval = heartbeat_interval
        self._heartbeat_timeout = heartbeat_timeout
        self._python = python
        self._threads = threads_per_worker
        self._warmup_timeout = warmup_timeout
        self._abandon_grace = abandon_grace
        self._state = _State.NEW
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

    def __repr__(self) -> str:
        return f"<WorkerPool {self.name!r} workers={self.size} {self._state.value}>"

    # -- models ----------------------------------------------------------------

    def add_model(
        self,
        name: str,
        *,
        load: Callable[[], Any],
        score: Callable[..., Any],
        idempotent: bool = True,
        max_compute_s: float | None = None,
        example: tuple[Any, ...] | None = None,
    ) -> None:
        """Registers a model: ``load()`` runs once in the zygote, ``score(model, ...)`` in workers.

        Returns at once. Before start, the model loads with the pool; on a
        running pool it loads now and the workers are replaced by fresh forks
        (``score`` calls for it wait for that, within their timeout; see
        :meth:`wait_ready`). Adding a name again reloads it; the previous
        version serves until the new one is in. ``idempotent=False``: a call
        whose worker dies is failed rather than retried. ``max_compute_s``:
        a worker still computing after that long is killed (the call fails
        with DeadlineExceeded). ``example``: arguments for ``score`` (after the
        model) that each fresh worker runs once before it takes calls, to
        find a model that hangs or crashes after the fork (a native thread
        pool started in ``load``) before a caller does; small and picklable.

        Raises TypeError at once when ``load`` or ``score`` cannot be pickled
        by reference (lambdas, nested functions).
        """
        if not callable(load) or not callable(score):
            raise TypeError(f"add_model('{name}'): load and score must be callables")
        code = pickle_callables(name, load, score)
        model = PoolModel(name, code, idempotent, max_compute_s, pickle_example(name, example))
        self._in_loop_soon(self._add_in_loop, model)

    def remove_model(self, name: str) -> None:
        """Takes a model out: calls for it raise ModelNotFound; workers are replaced."""
        self._in_loop_soon(self._remove_in_loop, name)

    def _add_in_loop(self, model: PoolModel) -> None:
        if self._state in (_State.CLOSING, _State.CLOSED):
            log.warning("workerpool %s: add_model(%r) after close ignored", self.name, model.name)
            return
        existing = self._models.get(model.name)
        if existing is not None and not existing.removed:
            existing.code = model.code
            existing.idempotent = model.idempotent
            existing.max_compute_s = model.max_compute_s
            existing.example = model.example
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

    # -- lifecycle ---------------------------------------------------------------

    async def __aenter__(self) -> WorkerPool:
        await self.astart()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    def __enter__(self) -> WorkerPool:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    async def astart(self) -> None:
        """Starts the zygote and the workers on the running loop; returns once they serve.

        Models added before start must load, or this raises ModelLoadError
        (and the pool is closed again).
        """
        if self._state is not _State.NEW:
            raise RuntimeError(f"WorkerPool '{self.name}' was started already")
        if in_zygote():
            raise RuntimeError(
                "a WorkerPool was started while the pool's zygote imported your main script "
                "(to find load/score functions defined there): start the pool under "
                '`if __name__ == "__main__":`'
            )
        self._state = _State.STARTING
        self._loop = asyncio.get_running_loop()
        self._idle.set()
        try:
            await self._launch()
            await asyncio.wait_for(self._until_started(), self.start_timeout)
        except TimeoutError:
            live = self._dispatcher.live_workers() if self._dispatcher is not None else 0
            await self._shutdown()
            raise Unavailable(
                f"workerpool '{self.name}' did not start within {self.start_timeout} s "
                f"({live} of {self.size} workers up; models: {self._describe_models()})"
            ) from None
        except BaseException:
            await self._shutdown()
            raise
        self._state = _State.RUNNING
        log.info(
            "workerpool %s: %d workers serving (zygote pid %d)",
            self.name,
            self.size,
            self._zygote.pid if self._zygote is not None else 0,
        )

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

    async def aclose(self, grace: float | None = None) -> None:
        """Stops taking calls, lets running ones finish for ``grace`` seconds
        (default ``close_timeout``), cancels the rest (they raise Cancelled),
        then stops the workers and the zygote. Idempotent."""
        if self._state is _State.NEW:
            self._state = _State.CLOSED
            return
        await self._in_pool_loop(self._aclose(self.close_timeout if grace is None else grace))

    async def _aclose(self, grace: float) -> None:
        if self._state in (_State.CLOSING, _State.CLOSED):
            await self._closed.wait()
            return
        self._state = _State.CLOSING
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
        self._state = _State.CLOSING
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
        self._state = _State.CLOSED
        self._closed.set()

    def start(self) -> WorkerPool:
        """Starts the pool on an event loop of its own, in a thread (for scripts)."""
        if self._state is not _State.NEW or self._thread is not None:
            raise RuntimeError(f"WorkerPool '{self.name}' was started already")
        loop = asyncio.new_event_loop()
        thread = threading.Thread(
            target=run_loop, args=(loop,), name=f"workerpool-{self.name}", daemon=True
        )
        thread.start()
        self._thread = thread
        try:
            asyncio.run_coroutine_threadsafe(self.astart(), loop).result()
        except BaseException:
            self._stop_thread(loop)
            raise
        return self

    def close(self, grace: float | None = None) -> None:
        """:meth:`aclose` for synchronous code (any thread but the pool loop's own)."""
        loop = self._loop
        if loop is None:
            self._state = _State.CLOSED
            return
        self._refuse_pool_thread("close", "await pool.aclose()")
        if not loop.is_closed():
            asyncio.run_coroutine_threadsafe(self.aclose(grace), loop).result()
        if self._thread is not None:
            self._stop_thread(loop)

    def _stop_thread(self, loop: asyncio.AbstractEventLoop) -> None:
        with contextlib.suppress(RuntimeError):  # closed already
            loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    # -- scoring -----------------------------------------------------------------

    async def score(
        self, model: str, /, *args: Any, timeout: float | None = None, **kwargs: Any
    ) -> Any:
        """Runs ``score(loaded_model, *args, **kwargs)`` on a worker; returns its result.

        ``timeout`` (seconds, default ``default_timeout``) bounds the whole
        call: a call still queued at its deadline never runs. Raises
        ScoreError (score raised), DeadlineExceeded, QueueFull, Unavailable
        (the worker died and the call could not be retried, or the pool is
        closed), ModelNotFound, ModelLoadError, Cancelled (the pool closed
        first). Cancelling the awaiting task cancels the call.
        """
        deadline = self._deadline(timeout)
        return await self._in_pool_loop(self._score(model, args, kwargs, deadline))

    def score_sync(
        self, model: str, /, *args: Any, timeout: float | None = None, **kwargs: Any
    ) -> Any:
        """:meth:`score` for synchronous code: blocks this thread (never the pool's loop)."""
        deadline = self._deadline(timeout)
        return self._sync(self._score(model, args, kwargs, deadline), "score_sync", "score")

    async def wait_ready(self, *models: str, timeout: float | None = None) -> None:
        """Waits until ``models`` (default: all) are loaded and on every worker.

        Raises ModelLoadError if the latest load of one failed (for a reload,
        the previous version still serves), DeadlineExceeded after ``timeout``.
        """
        deadline = self._deadline(timeout)
        await self._in_pool_loop(self._wait_ready(models, deadline))

    def wait_ready_sync(self, *models: str, timeout: float | None = None) -> None:
        deadline = self._deadline(timeout)
        self._sync(self._wait_ready(models, deadline), "wait_ready_sync", "wait_ready")

    def _deadline(self, timeout: float | None) -> float:
        seconds = self.default_timeout if timeout is None else timeout
        return time.monotonic() + (NO_DEADLINE_S if seconds is None else seconds)

    async def _score(
        self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any], deadline_mono: float
    ) -> Any:
        self._raise_unless_open()
        model = self._lookup(name)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (deadline_mono - time.monotonic())
        call = loop.create_task(self._call(model, args, kwargs, deadline))
        self._calls.add(call)
        self._idle.clear()
        try:
            return await call
        except asyncio.CancelledError:
            task = asyncio.current_task()
            ours = task is None or not task.cancelling()  # we cancelled it, not its caller
            if call.cancelled() and self._cancel_reason and ours:
                raise Cancelled(self._cancel_reason) from None
            raise
        finally:
            self._calls.discard(call)
            if not self._calls:
                self._idle.set()

    async def _call(
        self, model: PoolModel, args: tuple[Any, ...], kwargs: dict[str, Any], deadline: float
    ) -> Any:
        stats = model.stats
        stats.calls += 1
        try:
            await self._until_serving(model, deadline)
            value = await self._run_job(model, args, kwargs, deadline)
        except asyncio.CancelledError:
            stats.cancelled += 1
            raise
        except ScoreError:
            stats.raised += 1
            raise
        except DeadlineExceeded:
            stats.deadline_exceeded += 1
            raise
        except QueueFull:
            stats.queue_full += 1
            raise
        except BaseException:
            stats.failed += 1
            raise
        stats.succeeded += 1
        return value

    async def _run_job(
        self, model: PoolModel, args: tuple[Any, ...], kwargs: dict[str, Any], deadline: float
    ) -> Any:
        assert self._dispatcher is not None
        job = next(self._jobs)
        self._live_jobs.add(job)
        try:
            try:
                try:
                    encoded = encode_call(job, model.name, args, kwargs, self._segments)
                except OSError:  # shared memory unusable: everything inline
                    encoded = encode_call(job, model.name, args, kwargs, None)
            except (pickle.PicklingError, AttributeError, TypeError) as exc:
                raise TypeError(
                    f"the arguments of a call to model '{model.name}' cannot be pickled: "
                    f"{type(exc).__name__}: {exc}"
                ) from exc
            try:
                result = await self._dispatcher.submit(
                    encoded.data,
                    deadline,
                    idempotent=model.idempotent,
                    tag=model.name,
                    timeout=model.max_compute_s,
                )
            finally:
                if encoded.segments and self._segments is not None:
                    self._segments.unlink(encoded.segments)
            self._record(model.stats, result)
            return decode_outcome(model.name, result.body, self._segments)
        finally:
            self._live_jobs.discard(job)

    @staticmethod
    def _record(stats: ScoreStats, result: Result) -> None:
        stats.executed += 1
        stats.queue_ns += result.queue_ns
        stats.decode_ns += result.timings.decode_ns
        stats.compute_ns += result.timings.compute_ns
        stats.encode_ns += result.timings.encode_ns

    def _lookup(self, name: str) -> PoolModel:
        model = self._models.get(name)
        if model is None or model.removed:
            known = ", ".join(sorted(self._models)) or "none"
            raise ModelNotFound(f"workerpool '{self.name}' has no model '{name}' (models: {known})")
        return model

    async def _until_serving(self, model: PoolModel, deadline: float) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._raise_if_broken()
            if model.removed:
                raise ModelNotFound(f"model '{model.name}' was removed from the pool")
            if model.disabled:
                raise ModelNotReady(
                    f"model '{model.name}' is disabled: {model.disabled}; "
                    "add_model it again to retry"
                )
            if model.serving:
                return
            if model.pending == 0 and model.load_error:
                raise ModelLoadError(model.name, model.load_error)
            if self._state in (_State.CLOSING, _State.CLOSED):
                raise Unavailable(f"workerpool '{self.name}' closed while the model loaded")
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise DeadlineExceeded(
                    f"deadline exceeded while model '{model.name}' was loading "
                    f"in workerpool '{self.name}'",
                    stage="pool",
                )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changes(), remaining)

    async def _wait_ready(self, names: tuple[str, ...], deadline_mono: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (deadline_mono - time.monotonic())
        for name in names or tuple(self._models):
            model = self._lookup(name)
            while not self._settled(model):
                self._raise_unless_open()
                remaining = deadline - loop.time()
                if remaining <= 0:
                    raise DeadlineExceeded(f"model '{name}' was not ready in time", stage="pool")
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changes(), remaining)
            if model.load_error:
                raise ModelLoadError(name, model.load_error)
            if model.disabled:
                raise ModelNotReady(f"model '{name}' is disabled: {model.disabled}")

    def _settled(self, model: PoolModel) -> bool:
        if model.pending or model.removed:
            return model.removed
        if model.load_error or model.disabled:
            return True
        return model.loaded and not self._has_stale(model.ready_gen)

    # -- statistics --------------------------------------------------------------

    def stats(self) -> dict[str, ScoreStats]:
        """Per-model counters (copies)."""
        return self._on_pool_loop(self._stats)

    def _stats(self) -> dict[str, ScoreStats]:
        return {name: dataclasses.replace(m.stats) for name, m in self._models.items()}

    def status(self) -> PoolStatus:
        """Processes, queue and models, as the pool sees them now."""
        return self._on_pool_loop(self._status)

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

    def _describe_models(self) -> str:
        return ", ".join(f"{n} {m.describe()}" for n, m in self._models.items()) or "none"

    # -- zygote and worker events (on the pool's loop) ------------------------------

    def _on_model(
        self, name: str, ok: bool, reason: str, _inputs: object = (), _outputs: object = ()
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
        if self._state in (_State.CLOSING, _State.CLOSED):
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

    # -- worker generations (the rolling replacement is the fleet's) ---------------

    def _has_stale(self, generation: int) -> bool:
        return self._fleet is not None and self._fleet.is_stale(generation)

    def _settle(self) -> None:
        for model in self._models.values():
            if model.serving or not model.loaded or model.disabled or model.removed:
                continue
            if not self._has_stale(model.ready_gen):
                model.serving = True
        self._wake()

    # -- shared memory -----------------------------------------------------------------

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

    # -- plumbing ----------------------------------------------------------------------

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
        if self._state is _State.NEW:
            raise RuntimeError(
                f"WorkerPool '{self.name}' is not started: use `async with` or start() first"
            )
        if self._state in (_State.CLOSING, _State.CLOSED):
            raise Unavailable(f"workerpool '{self.name}' is {self._state.value}")
