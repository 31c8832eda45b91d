"""The router: the only door clients see.

It stays thin: request bytes in, response bytes out. For calls about one
model it reads only the model name from the wire bytes (never the tensors)
and forwards the bytes over a channel kept open to the pool's unix socket,
with the client's remaining deadline and metadata. It follows every pool's
health through Watch streams (push, not polling), so ServerReady and its own
grpc.health.v1 agree and never claim ready while any configured model is not.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import logging
import signal
import time
from collections import Counter
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry.trace import Span

from poolserve.protos import control_pb2 as cpb
from poolserve.protos import inference_pb2 as pb
from poolserve.service import __version__
from poolserve.service.contract.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    Failure,
    InvalidInput,
    ModelNotReady,
    ServingError,
    StreamStalled,
    Unavailable,
    clip,
    load_failed,
    unknown_model,
)
from poolserve.service.contract.lane import lane_path, refused_request
from poolserve.service.contract.repository import Repository, scan
from poolserve.service.contract.rundir import (
    ADDRESS_FILE,
    METRICS_ADDRESS_FILE,
    ROUTER_CONTROL_SOCKET,
    FileId,
    file_id,
    pool_socket_path,
    remove_own,
)
from poolserve.service.contract.settings import ConfigError, ServerSettings
from poolserve.service.contract.shm import forged
from poolserve.service.contract.slab import MAX_BODY as SLAB_MAX_BODY
from poolserve.service.contract.slab import THRESHOLD as SLAB_THRESHOLD
from poolserve.service.contract.slab import Arena, without_raw_inputs
from poolserve.service.contract.wire import peek_model
from poolserve.service.grpcserver.handlers import (
    EXTENSIONS,
    NO_DEADLINE_S,
    SERVICE,
    abort,
    guarded,
)
from poolserve.service.grpcserver.health import SERVING, Health
from poolserve.service.grpcserver.pacing import Rescanner
from poolserve.service.grpcserver.shm import SharedMemory
from poolserve.service.grpcserver.sockets import bind_private_unix
from poolserve.service.grpcserver.status import STAGE_METADATA, from_upstream, grpc_status
from poolserve.service.grpcserver.tracing import Tracing, carried, deadline_event, strip_carried
from poolserve.service.lifecycle.limits import (
    return_large_frees,
    trim_freed_memory,
    trim_heap,
    watch_descriptors,
)
from poolserve.service.router.lane_client import LaneClient
from poolserve.service.router.metrics import MetricsSource, RouterCounts
from poolserve.service.router.metrics_http import MetricsServer
from poolserve.service.router.model_repository import model_repository_handler
from poolserve.service.router.replybudget import TRACKED_REPLY, ReplyBudget
from poolserve.service.router.streams import StreamLimit

log = logging.getLogger(__name__)

_DROP_METADATA = frozenset({"user-agent", "content-type", "te", "host"})
ROUTED = ("ModelInfer", "ModelReady", "ModelMetadata", "ModelConfig", "ModelStatistics")
RETRY_WATCH_S = (0.05, 1.0)
DESCRIPTOR_CHECK_S = 1.0
HEAP_CHECK_S = 1.0  # freed memory given back within this (limits.HeapTrimmer)
ROUTER_CONTROL_SERVICE = "poolserve.control.v1.RouterControl"
Handler = Callable[[bytes, Any], Awaitable[bytes]]
# The router's span of the call being handled (each RPC runs in its own task).
_SPAN: contextvars.ContextVar[Span | None] = contextvars.ContextVar(
    "span", default=None
)  # host:port actually bound (useful with --grpc-port 0)


_ERROR_MESSAGE_TAG = b"\x0a"  # ModelStreamInferResponse field 1 (error_message), first when set


class _Counted:
    """An async iterator of a stream's requests that counts what it hands on."""

    def __init__(self, requests: AsyncIterator[bytes]) -> None:
        self._requests = requests
        self.count = 0

    def __aiter__(self) -> _Counted:
        return self

    async def __anext__(self) -> bytes:
        message = await anext(self._requests)
        self.count += 1
        return message


@dataclass(eq=False)
class PoolRoute:
    gid: str
    path: Path
    models: list[str]
    channel: grpc.aio.Channel | None = None
    lane: LaneClient | None = None
    calls: dict[str, grpc.aio.UnaryUnaryMultiCallable[bytes, bytes]] = field(default_factory=dict)
    serving: bool = False
    responsive: bool = True  # answered a lane PING within heartbeat_timeout_s
    model_serving: dict[str, bool] = field(default_factory=dict)
    watchers: list[asyncio.Task[None]] = field(default_factory=list)

    @property
    def where(self) -> str:
        return f"pool '{self.gid}'"


