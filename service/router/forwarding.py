"""The router's one forwarding core, shared by every door.

A door (gRPC, HTTP) translates its call into: a model name, the request's
bytes, the client's remaining time and its trace context. The core turns the
remaining time into a deadline (or answers DEADLINE_EXCEEDED at once and
counts it), attaches the shared-memory registrations a request names, sends
the bytes over the model's pool's lane (a large body through a slab), and
records the pool and deadline on the call's span. Calls that are not
inferences go to the pool's gRPC socket with the same timeout and trace.
Cancellation is the caller's: a door whose client went away cancels the task
awaiting :meth:`Forwarder.infer`, and the lane tells the pool at once.
"""

from __future__ import annotations

import asyncio
import contextvars
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

import grpc
from opentelemetry.trace import Span

from poolserve.service.contract.errors import DeadlineExceeded, ServingError, Unavailable
from poolserve.service.contract.settings import ServerSettings
from poolserve.service.contract.slab import MAX_BODY as SLAB_MAX_BODY
from poolserve.service.contract.slab import THRESHOLD as SLAB_THRESHOLD
from poolserve.service.contract.slab import without_raw_inputs
from poolserve.service.grpcserver.handlers import NO_DEADLINE_S
from poolserve.service.grpcserver.shm import SharedMemory
from poolserve.service.grpcserver.status import STAGE_METADATA, from_upstream
from poolserve.service.grpcserver.tracing import Tracing, carried, strip_carried
from poolserve.service.router.lane_client import Lend
from poolserve.service.router.routes import PoolRoute, Routes
from poolserve.service.router.slab_sink import SlabSink

# The router's span of the call being handled (each call runs in its own task).
SPAN: contextvars.ContextVar[Span | None] = contextvars.ContextVar("span", default=None)
Metadata = Sequence[tuple[str, Any]]


def _stage_of(exc: grpc.aio.AioRpcError) -> str:
    for key, value in exc.trailing_metadata() or ():
        if key == STAGE_METADATA:
            return str(value)
    return ""


