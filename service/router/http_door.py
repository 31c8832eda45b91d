"""The router's HTTP/REST door: the Open Inference Protocol's REST API (and
Triton's HTTP extensions) as a thin translation onto the forwarding core
(:mod:`poolserve.service.router.forwarding`), on the router's event loop.

The HTTP parser is httptools', driven by uvicorn's protocol (a bare ASGI app,
no framework; chosen over aiohttp's low-level server for its lower CPU per
request, measured in the issue note). The router reads the request line and
the headers only: the model comes from the URL, the deadline from the
``Grpc-Timeout`` header, the trace context from ``traceparent``. An infer
body goes to the model's pool unparsed, inside the wrapper of
:mod:`poolserve.service.contract.rest`; the worker decodes it and encodes the
reply (:mod:`poolserve.service.inference.rest`). Health and metadata, off the
hot path, are answered from the same routes and pool calls as the gRPC door
and rendered as JSON here.

Limits: a body over ``max_message_size`` is 413; request line and headers
over ``http_max_header_bytes`` are 431, and must come within
``handshake_timeout_s`` (408); an idle keep-alive connection is closed after
``http_keepalive_timeout_s``; beyond ``http_max_connections`` open
connections a new one is answered 503 and closed. A client that closes its
connection cancels its call, and the lane tells the pool at once.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import logging
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any

import grpc
import httptools
import orjson
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message
from opentelemetry.trace import Span
from uvicorn.config import Config
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

from poolserve.protos import inference_pb2 as pb
from poolserve.service import __version__
from poolserve.service.contract.errors import (
    DeadlineExceeded,
    Failure,
    InvalidInput,
    MessageTooLarge,
    ServingError,
    clip,
    load_failed,
)
from poolserve.service.contract.rest import (
    ENCODING_NAMES,
    ENCODINGS,
    IDENTITY,
    REPLY_HEAD,
    V1,
    V2,
    RestHead,
    envelope_head,
    wrap_head,
)
from poolserve.service.contract.settings import ServerSettings
from poolserve.service.contract.shm import wrap
from poolserve.service.contract.slab import THRESHOLD as SLAB_THRESHOLD
from poolserve.service.contract.wire import read_varint
from poolserve.service.grpcserver.handlers import EXTENSIONS
from poolserve.service.grpcserver.shm import SharedMemory
from poolserve.service.grpcserver.status import from_upstream, http_status
from poolserve.service.grpcserver.tracing import Tracing, deadline_event
from poolserve.service.router.forwarding import SPAN, Forwarder
from poolserve.service.router.repository import LOAD, UNLOAD, RepositoryCalls
from poolserve.service.router.routes import Routes

log = logging.getLogger(__name__)

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

# The deadline of a REST call: gRPC's own header and format ("500m", "2S"), so
# that one value means the same at both doors and through gateways that turn
# REST into gRPC; Triton's ``timeout`` parameter, in the body, is the model's.
TIMEOUT_HEADER = b"grpc-timeout"
_TIMEOUT = re.compile(rb"^([0-9]{1,8})([HMSmun])$")
_UNIT_S = {b"H": 3600.0, b"M": 60.0, b"S": 1.0, b"m": 1e-3, b"u": 1e-6, b"n": 1e-9}
_CARRIED = frozenset((b"traceparent", b"tracestate"))
JSON = b"application/json"
_MENTION = b"shared_memory_region"
_MODEL_PATH = re.compile(
    r"^/v2/models/([^/]+)(?:/versions/([^/]+))?(?:/(ready|infer|generate|config|stats))?$"
)


_STREAM_PATH = re.compile(r"^/v2/models/([^/]+)(?:/versions/([^/]+))?/generate_stream$")
_SSE_START = {
    "type": "http.response.start",
    "status": 200,
    "headers": [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")],
}
_V1_MODEL_PATH = re.compile(r"^/v1/models/([^/:]+)$")
_V1_PREDICT_PATH = re.compile(r"^/v1/models/([^/:]+):predict$")
_SHARED_MEMORY_PATH = re.compile(
    r"^/v2/(system|cuda)sharedmemory(?:/region/([^/]+))?/(status|register|unregister)$"
)
_REPOSITORY_PATH = re.compile(r"^/v2/repository/models/([^/]+)/(load|unload)$")


class HttpError(Exception):
    """An answer that is an HTTP status of the door's own (not a model's error)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def parse_timeout(value: bytes) -> float:
    """A ``Grpc-Timeout`` value in seconds; InvalidInput when malformed."""
    match = _TIMEOUT.match(value.strip())
    if match is None:
        raise InvalidInput(
            f"header Grpc-Timeout {clip(value.decode('latin-1'))!r} is not an integer of "
            "at most 8 digits and a unit (H, M, S, m, u, n), e.g. 500m"
        )
    return int(match.group(1)) * _UNIT_S[match.group(2)]


