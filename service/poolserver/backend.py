"""The InferBackend of a pool server: a request goes to an inline model or,
through the dispatcher, to a forked worker, after its schedule (priority
level, deadline) is planned and, with ``reject_hopeless``, a request that
cannot finish in time is refused on arrival. A model that caches its
replies answers a request it answered before from the pool's response cache
(:mod:`poolserve.service.poolserver.response_cache`), on every path here."""

from __future__ import annotations

import functools
import time
from collections.abc import AsyncIterator, Callable

from poolserve.service.contract.batching import peek_batch
from poolserve.service.contract.chain import REFUSED as CHAIN_REFUSED
from poolserve.service.contract.chain import is_chain
from poolserve.service.contract.chain import unwrap as unwrap_chain
from poolserve.service.contract.errors import (
    DeadlineExceeded,
    InvalidInput,
    MessageTooLarge,
    ServingError,
    Unavailable,
    Unimplemented,
    decoupled_refusal,
    prefixed,
)
from poolserve.service.contract.framing import Payload
from poolserve.service.contract.schedule import PriorityLevels, Schedule, schedule
from poolserve.service.contract.sequence import peek_sequence
from poolserve.service.contract.shm import is_wrapped
from poolserve.service.contract.slab import Mapper, head, is_enveloped, parse
from poolserve.service.contract.wire import Routing, peek_routing
from poolserve.service.poolcore.dispatcher import Dispatcher
from poolserve.service.poolcore.jobs import Result
from poolserve.service.poolcore.sequences import Sequences
from poolserve.service.poolcore.started import Started
from poolserve.service.poolserver.catalog import Catalog, ModelEntry
from poolserve.service.poolserver.inline import InlineRunner
from poolserve.service.poolserver.inline_sequences import InlineSequences
from poolserve.service.poolserver.response_cache import Probe, ResponseCache
from poolserve.service.poolserver.rest_scheduling import (
    ready_route,
    rest_batch,
    scheduling_view,
)
from poolserve.service.poolserver.servicer import Observer


