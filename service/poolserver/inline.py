"""Inline models: run inside the pool server process, with no worker hop.

For models whose predict takes well under a millisecond, the hop to a worker
costs more than the model. A model whose settings say ``"parallel_workers":
0`` (MLServer's field for the same idea) is loaded and run here. Its predict
runs on the event loop only if it is declared fast (``inline_fast = True`` on
the class, or ``parameters.extra.inline_fast``); otherwise on one thread of
its own, so a slow inline model cannot stall the pool's dispatcher or the
other models.

A batching model (``max_batch_size`` above 1) on its own thread batches as a
worker model does: when its thread frees, the call it takes next brings the
compatible calls queued behind it (same batch key, up to ``max_batch_size``
rows) into one ``predict`` (:mod:`poolserve.service.inference.batch`). A
model declared fast runs each call the moment it comes: nothing waits, so
nothing batches.

The pool's promises hold for them as for worker models: calls waiting for a
model's thread sit in a queue of their own, bounded by ``max_queue``
(RESOURCE_EXHAUSTED beyond it) and ordered as the dispatcher's (priority,
then deadline, then arrival); a call whose deadline passes while it waits is
answered at that moment and never runs; a cancelled call leaves the queue at
once; a reply over ``max_message_size`` is refused here with a clear
RESOURCE_EXHAUSTED, before gRPC could fail on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import time
import traceback
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

from poolserve.service.contract.batching import BatchPolicy
from poolserve.service.contract.errors import (
    DeadlineExceeded,
    MessageTooLarge,
    ServingError,
    Unavailable,
    error_for,
)
from poolserve.service.contract.framing import HEADER, Payload
from poolserve.service.contract.repository import ModelSettings
from poolserve.service.contract.schedule import Schedule
from poolserve.service.grpcserver.status import as_serving_error
from poolserve.service.poolcore.frames import (
    PART,
    Frame,
    Reply,
    join_frames,
    parse_batch_reply,
    parse_reply,
)
from poolserve.service.poolcore.jobqueue import JobQueue, take_batch
from poolserve.service.poolcore.jobs import Job, JobState, Result
from poolserve.service.poolcore.stats import Timings
from poolserve.service.poolserver.catalog import Catalog, ModelEntry, ModelState

if TYPE_CHECKING:
    # numpy comes with these; the pool server must not import it before it forks
    # its zygote (numpy's BLAS starts a thread at import)
    from poolserve.service.inference.model import Model

log = logging.getLogger(__name__)

Ran = tuple[float, bytes, Timings]  # what the model's thread hands back: started, reply, timings
RanBatch = tuple[float, list[Reply]]  # a batch: started, one reply per call


def is_inline(settings: ModelSettings) -> bool:
    return settings.parallel_workers == 0


@dataclass(eq=False)
class _Inline:
    model: Model
    thread: ThreadPoolExecutor | None  # None: declared fast, runs on the event loop
    queue: JobQueue
    running: Job | None = None
    retired: bool = False  # unloaded or replaced: ends its thread once its queue is empty


def _declared_fast(model: Model) -> bool:
    extra = model.settings.extra.get("inline_fast")
    if isinstance(extra, bool):
        return extra
    return bool(getattr(model, "inline_fast", False))


class InlineRunner:
    def __init__(
        self,
        catalog: Catalog,
        pool: str = "",
        max_queue: int = 1024,
        max_message_size: int = 64 * 1024 * 1024,
    ) -> None:
        self._catalog = catalog
        self._models: dict[str, _Inline] = {}
        self.pool = pool
        self.max_queue = max_queue
        self.max_message_size = max_message_size
        self._seq = itertools.count(1)
        self.late_replies = 0

    def __contains__(self, name: object) -> bool:
        return name in self._models

    def queue_depth(self) -> int:
        return sum(len(inline.queue) for inline in self._models.values())

    async def load(self, models: Sequence[ModelSettings]) -> dict[str, str]:
        """Loads each model on its own thread; returns the failures by model key.

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
                trace = "".join(traceback.format_exception(exc))
                extra = {"model": settings.name, "traceback": trace}
                log.error("inline model %s: %s", settings.name, reason, extra=extra)
                failures[settings.key] = reason
                if settings.key not in self._models:
                    self._catalog.set_state(settings.key, ModelState.UNAVAILABLE, reason)
                continue
            fast = _declared_fast(model)
            if fast:
                thread.shutdown(wait=False)
            self.unload(settings.key)  # a reload replaces the previous one
            where = f"pool '{self.pool}' (inline model '{settings.name}')"
            self._models[settings.key] = _Inline(
                model, None if fast else thread, JobQueue(self.max_queue, where)
            )
            mode = "on the event loop" if fast else "on its own thread"
            log.info("inline model %s loaded (runs %s)", settings.name, mode)
            from poolserve.service.inference.model import tensor_specs

            policy = model.transaction_policy()  # a class with predict_stream streams here too
            entry = self._catalog.find(settings.key)
            if entry is not None:
                own = getattr(model, "own_metadata", None)  # an adapter's server's answer
                entry.own_metadata = own if isinstance(own, bytes) else None
                entry.custom_routes = tuple(getattr(model, "custom_routes", ()))
            self._catalog.set_state(settings.key, ModelState.READY, "", tensor_specs(model), policy)
        return failures

    async def infer(
        self,
        entry: ModelEntry,
        request: Payload,
        plan: Schedule,
        observe: Callable[[Result], None] | None,
        batch: tuple[BatchPolicy, int, bytes] | None = None,
    ) -> Payload:
        """``batch``: (policy, rows, batch key) when the call may run in a batch."""
        inline = self._models[entry.key]
        if inline.thread is None:
            return self.infer_now(entry, request, plan.deadline, observe)
        loop = asyncio.get_running_loop()
        enqueued = loop.time()
        try:
            result = await self._submit(inline, request, plan, enqueued, batch)
            body = self._checked(entry.name, result.body)
        except ServingError as exc:
            entry.stats.record_failure(int((loop.time() - enqueued) * 1e9), error=exc)
            raise
        entry.stats.record_success(
            result.queue_ns,
            result.timings,
            int((result.finished - enqueued) * 1e9),
            result.batch_report,
        )
        if result.batch_report:
            entry.stats.record_batch(result.batch_size, result.timings)
        if observe is not None:
            observe(result)
        return body

    async def _submit(
        self,
        inline: _Inline,
        request: Payload,
        plan: Schedule,
        now: float,
        batch: tuple[BatchPolicy, int, bytes] | None = None,
    ) -> Result:
        """As the dispatcher's submit, with the model's thread as the one worker."""
        if plan.deadline <= now:
            raise DeadlineExceeded(
                f"deadline already spent on arrival at pool '{self.pool}'", stage="pool"
            )
        loop = asyncio.get_running_loop()
        tag = inline.model.settings.key
        job = Job(request, plan.deadline, plan.priority, next(self._seq), loop.create_future(), tag)
        job.enqueued = now
        if batch is not None and batch[1] <= batch[0].max_size:
            job.batch, job.rows, job.batch_key = batch
        if inline.running is None and not inline.queue:
            self._start(inline, [job])
        else:
            inline.queue.push(job, plan.precision)
        timer = loop.call_at(plan.deadline, self._expire, inline, job)
        try:
            return await job.future
        finally:
            timer.cancel()
            _abandon(inline, job)

    def _start(self, inline: _Inline, jobs: list[Job]) -> None:
        assert inline.thread is not None
        loop = asyncio.get_running_loop()
        for job in jobs:
            job.state = JobState.RUNNING
            job.started = loop.time()
        inline.running = job = jobs[0]
        if len(jobs) > 1:
            bodies = [j.body for j in jobs]
            batch = loop.run_in_executor(inline.thread, _timed_batch, inline.model, bodies)
            batch.add_done_callback(functools.partial(self._ran_batch, inline, jobs))
            return
        future = loop.run_in_executor(
            inline.thread, _timed_run, inline.model, job.body, job.deadline
        )
        future.add_done_callback(functools.partial(self._ran, inline, job))

    def _ran_batch(
        self, inline: _Inline, jobs: list[Job], future: asyncio.Future[RanBatch]
    ) -> None:
        inline.running = None
        finished = asyncio.get_running_loop().time()
        rows = sum(j.rows for j in jobs)
        report = True
        for i, job in enumerate(jobs):
            if job.state is not JobState.RUNNING:
                self.late_replies += not future.cancelled()
                continue
            job.state = JobState.DONE
            if future.cancelled():
                job.future.set_exception(Unavailable(f"pool '{self.pool}' is stopping"))
            elif (exc := future.exception()) is not None:
                job.future.set_exception(as_serving_error(exc))
            else:
                started, parts = future.result()
                part = parts[i]
                if part.failure is not None:
                    job.future.set_exception(error_for(part.failure, part.message))
                    continue
                queue_ns = int((started - job.enqueued) * 1e9)
                job.future.set_result(
                    Result(part.body, part.timings, queue_ns, job.enqueued, started, finished,
                           batch_size=rows, batch_report=report)
                )  # fmt: skip
                report = False
        self._next(inline)

    def _ran(self, inline: _Inline, job: Job, future: asyncio.Future[Ran]) -> None:
        inline.running = None
        if job.state is JobState.RUNNING:
            job.state = JobState.DONE
            if future.cancelled():
                job.future.set_exception(Unavailable(f"pool '{self.pool}' is stopping"))
            elif (exc := future.exception()) is not None:
                if not isinstance(exc, ServingError):
                    log.error("inline model %s: unexpected error", job.tag, exc_info=exc)
                job.future.set_exception(as_serving_error(exc))
            else:
                started, body, timings = future.result()
                queue_ns = int((started - job.enqueued) * 1e9)
                finished = asyncio.get_running_loop().time()
                job.future.set_result(
                    Result(body, timings, queue_ns, job.enqueued, started, finished)
                )
        elif not future.cancelled():
            self.late_replies += 1  # its caller left while it ran
        self._next(inline)

    def _next(self, inline: _Inline) -> None:
        job = inline.queue.pop()
        if job is not None:
            self._start(inline, take_batch(inline.queue, job))
        elif inline.retired and inline.thread is not None:
            inline.thread.shutdown(wait=False)

    def _expire(self, inline: _Inline, job: Job) -> None:
        if job.future.done():
            return
        name = inline.model.settings.name
        if job.state is JobState.QUEUED:
            error = DeadlineExceeded(
                f"deadline exceeded while queued in pool '{self.pool}' for inline model "
                f"'{name}' (it never ran)",
                stage="pool queue",
            )
        else:
            error = DeadlineExceeded(
                f"deadline exceeded while model '{name}' ran inline", stage="worker"
            )
        job.future.set_exception(error)
        _abandon(inline, job)

    async def stream(
        self, entry: ModelEntry, request: Payload, deadline: float
    ) -> AsyncIterator[bytes]:
        """A decoupled inline model's responses (serialized ModelInferResponses),
        each as its ``predict_stream`` yields it, then the closing response if
        there is one. Each step of the stream runs on the model's thread (on the
        event loop for a model declared fast), between the model's other calls;
        leaving early (the client went away) closes the model's generator there.
        Counted once in the statistics, when the stream ends."""
        inline = self._models[entry.key]
        thread = inline.thread
        loop = asyncio.get_running_loop()
        began = time.monotonic()
        frames = _frames(inline.model, request)

        async def on_thread(fn: Callable[[], _Step]) -> _Step:
            if thread is None:
                return fn()
            try:
                return await loop.run_in_executor(thread, fn)
            except RuntimeError as exc:  # its thread ended: unloaded or replaced
                raise Unavailable(f"inline model '{entry.name}' was unloaded") from exc

        finished = False
        try:
            while True:
                if time.monotonic() >= deadline:
                    raise DeadlineExceeded(
                        f"deadline exceeded while inline model '{entry.name}' streamed",
                        stage="worker",
                    )
                kind, body, timings = await on_thread(functools.partial(_step, frames))
                self._checked(entry.name, body)
                if kind == _PART:
                    yield body
                    continue
                finished = True
                elapsed = int((time.monotonic() - began) * 1e9)
                entry.stats.record_success(0, timings, elapsed)
                if body:
                    yield body
                return
        except ServingError as exc:
            finished = True
            entry.stats.record_failure(int((time.monotonic() - began) * 1e9), error=exc)
            raise
        finally:
            if not finished:  # the caller left: the model's generator ends on its thread
                with contextlib.suppress(Exception):
                    await on_thread(functools.partial(_close, frames))

    def _checked(self, name: str, body: Payload) -> Payload:
        if len(body) > self.max_message_size:
            raise MessageTooLarge.reply(name, len(body), self.max_message_size)
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
        request: Payload,
        deadline: float,
        observe: Callable[[Result], None] | None = None,
    ) -> bytes:
        """A model declared fast, run here and now (on the event loop)."""
        model = self._models[entry.key].model
        started = time.monotonic()
        try:
            body, timings = _run(model, request, deadline)
            self._checked(entry.name, body)
        except ServingError as exc:
            entry.stats.record_failure(int((time.monotonic() - started) * 1e9), error=exc)
            raise
        finished = time.monotonic()
        entry.stats.record_success(0, timings, int((finished - started) * 1e9))
        if observe is not None:
            observe(Result(body, timings, 0, started, started, finished))
        return body

    def end_sequence(self, name: str, ident: int | str, reason: str) -> None:
        """Runs the model's ``sequence_ended`` hook on its thread, after what runs
        there now (on the event loop for a model declared fast)."""
        inline = self._models.get(name)
        if inline is None:
            return
        if inline.thread is None:
            _sequence_ended(inline.model, ident, reason)
            return
        loop = asyncio.get_running_loop()
        with contextlib.suppress(RuntimeError):  # its thread ended (unloaded): no state left
            loop.run_in_executor(inline.thread, _sequence_ended, inline.model, ident, reason)

    def unload(self, name: str) -> bool:
        inline = self._models.pop(name, None)
        if inline is None:
            return False
        inline.retired = True  # what is queued for it still runs, then its thread ends
        if inline.thread is not None and inline.running is None and not inline.queue:
            inline.thread.shutdown(wait=False)
        return True

    def close(self) -> None:
        for inline in self._models.values():
            if inline.thread is not None:
                inline.thread.shutdown(wait=False, cancel_futures=True)
            while (job := inline.queue.pop()) is not None:
                job.state = JobState.DONE
                job.future.set_exception(Unavailable(f"pool '{self.pool}' is stopping"))


