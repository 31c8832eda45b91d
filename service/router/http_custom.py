"""An MLServer model's custom REST endpoint (``@custom_handler``) on the HTTP door.

A path that is none of the door's own endpoints may be one a loaded
MLServer model declared (:mod:`poolserve.service.router.custom_routes`):
the call then goes to that model's pool, as an inference does, inside the
REST wrapper with the :data:`~poolserve.service.contract.rest.CUSTOM`
protocol, the body unparsed and the call's method, path, query and headers
beside it. The worker (or the pool, for an inline model) runs the handler
as MLServer's web framework runs it and answers its status, headers and
body, which are sent back as they are (:func:`send_reply`). As for
inferences: the deadline, cancellation when the client closes its
connection, the trace, admission and the reply budget apply.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from opentelemetry.trace import Span

from poolserve.service.contract.errors import Failure, ServingError
from poolserve.service.contract.rest import (
    CUSTOM,
    IDENTITY,
    RestHead,
    custom_call,
    envelope_head,
    wrap_head,
)
from poolserve.service.contract.settings import ServerSettings
from poolserve.service.contract.slab import THRESHOLD as SLAB_THRESHOLD
from poolserve.service.grpcserver.status import http_status
from poolserve.service.grpcserver.tracing import deadline_event
from poolserve.service.router.custom_routes import CustomRoute
from poolserve.service.router.forwarding import Forwarder
from poolserve.service.router.http_connection import HttpConnection
from poolserve.service.router.http_wire import (
    Receive,
    Scope,
    Send,
    budget_of,
    carried_of,
    error_body,
    headers_of,
    respond,
)

ReadBody = Callable[
    [Scope, Receive, dict[bytes, bytes], float | None], Awaitable[list[bytes] | None]
]
AnswerReply = Callable[[HttpConnection, Send, bytes], Awaitable[int]]


async def run_custom(
    settings: ServerSettings,
    core: Forwarder,
    read_body: ReadBody,
    answer_reply: AnswerReply,
    route: CustomRoute,
    connection: HttpConnection,
    scope: Scope,
    receive: Receive,
    send: Send,
    span: Span | None,
) -> int:
    """One call of ``route``'s endpoint: its HTTP status."""
    name = route.model
    body_read = False
    try:
        if span is not None:
            span.set_attribute("poolserve.model.name", name)
            span.set_attribute("poolserve.mlserver.custom_path", route.template)
        headers = headers_of(scope)
        budget = budget_of(scope, headers)
        chunks = await read_body(scope, receive, headers, budget)
        if chunks is None:
            return 499  # the client went away while sending
        body_read = True
        size = sum(map(len, chunks))
        call = custom_call(scope["method"], scope["path"], scope["query_string"], scope["headers"])
        rest = RestHead(None, IDENTITY, IDENTITY, settings.max_message_size, CUSTOM, call)
        prefix = wrap_head(name, "", size, rest)
        wrapped = b"".join([prefix, *chunks])
        del chunks
        body = memoryview(wrapped)[len(prefix) :]
        head = envelope_head(name, "", rest, body) if len(wrapped) > SLAB_THRESHOLD else b""
        del body
        connection.forwarding = asyncio.current_task()
        try:
            reply = await core.infer(name, "", wrapped, budget, carried_of(scope), head)
        finally:
            connection.forwarding = None
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if connection.lost and task is not None and task.uncancel() == 0:
            return 499  # nobody to answer: the pool dropped the call
        raise
    except ServingError as exc:
        if span is not None and exc.failure is Failure.DEADLINE:
            deadline_event(span, exc.stage or "router", exc.message)
        status, message = http_status(exc)
    else:
        return await answer_reply(connection, send, reply)
    if body_read:
        await respond(send, status, error_body(message))
    else:
        connection.refuse(status, message)
    return status
