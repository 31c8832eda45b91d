"""The path of one ``score`` call in a WorkerPool: wait for its model to
serve, pickle the call (large arrays into shared memory), submit it to the
dispatcher within its deadline, count it, and unpickle the outcome; and
``wait_ready``.
"""

from __future__ import annotations

import asyncio
import contextlib
import pickle
import time
from typing import Any

from poolserve.service.contract.errors import (
    Cancelled,
    DeadlineExceeded,
    ModelNotFound,
    ModelNotReady,
    QueueFull,
    Unavailable,
)
from poolserve.service.poolcore.jobs import Result
from poolserve.service.workerpool.models import PoolModel
from poolserve.service.workerpool.runtime import PoolRuntime, State
from poolserve.service.workerpool.scoring import (
    ModelLoadError,
    ScoreError,
    batch_key,
    decode_outcome,
    encode_call,
)
from poolserve.service.workerpool.status import ScoreStats

NO_DEADLINE_S = 10 * 365 * 86400.0  # "no timeout": a deadline no call lives to see


class CallPath(PoolRuntime):
    """Calls and readiness waits, on the pool's loop (WorkerPool's base)."""

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
                rows, key = batch_key(args, kwargs) if model.batch is not None else (0, b"")
                result = await self._dispatcher.submit(
                    encoded.data,
                    deadline,
                    idempotent=model.idempotent,
                    tag=model.name,
                    timeout=model.max_compute_s,
                    batch=model.batch if rows else None,
                    rows=max(rows, 1),
                    batch_key=key,
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
            if self._state in (State.CLOSING, State.CLOSED):
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