def _abandon(inline: _Inline, job: Job) -> None:
    """The caller is gone (answer, deadline or cancel): a queued call leaves at once."""
    if job.state is JobState.QUEUED:
        inline.queue.remove(job)
        job.state = JobState.ABANDONED
    elif job.state is JobState.RUNNING:
        job.state = JobState.ABANDONED


def _load(settings: ModelSettings) -> Model:
    from poolserve.service.inference.model import load_model

    model = load_model(settings)
    if hasattr(model, "runs_inline"):  # an adapter that answers as its server's inline models
        model.runs_inline = True
    return model


def _run(model: Model, request: Payload, deadline: float) -> tuple[bytes, Timings]:
    if time.monotonic() >= deadline:  # expired while it waited for the thread
        raise DeadlineExceeded(
            f"deadline exceeded before inline model '{model.settings.name}' ran",
            stage="pool queue",
        )
    from poolserve.service.inference.infer import infer

    return infer(model, request)


_PART, _END = 0, 1
_Step = tuple[int, bytes, Timings]  # a stream's step: PART or END, its body, END's timings


def _frames(model: Model, request: Payload) -> Iterator[Frame]:
    """The worker's frames of one stream request (PART frames, then REPLY or ERROR)."""
    from poolserve.service.inference.cargo import handle_stream

    body = request if isinstance(request, bytes) else bytes(request)
    return handle_stream({model.settings.name: model}, body, 0)


