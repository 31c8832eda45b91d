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
import contextlib
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from opentelemetry.trace import Span
from uvicorn.config import Config
from uvicorn.server import ServerState

from poolserve.service.contract.errors import (
    DeadlineExceeded,
    Failure,
    InvalidInput,
    MessageTooLarge,
    ServingError,
    clip,
)
from poolserve.service.contract.rest import (
    IDENTITY,
    V1,
    V2,
    RestHead,
    envelope_head,
    wrap_head,
)
from poolserve.service.contract.settings import ServerSettings
from poolserve.service.contract.shm import wrap
from poolserve.service.contract.slab import THRESHOLD as SLAB_THRESHOLD
from poolserve.service.grpcserver.shm import SharedMemory
from poolserve.service.grpcserver.status import http_status
from poolserve.service.grpcserver.tracing import Tracing, deadline_event
from poolserve.service.router import ensemble_rest
from poolserve.service.router.custom_routes import CustomRoutes
from poolserve.service.router.forwarding import SPAN, Forwarder
from poolserve.service.router.http_connection import HttpConnection, tls_context
from poolserve.service.router.http_control import HttpControl
from poolserve.service.router.http_custom import run_custom
from poolserve.service.router.http_io import Body, forwarded
from poolserve.service.router.http_methods import STREAM_PATH, V1_PREDICT_PATH, allow_header
from poolserve.service.router.http_wire import (
    MODEL_PATH,
    SSE_START,
    TIMEOUT_HEADER,
    Gone,
    HttpError,
    Receive,
    Scope,
    Send,
    accepted,
    as_is,
    budget_of,
    carried_of,
    encoding_of,
    error_body,
    header_length_of,
    headers_of,
    identity,
    no_more,
    parse_timeout,
    refusal,
    respond,
    send_reply,
    sse_event,
)
from poolserve.service.router.replybudget import TRACKED_REPLY, RepliesUnread, ReplyBudget
from poolserve.service.router.repository import RepositoryCalls
from poolserve.service.router.routes import Routes

log = logging.getLogger(__name__)

_MENTION = b"shared_memory_region"