def _stage_of(exc: grpc.aio.AioRpcError) -> str:
    for key, value in exc.trailing_metadata() or ():
        if key == STAGE_METADATA:
            return str(value)
    return ""


def _peek_model_name_field2(data: bytes) -> str:
    """RepositoryModelLoad/Unload carry the model name in field 2."""
    return peek_model(data)[1]


def server_credentials(settings: ServerSettings) -> grpc.ServerCredentials | None:
    """TLS for the router's port when configured; mutual TLS with a client CA."""
    if not settings.tls_cert_file:
        return None
    key = Path(settings.tls_key_file).read_bytes()
    cert = Path(settings.tls_cert_file).read_bytes()
    client_ca = (
        Path(settings.tls_client_ca_file).read_bytes() if settings.tls_client_ca_file else None
    )
    return grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=client_ca, require_client_auth=client_ca is not None
    )


def server_options(settings: ServerSettings) -> list[tuple[str, int]]:
    """The router port's channel options: message sizes, and how long a
    connection may sit in its handshake, idle, or silent under a call."""
    limit = settings.max_message_size
    options = [
        ("grpc.max_receive_message_length", limit),
        ("grpc.max_send_message_length", limit),
        # No grpc.max_concurrent_streams: in grpcio 1.81 it bounds the whole
        # server, not one connection; the router counts them (streams.py).
        ("grpc.so_reuseport", 0),
        # The client's HTTP/2 SETTINGS (and the TLS handshake) must come within
        # this, or the connection is closed: a connection that only sent the
        # preface no longer holds a descriptor for gRPC's default 120 s.
        ("grpc.server_handshake_timeout_ms", _ms(settings.handshake_timeout_s)),
        # Pings on connections with calls in flight find peers that vanished;
        # idle connections are closed by max_connection_idle_ms instead.
        ("grpc.keepalive_time_ms", _ms(settings.keepalive_time_s)),
        ("grpc.keepalive_timeout_ms", _ms(settings.keepalive_timeout_s)),
        ("grpc.keepalive_permit_without_calls", 0),
        ("grpc.http2.max_pings_without_data", 0),
    ]
    if settings.max_connection_idle_s > 0:
        options.append(("grpc.max_connection_idle_ms", _ms(settings.max_connection_idle_s)))
    if settings.max_connection_age_s > 0:
        options.append(("grpc.max_connection_age_ms", _ms(settings.max_connection_age_s)))
        grace = _ms(settings.max_connection_age_grace_s)
        options.append(("grpc.max_connection_age_grace_ms", grace))
    return options


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))


