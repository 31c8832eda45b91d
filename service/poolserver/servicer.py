"""The Open Inference Protocol service over a catalog and an inference backend.

ModelInfer and ModelStreamInfer are registered as byte handlers: the request
bytes go to the backend unparsed (only the model name is peeked) and the
response bytes come back unparsed. The other RPCs answer from the catalog.
Every handler goes through
:func:`poolserve.service.grpcserver.handlers.guarded`, the one place where errors
become gRPC statuses. The same service runs in a pool server (backend: the
dispatcher over pre-forked workers) and in-process (backend: a thread).
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterable
from typing import TYPE_CHECKING, Any, Protocol

import grpc

from poolserve.protos import inference_pb2 as pb
from poolserve.service import __version__
from poolserve.service.contract.errors import Failure, InvalidInput, ServingError, Unimplemented
from poolserve.service.contract.framing import Payload
from poolserve.service.contract.lane import Trace, refusal
from poolserve.service.contract.rest import is_rest
from poolserve.service.contract.wire import Routing, encode_len_field
from poolserve.service.grpcserver.handlers import (
    EXTENSIONS,
    SERVICE,
    abort,
    deadline_from,
    guarded,
)
from poolserve.service.grpcserver.shm import SharedMemory
from poolserve.service.grpcserver.status import grpc_status
from poolserve.service.grpcserver.tracing import Tracing, deadline_event
from poolserve.service.poolserver.catalog import Catalog, ModelEntry, wrong_version
from poolserve.service.poolserver.metadata import model_config, model_metadata
from poolserve.service.poolserver.rest_scheduling import scheduling_routing
from poolserve.service.poolserver.statistics import model_statistics

if TYPE_CHECKING:
    from poolserve.service.poolcore.jobs import Result

log = logging.getLogger(__name__)


Observer = Callable[["Result"], None]  # sees a successful execution's timings (for spans)


def as_bytes(body: Payload) -> bytes:
    """gRPC sends bytes only: a large reply (a view of its frame's buffer) is copied once."""
    return body if isinstance(body, bytes) else bytes(body)


class InferBackend(Protocol):
    """Runs serialized requests for ready models; raises ServingError subclasses."""

    async def infer(
        self,
        entry: ModelEntry,
        request: Payload,
        deadline: float,
        routing: Routing,
        observe: Observer | None = None,
    ) -> Payload: ...

    def serving(self) -> bool: ...

    def route(self, catalog: Catalog, request: Payload) -> tuple[ModelEntry, Routing]: ...


class ModelControl(Protocol):
    """Live model load and unload, where the server supports them."""

    async def repository_model_load(
        self, req: pb.RepositoryModelLoadRequest, context: Any
    ) -> pb.RepositoryModelLoadResponse: ...

    async def repository_model_unload(
        self, req: pb.RepositoryModelUnloadRequest, context: Any
    ) -> pb.RepositoryModelUnloadResponse: ...


class InferenceServicer:
    def __init__(
        self,
        catalog: Catalog,
        backend: InferBackend,
        *,
        server_name: str = "poolserve",
        default_timeout_s: float = 60.0,
        control: ModelControl | None = None,
        margin_s: float = 0.0,
        shared_memory: SharedMemory | None = None,
        stream_messages: str = "kserve",
    ) -> None:
        self.catalog = catalog
        # setting stream_messages: "mlserver", ModelStreamInfer answers bare
        # ModelInferResponses and an error ends the stream with its status; "auto",
        # so for a stream whose first request names an MLServer model
        self.stream_messages = stream_messages
        # This server's own registry, for calls addressed to it directly (a
        # pool's calls through the router come with the router's registrations).
        self.shared_memory = shared_memory or SharedMemory()
        self.backend = backend
        self.control = control
        self.margin_s = margin_s
        self.tracing: Tracing | None = None  # set by the server once it can have threads
        self.server_name = server_name
        self.default_timeout_s = default_timeout_s

    def ready(self) -> bool:
        return self.catalog.all_ready() and self.backend.serving()

    async def server_live(self, _: pb.ServerLiveRequest, __: Any) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=True)

    async def server_ready(self, _: pb.ServerReadyRequest, __: Any) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=self.ready())

    async def model_ready(self, req: pb.ModelReadyRequest, _: Any) -> pb.ModelReadyResponse:
        # As Triton: a model (or version) that does not exist is simply not ready;
        # as MLServer for its models: a version they do not have is NOT_FOUND.
        entry = self.catalog.version(req.name, req.version)
        if entry is None:
            named = self.catalog.find(req.name)
            if named is not None and named.mlserver:
                raise wrong_version(named, req.version)
            return pb.ModelReadyResponse(ready=False)
        return pb.ModelReadyResponse(ready=entry.ready and self.backend.serving())

    async def server_metadata(
        self, _: pb.ServerMetadataRequest, __: Any
    ) -> pb.ServerMetadataResponse:
        return pb.ServerMetadataResponse(
            name=self.server_name, version=__version__, extensions=list(EXTENSIONS)
        )

    async def model_metadata(
        self, req: pb.ModelMetadataRequest, _: Any
    ) -> pb.ModelMetadataResponse:
        e = self.catalog.lookup(req.name, req.version)
        if e.own_metadata is not None:  # an MLServer model: as MLServer answers it
            return pb.ModelMetadataResponse.FromString(e.own_metadata)
        # as Triton: every version a call may name (the one asked for, if it asked)
        versions = [e.shown_version] if req.version or not e.versioned else self._served(e.name)
        return model_metadata(e.name, versions, e.platform, e.inputs, e.outputs)

    def _served(self, name: str) -> list[str]:
        return [v.shown_version for v in self.catalog.versions(name)]

    async def model_config(self, req: pb.ModelConfigRequest, _: Any) -> pb.ModelConfigResponse:
        e = self.catalog.lookup(req.name, req.version)
        settings = e.settings
        sequence = settings.sequence if settings is not None else None
        decoupled = e.policy.decoupled
        return model_config(
            e.name, e.platform, e.max_batch_size, e.inputs, e.outputs, sequence, decoupled
        )

    async def model_statistics(
        self, req: pb.ModelStatisticsRequest, _: Any
    ) -> pb.ModelStatisticsResponse:
        if req.name and req.version:
            entries = [self.catalog.lookup(req.name, req.version)]
        elif req.name:  # as Triton: every version of the model
            self.catalog.lookup(req.name)
            entries = self.catalog.versions(req.name)
        else:
            entries = self.catalog.entries()
        return pb.ModelStatisticsResponse(
            model_stats=[model_statistics(e.stats, e.name, e.version) for e in entries]
        )

    async def mlserver_models(self, _: bytes, __: Any) -> bytes:
        """The names of this pool's MLServer models (known once loaded), for the
        router's streams under ``stream_messages: "auto"``: JSON ``[name, ...]``."""
        return json.dumps([e.name for e in self.catalog.entries() if e.mlserver]).encode()

    async def custom_routes(self, _: bytes, __: Any) -> bytes:
        """The @custom_handler endpoints of this pool's ready MLServer models, for
        the router's HTTP door: JSON ``[[model, method, path], ...]``."""
        routes = [
            [e.name, method, path]
            for e in self.catalog.entries()
            if e.ready
            for method, path in e.custom_routes
        ]
        return json.dumps(routes).encode()

    async def repository_index(
        self, req: pb.RepositoryIndexRequest, _: Any
    ) -> pb.RepositoryIndexResponse:
        return pb.RepositoryIndexResponse(models=index_entries(self.catalog, req.ready))

    async def repository_model_load(
        self, req: pb.RepositoryModelLoadRequest, context: Any
    ) -> pb.RepositoryModelLoadResponse:
        if self.control is None:
            raise Unimplemented("this server loads models only at start")
        return await self.control.repository_model_load(req, context)

    async def repository_model_unload(
        self, req: pb.RepositoryModelUnloadRequest, context: Any
    ) -> pb.RepositoryModelUnloadResponse:
        if self.control is None:
            raise Unimplemented("this server unloads models only at stop")
        return await self.control.repository_model_unload(req, context)

    async def model_infer(
        self, request: bytes, context: grpc.aio.ServicerContext[Any, Any]
    ) -> bytes:
        deadline = deadline_from(context, self.default_timeout_s, self.margin_s)
        request = self.shared_memory.attach(request)
        if self.tracing is None:
            return as_bytes(await self.infer_bytes(request, deadline))
        metadata = context.invocation_metadata()
        return as_bytes(await self._infer_traced(self.tracing, request, metadata, deadline))

    async def infer_lane(self, request: Payload, deadline: float, trace: Trace) -> Payload:
        """A ModelInfer that came over the router's lane (no gRPC context)."""
        deadline -= self.margin_s
        if self.tracing is None:
            return await self.infer_bytes(request, deadline)
        return await self._infer_traced(self.tracing, request, trace, deadline)

    async def infer_bytes(
        self, request: Payload, deadline: float, observe: Observer | None = None
    ) -> Payload:
        entry, routing = self.backend.route(self.catalog, request)
        return await self.backend.infer(entry, request, deadline, routing, observe)

    async def _infer_traced(
        self,
        tracing: Tracing,
        request: Payload,
        metadata: Iterable[tuple[str, Any]] | None,
        deadline: float,
    ) -> Payload:
        """The pool's span, with ``queue`` and ``compute`` children from the worker's timings."""
        span = tracing.server_span(
            f"{self.server_name} pool ModelInfer",
            metadata,
            {
                "rpc.system": "grpc",
                "rpc.service": SERVICE,
                "rpc.method": "ModelInfer",
                "poolserve.deadline.remaining_ms": (deadline - time.monotonic() + self.margin_s)
                * 1000,
            },
        )
        if not span.is_recording():  # not sampled: no child spans, no status to record
            return await self.infer_bytes(request, deadline)

        def observe(result: Result) -> None:
            worker = result.timings
            busy = (worker.decode_ns + worker.compute_ns + worker.encode_ns) / 1e9
            tracing.child(span, "queue", result.enqueued, result.started)
            tracing.child(
                span,
                "compute",
                max(result.started, result.finished - busy),
                result.finished,
                {
                    "poolserve.decode_ns": worker.decode_ns,
                    "poolserve.compute_ns": worker.compute_ns,
                    "poolserve.encode_ns": worker.encode_ns,
                    "poolserve.batch_size": result.batch_size,
                },
            )

        code = grpc.StatusCode.OK
        try:
            return await self.infer_bytes(request, deadline, observe)
        except ServingError as exc:
            code = grpc_status(exc)[0]
            if exc.failure is Failure.DEADLINE:
                deadline_event(span, exc.stage or "pool", exc.message)
            raise
        finally:
            span.set_attribute("rpc.grpc.status_code", code.value[0])
            span.end()

    async def model_stream_infer(
        self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[bytes]:
        def deadline() -> float:
            return deadline_from(context, self.default_timeout_s)

        try:
            async for reply in self.answer_stream(requests, deadline, attach=True):
                yield reply
        except ServingError as exc:  # MLServer's streams: the error is the stream's status
            await abort(context, *grpc_status(exc))

    def stream_lane(
        self, requests: AsyncIterator[Payload], deadline: float
    ) -> AsyncGenerator[bytes, None]:
        """A ModelStreamInfer that came over the router's lane (no gRPC context;
        its requests come with their registrations attached)."""
        deadline -= self.margin_s
        return self.answer_stream(requests, lambda: deadline, attach=False)

    async def answer_stream(
        self, requests: AsyncIterator[Payload], deadline_of: Callable[[], float], attach: bool
    ) -> AsyncGenerator[bytes, None]:
        """Each request in turn: its response, or a decoupled model's responses;
        a request's error as a response with ``error_message``. With MLServer's
        stream messages, each response is the bare ModelInferResponse and an
        error is raised: it ends the stream with its status, as MLServer's
        (``stream_messages`` "auto": when the stream's first request that names
        a model of this pool names an MLServer model; the router decides the
        same by the same model). A REST stream (``generate_stream``: the HTTP
        door reads it and sends server-sent events) is always framed KServe's
        way."""
        mlserver = self.stream_messages == "mlserver"
        decided = self.stream_messages != "auto"
        first = True
        async for request in requests:
            if first and is_rest(request):
                mlserver, decided = False, True
            first = False
            deadline = deadline_of()
            reason = None if attach else refusal(request)
            if reason is not None:  # a request the router refused: its answer, here
                if mlserver:
                    raise InvalidInput(reason)
                yield pb.ModelStreamInferResponse(error_message=reason).SerializeToString()
                continue
            try:
                if attach:
                    request = self.shared_memory.attach(as_bytes(request))
                routing = scheduling_routing(request)
                if not decided:
                    named = self.catalog.find(routing.name)
                    if named is not None:
                        mlserver, decided = named.mlserver, True
                entry = self.catalog.lookup_ready(routing.name, routing.version)
                if entry.policy.decoupled:
                    async for part in self._stream(entry, request, deadline, routing, mlserver):
                        yield part
                    continue
                body = await self.backend.infer(entry, request, deadline, routing)
            except ServingError as exc:
                if mlserver:
                    raise
                yield pb.ModelStreamInferResponse(error_message=exc.message).SerializeToString()
                continue
            yield as_bytes(body) if mlserver else encode_len_field(2, as_bytes(body))

    async def _stream(
        self,
        entry: ModelEntry,
        request: Payload,
        deadline: float,
        routing: Routing,
        mlserver: bool,
    ) -> AsyncIterator[bytes]:
        """A decoupled model's responses, each as one ModelStreamInferResponse as
        soon as its worker yields it; an error mid-stream ends it with its
        status name in ``error_message``. Leaving early (the client went
        away) closes the stream, which cancels it on the worker."""
        infer_stream = getattr(self.backend, "infer_stream", None)
        try:
            if infer_stream is None:
                raise Unimplemented(f"decoupled model '{entry.name}' needs a pool server's workers")
            parts = infer_stream(entry, request, deadline, routing)
            async with contextlib.aclosing(parts):
                async for body in parts:
                    yield body if mlserver else encode_len_field(2, body)
        except ServingError as exc:
            if mlserver:
                raise
            message = f"{grpc_status(exc)[0].name}: {exc.message}"
            yield pb.ModelStreamInferResponse(error_message=message).SerializeToString()

    def generic_handler(self) -> grpc.GenericRpcHandler:
        def unary(
            fn: Callable[..., Awaitable[Any]], req: Any, resp: Any
        ) -> grpc.RpcMethodHandler[Any, Any]:
            return grpc.unary_unary_rpc_method_handler(
                guarded(fn),
                request_deserializer=req.FromString,
                response_serializer=resp.SerializeToString,
            )

        handlers: dict[str, grpc.RpcMethodHandler[Any, Any]] = {
            "ServerLive": unary(self.server_live, pb.ServerLiveRequest, pb.ServerLiveResponse),
            "ServerReady": unary(self.server_ready, pb.ServerReadyRequest, pb.ServerReadyResponse),
            "ModelReady": unary(self.model_ready, pb.ModelReadyRequest, pb.ModelReadyResponse),
            "ServerMetadata": unary(
                self.server_metadata, pb.ServerMetadataRequest, pb.ServerMetadataResponse
            ),
            "ModelMetadata": unary(
                self.model_metadata, pb.ModelMetadataRequest, pb.ModelMetadataResponse
            ),
            "ModelConfig": unary(self.model_config, pb.ModelConfigRequest, pb.ModelConfigResponse),
            "ModelStatistics": unary(
                self.model_statistics, pb.ModelStatisticsRequest, pb.ModelStatisticsResponse
            ),
            "RepositoryIndex": unary(
                self.repository_index, pb.RepositoryIndexRequest, pb.RepositoryIndexResponse
            ),
            "RepositoryModelLoad": unary(
                self.repository_model_load,
                pb.RepositoryModelLoadRequest,
                pb.RepositoryModelLoadResponse,
            ),
            "RepositoryModelUnload": unary(
                self.repository_model_unload,
                pb.RepositoryModelUnloadRequest,
                pb.RepositoryModelUnloadResponse,
            ),
            # Bytes in, bytes out: no (de)serializer on the hot path.
            "ModelInfer": grpc.unary_unary_rpc_method_handler(guarded(self.model_infer)),
            # for the router only (this socket is private): bytes in, JSON out
            "CustomRoutes": grpc.unary_unary_rpc_method_handler(guarded(self.custom_routes)),
            "MLServerModels": grpc.unary_unary_rpc_method_handler(guarded(self.mlserver_models)),
            "ModelStreamInfer": grpc.stream_stream_rpc_method_handler(self.model_stream_infer),
            **self.shared_memory.handlers(),
        }
        return grpc.method_handlers_generic_handler(SERVICE, handlers)


def index_entries(
    catalog: Catalog, ready_only: bool
) -> list[pb.RepositoryIndexResponse.ModelIndex]:
    return [
        pb.RepositoryIndexResponse.ModelIndex(
            name=e.name, version=e.shown_version, state=str(e.state), reason=e.reason
        )
        for e in catalog.entries()
        if e.ready or not ready_only
    ]
