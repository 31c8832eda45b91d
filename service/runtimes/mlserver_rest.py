"""An MLServer model's custom REST endpoints (``mlserver.handlers.custom_handler``).

MLServer adds each ``@custom_handler(rest_path=..., rest_method=...)`` method
of a loaded model to its FastAPI app (``app.add_api_route(rest_path, method,
methods=[rest_method])``, with MLServer's route class): FastAPI reads the
method's signature (a ``Request``, MLServer's, which inflates a gzip body;
path and query parameters, a pydantic or plain JSON body, headers), and
encodes what it returns with MLServer's ``Response`` (JSON, without unset or
None fields; gzip for a client that accepts it); MLServer's exception
handler answers an ``MLServerError`` with its status and ``{"error": ...}``.

poolserve builds the same app, with the same calls, once per model where it
loads (:func:`custom_app`: the zygote, so the workers share it), and each
worker runs a call on it as an ASGI application (:func:`call_app`): the
router forwarded the call's method, path, query, headers and body unparsed.
One difference: an exception that is not MLServer's own is ``500 Internal
Server Error`` in plain text, never the traceback that MLServer's ``debug``
(true by default) sends to the client.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

Routes = tuple[tuple[str, str], ...]


def custom_app(mlmodel: Any) -> tuple[Routes, Any]:
    """((method, path) of each endpoint, the app serving them) of a loaded
    model; ((), None) when it declares none."""
    from mlserver.handlers.custom import get_custom_handlers

    handlers = get_custom_handlers(mlmodel)
    if not handlers:
        return (), None
    from fastapi import FastAPI
    from fastapi.middleware.gzip import GZipMiddleware
    from mlserver.rest.app import APIRoute
    from mlserver.rest.errors import _EXCEPTION_HANDLERS
    from mlserver.rest.responses import Response

    app = FastAPI(
        default_response_class=Response,
        exception_handlers=_EXCEPTION_HANDLERS,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    # as mlserver.rest.app.create_app: its route class (its Request, which inflates a
    # gzip body; its Response), and gzip replies for clients that accept them
    app.router.route_class = APIRoute
    app.add_middleware(GZipMiddleware)
    for handler, method in handlers:
        app.add_api_route(handler.rest_path, method, methods=[handler.rest_method])
    return tuple((h.rest_method.upper(), h.rest_path) for h, _ in handlers), app


async def call_app(app: Any, call: bytes, body: bytes) -> tuple[int, list[list[str]], bytes]:
    """(status, headers, body) of one call (the router's JSON ``call``: method,
    path, query and headers) on ``app``."""
    doc = json.loads(call)
    path: str = doc["path"]
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": doc["method"],
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": doc["query"].encode("latin-1"),
        "headers": [(k.encode("latin-1"), v.encode("latin-1")) for k, v in doc["headers"]],
        "client": None,
        "server": None,
    }
    given = False

    async def receive() -> dict[str, Any]:
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()  # the client is there until the answer is sent
        raise AssertionError("unreachable")

    status = 500
    headers: list[list[str]] = []
    chunks: list[bytes] = []
    started = False

    async def send(message: dict[str, Any]) -> None:
        nonlocal status, headers, started
        if message["type"] == "http.response.start":
            started = True
            status = int(message["status"])
            headers = [[k.decode("latin-1"), v.decode("latin-1")] for k, v in message["headers"]]
        elif message["type"] == "http.response.body":
            chunks.append(bytes(message.get("body", b"")))

    try:
        await app(scope, receive, send)
    except Exception:
        if not started:  # Starlette answered nothing: as its error middleware would
            text = b"Internal Server Error"
            plain = [["content-type", "text/plain; charset=utf-8"]]
            return 500, [*plain, ["content-length", str(len(text))]], text
    return status, headers, b"".join(chunks)