class Forwarder:
    """Lane, deadline, trace span and the router's own counters for every door."""

    def __init__(
        self, settings: ServerSettings, routes: Routes, shared_memory: SharedMemory
    ) -> None:
        self.settings = settings
        self.routes = routes
        self.shared_memory = shared_memory
        self.tracing: Tracing | None = None  # set in serve(): never before a fork
        # Deadlines spent before the router could forward, by (model, version, pool).
        self.router_deadlines: Counter[tuple[str, str, str]] = Counter()
        self.requests = 0  # inference calls this router took (poolserve_router_requests_total)
        # Streams ended by stream_stall_s, by model (the doors count them).
        self.streams_stalled: Counter[str] = Counter()

    def timeout(self, remaining: float | None) -> float:
        """The time a call may take from now: the client's ``remaining`` (None or
        huge: none given, ``default_timeout_s``) less ``deadline_margin_ms``."""
        if remaining is None or remaining > NO_DEADLINE_S:
            remaining = self.settings.default_timeout_s
        timeout = remaining - self.settings.deadline_margin_ms / 1000
        if timeout <= 0:
            raise DeadlineExceeded(
                "deadline spent before the router could forward the call", stage="router"
            )
        return timeout

    def deadline(self, remaining: float | None) -> float:
        """:meth:`timeout` as an absolute time on the monotonic clock."""
        return time.monotonic() + self.timeout(remaining)

    def count_router_deadline(self, exc: DeadlineExceeded, name: str, version: str) -> None:
        route = self.routes.routes.get(name)
        if exc.stage == "router" and route is not None:
            self.router_deadlines[(name, version, route.gid)] += 1

    def count_stalled(self, name: str) -> None:
        """A stream of model ``name`` ended by stream_stall_s."""
        self.streams_stalled[name] += 1

    async def infer(
        self,
        name: str,
        version: str,
        body: bytes,
        remaining: float | None,
        carrier: Iterable[tuple[str, Any]] | None,
        head: bytes | None = None,
        attached: bool = False,
    ) -> bytes:
        """One inference over the model's pool's lane: frames, not a second gRPC hop.

        ``carrier``: the caller's trace context (metadata or headers), passed
        on when the router does not trace itself (the pool may). ``head``: the
        body without its tensors' bytes, when the door has it (a large body's
        envelope carries it for the pool's peeks); else found here.
        ``attached``: the door put the shared-memory registrations in front itself.
        """
        reply = await self.infer_lent(name, version, body, remaining, carrier, None, head, attached)
        assert isinstance(reply, bytes)
        return reply

    async def infer_lent(
        self,
        name: str,
        version: str,
        body: bytes | memoryview,
        remaining: float | None,
        carrier: Iterable[tuple[str, Any]] | None,
        lend: Lend | None,
        head: bytes | None = None,
        attached: bool = False,
        sunk: SlabSink | None = None,
    ) -> bytes | memoryview:
        """:meth:`infer`; with ``lend`` (a door that sends views and frees the
        slab once the reply left: lane_client.Lend) a large reply may be a view;
        ``sunk``: the slab ``body`` was received into (router/slab_sink.py)."""
        self.requests += 1
        try:
            route = self.routes.route(name)
            deadline = self.deadline(remaining)
        except DeadlineExceeded as exc:
            self.count_router_deadline(exc, name, version)
            raise
        return await self._send(route, name, body, deadline, carrier, head, attached, lend, sunk)

    async def step(
        self,
        name: str,
        body: bytes,
        deadline: float,
        carrier: Iterable[tuple[str, Any]] | None,
        attached: bool = False,
    ) -> bytes:
        """One step of an ensemble (router/ensemble.py): an inference of model
        ``name`` with the ensemble's absolute ``deadline``, shared by its steps;
        ``attached``: the body is the router's own envelope (a chain), sent as it is."""
        route = self.routes.route(name)
        if deadline <= time.monotonic():
            raise DeadlineExceeded(
                "deadline spent before the router could forward the step", stage="router"
            )
        reply = await self._send(route, name, body, deadline, carrier, None, attached, None, None)
        assert isinstance(reply, bytes)
        return reply

    async def _send(
        self,
        route: PoolRoute,
        name: str,
        body: bytes | memoryview,
        deadline: float,
        carrier: Iterable[tuple[str, Any]] | None,
        head: bytes | None,
        attached: bool,
        lend: Lend | None,
        sunk: SlabSink | None,
    ) -> bytes | memoryview:
        span = SPAN.get()
        trace: list[tuple[str, str]]
        if span is not None:
            span.set_attribute(
                "poolserve.deadline.remaining_ms", (deadline - time.monotonic()) * 1000
            )
            span.set_attribute("poolserve.pool", route.gid)
            trace = Tracing.carry(span)
        else:  # the pool may trace even when the router does not
            trace = carried(carrier)
        assert route.lane is not None
        if head is None and SLAB_THRESHOLD < len(body) <= SLAB_MAX_BODY:
            head = without_raw_inputs(body)
        if isinstance(body, memoryview):  # received into its slab (slab_sink.py)
            if not attached and self.shared_memory.needs_attach(body, head):
                body = self.shared_memory.attach(bytes(body), head)
        elif not attached:
            # the registrations of the regions it names go with it (no copy when it names none)
            body = self.shared_memory.attach(body, head)
        return await route.lane.call(body, deadline, trace, name, head, lend, sunk)

    async def forward(
        self,
        route: PoolRoute,
        method: str,
        body: bytes,
        remaining: float | None,
        metadata: Metadata,
    ) -> bytes:
        """A call that is not an inference, on the pool's gRPC socket."""
        timeout = self.timeout(remaining)
        span = SPAN.get()
        if span is not None:
            span.set_attribute("poolserve.deadline.remaining_ms", timeout * 1000)
            span.set_attribute("poolserve.pool", route.gid)
            metadata = (*strip_carried(metadata), *Tracing.carry(span))
        try:
            return await route.calls[method](body, timeout=timeout, metadata=metadata)
        except grpc.aio.AioRpcError as exc:
            details = exc.details() or ""
            stage = _stage_of(exc)
            if exc.code() is grpc.StatusCode.DEADLINE_EXCEEDED and not stage:
                details = f"deadline exceeded waiting for {route.where} to answer"
                stage = "pool"
            if exc.code() is grpc.StatusCode.CANCELLED:
                # Our caller did not cancel (or this task would be cancelled, not
                # here): the pool dropped the call while stopping. Try again elsewhere.
                raise Unavailable(f"{route.where} dropped the call while stopping") from None
            raise from_upstream(exc.code(), details, route.where, stage) from None

    async def gather(
        self, method: str, body: bytes, remaining: float | None, metadata: Metadata
    ) -> list[tuple[PoolRoute, bytes | ServingError]]:
        """One call to every pool; each answer or its error."""

        async def one(route: PoolRoute) -> tuple[PoolRoute, bytes | ServingError]:
            try:
                return route, await self.forward(route, method, body, remaining, metadata)
            except ServingError as exc:
                return route, exc

        return list(await asyncio.gather(*(one(r) for r in self.routes.pools.values())))