class Router:
    def __init__(
        self,
        repository: Repository,
        settings: ServerSettings,
        run_dir: Path,
        repo: Path | None = None,
    ) -> None:
        self.settings = settings
        self.repo = repo
        self.address_file = run_dir / ADDRESS_FILE
        self.invalid = {bad.name: bad.reason for bad in repository.invalid}
        self.pools: dict[str, PoolRoute] = {}
        self.routes: dict[str, PoolRoute] = {}
        for gid, models in repository.pools().items():
            route = PoolRoute(gid, pool_socket_path(run_dir, gid), [m.name for m in models])
            self.pools[gid] = route
            for name in route.models:
                self.routes[name] = route
        self.health = Health()
        # the one registry of the whole server
        self.shared_memory = SharedMemory.from_settings(settings)
        # large ModelInfer bodies go to the workers through these (contract/slab.py)
        self.arena = Arena(min(settings.max_message_size, SLAB_MAX_BODY))
        self.replies = ReplyBudget(
            settings.max_unread_reply_bytes,
            settings.max_unread_reply_bytes_total,
            give_back=trim_freed_memory,
            grace=settings.unread_reply_grace_s,
        )
        self.streams = StreamLimit(settings.max_concurrent_streams)  # per connection
        self._stop = asyncio.Event()
        self._tasks: asyncio.TaskGroup | None = None
        self._generation = 0
        self.control_path = run_dir / ROUTER_CONTROL_SOCKET
        self._control_bound: FileId | None = None  # what we bound and wrote, we remove
        self._address_written: FileId | None = None
        self.tracing: Tracing | None = None  # set in serve(): never before a fork
        self.rescanner = Rescanner(
            lambda: scan(repo) if repo is not None else repository,
            settings.repository_rescan_s,
            initial=repository,
        )
        self.port = 0
        self.metrics_port = 0  # bound by serve() when metrics_port is not -1
        self.metrics_address_file = run_dir / METRICS_ADDRESS_FILE
        self._metrics_written: FileId | None = None
        # Deadlines spent before the router could forward, by (model, version, pool).
        self.router_deadlines: Counter[tuple[str, str, str]] = Counter()
        self.metrics = MetricsSource(
            lambda: {gid: route.channel for gid, route in self.pools.items()},
            lambda: RouterCounts(self.router_deadlines, self._routed_models()),
        )

    def _routed_models(self) -> list[tuple[str, str]]:
        """(model, pool) of every route: the series the router's own counters cover."""
        return [(name, route.gid) for name, route in self.routes.items()]

    # -- readiness -------------------------------------------------------------

    def ready(self) -> bool:
        return (
            not self.invalid
            and bool(self.pools)
            and all(route.serving and route.responsive for route in self.pools.values())
        )

    def _sync_health(self) -> None:
        ready = self.ready()
        self.health.set_many({"": ready, SERVICE: ready})
        for name, route in self.routes.items():
            serving = route.model_serving.get(name, False) and route.responsive
            self.health.set(f"model:{name}", serving)
        for name in self.invalid:
            if name not in self.routes:  # a broken duplicate must not shadow a good model
                self.health.set(f"model:{name}", False)

    async def _watch(self, route: PoolRoute, service: str, apply: Callable[[bool], None]) -> None:
        """Follows one health service of a pool for the router's whole life."""
        assert route.channel is not None
        stub = health_pb2_grpc.HealthStub(route.channel)
        delay = RETRY_WATCH_S[0]
        while True:
            try:
                stream = stub.Watch(
                    health_pb2.HealthCheckRequest(service=service), wait_for_ready=True
                )
                async for reply in stream:
                    apply(reply.status == SERVING)
                    delay = RETRY_WATCH_S[0]
            except grpc.aio.AioRpcError:
                pass
            apply(False)  # the stream broke: the pool is down until it says otherwise
            await asyncio.sleep(delay)  # back-off between reconnects, not a readiness wait
            delay = min(delay * 2, RETRY_WATCH_S[1])

    async def _heartbeat(self, route: PoolRoute) -> None:
        """Pings the pool's lane every heartbeat_interval_s for the router's whole life.

        A Watch stream only breaks when the pool's socket does: a pool that is
        stopped (SIGSTOP) or whose event loop is blocked keeps it open and
        silent. A pool that has not answered for heartbeat_timeout_s is
        NOT_SERVING, with its models, until it answers again. The ping is
        answered by the pool's event loop itself, so it proves what a call needs.
        """
        assert route.lane is not None
        loop = asyncio.get_running_loop()
        interval = self.settings.heartbeat_interval_s
        limit = self.settings.heartbeat_timeout_s
        answered = loop.time()
        while True:
            try:
                if route.responsive:
                    async with asyncio.timeout_at(answered + limit):
                        await route.lane.ping()
                else:
                    await route.lane.ping()  # silent already: wait for any answer
            except TimeoutError:
                self._set_responsive(route, False, loop.time() - answered)
                continue
            except Unavailable:
                pass  # down, not silent: its Watch streams say so, and reconnect
            answered = loop.time()
            self._set_responsive(route, True, 0.0)
            await asyncio.sleep(interval)

    def _set_responsive(self, route: PoolRoute, responsive: bool, silent_s: float) -> None:
        if route.responsive == responsive:
            return
        route.responsive = responsive
        if responsive:
            log.info("router: %s answers its heartbeat again", route.where)
        else:
            log.warning(
                "router: %s has not answered its heartbeat for %.1f s "
                "(stopped, or its event loop is blocked): NOT_SERVING",
                route.where,
                silent_s,
            )
        self._sync_health()

    def _pool_applier(self, route: PoolRoute) -> Callable[[bool], None]:
        def apply(serving: bool) -> None:
            if route.serving != serving:
                log.info("router: %s %s", route.where, "SERVING" if serving else "NOT_SERVING")
            route.serving = serving
            self._sync_health()

        return apply

    def _model_applier(self, route: PoolRoute, name: str) -> Callable[[bool], None]:
        def apply(serving: bool) -> None:
            route.model_serving[name] = serving
            self._sync_health()

        return apply

    # -- forwarding ------------------------------------------------------------

    def _route(self, name: str) -> PoolRoute:
        route = self.routes.get(name)
        if route is not None:
            return route
        if name in self.invalid:
            raise ModelNotReady(f"model '{name}' is unavailable: {self.invalid[name]}")
        raise unknown_model(name)

    def _timeout(self, context: grpc.aio.ServicerContext[Any, Any]) -> float:
        remaining = context.time_remaining()
        if remaining is None or remaining > NO_DEADLINE_S:
            remaining = self.settings.default_timeout_s
        timeout = remaining - self.settings.deadline_margin_ms / 1000
        if timeout <= 0:
            raise DeadlineExceeded(
                "deadline spent before the router could forward the call", stage="router"
            )
        return timeout

    @staticmethod
    def _metadata(context: grpc.aio.ServicerContext[Any, Any]) -> tuple[tuple[str, Any], ...]:
        return tuple(
            (key, value)
            for key, value in context.invocation_metadata() or ()
            if not key.startswith(("grpc-", ":")) and key not in _DROP_METADATA
        )

    def _deadline(self, context: grpc.aio.ServicerContext[Any, Any]) -> float:
        return time.monotonic() + self._timeout(context)

    async def _infer(
        self,
        route: PoolRoute,
        body: bytes,
        context: grpc.aio.ServicerContext[Any, Any],
        model: str = "",
    ) -> bytes:
        """ModelInfer over the pool's lane: frames, not a second gRPC hop."""
        deadline = self._deadline(context)
        span = _SPAN.get()
        trace: list[tuple[str, str]]
        if span is not None:
            span.set_attribute(
                "poolserve.deadline.remaining_ms", (deadline - time.monotonic()) * 1000
            )
            span.set_attribute("poolserve.pool", route.gid)
            trace = Tracing.carry(span)
        else:  # the pool may trace even when the router does not
            trace = carried(context.invocation_metadata())
        assert route.lane is not None
        # a large body's head: what the pool peeks at, and where a region is named
        head = without_raw_inputs(body) if SLAB_THRESHOLD < len(body) <= SLAB_MAX_BODY else None
        # the registrations of the regions it names go with it (no copy when it names none)
        body = self.shared_memory.attach(body, head)
        return await route.lane.call(body, deadline, trace, model, head)

    async def _forward(
        self,
        route: PoolRoute,
        method: str,
        body: bytes,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> bytes:
        timeout = self._timeout(context)
        metadata = self._metadata(context)
        span = _SPAN.get()
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

    def _routed(self, method: str) -> Callable[[bytes, Any], Awaitable[bytes]]:
        async def handler(body: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
            name, version = peek_model(body)
            span = _SPAN.get()
            if span is not None:
                span.set_attribute("poolserve.model.name", name)
                span.set_attribute("poolserve.model.version", version)
            if method == "ModelStatistics" and not name:
                return await self._all_statistics(context)
            if method == "ModelReady" and name not in self.routes:
                # As Triton: a model that does not exist is not ready; no NOT_FOUND.
                return pb.ModelReadyResponse(ready=False).SerializeToString()
            try:
                if method == "ModelInfer":
                    if self.replies.total:  # someone is not reading: is it this connection?
                        self.replies.check(context)
                    reply = await self._infer(self._route(name), body, context, name)
                    if len(reply) >= TRACKED_REPLY:
                        await self.replies.track(context, len(reply))
                    return reply
                return await self._forward(self._route(name), method, body, context)
            except DeadlineExceeded as exc:
                if exc.stage == "router" and name in self.routes:
                    self.router_deadlines[(name, version, self.routes[name].gid)] += 1
                raise

        handler.__name__ = method
        return handler

    def _routed_by_field2(self, method: str) -> Callable[[bytes, Any], Awaitable[bytes]]:
        async def handler(body: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
            name = _peek_model_name_field2(body)
            try:
                return await self._control(method, name, body, context)
            except ServingError as exc:
                if method == "RepositoryModelLoad":
                    raise load_failed(name, exc) from None
                raise

        handler.__name__ = method
        return handler

    async def _control(
        self, method: str, name: str, body: bytes, context: grpc.aio.ServicerContext[Any, Any]
    ) -> bytes:
        if not self.settings.model_control:
            # Checked here, at the public door: the pools' private sockets always
            # accept loads, so that `poolserve reload` can use them.
            raise FailedPrecondition(
                "loading and unloading models through the API is disabled (model_control)"
            )
        if method == "RepositoryModelLoad" and name not in self.routes:
            await self._learn_route(name)
        return await self._forward(self._route(name), method, body, context)

    async def _learn_route(self, name: str) -> None:
        """A model added to the repository after start: route it to its pool.

        The repository is scanned on a thread, at most once per
        repository_rescan_s, and every load waiting for a name shares the scan:
        a flood of loads for names that do not exist costs one scan per interval.
        """
        if self.repo is None:
            return
        try:
            repository = await self.rescanner.fresh()
        except ConfigError as exc:
            raise FailedPrecondition(f"the repository cannot be scanned: {exc}") from None
        settings = repository.model(name)
        if settings is None or name in self.routes:
            return  # not there: _route answers NOT_FOUND; or a concurrent load routed it
        route = self.pools.get(settings.gid)
        if route is None:
            raise FailedPrecondition(
                f"model '{name}' needs a new pool '{settings.gid}': run `poolserve reload` "
                "(or send SIGHUP to the supervisor) to start it"
            )
        self.invalid.pop(name, None)
        route.models.append(name)
        self.routes[name] = route
        self._watch_model(route, name)

    # -- aggregated answers --------------------------------------------------

    async def server_live(self, _: bytes, __: Any) -> bytes:
        return pb.ServerLiveResponse(live=True).SerializeToString()

    async def server_ready(self, _: bytes, __: Any) -> bytes:
        return pb.ServerReadyResponse(ready=self.ready()).SerializeToString()

    async def server_metadata(self, _: bytes, __: Any) -> bytes:
        return pb.ServerMetadataResponse(
            name=self.settings.server_name, version=__version__, extensions=list(EXTENSIONS)
        ).SerializeToString()

    async def _gather(
        self, method: str, body: bytes, context: grpc.aio.ServicerContext[Any, Any]
    ) -> list[tuple[PoolRoute, bytes | ServingError]]:
        async def one(route: PoolRoute) -> tuple[PoolRoute, bytes | ServingError]:
            try:
                return route, await self._forward(route, method, body, context)
            except ServingError as exc:
                return route, exc

        return list(await asyncio.gather(*(one(r) for r in self.pools.values())))

    async def repository_index(self, body: bytes, context: Any) -> bytes:
        request = pb.RepositoryIndexRequest.FromString(body)
        all_models = pb.RepositoryIndexRequest(repository_name=request.repository_name)
        merged = pb.RepositoryIndexResponse()
        for route, answer in await self._gather(
            "RepositoryIndex", all_models.SerializeToString(), context
        ):
            if isinstance(answer, ServingError):
                for name in route.models:
                    merged.models.add(
                        name=name,
                        state="UNAVAILABLE",
                        reason=f"{route.where} is not answering: {answer.message}",
                    )
            else:
                merged.models.extend(pb.RepositoryIndexResponse.FromString(answer).models)
        for name, reason in self.invalid.items():
            merged.models.add(name=name, state="UNAVAILABLE", reason=reason)
        if request.ready:
            kept = [m for m in merged.models if m.state == "READY"]
            del merged.models[:]
            merged.models.extend(kept)
        return merged.SerializeToString()

    async def _all_statistics(self, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
        merged = pb.ModelStatisticsResponse()
        empty = pb.ModelStatisticsRequest().SerializeToString()
        for _, answer in await self._gather("ModelStatistics", empty, context):
            if not isinstance(answer, ServingError):
                merged.model_stats.extend(pb.ModelStatisticsResponse.FromString(answer).model_stats)
        return merged.SerializeToString()

    async def model_stream_infer(
        self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[bytes]:
        """A ModelStreamInfer, with a SERVER span for the whole stream when tracing
        is on: its model and pool, how many requests came and how many responses
        (and error responses) went, its status and where its deadline ran out."""
        tracing = self.tracing
        if tracing is None:
            try:
                async for reply in self._stream_infer(requests, context, None):
                    yield reply
            except ServingError as exc:  # MLServer's streams: the error is the stream's status
                await abort(context, *grpc_status(exc))
            return
        span = self._server_span(tracing, "ModelStreamInfer", context)
        counted = _Counted(requests)
        responses = errors = 0
        code = grpc.StatusCode.OK
        try:
            async with contextlib.aclosing(self._stream_infer(counted, context, span)) as replies:
                async for reply in replies:
                    responses += 1
                    errors += not self._mlserver_streams and reply[:1] == _ERROR_MESSAGE_TAG
                    yield reply
        except (asyncio.CancelledError, GeneratorExit):
            code = self._ended_early(span, context)
            raise
        except grpc.aio.AbortError:  # ended with a status (a client that stopped reading)
            code = context.code()  # set by the abort
            raise
        except ServingError as exc:  # MLServer's streams: the error is the stream's status
            code = grpc_status(exc)[0]
            await abort(context, *grpc_status(exc))
        finally:
            span.set_attribute("poolserve.stream.requests", counted.count)
            span.set_attribute("poolserve.stream.responses", responses)
            span.set_attribute("poolserve.stream.error_responses", errors)
            span.set_attribute("rpc.grpc.status_code", code.value[0])
            span.end()

    async def _stream_infer(
        self,
        requests: AsyncIterator[bytes],
        context: grpc.aio.ServicerContext[Any, Any],
        span: Span | None,
    ) -> AsyncGenerator[bytes, None]:
        """Routed by the model of its first routable message, over that model's
        pool's lane; the pool answers the rest in-stream. A message that cannot
        be routed before then is answered with its error, and the next one tried."""
        route: PoolRoute | None = None
        first = b""
        while route is None:
            taken = await anext(requests, None)
            if taken is None:
                return
            first = taken
            try:
                name, version = peek_model(first)
                route = self._route(name)
                deadline = self._deadline(context)
            except ServingError as exc:
                route = None
                yield self._stream_error(exc, exc.message)
        assert route.lane is not None
        if span is not None:
            span.set_attribute("poolserve.model.name", name)
            span.set_attribute("poolserve.model.version", version)
            span.set_attribute("poolserve.pool", route.gid)
            span.set_attribute(
                "poolserve.deadline.remaining_ms", (deadline - time.monotonic()) * 1000
            )
        try:
            attach = functools.partial(self._attach_in_stream, route)
            stall_s = self.settings.stream_stall_s
            lane = route.lane.stream(first, requests, deadline, attach, stall_s)
            async with contextlib.aclosing(lane):  # closed here, whatever ends the call
                async for item in lane:
                    if isinstance(item, StreamStalled):  # the client stopped reading: a status
                        await abort(context, *grpc_status(item))
                    if isinstance(item, ServingError):  # the stream failed as a whole
                        if span is not None and item.failure is Failure.DEADLINE:
                            deadline_event(span, item.stage or "router", item.message)
                        message = f"{grpc_status(item)[0].name}: {item.message}"
                        yield self._stream_error(item, message)
                        return
                    yield item
        except ServingError as exc:  # the lane is not reachable
            yield self._stream_error(exc, exc.message)

    @property
    def _mlserver_streams(self) -> bool:
        return self.settings.stream_messages == "mlserver"

    def _stream_error(self, exc: ServingError, message: str) -> bytes:
        """An error in a stream: a ModelStreamInferResponse with ``message`` (Triton,
        KServe); with MLServer's stream messages, raised: the stream's status."""
        if self._mlserver_streams:
            raise exc
        return pb.ModelStreamInferResponse(error_message=message).SerializeToString()

    def _attach_in_stream(self, route: PoolRoute, message: bytes) -> bytes:
        """A streamed request with its registrations. One that names an unknown
        region goes as it is, and the pool answers its error in the stream; one
        that starts with a zero byte (only the router may send such bytes to a
        pool), or that names a model of another pool, goes as its refusal,
        answered by the pool in the same place."""
        try:
            body = self.shared_memory.attach(message)
        except InvalidInput as exc:
            if forged(message):
                return refused_request(exc.message)
            return message
        try:
            name = peek_model(message)[0]
        except InvalidInput:
            return body  # the pool answers what cannot be parsed
        other = self.routes.get(name)
        if other is not None and other is not route:
            return refused_request(
                f"model '{clip(name)}' is served by pool '{other.gid}', not by this stream's "
                f"pool '{route.gid}': a ModelStreamInfer goes to the pool of its first "
                "request's model (open one stream per pool)"
            )
        return body

    @staticmethod
    def _server_span(
        tracing: Tracing, method: str, context: grpc.aio.ServicerContext[Any, Any]
    ) -> Span:
        """The router's SERVER span of one call, continuing the caller's trace."""
        attributes: dict[str, Any] = {
            "rpc.system": "grpc",
            "rpc.service": SERVICE,
            "rpc.method": method,
        }
        budget = context.time_remaining()
        if budget is not None and budget <= NO_DEADLINE_S:
            attributes["poolserve.deadline.budget_ms"] = budget * 1000
        return tracing.server_span(f"{SERVICE}/{method}", context.invocation_metadata(), attributes)

    @staticmethod
    def _ended_early(span: Span, context: grpc.aio.ServicerContext[Any, Any]) -> grpc.StatusCode:
        """The status of a call that ended before its answer: grpc ended it at its
        deadline (said as an event on the span), or the client cancelled it."""
        remaining = context.time_remaining()
        if remaining is not None and remaining <= 0:
            deadline_event(span, "pool", "deadline passed while the pool had the call")
            return grpc.StatusCode.DEADLINE_EXCEEDED
        return grpc.StatusCode.CANCELLED

    def _traced(self, method: str, fn: Handler) -> Handler:
        """A SERVER span per call, with the deadline budget and where it ran out."""
        tracing = self.tracing
        if tracing is None:
            return fn

        async def handler(body: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
            span = self._server_span(tracing, method, context)
            token = _SPAN.set(span)
            code = grpc.StatusCode.OK
            try:
                return await fn(body, context)
            except ServingError as exc:
                code = grpc_status(exc)[0]
                if exc.failure is Failure.DEADLINE:
                    deadline_event(span, exc.stage or "router", exc.message)
                raise
            except asyncio.CancelledError:
                code = self._ended_early(span, context)
                raise
            finally:
                _SPAN.reset(token)
                span.set_attribute("rpc.grpc.status_code", code.value[0])
                span.end()

        handler.__name__ = fn.__name__
        return handler

    def generic_handler(self) -> grpc.GenericRpcHandler:
        def unary(fn: Handler) -> grpc.RpcMethodHandler[Any, Any]:
            return grpc.unary_unary_rpc_method_handler(guarded(fn))

        def traced(method: str, fn: Handler) -> grpc.RpcMethodHandler[Any, Any]:
            return unary(self._traced(method, fn))

        handlers: dict[str, grpc.RpcMethodHandler[Any, Any]] = {
            m: traced(m, self._routed(m)) for m in ROUTED
        }
        handlers.update(
            {
                "ServerLive": unary(self.server_live),
                "ServerReady": unary(self.server_ready),
                "ServerMetadata": unary(self.server_metadata),
                "RepositoryIndex": traced("RepositoryIndex", self.repository_index),
                "RepositoryModelLoad": traced(
                    "RepositoryModelLoad", self._routed_by_field2("RepositoryModelLoad")
                ),
                "RepositoryModelUnload": traced(
                    "RepositoryModelUnload", self._routed_by_field2("RepositoryModelUnload")
                ),
                "ModelStreamInfer": grpc.stream_stream_rpc_method_handler(self.model_stream_infer),
                **self.shared_memory.handlers(),
            }
        )
        return grpc.method_handlers_generic_handler(SERVICE, handlers)

    # -- lifecycle ---------------------------------------------------------------

    def _open_channel(self, route: PoolRoute) -> None:
        limit = self.settings.max_message_size
        options = [
            ("grpc.max_receive_message_length", limit),
            ("grpc.max_send_message_length", limit),
        ]
        methods = (*ROUTED, "RepositoryIndex", "RepositoryModelLoad", "RepositoryModelUnload")
        route.channel = grpc.aio.insecure_channel(f"unix:{route.path}", options=options)
        route.calls = {m: route.channel.unary_unary(f"/{SERVICE}/{m}") for m in methods}
        route.lane = LaneClient(lane_path(route.path), route.where, self.arena)

    def _open_channels(self) -> None:
        for route in self.pools.values():
            self._open_channel(route)

    # -- live route updates (from the supervisor, on a private socket) -------

    async def set_routes(self, table: cpb.RouteTable, _: Any) -> cpb.SetRoutesResponse:
        """Applies a whole route table; replies once it is in force."""
        if table.generation <= self._generation:
            return cpb.SetRoutesResponse(generation=self._generation)
        self._generation = table.generation
        wanted = {p.gid: p for p in table.pools}
        removed = [route for gid, route in self.pools.items() if gid not in wanted]
        for gid, pool in wanted.items():
            route = self.pools.get(gid)
            if route is None:
                route = PoolRoute(gid, Path(pool.address.removeprefix("unix:")), [])
                self.pools[gid] = route
                self._open_channel(route)
                self._watch_pool(route)
            for name in pool.models:
                if name not in route.models:
                    route.models.append(name)
                    self._watch_model(route, name)
            route.models[:] = [m for m in route.models if m in set(pool.models)]
        for route in removed:
            del self.pools[route.gid]
        self.routes = {name: r for r in self.pools.values() for name in r.models}
        self.invalid = {bad.name: bad.reason for bad in table.invalid}
        self._sync_health()
        for route in removed:
            for task in route.watchers:
                task.cancel()
            if route.lane is not None:
                route.lane.close()
            if route.channel is not None:
                await route.channel.close(grace=self.settings.stop_grace_s)
        log.info(
            "router: routes generation %d: %d pools, %d models",
            table.generation,
            len(self.pools),
            len(self.routes),
        )
        return cpb.SetRoutesResponse(generation=table.generation)

    def _control_server(self) -> grpc.aio.Server:
        server = grpc.aio.server()
        handler = grpc.method_handlers_generic_handler(
            ROUTER_CONTROL_SERVICE,
            {
                "SetRoutes": grpc.unary_unary_rpc_method_handler(
                    guarded(self.set_routes),
                    cpb.RouteTable.FromString,
                    cpb.SetRoutesResponse.SerializeToString,
                )
            },
        )
        # Health here too: the supervisor follows it to say when the server is ready.
        server.add_generic_rpc_handlers((handler, self.health.generic_handler()))
        self._control_bound = bind_private_unix(server, self.control_path)
        return server

    def request_stop(self) -> None:
        self.health.shutdown()  # NOT_SERVING from the first moment of the stop
        self._stop.set()

    async def serve(self, ready: Callable[[], None], bind: str | None = None) -> None:
        self.tracing = Tracing.from_env("router")
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop)
        self._open_channels()
        self._sync_health()
        if return_large_frees():  # (tests/test_client_limits.py looks for this line)
            log.info("router: malloc maps buffers of 16 MiB and up on their own, reuses smaller")
        server = grpc.aio.server(options=server_options(self.settings))
        mlserver_repository = model_repository_handler(  # MLServer's, over the same calls
            self.repository_index,
            self._routed_by_field2("RepositoryModelLoad"),
            self._routed_by_field2("RepositoryModelUnload"),
        )
        server.add_generic_rpc_handlers(
            (
                self.streams.bound(self.generic_handler()),
                self.streams.bound(mlserver_repository),
                self.streams.bound(self.health.generic_handler()),
            )
        )
        address = bind or f"{self.settings.host}:{self.settings.grpc_port}"
        credentials = server_credentials(self.settings)
        try:
            if credentials is None:
                self.port = server.add_insecure_port(address)
            else:
                self.port = server.add_secure_port(address, credentials)
        except RuntimeError as exc:
            self.port = 0
            reason = str(exc)
        else:
            reason = "the address is in use or not ours"
        if self.port == 0:
            raise ConfigError("router", "grpc_port", f"cannot listen on {address}: {reason}")
        control = self._control_server()
        metrics = await self._start_metrics()
        async with asyncio.TaskGroup() as tasks:
            self._tasks = tasks
            fds = tasks.create_task(watch_descriptors("router", DESCRIPTOR_CHECK_S))
            heap = tasks.create_task(trim_heap(HEAP_CHECK_S))  # issue 28 §7
            rescanner = tasks.create_task(self.rescanner.serve(), name="rescanner")
            for route in self.pools.values():
                self._watch_pool(route)
                for name in route.models:
                    self._watch_model(route, name)
            await server.start()
            await control.start()
            self._publish_address()
            log.info("router: listening on %s", address)
            ready()
            await self._stop.wait()
            began = time.monotonic()
            await control.stop(0)
            if metrics is not None:
                await metrics.stop()
            await server.stop(self.settings.stop_grace_s)
            log.info("router: drained in %.3f s", time.monotonic() - began)
            rescanner.cancel()
            for route in self.pools.values():
                for task in route.watchers:
                    task.cancel()
            fds.cancel()
            heap.cancel()
        self._tasks = None
        remove_own(self.control_path, self._control_bound)
        remove_own(self.address_file, self._address_written)
        remove_own(self.metrics_address_file, self._metrics_written)
        if self.tracing is not None:
            await asyncio.to_thread(self.tracing.shutdown)  # flushes, off the loop
        for route in self.pools.values():
            if route.lane is not None:
                route.lane.close()
            if route.channel is not None:
                await route.channel.close()
        self.arena.close()  # every slab closed

    def _publish_address(self) -> None:
        self._address_written = _publish(self.address_file, self.settings.host, self.port)

    async def _start_metrics(self) -> MetricsServer | None:
        """The HTTP /metrics port (metrics_port; -1: none), on this event loop."""
        if self.settings.metrics_port < 0:
            return None
        metrics = MetricsServer(self.metrics)
        host = self.settings.host
        try:
            self.metrics_port = await metrics.start(host, self.settings.metrics_port)
        except OSError as exc:
            raise ConfigError(
                "router",
                "metrics_port",
                f"cannot listen on {host}:{self.settings.metrics_port}: {exc}",
            ) from None
        self._metrics_written = _publish(self.metrics_address_file, host, self.metrics_port)
        log.info("router: metrics on http://%s/metrics", _host_port(host, self.metrics_port))
        return metrics

    def _watch_pool(self, route: PoolRoute) -> None:
        assert self._tasks is not None
        route.watchers.append(
            self._tasks.create_task(self._watch(route, "", self._pool_applier(route)))
        )
        route.watchers.append(self._tasks.create_task(self._heartbeat(route)))

    def _watch_model(self, route: PoolRoute, name: str) -> None:
        if self._tasks is None:
            return  # not serving yet: serve() starts every watcher
        applier = self._model_applier(route, name)
        route.watchers.append(self._tasks.create_task(self._watch(route, f"model:{name}", applier)))


def _host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _publish(path: Path, host: str, port: int) -> FileId | None:
    """Writes ``host:port`` to ``path`` at once (a reader never sees half of it)."""
    partial = path.with_suffix(".tmp")
    partial.write_text(_host_port(host, port) + "\n")
    partial.replace(path)
    return file_id(path)