class PoolBackend:
    """The InferBackend of a pool server: the dispatcher over forked workers."""

    def __init__(
        self,
        dispatcher: Dispatcher,
        inline: InlineRunner,
        needs_workers: bool,
        reject_hopeless: bool = False,
        max_message_size: int = 64 * 1024 * 1024,
        cache: ResponseCache | None = None,
    ) -> None:
        self.max_message_size = max_message_size
        self.cache = cache if cache is not None else ResponseCache(0, 0)
        self.dispatcher = dispatcher
        self.inline = inline
        self.needs_workers = needs_workers
        self.reject_hopeless = reject_hopeless
        self.sequences: dict[str, Sequences] = {}  # per sequence model: its live sequences
        self.inline_sequences: dict[str, InlineSequences] = {}  # the same, of inline models
        self.slabs = Mapper()  # the router's slabs an inline model reads large requests from

    def route(self, catalog: Catalog, request: Payload) -> tuple[ModelEntry, Routing]:
        """The ready model a request runs on, and its routing. An ensemble's
        chain (:mod:`poolserve.service.contract.chain`) runs as its first
        step's job, on one worker, when every step's model is ready here and a
        worker runs it alone; else it is refused, and the router names why."""
        if not is_chain(request):
            return ready_route(catalog, request)
        plan, inner = unwrap_chain(request)
        entries = []
        for index, step in enumerate(plan.steps):
            try:
                entry = catalog.lookup_ready(step.model, step.version)
            except ServingError as exc:
                raise prefixed(exc, plan.step_name(index)) from None
            settings = entry.settings
            if (
                entry.key in self.inline
                or not entry.policy.unary
                or self.cache.caches(entry)
                or (settings is not None and (settings.sequence or settings.batching))
            ):
                raise Unavailable(
                    f"{CHAIN_REFUSED}: {plan.step_name(index)} runs inline, batched, "
                    "in a sequence, decoupled or cached"
                )
            entries.append(entry)
        routing = peek_routing(inner)
        routing.name, routing.version = entries[0].name, entries[0].version
        routing.chain = tuple(entries[1:])
        return entries[0], routing

    def serving(self) -> bool:
        return not self.needs_workers or self.dispatcher.live_workers() > 0

    async def infer(
        self,
        entry: ModelEntry,
        request: Payload,
        deadline: float,
        routing: Routing,
        observe: Observer | None = None,
    ) -> Payload:
        if not entry.policy.unary:
            refused = decoupled_refusal(entry.name)
            entry.stats.record_failure(0, error=refused)
            raise refused
        plan = self._plan(entry, routing, deadline)
        probe, hit = self._look_up(entry, request, routing)
        if hit is not None:
            return hit
        body = await self._compute(entry, request, plan, routing, observe)
        if probe is not None:
            self._keep(entry, probe, body)
        return body

    async def _compute(
        self,
        entry: ModelEntry,
        request: Payload,
        plan: Schedule,
        routing: Routing,
        observe: Observer | None,
    ) -> Payload:
        """:meth:`infer` past the cache: inline, on a sequence's worker, batched or alone."""
        if self.reject_hopeless:
            self._reject_if_hopeless(entry, plan.deadline)
        sequential = entry.settings is not None and entry.settings.sequence is not None
        if sequential and entry.key not in self.inline:
            return await self._infer_in_sequence(entry, request, plan, routing, observe)
        if sequential:  # inline: one thread, every sequence
            return await self._infer_inline_sequence(entry, request, plan, routing, observe)
        policy = entry.settings.batching if entry.settings is not None else None
        rows, key = 1, b""
        if policy is not None and is_wrapped(request):
            policy = None  # it names shared-memory regions: it runs alone (not a batch member)
        if policy is not None:
            try:
                peeked = peek_batch(head(request), policy.safe_parameters)
            except InvalidInput:
                peeked = None  # malformed: it runs alone, and the worker says what is wrong
            if peeked is None:  # an HTTP/REST body: from its JSON, when small
                peeked = rest_batch(request, policy.safe_parameters, routing)
            if peeked is None:
                policy = None
            else:
                rows, key = peeked
        if entry.key in self.inline:
            batch = None if policy is None else (policy, rows, key)
            return await self.inline.infer(entry, self._inline(request), plan, observe, batch)
        began = time.monotonic_ns()
        try:
            result = await self.dispatcher.submit(
                request,
                plan.deadline,
                priority=plan.priority,
                idempotent=routing.idempotent,
                tag=entry.key,
                timeout=entry.settings.timeout_s if entry.settings is not None else None,
                precision=plan.precision,
                batch=policy,
                rows=rows,
                batch_key=key,
            )
        except ServingError as exc:
            entry.stats.record_failure(time.monotonic_ns() - began, error=exc)
            raise
        body = self._answered(entry, result, began, routing)
        if observe is not None:
            observe(result)
        return body

    def begin(
        self,
        entry: ModelEntry,
        request: Payload,
        deadline: float,
        routing: Routing,
        reply: Callable[[Payload | Exception], None],
    ) -> Started | None:
        """:meth:`infer` without a task, for a request on a forked worker that runs
        alone (not inline, not in a sequence, not batched, unary): its reply's
        bytes or its error go to ``reply`` (unless cancelled first), counted in
        the model's statistics as :meth:`infer` counts them. None: it takes
        :meth:`infer`. Refusals on arrival are raised here."""
        settings = entry.settings
        if (
            not entry.policy.unary
            or entry.key in self.inline
            or (
                settings is not None
                and (settings.sequence is not None or settings.batching is not None)
            )
        ):
            return None
        plan = self._plan(entry, routing, deadline)
        probe, hit = self._look_up(entry, request, routing, answer=False)
        if hit is not None:
            return None  # kept meanwhile: :meth:`infer` answers it from the cache
        if self.reject_hopeless:
            self._reject_if_hopeless(entry, plan.deadline)
        stats = entry.stats
        began = time.monotonic_ns()

        def done(outcome: Result | BaseException) -> None:
            try:
                if isinstance(outcome, BaseException):
                    if isinstance(outcome, ServingError):
                        stats.record_failure(time.monotonic_ns() - began, error=outcome)
                    reply(outcome if isinstance(outcome, Exception) else Exception(outcome))
                    return
                body = self._answered(entry, outcome, began, routing)
                if probe is not None:
                    self._keep(entry, probe, body)
                reply(body)
            except Exception as exc:  # (a bug: the call still gets an answer)
                reply(exc)

        try:
            return self.dispatcher.begin(
                request,
                plan.deadline,
                done,
                priority=plan.priority,
                idempotent=routing.idempotent,
                tag=entry.key,
                timeout=settings.timeout_s if settings is not None else None,
                precision=plan.precision,
            )
        except ServingError as exc:
            stats.record_failure(time.monotonic_ns() - began, error=exc)
            raise

    def _look_up(
        self,
        entry: ModelEntry,
        request: Payload,
        routing: Routing,
        answer: bool = True,
        count_miss: bool = True,
    ) -> tuple[Probe | None, bytes | None]:
        """The request's probe of the response cache (None: not cached) and the
        reply it found; a hit is counted when ``answer`` (it is the answer), a
        miss when ``count_miss`` (the request is computed next)."""
        if not self.cache.caches(entry):
            return None, None  # (every request of an uncached model: no clock read)
        began = time.monotonic_ns()
        probe = self.cache.probe(entry, request, routing)
        if probe is None:
            return None, None
        hit = self.cache.get(probe)
        spent = time.monotonic_ns() - began
        if hit is not None:
            if answer:
                entry.stats.record_cache_hit(spent, spent)
            return probe, hit
        if count_miss:
            entry.stats.record_cache_miss(spent)
        return probe, None

    def _keep(self, entry: ModelEntry, probe: Probe, body: Payload) -> None:
        """A computed reply into the cache, its time counted with the miss."""
        began = time.monotonic_ns()
        self.cache.put(probe, entry, body)
        entry.stats.record_cache_insert(time.monotonic_ns() - began)

    def _answered(self, entry: ModelEntry, result: Result, began: int, routing: Routing) -> Payload:
        """A worker's result, counted: its body, or MessageTooLarge (raised).
        A chain's is counted by each of its steps' models, as Triton's
        composing models count an ensemble's calls."""
        if len(result.body) > self.max_message_size:
            too_large = MessageTooLarge.reply(entry.name, len(result.body), self.max_message_size)
            entry.stats.record_failure(time.monotonic_ns() - began, error=too_large)
            raise too_large
        spent = time.monotonic_ns() - began
        entry.stats.record_success(result.queue_ns, result.timings, spent, result.batch_report)
        for step in routing.chain:
            step.stats.record_success(result.queue_ns, result.timings, spent, result.batch_report)
        if result.batch_report:
            entry.stats.record_batch(result.batch_size, result.timings)
        return result.body

    async def _infer_in_sequence(
        self,
        entry: ModelEntry,
        request: Payload,
        plan: Schedule,
        routing: Routing,
        observe: Observer | None,
    ) -> Payload:
        """A sequence model's request, on the worker that holds its sequence."""
        settings = entry.settings
        assert settings is not None and settings.sequence is not None
        table = self._sequence_table(entry)
        began = time.monotonic_ns()
        try:
            control = peek_sequence(scheduling_view(request, routing))
            worker, name = table.route(control)
        except ServingError as exc:
            entry.stats.record_failure(0, error=exc)
            raise
        try:
            result = await self.dispatcher.submit_pinned(
                worker,
                request,
                plan.deadline,
                sequence=name,
                tag=entry.key,
                timeout=settings.timeout_s,
            )
        except ServingError as exc:
            entry.stats.record_failure(time.monotonic_ns() - began, error=exc)
            raise
        finally:
            table.ran(control)
        entry.stats.record_success(result.queue_ns, result.timings, time.monotonic_ns() - began)
        if observe is not None:
            observe(result)
        return result.body

    def _sequence_table(self, entry: ModelEntry) -> Sequences:
        settings = entry.settings
        assert settings is not None and settings.sequence is not None
        table = self.sequences.get(entry.key)
        if table is None or table.policy != settings.sequence:
            table = self.sequences[entry.key] = Sequences(
                entry.key, settings.sequence, self.dispatcher
            )
        return table

    async def _infer_inline_sequence(
        self,
        entry: ModelEntry,
        request: Payload,
        plan: Schedule,
        routing: Routing,
        observe: Observer | None,
    ) -> Payload:
        """An inline sequence model's request, with the sequence rules of workers."""
        settings = entry.settings
        assert settings is not None and settings.sequence is not None
        table = self.inline_sequences.get(entry.key)
        if table is None or table.policy != settings.sequence:
            if table is not None:
                table.close()
            ended = functools.partial(self.inline.end_sequence, entry.key)
            table = self.inline_sequences[entry.key] = InlineSequences(
                entry.key, settings.sequence, ended
            )
        try:
            control = peek_sequence(scheduling_view(request, routing))
            table.route(control)
        except ServingError as exc:
            entry.stats.record_failure(0, error=exc)
            raise
        try:
            return await self.inline.infer(entry, request, plan, observe)
        finally:
            table.ran(control)

    async def infer_stream(
        self, entry: ModelEntry, request: Payload, deadline: float, routing: Routing
    ) -> AsyncIterator[bytes]:
        """A decoupled model's responses (serialized ModelInferResponses) as its
        worker yields them; the stream's closing response last, if it has one.
        Counted once in the statistics, when the stream ends."""
        settings = entry.settings
        assert settings is not None and entry.policy.decoupled
        plan = self._plan(entry, routing, deadline)
        if entry.key in self.inline:
            if settings.sequence is not None:
                raise Unimplemented(
                    f"decoupled sequence model '{entry.name}' runs on workers only; "
                    "set parallel_workers to 1 or more"
                )
            async for body in self.inline.stream(entry, self._inline(request), plan.deadline):
                yield bytes(body)
            return
        began = time.monotonic_ns()
        pinned, name, control, table = None, "", None, None
        if settings.sequence is not None:  # a decoupled sequence model: on its worker
            table = self._sequence_table(entry)
            try:
                control = peek_sequence(scheduling_view(request, routing))
                pinned, name = table.route(control)
            except ServingError as exc:
                entry.stats.record_failure(0, error=exc)
                raise
        try:
            async for item in self.dispatcher.submit_stream(
                request,
                plan.deadline,
                window=settings.stream_window,
                priority=plan.priority,
                tag=entry.key,
                timeout=settings.timeout_s,
                precision=plan.precision,
                pinned=pinned,
                sequence=name,
            ):
                if isinstance(item, Result):
                    entry.stats.record_success(
                        item.queue_ns, item.timings, time.monotonic_ns() - began
                    )
                    if item.body:
                        yield bytes(item.body)
                    return
                yield item
        except ServingError as exc:
            entry.stats.record_failure(time.monotonic_ns() - began, error=exc)
            raise
        finally:
            if table is not None and control is not None:
                table.ran(control)

    def infer_now(
        self, entry: ModelEntry, request: Payload, deadline: float, routing: Routing
    ) -> bytes | None:
        """The answer on the spot: a hit of the response cache, or an inline model
        declared fast; None for the rest."""
        fast = self.inline.runs_on_loop(entry.key)
        if not fast and not self.cache.caches(entry):
            return None
        if entry.settings is not None and entry.settings.sequence is not None:
            return None  # through infer: the sequence rules apply
        if not entry.policy.unary:
            return None  # refused by infer
        plan = self._plan(entry, routing, deadline)
        probe, hit = self._look_up(entry, request, routing, count_miss=fast)
        if hit is not None or not fast:
            return hit  # a miss on a worker's model: begin or infer computes it
        if self.reject_hopeless:
            self._reject_if_hopeless(entry, plan.deadline)
        body = self.inline.infer_now(entry, self._inline(request), plan.deadline)
        if probe is not None:
            self._keep(entry, probe, body)
        return body

    def _inline(self, request: Payload) -> Payload:
        """What an inline model reads: a large request's slab (its reply goes
        back inline), any other request as it is."""
        if not is_enveloped(request):
            return request
        return self.slabs.request(parse(request)[0])

    @staticmethod
    def _plan(entry: ModelEntry, routing: Routing, deadline: float) -> Schedule:
        """The request's queue level and deadline (schedule_policy: priority, timeout)."""
        levels = entry.settings.priority if entry.settings is not None else PriorityLevels()
        try:
            return schedule(
                entry.name, levels, routing.priority, routing.timeout_us, deadline, time.monotonic()
            )
        except InvalidInput as exc:
            entry.stats.record_failure(0, error=exc)
            raise

    @staticmethod
    def _reject_if_hopeless(entry: ModelEntry, deadline: float) -> None:
        """Refuses at once a request that cannot finish in time (setting reject_hopeless)."""
        p50 = entry.stats.p50_compute_s()
        remaining = deadline - time.monotonic()
        if p50 is not None and remaining < p50:
            hopeless = DeadlineExceeded(
                f"rejected on arrival: {remaining * 1000:.1f} ms left, below model "
                f"'{entry.name}' recent median compute time of {p50 * 1000:.1f} ms",
                stage="pool",
            )
            entry.stats.record_failure(0, error=hopeless)
            raise hopeless
