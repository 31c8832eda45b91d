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
import logging
import threading
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

from poolserve.service.contract.batching import BatchPolicy, batch_settings
from poolserve.service.contract.errors import Unavailable
from poolserve.service.contract.settings import ConfigError
from poolserve.service.workerpool.calls import CallPath
from poolserve.service.workerpool.loop import run_loop
from poolserve.service.workerpool.models import PoolModel, pickle_callables, pickle_example
from poolserve.service.workerpool.payload import SHM_THRESHOLD
from poolserve.service.workerpool.runtime import State
from poolserve.service.workerpool.scoring import ModelLoadError, ScoreError, in_zygote
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


class WorkerPool(CallPath):
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
        super().__init__()

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
        max_batch_size: int = 0,
        max_batch_time: float = 0.0,
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

        ``max_batch_size`` above 1: ``score`` takes stacked arrays (rows
        along dimension 0 of every positional argument) and returns an array,
        or a tuple, list or dict of arrays, with as many rows. Calls whose
        positional arguments are all arrays with the same dtypes and
        dimensions past the first, and no keyword arguments, then run
        together, up to ``max_batch_size`` rows, waiting at most
        ``max_batch_time`` seconds (only while another batch of the model
        runs): each caller gets its own rows. Other calls run alone.

        Raises TypeError at once when ``load`` or ``score`` cannot be pickled
        by reference (lambdas, nested functions); ValueError for bad batching
        settings.
        """
        if not callable(load) or not callable(score):
            raise TypeError(f"add_model('{name}'): load and score must be callables")
        code = pickle_callables(name, load, score)
        model = PoolModel(name, code, idempotent, max_compute_s, pickle_example(name, example))
        try:
            size, wait, _, _ = batch_settings(
                f"add_model('{name}')", max_batch_size, max_batch_time, {}
            )
        except ConfigError as exc:
            raise ValueError(str(exc)) from None
        model.batch = BatchPolicy(size, wait) if size > 1 else None
        self._in_loop_soon(self._add_in_loop, model)

    def remove_model(self, name: str) -> None:
        """Takes a model out: calls for it raise ModelNotFound; workers are replaced."""
        self._in_loop_soon(self._remove_in_loop, name)

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
        if self._state is not State.NEW:
            raise RuntimeError(f"WorkerPool '{self.name}' was started already")
        if in_zygote():
            raise RuntimeError(
                "a WorkerPool was started while the pool's zygote imported your main script "
                "(to find load/score functions defined there): start the pool under "
                '`if __name__ == "__main__":`'
            )
        self._state = State.STARTING
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
        self._state = State.RUNNING
        log.info(
            "workerpool %s: %d workers serving (zygote pid %d)",
            self.name,
            self.size,
            self._zygote.pid if self._zygote is not None else 0,
        )

    async def aclose(self, grace: float | None = None) -> None:
        """Stops taking calls, lets running ones finish for ``grace`` seconds
        (default ``close_timeout``), cancels the rest (they raise Cancelled),
        then stops the workers and the zygote. Idempotent."""
        if self._state is State.NEW:
            self._state = State.CLOSED
            return
        await self._in_pool_loop(self._aclose(self.close_timeout if grace is None else grace))

    def start(self) -> WorkerPool:
        """Starts the pool on an event loop of its own, in a thread (for scripts)."""
        if self._state is not State.NEW or self._thread is not None:
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
            self._state = State.CLOSED
            return
        self._refuse_pool_thread("close", "await pool.aclose()")
        if not loop.is_closed():
            asyncio.run_coroutine_threadsafe(self.aclose(grace), loop).result()
        if self._thread is not None:
            self._stop_thread(loop)

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

    # -- statistics --------------------------------------------------------------

    def stats(self) -> dict[str, ScoreStats]:
        """Per-model counters (copies)."""
        return self._on_pool_loop(self._stats)

    def status(self) -> PoolStatus:
        """Processes, queue and models, as the pool sees them now."""
        return self._on_pool_loop(self._status)
