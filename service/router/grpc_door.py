"""The router's gRPC door: the Open Inference Protocol's gRPC service as a
thin translation onto the forwarding core (:mod:`poolserve.service.router.forwarding`).

It reads the model name from the request's wire bytes, the remaining time
from the call's deadline and the trace context from its metadata; the
answers come back as bytes, untouched. Server-wide answers (liveness,
readiness, metadata, the repository index, statistics of every model) are
put together here from the routes and from every pool.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from opentelemetry.trace import Span

from poolserve.protos import inference_pb2 as pb
from poolserve.service import __version__
from poolserve.service.contract.errors import (
    DeadlineExceeded,
    Failure,
    InvalidInput,
    ServingError,
    StreamStalled,
    Unimplemented,
    clip,
    load_failed,
)
from poolserve.service.contract.lane import refused_request
from poolserve.service.contract.rest import refuse_reserved
from poolserve.service.contract.settings import ServerSettings
from poolserve.service.contract.shm import forged
from poolserve.service.contract.wire import peek_model, peek_routing
from poolserve.service.grpcserver.handlers import (
    EXTENSIONS,
    NO_DEADLINE_S,
    SERVICE,
    abort,
    guarded,
)
from poolserve.service.grpcserver.shm import SharedMemory
from poolserve.service.grpcserver.status import grpc_status
from poolserve.service.grpcserver.tracing import Tracing, deadline_event
from poolserve.service.router.forwarding import SPAN, Forwarder
from poolserve.service.router.lane_client import Lend
from poolserve.service.router.pool_tables import MLServerModels
from poolserve.service.router.replybudget import TRACKED_REPLY, ReplyBudget
from poolserve.service.router.repository import RepositoryCalls
from poolserve.service.router.routes import PoolRoute, Routes

_DROP_METADATA = frozenset({"user-agent", "content-type", "te", "host"})
ROUTED = ("ModelInfer", "ModelReady", "ModelMetadata", "ModelConfig", "ModelStatistics")
# (a large reply may be a view of its slab: lane_client.Lend, lent())
Handler = Callable[[bytes, Any], Awaitable[bytes | memoryview]]
Context = grpc.aio.ServicerContext[Any, Any]

_ERROR_MESSAGE_TAG = b"\x0a"  # ModelStreamInferResponse field 1 (error_message), first when set


class _Speaks:
    """Which messages one stream speaks: MLServer's (bare ModelInferResponses,
    an error ends the stream with its status) or KServe's."""

    __slots__ = ("mlserver",)

    def __init__(self, mlserver: bool) -> None:
        self.mlserver = mlserver


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


def _peek_model_name_field2(data: bytes) -> str:
    """RepositoryModelLoad/Unload carry the model name in field 2."""
    return peek_model(data)[1]


def lender(context: Any) -> Lend | None:
    """How a reply may be sent from its slab: the router's own HTTP/2 calls send
    views and run their done callbacks once the reply left (the slab is freed
    then); grpcio's server sends ``bytes`` only (None: a copy)."""
    if not getattr(context, "sends_views", False):
        return None

    def lend(free: Callable[[], None]) -> None:
        context.add_done_callback(lambda _: free())

    return lend


def remaining(context: Context) -> float | None:
    """The client's remaining time (None or huge when it set no deadline)."""
    return context.time_remaining()


def metadata_of(context: Context) -> tuple[tuple[str, Any], ...]:
    """The call's metadata to pass on to a pool, without transport headers."""
    return tuple(
        (key, value)
        for key, value in context.invocation_metadata() or ()
        if not key.startswith(("grpc-", ":")) and key not in _DROP_METADATA
    )