class HttpDoor:
    """The REST API on ``http_port``: an ASGI app on uvicorn's httptools protocol."""

    def __init__(
        self,
        settings: ServerSettings,
        routes: Routes,
        core: Forwarder,
        repository: RepositoryCalls,
        shared_memory: SharedMemory,
        replies: ReplyBudget,
    ) -> None:
        self.settings = settings
        self.routes = routes
        self.core = core
        self.shared_memory = shared_memory
        self.replies = replies  # the router's one budget of unread replies, both doors
        self.control = HttpControl(settings, routes, core, repository, shared_memory)
        self.ensembles = repository.ensembles  # run in the router (router/ensemble.py)
        self.custom = CustomRoutes(core)  # MLServer models' @custom_handler endpoints
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

    async def start(self, host: str, port: int, reuse_port: bool = False) -> int:
        """Listens on ``host:port``; the port bound (``port`` 0: any free one).
        ``reuse_port``: SO_REUSEPORT, a fleet's routers share the port."""
        loop = asyncio.get_running_loop()

        def connection() -> HttpConnection:
            return HttpConnection(
                self.settings,
                self.replies,
                config=self._config,
                server_state=self.state,
                app_state={},
            )

        tls = tls_context(self.settings)
        self._server = await loop.create_server(
            connection,
            host,
            port,
            backlog=2048,
            reuse_port=reuse_port,
            ssl=tls,
            ssl_handshake_timeout=self.settings.handshake_timeout_s if tls else None,
        )
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
        connection: HttpConnection = scope["poolserve.connection"]
        method: str = scope["method"]
        path: str = scope["path"]
        extra: tuple[tuple[bytes, bytes], ...] = ()
        try:
            if method == "POST" and path.endswith("/generate_stream") and STREAM_PATH.match(path):
                await self._traced(self._generate_stream, connection, scope, receive, send, path)
                return
            if forwarded(method, path) and _is_infer(path):
                await self._traced(self._run_infer, connection, scope, receive, send, path)
                return
            asked = "GET" if method == "HEAD" else method  # HEAD: GET's answer without its body
            status, body = await self.control.answer(asked, path, scope, receive)
        except Gone:
            return
        except HttpError as exc:
            if exc.status in (404, 405) and await self._custom(connection, scope, receive, send):
                return  # a path none of ours: an MLServer model's @custom_handler endpoint
            status, body = exc.status, error_body(exc.message)
            if exc.allow:
                extra = ((b"allow", allow_header(exc.allow)),)
        except ServingError as exc:
            status, message = http_status(exc)
            body = error_body(message)
        with connection.corked():
            await respond(send, status, body, extra=extra)

    async def _custom(
        self, connection: HttpConnection, scope: Scope, receive: Receive, send: Send
    ) -> bool:
        """Runs the call if a loaded MLServer model declared its path
        (:mod:`poolserve.service.router.http_custom`); False if none did."""
        method, path = scope["method"], scope["path"]
        route, others = await self.custom.find(method, path)
        if route is None:
            if not others:
                return False
            message = f"{method} {clip(path)}: this endpoint takes {' or '.join(others)}"
            extra = ((b"allow", allow_header(others)),)
            await respond(send, 405, error_body(message), extra=extra)
            return True

        async def run(
            connection: HttpConnection,
            scope: Scope,
            receive: Receive,
            send: Send,
            _: str,
            span: Span | None,
        ) -> int:
            return await run_custom(
                self.settings, self.core, self._read_body, self._answer_reply, route,
                connection, scope, receive, send, span,
            )  # fmt: skip

        await self._traced(run, connection, scope, receive, send, path)
        return True

    async def _traced(
        self,
        run: Callable[[HttpConnection, Scope, Receive, Send, str, Span | None], Awaitable[int]],
        connection: HttpConnection,
        scope: Scope,
        receive: Receive,
        send: Send,
        path: str,
    ) -> None:
        """A SERVER span per call when tracing is on, with the status it ended with."""
        tracing = self.core.tracing
        span = None if tracing is None else _server_span(tracing, scope)
        token = SPAN.set(span) if span is not None else None
        status = 200
        try:
            status = await run(connection, scope, receive, send, path, span)
        finally:
            if token is not None:
                SPAN.reset(token)
            if span is not None:
                span.set_attribute("http.response.status_code", status)
                span.end()

    async def _generate_stream(
        self,
        connection: HttpConnection,
        scope: Scope,
        receive: Receive,
        send: Send,
        path: str,
        span: Span | None,
    ) -> int:
        """MLServer's ``generate_stream``: a decoupled model's responses as
        server-sent events, one ``data: <JSON response>`` each, over the lane's
        stream; an error in the stream is an event ``data: {"error": ...}``."""
        match = STREAM_PATH.match(path)
        started = False
        events_sent = 0
        try:
            if match is None:
                raise HttpError(404, f"POST {clip(path)} is not an endpoint of this server")
            name, version = match.group(1), match.group(2) or ""
            if span is not None:
                span.set_attribute("poolserve.model.name", name)
                span.set_attribute("poolserve.model.version", version)
            headers = headers_of(scope)
            budget = budget_of(scope, headers)
            header_length = header_length_of(headers)
            chunks = await self._read_body(scope, receive, headers, budget)
            if chunks is None:
                return 499  # the client went away while sending
            limit = self.settings.max_message_size
            rest = RestHead(header_length, encoding_of(headers), IDENTITY, limit)
            prefix = wrap_head(name, version, sum(map(len, chunks)), rest)
            wrapped = b"".join([prefix, *chunks])
            route = self.routes.route(name)
            deadline = self.core.deadline(budget)
            assert route.lane is not None
            if span is not None:
                span.set_attribute("poolserve.pool", route.gid)
            connection.forwarding = asyncio.current_task()
            try:
                # a client that reads none of its events for stream_stall_s frees its worker
                stall_s = self.settings.stream_stall_s
                stalled = functools.partial(self.core.count_stalled, name)
                items = route.lane.stream(wrapped, no_more(), deadline, as_is, stall_s, stalled)
                async with contextlib.aclosing(items) as events:
                    async for item in events:
                        if not started:
                            refused = refusal(item)
                            if refused is not None:  # before any response: an HTTP error
                                await respond(send, refused[0], error_body(refused[1]))
                                return refused[0]
                            await send(SSE_START)
                            started = True
                        await send(sse_event(item))
                        events_sent += 1
            finally:
                connection.forwarding = None
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if connection.lost and task is not None and task.uncancel() == 0:
                if span is not None:
                    span.add_event("the client closed its connection")
                return 499  # the client went: the lane's CANCEL ended the stream in the pool
            raise
        except (HttpError, ServingError) as exc:
            if isinstance(exc, HttpError):
                status, message = exc.status, exc.message
            else:
                status, message = http_status(exc)
            if started:
                await send(sse_event(ServingError(message)))
            else:
                await respond(send, status, error_body(message))
                return status
        finally:
            if span is not None:
                span.set_attribute("poolserve.stream.responses", events_sent)
        if not started:
            await send(SSE_START)
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        return 200

    async def _run_infer(
        self,
        connection: HttpConnection,
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
            headers = headers_of(scope)
            budget = budget_of(scope, headers)
            started = time.monotonic()
            header_length = header_length_of(headers)
            chunks = await self._read_body(scope, receive, headers, budget)
            if chunks is None:
                return 499  # the client went away while sending
            body_read = True
            size = sum(map(len, chunks))
            if budget is not None:
                budget -= time.monotonic() - started
            if header_length is not None and identity(headers) and header_length > size:
                raise InvalidInput(
                    f"Inference-Header-Content-Length {header_length} is past the end of "
                    f"the {size}-byte body"
                )
            if name in self.ensembles.plans and protocol == V2:
                connection.forwarding = asyncio.current_task()
                try:
                    reply = await self._ensemble(
                        name, version, headers, chunks, header_length, budget, scope
                    )
                finally:
                    connection.forwarding = None
                return await self._answer_reply(connection, send, reply)
            rest = RestHead(
                header_length if protocol == V2 else None,
                encoding_of(headers),
                accepted(headers),
                self.settings.max_message_size,
                protocol,
            )
            prefix = wrap_head(name, version, size, rest)
            wrapped = b"".join([prefix, *chunks])  # the one copy of the body in the router
            del chunks
            body = memoryview(wrapped)[len(prefix) :]
            attached = self._names_regions(wrapped, len(prefix), rest)
            if attached:  # every registration: the worker takes the ones it names
                wrapped = wrap(list(self.shared_memory.regions.values()), wrapped)
            # a large body goes in a slab: the pool peeks at this instead
            head = (
                envelope_head(name, version, rest, body) if len(wrapped) > SLAB_THRESHOLD else b""
            )
            del body
            if self.replies.total:  # someone is not reading: is it this connection?
                self.replies.admit(connection.peer)
            connection.forwarding = asyncio.current_task()
            try:
                reply = await self.core.infer(
                    name, version, wrapped, budget, carried_of(scope), head, attached
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
            return await self._answer_reply(connection, send, reply)
        if body_read:
            with connection.corked():
                await respond(send, status, error_body(message))
        else:  # the body is still coming: answered, and the connection closed
            connection.refuse(status, message)
        return status

    async def _ensemble(
        self,
        name: str,
        version: str,
        headers: dict[bytes, bytes],
        chunks: list[bytes],
        header_length: int | None,
        budget: float | None,
        scope: Scope,
    ) -> bytes:
        """An ensemble's call: its body read here, its steps run by the router."""
        plan = self.ensembles.plan(name, version)
        body = b"".join(chunks)
        limit = self.settings.max_message_size
        request, wanted = ensemble_rest.parse(body, header_length, encoding_of(headers), limit)
        response = await self.ensembles.run(plan, request, budget, carried_of(scope))
        return ensemble_rest.reply(response, wanted)

    async def _answer_reply(self, connection: HttpConnection, send: Send, reply: bytes) -> int:
        """Sends a worker's reply; a large one is counted in the router's reply
        budget until the client has taken it (429 when over a bound)."""
        if len(reply) >= TRACKED_REPLY:
            try:
                connection.hold(len(reply))
            except RepliesUnread as exc:
                status, message = http_status(exc)
                await respond(send, status, error_body(message))
                return status
        with connection.corked():  # the status line, headers and body as one write
            await send_reply(send, reply)
        connection.settle()
        return 200

    def _names_regions(self, wrapped: bytes, start: int, rest: RestHead) -> bool:
        """Whether the body (from ``start`` in ``wrapped``) may name a shared-memory
        region: its JSON is searched for the parameter's name, never parsed (a
        compressed one cannot be searched)."""
        if not self.shared_memory.regions:
            return False
        if rest.encoding != IDENTITY:
            return True
        end = len(wrapped) if rest.header_length is None else start + rest.header_length
        return wrapped.find(_MENTION, start, end) >= 0

    async def _read_body(
        self, scope: Scope, receive: Receive, headers: dict[bytes, bytes], budget: float | None
    ) -> list[bytes] | None:
        """The body's chunks as httptools made them (None: the client went
        away), within the call's deadline; joined once, by the caller."""
        limit = self.settings.max_message_size
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise MessageTooLarge(
                f"the body of {int(declared)} bytes is over max_message_size ({limit})"
            )
        encoding_of(headers)  # one we cannot inflate is refused before the body comes
        # An inference's body is kept by the connection as httptools made it;
        # another (an MLServer custom endpoint's) comes through uvicorn's receive.
        body: Body | None = scope.get("poolserve.body")
        if body is not None:
            body.unread = 0
            if body.complete:  # all there already (a small body): nothing to wait for
                return None if scope["poolserve.connection"].lost else body.chunks
        chunks: list[bytes] = [] if body is None else body.chunks
        try:
            async with asyncio.timeout(self.core.timeout(budget)):
                while True:
                    message = await receive()  # a kept body's: resumes reading, comes empty
                    if body is None:
                        chunks.append(message.get("body", b""))
                    else:
                        body.unread = 0
                    if message["type"] == "http.disconnect":
                        return None
                    if not message.get("more_body", False):
                        return chunks
        except TimeoutError:
            raise DeadlineExceeded(
                "deadline exceeded while the client was still sending its body", stage="router"
            ) from None


def _is_infer(path: str) -> bool:
    match = MODEL_PATH.match(path)
    if match is not None:
        return match.group(3) in ("infer", "generate")
    return V1_PREDICT_PATH.match(path) is not None


def _infer_target(path: str) -> tuple[str, str, int]:
    """(model, version, protocol) of an inference's URL."""
    match = MODEL_PATH.match(path)
    if match is not None and match.group(3) in ("infer", "generate"):
        return match.group(1), match.group(2) or "", V2
    match = V1_PREDICT_PATH.match(path)
    if match is not None:
        return match.group(1), "", V1
    raise HttpError(404, f"POST {clip(path)} is not an endpoint of this server")


def _server_span(tracing: Tracing, scope: Scope) -> Span:
    attributes: dict[str, Any] = {
        "http.request.method": scope["method"],
        "url.path": scope["path"],
    }
    budget = dict(scope["headers"]).get(TIMEOUT_HEADER)
    if budget is not None:
        with contextlib.suppress(InvalidInput):
            attributes["poolserve.deadline.budget_ms"] = parse_timeout(budget) * 1000
    return tracing.server_span(f"POST {scope['path']}", carried_of(scope), attributes)
