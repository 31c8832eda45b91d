"""The InferBackend of a pool server: a request goes to an inline model or,
through the dispatcher, to a forked worker, after its schedule (priority
level, deadline) is planned and, with ``reject_hopeless``, a request that
cannot finish in time is refused on arrival."""

from __future__ import annotations

import time

from poolserve.service.contract.errors import (
    DeadlineExceeded,
    InvalidInput,
    MessageTooLarge,
    ServingError,
)
from poolserve.service.contract.framing import Payload
from poolserve.service.contract.schedule import PriorityLevels, Schedule, schedule
from poolserve.service.contract.wire import Routing
from poolserve.service.poolcore.dispatcher import Dispatcher
from poolserve.service.poolserver.catalog import ModelEntry
from poolserve.service.poolserver.inline import InlineRunner
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
    ) -> None:
        self.max_message_size = max_message_size
        self.dispatcher = dispatcher
        self.inline = inline
        self.needs_workers = needs_workers
        self.reject_hopeless = reject_hopeless

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
        plan = self._plan(entry, routing, deadline)
        if self.reject_hopeless:
            self._reject_if_hopeless(entry, plan.deadline)
        if entry.name in self.inline:
            return await self.inline.infer(entry, request, plan, observe)
        began = time.monotonic_ns()
        try:
            result = await self.dispatcher.submit(
                request,
                plan.deadline,
                priority=plan.priority,
                idempotent=routing.idempotent,
                tag=entry.name,
                timeout=entry.settings.timeout_s if entry.settings is not None else None,
                precision=plan.precision,
            )
        except DeadlineExceeded:
            entry.stats.record_failure(time.monotonic_ns() - began)
            raise
        except ServingError:
            entry.stats.record_failure(time.monotonic_ns() - began)
            raise
        if len(result.body) > self.max_message_size:
            entry.stats.record_failure(time.monotonic_ns() - began)
            raise MessageTooLarge.reply(entry.name, len(result.body), self.max_message_size)
        entry.stats.record_success(result.queue_ns, result.timings, time.monotonic_ns() - began)
        if observe is not None:
            observe(result)
        return result.body

    def infer_now(
        self, entry: ModelEntry, request: Payload, deadline: float, routing: Routing
    ) -> bytes | None:
        """The answer on the spot for an inline model declared fast; None for the rest."""
        if not self.inline.runs_on_loop(entry.name):
            return None
        plan = self._plan(entry, routing, deadline)
        if self.reject_hopeless:
            self._reject_if_hopeless(entry, plan.deadline)
        return self.inline.infer_now(entry, request, plan.deadline)

    @staticmethod
    def _plan(entry: ModelEntry, routing: Routing, deadline: float) -> Schedule:
        """The request's queue level and deadline (schedule_policy: priority, timeout)."""
        levels = entry.settings.priority if entry.settings is not None else PriorityLevels()
        try:
            return schedule(
                entry.name, levels, routing.priority, routing.timeout_us, deadline, time.monotonic()
            )
        except InvalidInput:
            entry.stats.record_failure(0)
            raise

    @staticmethod
    def _reject_if_hopeless(entry: ModelEntry, deadline: float) -> None:
        """Refuses at once a request that cannot finish in time (setting reject_hopeless)."""
        p50 = entry.stats.p50_compute_s()
        remaining = deadline - time.monotonic()
        if p50 is not None and remaining < p50:
            entry.stats.record_failure(0)
            raise DeadlineExceeded(
                f"rejected on arrival: {remaining * 1000:.1f} ms left, below model "
                f"'{entry.name}' recent median compute time of {p50 * 1000:.1f} ms",
                stage="pool",
            )