def _error_body(message: str) -> bytes:
    return orjson.dumps({"error": message})


LINGER_S = 1.0


class _Connection(HttpToolsProtocol):
    """uvicorn's httptools protocol with the door's limits, and a hook that
    cancels a call whose client closed its connection."""

    def __init__(self, door: HttpDoor, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.door = door
        self.refused = False
        self.lost = False
        self.forwarding: asyncio.Task[Any] | None = None
        self._head_bytes = 0
        self._body_bytes = 0
        self._head_timer: asyncio.TimerHandle | None = None
        self._linger: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        if len(self.connections) >= self.door.settings.http_max_connections:
            self.refused = True
            body = _error_body("too many connections to the HTTP port (http_max_connections)")
            transport.write(_raw_response(503, body))
            self._linger_close(transport)
            return
        super().connection_made(transport)
        self._arm_head_timer()

    def _linger_close(self, transport: asyncio.Transport) -> None:
        """Ends the connection after an answer: no more writes, and what the
        client still sends is read and dropped for up to LINGER_S (closing
        with unread data would reset the connection, and lose the answer)."""
        if transport.can_write_eof():
            transport.write_eof()
            self._linger = self.loop.call_later(LINGER_S, transport.close)
        else:
            transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self._disarm_head_timer()
        if self._linger is not None:
            self._linger.cancel()
        if self.refused and self not in self.connections:
            return  # refused in connection_made: uvicorn never saw it
        if self.forwarding is not None:
            self.forwarding.cancel()  # the client went: the pool drops its call
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.refused:
            return
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self.refuse(400, "protocol upgrades are not served on this port")
        except httptools.HttpParserError as exc:
            if not self.refused:
                self.refuse(400, f"invalid HTTP request: {exc}")

    def refuse(self, status: int, message: str) -> None:
        """Answers ``status`` (unless a response began) and closes the connection."""
        if self.refused:
            return
        self.refused = True
        self._disarm_head_timer()
        cycle = self.cycle
        if self.transport is None or self.transport.is_closing():
            return
        if cycle is None or not cycle.response_started:
            self.transport.write(_raw_response(status, _error_body(message)))
        if cycle is not None:
            cycle.disconnected = True  # the app's answer, if any, goes nowhere
            cycle.message_event.set()
        self.lost = True  # nobody to answer: a call in flight is dropped
        if self.forwarding is not None:
            self.forwarding.cancel()
        self._linger_close(self.transport)

    def _arm_head_timer(self) -> None:
        self._disarm_head_timer()
        limit = self.door.settings.handshake_timeout_s
        self._head_timer = self.loop.call_later(limit, self._head_timed_out)

    def _disarm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.cycle is None or self.cycle.response_complete:
            self.refuse(408, "the request line and headers did not come in time")

    # parser callbacks, counted

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_bytes = self._body_bytes = 0
        self.scope["poolserve.connection"] = self  # type: ignore[typeddict-unknown-key]
        if self._head_timer is None:
            self._arm_head_timer()

    def on_url(self, url: bytes) -> None:
        self._count_head(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count_head(len(name) + len(value) + 4)
        super().on_header(name, value)

    def _count_head(self, size: int) -> None:
        self._head_bytes += size
        if self._head_bytes > self.door.settings.http_max_header_bytes:
            self.refuse(431, "the request line and headers are over http_max_header_bytes")
            raise _Refused

    def on_headers_complete(self) -> None:
        self._disarm_head_timer()
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        self._body_bytes += len(body)
        if self._body_bytes > self.door.settings.max_message_size:
            self.refuse(
                413,
                f"the body is over max_message_size ({self.door.settings.max_message_size} bytes)",
            )
            raise _Refused
        super().on_body(body)


class _Gone(Exception):
    """The client closed its connection: nobody to answer."""


class _Refused(Exception):
    """Stops the parser: the connection was answered and is closing."""


_REASONS = {
    200: b"OK",
    400: b"Bad Request",
    404: b"Not Found",
    408: b"Request Timeout",
    413: b"Content Too Large",
    429: b"Too Many Requests",
    431: b"Request Header Fields Too Large",
    500: b"Internal Server Error",
    501: b"Not Implemented",
    503: b"Service Unavailable",
    504: b"Gateway Timeout",
}


def _raw_response(status: int, body: bytes) -> bytes:
    reason = _REASONS.get(status, b"Error")
    return (
        b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
        b"connection: close\r\n\r\n" % (status, reason, len(body))
    ) + body


class HttpDoor:
    """The REST API on ``http_port``: an ASGI app on uvicorn's httptools protocol."""

    def __init__(
        self,
        settings: ServerSettings,
        routes: Routes,
        core: Forwarder,
        repository: RepositoryCalls,
        shared_memory: SharedMemory,
    ) -> None:
        self.settings = settings
        self.routes = routes
        self.core = core
        self.repository = repository
        self.shared_memory = shared_memory
        self.state = ServerState()
        self._server: asyncio.base_events.Server | None = None
        self._config = Config(
            self.app,
            loop="none",
            http="httptools",
            ws="none",
            lifespan="off",
            interface="asgi3",
            proxy_headers=False,
            server_header=False,
            date_header=False,
            access_log=False,
            log_config=None,
            timeout_keep_alive=max(1, round(settings.http_keepalive_timeout_s)),
        )
        self._config.load()

    async def start(self, host: str, port: int) -> int:
        """Listens on ``host:port``; the port bound (``port`` 0: any free one)."""
        loop = asyncio.get_running_loop()

        def connection() -> _Connection:
            return _Connection(self, config=self._config, server_state=self.state, app_state={})

        self._server = await loop.create_server(connection, host, port, backlog=2048)
        return int(self._server.sockets[0].getsockname()[1])

    async def stop(self, grace_s: float) -> None:
        """Stops accepting, lets calls in flight finish within ``grace_s``, closes the rest."""
        if self._server is None:
            return
        self._server.close()
        for connection in list(self.state.connections):
            connection.shutdown()  # idle ones close now, busy ones after their answer
        if self.state.tasks:
            await asyncio.wait(list(self.state.tasks), timeout=grace_s)
        for task in list(self.state.tasks):
            task.cancel()
        if self.state.tasks:
            await asyncio.wait(list(self.state.tasks))
        for connection in list(self.state.connections):
            if connection.transport is not None:
                connection.transport.close()
        await self._server.wait_closed()

    # -- the ASGI app ---------------------------------------------------------

    async def app(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        connection: _Connection = scope["poolserve.connection"]
        method: str = scope["method"]
        path: str = scope["path"]
        try:
            if method == "POST" and path.endswith("/generate_stream"):
                await self._generate_stream(connection, scope, receive, send, path)
                return
            if method == "POST" and path.endswith(("/infer", "/generate", ":predict")):
                await self._infer(connection, scope, receive, send, path)
                return
            status, body = await self._answer(method, path, scope, receive)
        except _Gone:
            return
        except HttpError as exc:
            status, body = exc.status, _error_body(exc.message)
        except ServingError as exc:
            status, message = http_status(exc)
            body = _error_body(message)
        await _respond(send, status, body)

    async def _answer(
        self, method: str, path: str, scope: Scope, receive: Receive
    ) -> tuple[int, bytes]:
        if method not in ("GET", "POST"):
            raise HttpError(
                405 if path.startswith("/v2") else 404, f"{method} {path} is not served"
            )
        if path == "/v2/health/live":
            return 200, orjson.dumps({"live": True})
        if path == "/v2/health/ready":
            ready = self.routes.ready()
            return (200 if ready else 503), orjson.dumps({"ready": ready})
        if path == "/v2" or path == "/v2/":
            return 200, orjson.dumps(
                {
                    "name": self.settings.server_name,
                    "version": __version__,
                    "extensions": list(EXTENSIONS),
                }
            )
        budget = _budget(scope)
        metadata = _carried(scope)
        if path.startswith(("/v2/systemsharedmemory", "/v2/cudasharedmemory")):
            return await self._shared_memory_call(method, path, receive)
        match = _V1_MODEL_PATH.match(path)
        if match is not None and method == "GET":  # KServe's V1: the model's readiness
            ready = await self._model_ready(match.group(1), "", budget, metadata)
            return (200 if ready else 503), orjson.dumps({"name": match.group(1), "ready": ready})
        if path.startswith("/v2/repository/") and method == "POST":
            return await self._repository(path, budget, metadata, receive)
        if path == "/v2/models/stats" and method == "GET":
            reply = await self.repository.all_statistics(budget, metadata)
            return 200, orjson.dumps(plain(pb.ModelStatisticsResponse.FromString(reply)))
        match = _MODEL_PATH.match(path)
        if match is None or method != "GET":
            raise HttpError(404, f"{method} {clip(path)} is not an endpoint of this server")
        name, version, action = match.group(1), match.group(2) or "", match.group(3)
        if action == "ready":
            ready = await self._model_ready(name, version, budget, metadata)
            return (200 if ready else 503), orjson.dumps({"name": name, "ready": ready})
        if action is None:
            request = pb.ModelMetadataRequest(name=name, version=version)
            reply = await self._forward(name, "ModelMetadata", request, budget, metadata)
            return 200, _metadata_json(pb.ModelMetadataResponse.FromString(reply))
        if action == "config":
            config_request = pb.ModelConfigRequest(name=name, version=version)
            reply = await self._forward(name, "ModelConfig", config_request, budget, metadata)
            return 200, orjson.dumps(plain(pb.ModelConfigResponse.FromString(reply).config))
        if action == "stats":
            stats_request = pb.ModelStatisticsRequest(name=name, version=version)
            reply = await self._forward(name, "ModelStatistics", stats_request, budget, metadata)
            return 200, orjson.dumps(plain(pb.ModelStatisticsResponse.FromString(reply)))
        raise HttpError(404, f"{method} {clip(path)} is not an endpoint of this server")

    async def _shared_memory_call(
        self, method: str, path: str, receive: Receive
    ) -> tuple[int, bytes]:
        """Triton's shared-memory extensions: the router's one registry, as over gRPC."""
        match = _SHARED_MEMORY_PATH.match(path)
        if match is None or method != ("GET" if match.group(3) == "status" else "POST"):
            raise HttpError(404, f"{method} {clip(path)} is not an endpoint of this server")
        kind, name, action = match.group(1), match.group(2) or "", match.group(3)
        if kind == "cuda":
            if action == "register":
                await self.shared_memory.cuda_register(
                    pb.CudaSharedMemoryRegisterRequest(name=name), None
                )
            return 200, b"[]" if action == "status" else b""
        if action == "status":
            regions = self.shared_memory.status(name)
            return 200, orjson.dumps(
                [
                    {"name": r.name, "key": r.key, "offset": r.offset, "byte_size": r.byte_size}
                    for r in regions
                ]
            )
        if action == "unregister":
            self.shared_memory.unregister(name)
            return 200, b""
        doc = await _small_json(receive, self.settings.max_message_size)
        key, offset, size = doc.get("key"), doc.get("offset", 0), doc.get("byte_size")
        if not name or not isinstance(key, str) or not _count(offset) or not _count(size):
            raise InvalidInput(
                "register takes /v2/systemsharedmemory/region/<name>/register with "
                '{"key": "/<object>", "offset": <int>, "byte_size": <int>}'
            )
        self.shared_memory.register(name, key, int(offset), int(size))  # type: ignore[arg-type]
        return 200, b""

    async def _repository(
        self, path: str, budget: float | None, metadata: list[tuple[str, str]], receive: Receive
    ) -> tuple[int, bytes]:
        """Triton's model repository extension: index, load, unload."""
        doc = await _small_json(receive, self.settings.max_message_size)
        if path == "/v2/repository/index":
            ready = doc.get("ready", False)
            if not isinstance(ready, bool):
                raise InvalidInput("'ready' must be true or false")
            request = pb.RepositoryIndexRequest(ready=ready)
            reply = await self.repository.index(request.SerializeToString(), budget, metadata)
            models = pb.RepositoryIndexResponse.FromString(reply).models
            return 200, orjson.dumps([plain(m) for m in models])
        match = _REPOSITORY_PATH.match(path)
        if match is None:
            raise HttpError(404, f"POST {clip(path)} is not an endpoint of this server")
        name, action = match.group(1), match.group(2)
        method = LOAD if action == "load" else UNLOAD
        load = pb.RepositoryModelLoadRequest(model_name=name)
        _repository_parameters(load, doc.get("parameters"))
        try:
            await self.repository.control(method, name, load.SerializeToString(), budget, metadata)
        except ServingError as exc:
            if method == LOAD:
                raise load_failed(name, exc) from None
            raise
        return 200, b""

    async def _model_ready(
        self, name: str, version: str, budget: float | None, metadata: list[tuple[str, str]]
    ) -> bool:
        if name not in self.routes.routes:
            return False  # as the gRPC door: a model that does not exist is not ready
        request = pb.ModelReadyRequest(name=name, version=version)
        reply = await self._forward(name, "ModelReady", request, budget, metadata)
        return pb.ModelReadyResponse.FromString(reply).ready

    async def _forward(
        self,
        name: str,
        method: str,
        request: Any,
        budget: float | None,
        metadata: list[tuple[str, str]],
    ) -> bytes:
        route = self.routes.route(name)
        return await self.core.forward(route, method, request.SerializeToString(), budget, metadata)

    # -- infer: the hot path --------------------------------------------------

    async def _infer(
        self, connection: _Connection, scope: Scope, receive: Receive, send: Send, path: str
    ) -> None:
        tracing = self.core.tracing
        span = None if tracing is None else _server_span(tracing, scope)
        token = SPAN.set(span) if span is not None else None
        status = 200
        try:
            status = await self._run_infer(connection, scope, receive, send, path, span)
        finally:
            if token is not None:
                SPAN.reset(token)
            if span is not None:
                span.set_attribute("http.response.status_code", status)
                span.end()

    async def _generate_stream(
        self, connection: _Connection, scope: Scope, receive: Receive, send: Send, path: str
    ) -> None:
        """MLServer's ``generate_stream``: a decoupled model's responses as
        server-sent events, one ``data: <JSON response>`` each, over the lane's
        stream; an error in the stream is an event ``data: {"error": ...}``."""
        match = _STREAM_PATH.match(path)
        started = False
        try:
            if match is None:
                raise HttpError(404, f"POST {clip(path)} is not an endpoint of this server")
            name, version = match.group(1), match.group(2) or ""
            headers = _headers(scope)
            budget = _budget(scope, headers)
            header_length = _header_length(headers)
            body = await self._read_body(receive, headers, budget)
            if body is None:
                return  # the client went away while sending
            limit = self.settings.max_message_size
            rest = RestHead(header_length, _encoding(headers), IDENTITY, limit)
            wrapped = b"".join((wrap_head(name, version, len(body), rest), body))
            route = self.routes.route(name)
            deadline = self.core.deadline(budget)
            assert route.lane is not None
            connection.forwarding = asyncio.current_task()
            try:
                items = route.lane.stream(wrapped, _no_more(), deadline, _as_is)
                async with contextlib.aclosing(items) as events:  # type: ignore[type-var]
                    async for item in events:
                        if not started:
                            refused = _refusal(item)
                            if refused is not None:  # before any response: an HTTP error
                                await _respond(send, refused[0], _error_body(refused[1]))
                                return
                            await send(_SSE_START)
                            started = True
                        await send(_event(item))
            finally:
                connection.forwarding = None
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if connection.lost and task is not None and task.uncancel() == 0:
                return  # the client went: the lane's CANCEL ended the stream in the pool
            raise
        except (HttpError, ServingError) as exc:
            if isinstance(exc, HttpError):
                status, message = exc.status, exc.message
            else:
                status, message = http_status(exc)
            if started:
                await send(_event(ServingError(message)))
            else:
                await _respond(send, status, _error_body(message))
                return
        if not started:
            await send(_SSE_START)
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _run_infer(
        self,
        connection: _Connection,
        scope: Scope,
        receive: Receive,
        send: Send,
        path: str,
        span: Span | None,
    ) -> int:
        name, version = "", ""
        body_read = False
        try:
            name, version, protocol = _infer_target(path)
            if span is not None:
                span.set_attribute("poolserve.model.name", name)
                span.set_attribute("poolserve.model.version", version)
            headers = _headers(scope)
            budget = _budget(scope, headers)
            started = time.monotonic()
            header_length = _header_length(headers)
            body = await self._read_body(receive, headers, budget)
            if body is None:
                return 499  # the client went away while sending
            body_read = True
            if budget is not None:
                budget -= time.monotonic() - started
            if header_length is not None and _identity(headers) and header_length > len(body):
                raise InvalidInput(
                    f"Inference-Header-Content-Length {header_length} is past the end of "
                    f"the {len(body)}-byte body"
                )
            rest = RestHead(
                header_length if protocol == V2 else None,
                _encoding(headers),
                _accepted(headers),
                self.settings.max_message_size,
                protocol,
            )
            wrapped = b"".join((wrap_head(name, version, len(body), rest), body))
            attached = self._names_regions(body, rest)
            if attached:  # every registration: the worker takes the ones it names
                wrapped = wrap(list(self.shared_memory.regions.values()), wrapped)
            # a large body goes in a slab: the pool peeks at this instead
            head = (
                envelope_head(name, version, rest, body) if len(wrapped) > SLAB_THRESHOLD else b""
            )
            del body
            connection.forwarding = asyncio.current_task()
            try:
                reply = await self.core.infer(
                    name, version, wrapped, budget, _carried(scope), head, attached
                )
            finally:
                connection.forwarding = None
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if connection.lost and task is not None and task.uncancel() == 0:
                if span is not None:
                    span.add_event("the client closed its connection")
                return 499  # nobody to answer: the pool dropped the call
            raise
        except HttpError as exc:
            status, message = exc.status, exc.message
        except ServingError as exc:
            if span is not None and exc.failure is Failure.DEADLINE:
                deadline_event(span, exc.stage or "router", exc.message)
            status, message = http_status(exc)
        else:
            await _send_reply(send, reply)
            return 200
        if body_read:
            await _respond(send, status, _error_body(message))
        else:  # the body is still coming: answered, and the connection closed
            connection.refuse(status, message)
        return status

    def _names_regions(self, body: bytes, rest: RestHead) -> bool:
        """Whether the body may name a shared-memory region (the JSON is searched
        for the parameter's name, never parsed; a compressed one cannot be)."""
        if not self.shared_memory.regions:
            return False
        if rest.encoding != IDENTITY:
            return True
        length = rest.header_length
        return _MENTION in (body if length is None else body[:length])

    async def _read_body(
        self, receive: Receive, headers: dict[bytes, bytes], budget: float | None
    ) -> bytes | None:
        """The whole body (None: the client went away), within the call's deadline."""
        limit = self.settings.max_message_size
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise MessageTooLarge(
                f"the body of {int(declared)} bytes is over max_message_size ({limit})"
            )
        _encoding(headers)  # one we cannot inflate is refused before the body comes
        chunks: list[bytes] = []
        timeout = self.core.timeout(budget)
        try:
            async with asyncio.timeout(timeout):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return None
                    chunks.append(message.get("body", b""))
                    if not message.get("more_body", False):
                        break
        except TimeoutError:
            raise DeadlineExceeded(
                "deadline exceeded while the client was still sending its body", stage="router"
            ) from None
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def _small_json(receive: Receive, limit: int) -> dict[str, Any]:
    """A control call's body (empty: ``{}``); the protocol stops one over ``limit``."""
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise _Gone
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    body = b"".join(chunks)
    if not body.strip():
        return {}
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise InvalidInput(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise InvalidInput("the request body must be a JSON object")
    return doc


def _infer_target(path: str) -> tuple[str, str, int]:
    """(model, version, protocol) of an inference's URL."""
    match = _MODEL_PATH.match(path)
    if match is not None and match.group(3) in ("infer", "generate"):
        return match.group(1), match.group(2) or "", V2
    match = _V1_PREDICT_PATH.match(path)
    if match is not None:
        return match.group(1), "", V1
    raise HttpError(404, f"POST {clip(path)} is not an endpoint of this server")


async def _no_more() -> AsyncIterator[bytes]:
    """A stream's further requests: none (generate_stream sends one)."""
    nothing: tuple[bytes, ...] = ()
    for message in nothing:
        yield message


def _as_is(message: bytes) -> bytes:
    return message


def _refusal(item: bytes | ServingError) -> tuple[int, str] | None:
    """A stream's first item when it is an error: its HTTP status and message
    (the pool names the gRPC status in front of a decoupled model's errors)."""
    if isinstance(item, ServingError):
        return http_status(item)
    tag, pos = read_varint(item, 0) if item else (0, 0)
    if tag != (1 << 3) | 2:
        return None
    size, pos = read_varint(item, pos)
    message = item[pos : pos + size].decode("utf-8", "replace")
    code, _, rest = message.partition(": ")
    status = getattr(grpc.StatusCode, code, None)
    if isinstance(status, grpc.StatusCode):
        return http_status(from_upstream(status, rest, "the pool"))
    return http_status(InvalidInput(message))


def _event(item: bytes | ServingError) -> dict[str, Any]:
    """One server-sent event: a response's JSON, or an error."""
    if isinstance(item, ServingError):
        data = _error_body(item.message)
    else:
        # a ModelStreamInferResponse: error_message (field 1), or in field 2 the
        # worker's REST reply, which no protobuf parser may read
        tag, pos = read_varint(item, 0) if item else (0, 0)
        size, pos = read_varint(item, pos) if tag & 7 == 2 else (0, pos)
        payload = item[pos : pos + size]
        if tag >> 3 != 2:
            data = _error_body(payload.decode("utf-8", "replace") or "an empty response")
        else:
            reply = payload
            json_length, _, binary = REPLY_HEAD.unpack_from(reply)
            start = REPLY_HEAD.size
            if binary:
                data = _error_body("binary outputs cannot travel in server-sent events")
            else:
                data = reply[start : start + json_length]
    return {"type": "http.response.body", "body": b"data: " + data + b"\n\n", "more_body": True}


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _repository_parameters(request: pb.RepositoryModelLoadRequest, params: object) -> None:
    """A load's JSON parameters: strings (``file:`` ones base64, as Triton's
    clients send them), booleans and integers."""
    if params is None:
        return
    if not isinstance(params, dict):
        raise InvalidInput("'parameters' must be a JSON object")
    for key, value in params.items():
        param = request.parameters[key]
        if isinstance(value, bool):
            param.bool_param = value
        elif isinstance(value, int):
            param.int64_param = value
        elif isinstance(value, str) and key.startswith("file:"):
            try:
                param.bytes_param = base64.b64decode(value, validate=True)
            except binascii.Error:
                raise InvalidInput(f"parameter '{clip(key)}' is not base64") from None
        elif isinstance(value, str):
            param.string_param = value
        else:
            raise InvalidInput(f"parameter '{clip(key)}' must be a string, a boolean or an integer")


def _headers(scope: Scope) -> dict[bytes, bytes]:
    return dict(scope["headers"])


def _budget(scope: Scope, headers: dict[bytes, bytes] | None = None) -> float | None:
    value = (headers if headers is not None else _headers(scope)).get(TIMEOUT_HEADER)
    return None if value is None else parse_timeout(value)


def _encoding(headers: dict[bytes, bytes]) -> int:
    value = headers.get(b"content-encoding")
    if value is None:
        return IDENTITY
    encoding = ENCODINGS.get(value.strip().lower())
    if encoding is None:
        raise HttpError(
            415,
            f"Content-Encoding {clip(value.decode('latin-1'))!r} is not accepted: "
            "send gzip, deflate or identity",
        )
    return encoding


def _identity(headers: dict[bytes, bytes]) -> bool:
    return b"content-encoding" not in headers or _encoding(headers) == IDENTITY


def _accepted(headers: dict[bytes, bytes]) -> int:
    """The reply's encoding from Accept-Encoding: gzip, else deflate, else none."""
    value = headers.get(b"accept-encoding")
    if value is None:
        return IDENTITY
    offered = set()
    for item in value.lower().split(b","):
        token, _, params = item.strip().partition(b";")
        if params.replace(b" ", b"") in (b"q=0", b"q=0.0", b"q=0.00", b"q=0.000"):
            continue
        offered.add(token.strip())
    for name in (b"gzip", b"deflate"):
        if name in offered:
            return ENCODINGS[name]
    return IDENTITY


def _header_length(headers: dict[bytes, bytes]) -> int | None:
    value = headers.get(b"inference-header-content-length")
    if value is None:
        return None
    if not value.strip().isdigit():
        raise InvalidInput("header Inference-Header-Content-Length is not a non-negative integer")
    return int(value)


def _carried(scope: Scope) -> list[tuple[str, str]]:
    return [
        (key.decode("latin-1"), value.decode("latin-1"))
        for key, value in scope["headers"]
        if key in _CARRIED
    ]


def _server_span(tracing: Tracing, scope: Scope) -> Span:
    attributes: dict[str, Any] = {
        "http.request.method": scope["method"],
        "url.path": scope["path"],
    }
    budget = dict(scope["headers"]).get(TIMEOUT_HEADER)
    if budget is not None:
        with contextlib.suppress(InvalidInput):
            attributes["poolserve.deadline.budget_ms"] = parse_timeout(budget) * 1000
    return tracing.server_span(f"POST {scope['path']}", _carried(scope), attributes)


async def _respond(send: Send, status: int, body: bytes, content_type: bytes = JSON) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", content_type), (b"content-length", b"%d" % len(body))],
        }
    )
    await send({"type": "http.response.body", "body": body})


async def _send_reply(send: Send, reply: bytes) -> None:
    """A worker's reply: JSON alone, or JSON and binary outputs (Triton's extension)."""
    json_length, encoding, binary = REPLY_HEAD.unpack_from(reply)
    start = REPLY_HEAD.size
    view = memoryview(reply)[start:]
    headers = [(b"content-length", b"%d" % len(view))]
    if encoding != IDENTITY:
        headers.append((b"content-encoding", ENCODING_NAMES[encoding]))
    if not binary:
        headers.append((b"content-type", JSON))
    else:
        headers.append((b"content-type", b"application/octet-stream"))
        headers.append((b"inference-header-content-length", b"%d" % json_length))
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": view})


def _metadata_json(reply: pb.ModelMetadataResponse) -> bytes:
    def tensors(items: Iterable[pb.ModelMetadataResponse.TensorMetadata]) -> list[dict[str, Any]]:
        return [{"name": t.name, "datatype": t.datatype, "shape": list(t.shape)} for t in items]

    return orjson.dumps(
        {
            "name": reply.name,
            "versions": list(reply.versions),
            "platform": reply.platform,
            "inputs": tensors(reply.inputs),
            "outputs": tensors(reply.outputs),
        }
    )


def plain(message: Message) -> dict[str, Any]:
    """A message as Triton's HTTP API writes it: field names as in the .proto,
    enums by name, and 64-bit integers as JSON numbers (protobuf's own JSON
    mapping writes them as strings)."""
    out: dict[str, Any] = {}
    for field, value in message.ListFields():
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            value_field = field.message_type.fields_by_name["value"]
            out[field.name] = {k: _plain_value(value_field, v) for k, v in value.items()}
        elif field.is_repeated:
            out[field.name] = [_plain_value(field, v) for v in value]
        else:
            out[field.name] = _plain_value(field, value)
    return out


def _plain_value(field: FieldDescriptor, value: Any) -> Any:
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        return plain(value)
    if field.type == FieldDescriptor.TYPE_ENUM:
        found = field.enum_type.values_by_number.get(value) if field.enum_type else None
        return found.name if found is not None else value
    if field.type == FieldDescriptor.TYPE_BYTES:
        return value.decode("latin-1")
    return value