def _step(frames: Iterator[Frame]) -> _Step:
    """The stream's next frame, run on the model's thread; raises the stream's error."""
    frame = next(frames)
    data = frame if isinstance(frame, bytes) else b"".join(frame)
    _, kind, _ = HEADER.unpack_from(data)
    payload = data[HEADER.size :]
    if kind == PART:
        return _PART, payload, Timings()
    reply = parse_reply(kind, 0, payload)
    if reply.failure is not None:
        raise error_for(reply.failure, reply.message)
    return _END, bytes(reply.body), reply.timings


def _close(frames: Iterator[Frame]) -> _Step:
    close = getattr(frames, "close", None)
    if close is not None:
        close()
    return _END, b"", Timings()


def _sequence_ended(model: Model, ident: int | str, reason: str) -> None:
    try:
        model.sequence_ended(ident, reason)
    except Exception:
        log.exception(
            "inline model %s: sequence_ended(%r, %r) raised", model.settings.name, ident, reason
        )


def _timed_batch(model: Model, bodies: list[Payload]) -> RanBatch:
    from poolserve.service.inference.batch import run_batch

    started = time.monotonic()
    frames = run_batch({model.settings.name: model}, bodies)
    parts = parse_batch_reply(0, join_frames(frames)).parts
    assert parts is not None
    return started, parts


def _timed_run(model: Model, request: Payload, deadline: float) -> tuple[float, bytes, Timings]:
    started = time.monotonic()
    body, timings = _run(model, request, deadline)
    return started, body, timings