class GrpcDoor:
    """The router's GRPCInferenceService, over the routes and the forwarding core."""

    def __init__(
        self,
        settings: ServerSettings,
        routes: Routes,
        core: Forwarder,
        shared_memory: SharedMemory,
        replies: ReplyBudget,
        repository: RepositoryCalls,
    ) -> None:
        self.settings = settings
        self.repository = repository
        self.routes = routes
        self.core = core
        self.shared_memory = shared_memory
        self.replies = replies
        # which models' streams speak MLServer's messages (stream_messages "auto")
        self.mlserver_models = MLServerModels(core)

    # -- calls about one model -------------------------------------------------

    def _routed(self, method: str) -> Handler:
        async def handler(body: bytes | memoryview, context: Context) -> bytes | memoryview:
            # (a large ModelInfer request is a view of the slab it was received
            # into on the router's own HTTP/2: router/slab_sink.py)
            routing = peek_routing(body, with_parameters=False)
            name, version = routing.name, routing.version
            span = SPAN.get()
            if span is not None:
                span.set_attribute("poolserve.model.name", name)
                span.set_attribute("poolserve.model.version", version)
            if name in self.repository.ensembles.plans:  # run here, over its steps' pools
                if method != "ModelInfer":
                    return self.repository.ensembles.answer(method, name, version)
                refuse_reserved(body, routing.wrapper_field)
                if self.replies.total:
                    self.replies.check(context)
                reply = await self.repository.ensembles.infer(
                    bytes(body), name, version, remaining(context), context.invocation_metadata()
                )
                if len(reply) >= TRACKED_REPLY:
                    await self.replies.track(context, len(reply))
                return reply
            if method == "ModelStatistics" and not name:
                return await self.repository.all_statistics(
                    remaining(context), metadata_of(context)
                )
            if method == "ModelReady" and name not in self.routes.routes:
                # As Triton: a model that does not exist is not ready; no NOT_FOUND.
                return pb.ModelReadyResponse(ready=False).SerializeToString()
            if method == "ModelInfer":
                # only the HTTP door makes REST wrappers
                refuse_reserved(body, routing.wrapper_field)
                if self.replies.total:  # someone is not reading: is it this connection?
                    self.replies.check(context)
                metadata = context.invocation_metadata()
                lent = await self.core.infer_lent(
                    name,
                    version,
                    body,
                    remaining(context),
                    metadata,
                    lender(context),
                    sunk=getattr(context, "sink", None),
                )
                if len(lent) >= TRACKED_REPLY:
                    await self.replies.track(context, len(lent))
                return lent
            try:
                route = self.routes.route(name)
                plain = body if isinstance(body, bytes) else bytes(body)  # (not ModelInfer: bytes)
                return await self.core.forward(
                    route, method, plain, remaining(context), metadata_of(context)
                )
            except DeadlineExceeded as exc:
                self.core.count_router_deadline(exc, name, version)
                raise

        handler.__name__ = method
        return handler

    def routed_by_field2(self, method: str) -> Callable[[bytes, Any], Awaitable[bytes]]:
        async def handler(body: bytes, context: Context) -> bytes:
            name = _peek_model_name_field2(body)
            try:
                return await self.repository.control(
                    method, name, body, remaining(context), metadata_of(context)
                )
            except ServingError as exc:
                if method == "RepositoryModelLoad":
                    raise load_failed(name, exc) from None
                raise

        handler.__name__ = method
        return handler

    # -- aggregated answers --------------------------------------------------

    async def server_live(self, _: bytes, __: Any) -> bytes:
        return pb.ServerLiveResponse(live=True).SerializeToString()

    async def server_ready(self, _: bytes, __: Any) -> bytes:
        return pb.ServerReadyResponse(ready=self.routes.ready()).SerializeToString()

    async def server_metadata(self, _: bytes, __: Any) -> bytes:
        return pb.ServerMetadataResponse(
            name=self.settings.server_name, version=__version__, extensions=list(EXTENSIONS)
        ).SerializeToString()

    async def repository_index(self, body: bytes, context: Any) -> bytes:
        return await self.repository.index(body, remaining(context), metadata_of(context))

    # -- ModelStreamInfer ------------------------------------------------------

    async def model_stream_infer(
        self, requests: AsyncIterator[bytes], context: Context
    ) -> AsyncIterator[bytes]:
        """A ModelStreamInfer, with a SERVER span for the whole stream when tracing
        is on: its model and pool, how many requests came and how many responses
        (and error responses) went, its status and where its deadline ran out."""
        tracing = self.core.tracing
        speaks = _Speaks(self.settings.stream_messages == "mlserver")
        if tracing is None:
            try:
                async for reply in self._stream_infer(requests, context, None, speaks):
                    yield reply
            except ServingError as exc:  # MLServer's streams: the error is the stream's status
                await abort(context, *grpc_status(exc))
            return
        span = _server_span(tracing, "ModelStreamInfer", context)
        counted = _Counted(requests)
        responses = errors = 0
        code = grpc.StatusCode.OK
        try:
            stream = self._stream_infer(counted, context, span, speaks)
            async with contextlib.aclosing(stream) as replies:
                async for reply in replies:
                    responses += 1
                    errors += not speaks.mlserver and reply[:1] == _ERROR_MESSAGE_TAG
                    yield reply
        except (asyncio.CancelledError, GeneratorExit):
            code = _ended_early(span, context)
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
        context: Context,
        span: Span | None,
        speaks: _Speaks,
    ) -> AsyncGenerator[bytes, None]:
        """Routed by the model of its first routable message, over that model's
        pool's lane; the pool answers the rest in-stream. A message that cannot
        be routed before then is answered with its error, and the next one tried.
        Under ``stream_messages`` "auto" the stream speaks MLServer's messages
        from there on when that model is an MLServer model (``speaks``); an
        error before then speaks MLServer's when every model of the router is
        an MLServer model (a client of such a server has MLServer's stubs),
        else KServe's."""
        route: PoolRoute | None = None
        first = b""
        while route is None:
            taken = await anext(requests, None)
            if taken is None:
                return
            first = taken
            try:
                name, version = peek_model(first)
                refuse_reserved(first)
                if name in self.repository.ensembles.plans:
                    raise Unimplemented(
                        f"ensemble '{clip(name)}' answers ModelInfer only, not ModelStreamInfer"
                    )
                route = self.routes.route(name)
                deadline = self.core.deadline(remaining(context))
            except ServingError as exc:
                route = None
                if self.settings.stream_messages == "auto":
                    speaks.mlserver = await self.mlserver_models.all_of(self.routes.routes)
                yield self._stream_error(exc, exc.message, speaks.mlserver)
        if self.settings.stream_messages == "auto":
            speaks.mlserver = await self.mlserver_models.has(name)
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
            stalled = functools.partial(self.core.count_stalled, name)
            lane = route.lane.stream(first, requests, deadline, attach, stall_s, stalled)
            async with contextlib.aclosing(lane):  # closed here, whatever ends the call
                async for item in lane:
                    if isinstance(item, StreamStalled):  # the client stopped reading: a status
                        await abort(context, *grpc_status(item))
                    if isinstance(item, ServingError):  # the stream failed as a whole
                        if span is not None and item.failure is Failure.DEADLINE:
                            deadline_event(span, item.stage or "router", item.message)
                        message = f"{grpc_status(item)[0].name}: {item.message}"
                        yield self._stream_error(item, message, speaks.mlserver)
                        return
                    yield item
        except ServingError as exc:  # the lane is not reachable
            yield self._stream_error(exc, exc.message, speaks.mlserver)

    @staticmethod
    def _stream_error(exc: ServingError, message: str, mlserver: bool) -> bytes:
        """An error in a stream: a ModelStreamInferResponse with ``message`` (Triton,
        KServe); with MLServer's stream messages, raised: the stream's status."""
        if mlserver:
            raise exc
        return pb.ModelStreamInferResponse(error_message=message).SerializeToString()

    def _attach_in_stream(self, route: PoolRoute, message: bytes) -> bytes:
        """A streamed request with its registrations. One that names an unknown
        region goes as it is, and the pool answers its error in the stream; one
        that starts with a zero byte (only the router may send such bytes to a
        pool), or that names a model of another pool, goes as its refusal,
        answered by the pool in the same place."""
        try:
            refuse_reserved(message)
        except InvalidInput as exc:
            return refused_request(exc.message)
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
        other = self.routes.routes.get(name)
        if other is not None and other is not route:
            return refused_request(
                f"model '{clip(name)}' is served by pool '{other.gid}', not by this stream's "
                f"pool '{route.gid}': a ModelStreamInfer goes to the pool of its first "
                "request's model (open one stream per pool)"
            )
        return body

    # -- tracing and registration ----------------------------------------------

    def _traced(self, method: str, fn: Handler) -> Handler:
        """A SERVER span per call, with the deadline budget and where it ran out."""
        tracing = self.core.tracing
        if tracing is None:
            return fn

        async def handler(body: bytes, context: Context) -> bytes | memoryview:
            span = _server_span(tracing, method, context)
            token = SPAN.set(span)
            code = grpc.StatusCode.OK
            try:
                return await fn(body, context)
            except ServingError as exc:
                code = grpc_status(exc)[0]
                if exc.failure is Failure.DEADLINE:
                    deadline_event(span, exc.stage or "router", exc.message)
                raise
            except asyncio.CancelledError:
                code = _ended_early(span, context)
                raise
            finally:
                SPAN.reset(token)
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
                    "RepositoryModelLoad", self.routed_by_field2("RepositoryModelLoad")
                ),
                "RepositoryModelUnload": traced(
                    "RepositoryModelUnload", self.routed_by_field2("RepositoryModelUnload")
                ),
                "ModelStreamInfer": grpc.stream_stream_rpc_method_handler(self.model_stream_infer),
                **self.shared_memory.handlers(),
            }
        )
        return grpc.method_handlers_generic_handler(SERVICE, handlers)


def _server_span(tracing: Tracing, method: str, context: Context) -> Span:
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


def _ended_early(span: Span, context: Context) -> grpc.StatusCode:
    """The status of a call that ended before its answer: grpc ended it at its
    deadline (said as an event on the span), or the client cancelled it."""
    left = context.time_remaining()
    if left is not None and left <= 0:
        deadline_event(span, "pool", "deadline passed while the pool had the call")
        return grpc.StatusCode.DEADLINE_EXCEEDED
    return grpc.StatusCode.CANCELLED
