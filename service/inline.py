"""Inline models: run inside the pool server process, with no worker hop.

For models whose predict takes well under a millisecond, the hop to a worker
costs more than the model. A model whose settings say ``"parallel_workers":
0`` (MLServer's field for the same idea) is loaded and run here. Its predict
runs on the event loop only if it is declared fast (``inline_fast = True`` on
the class, or ``parameters.extra.inline_fast``); otherwise on one thread of
its own, so a slow inline model cannot stall the pool's dispatcher or the
other models. Deadlines, cancellation and statistics behave as for worker
models: expired or cancelled work never starts.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

from poolserve.service.catalog import Catalog, ModelEntry, ModelState
from poolserve.service.dispatcher import Result
from poolserve.service.errors import DeadlineExceeded, ServingError
from poolserve.service.repository import ModelSettings
from poolserve.service.stats import Timings

if TYPE_CHECKING:
    # numpy comes with these; the pool server must not import it before it forks
    # its zygote (numpy's BLAS starts a thread at import)
    from poolserve.service.model import Model

log = logging.getLogger(__name__)


def is_inline(settings: ModelSettings) -> bool:
    return settings.parallel_workers == 0


@dataclass(eq=False)
class _Inline:
    model: Model
    fast: bool
    thread: ThreadPoolExecutor | None


def _declared_fast(model: Model) -> bool:
    extra = model.settings.extra.get("inline_fast")
    if isinstance(extra, bool):
        return extra
    return bool(getattr(model, "inline_fast", False))


class InlineRunner:
    def __init__(self, catalog: Catalog) -> None:
        self._catalog = catalog
        self._models: dict[str, _Inline] = {}

    def __contains__(self, name: object) -> bool:
        return name in self._models

    async def load(self, models: Sequence[ModelSettings]) -> dict[str, str]:
        """Loads each model on its own thread; returns the failures by model name.

        A failure marks only that model, and a failed reload leaves the
        previous version serving.
        """
        failures: dict[str, str] = {}
        for settings in models:
            thread = ThreadPoolExecutor(1, thread_name_prefix=f"inline-{settings.name}")
            loop = asyncio.get_running_loop()
            try:
                model = await loop.run_in_executor(thread, _load, settings)
            except Exception as exc:
                thread.shutdown(wait=False)
                reason = f"load failed: {type(exc).__name__}: {exc} (model {settings.source})"
                log.error("inline model %s: %s", settings.name, reason)
                failures[settings.name] = reason
                if settings.name not in self._models:
                    self._catalog.set_state(settings.name, ModelState.UNAVAILABLE, reason)
                continue
            fast = _declared_fast(model)
            if fast:
                thread.shutdown(wait=False)
            self.unload(settings.name)  # a reload replaces the previous one
            self._models[settings.name] = _Inline(model, fast, None if fast else thread)
            mode = "on the event loop" if fast else "on its own thread"
            log.info("inline model %s loaded (runs %s)", settings.name, mode)
            from poolserve.service.model import tensor_specs

            self._catalog.set_state(settings.name, ModelState.READY, "", tensor_specs(model))
        return failures

    async def infer(
        self,
        entry: ModelEntry,
        request: bytes,
        deadline: float,
        observe: Callable[[Result], None] | None,
    ) -> bytes:
        inline = self._models[entry.name]
        if inline.thread is None:
            return self.infer_now(entry, request, deadline, observe)
        loop = asyncio.get_running_loop()
        enqueued = loop.time()
        try:
            future = loop.run_in_executor(
                inline.thread, _timed_run, inline.model, request, deadline
            )
            started, body, timings = await asyncio.wait_for(future, deadline - enqueued)
        except TimeoutError:
            entry.stats.record_failure(int((loop.time() - enqueued) * 1e9))
            raise DeadlineExceeded(
                f"deadline exceeded while model '{entry.name}' ran inline", stage="worker"
            ) from None
        except ServingError:
            entry.stats.record_failure(int((loop.time() - enqueued) * 1e9))
            raise
        finished = loop.time()
        queue_ns = int((started - enqueued) * 1e9)
        entry.stats.record_success(queue_ns, timings, int((finished - enqueued) * 1e9))
        if observe is not None:
            observe(Result(body, timings, queue_ns, enqueued, started, finished))
        return body

    def runs_on_loop(self, name: str) -> bool:
        """Declared fast: runs right where it is called, with no await."""
        inline = self._models.get(name)
        return inline is not None and inline.thread is None

    def has_fast(self) -> bool:
        return any(inline.thread is None for inline in self._models.values())

    def infer_now(
        self,
        entry: ModelEntry,
        request: bytes,
        deadline: float,
        observe: Callable[[Result], None] | None = None,
    ) -> bytes:
        """A model declared fast, run here and now (on the event loop)."""
        model = self._models[entry.name].model
        started = time.monotonic()
        try:
            body, timings = _run(model, request, deadline)
        except ServingError:
            entry.stats.record_failure(int((time.monotonic() - started) * 1e9))
            raise
        finished = time.monotonic()
        entry.stats.record_success(0, timings, int((finished - started) * 1e9))
        if observe is not None:
            observe(Result(body, timings, 0, started, started, finished))
        return body

    def unload(self, name: str) -> bool:
        inline = self._models.pop(name, None)
        if inline is None:
            return False
        if inline.thread is not None:
            inline.thread.shutdown(wait=False)  # its queued calls finish, then it ends
        return True

    def close(self) -> None:
        for inline in self._models.values():
            if inline.thread is not None:
                inline.thread.shutdown(wait=False, cancel_futures=True)


def _load(settings: ModelSettings) -> Model:
    from poolserve.service.model import instantiate

    model = instantiate(settings)
    model.load()
    return model


def _run(model: Model, request: bytes, deadline: float) -> tuple[bytes, Timings]:
    if time.monotonic() >= deadline:  # expired while it waited for the thread
        raise DeadlineExceeded(
            f"deadline exceeded before inline model '{model.settings.name}' ran",
            stage="pool queue",
        )
    from poolserve.service.inference import infer

    return infer(model, request)


def _timed_run(model: Model, request: bytes, deadline: float) -> tuple[float, bytes, Timings]:
    started = time.monotonic()
    body, timings = _run(model, request, deadline)
    return started, body, timings
