"""What the router's HTTP door reads from a request and writes back, beside
the parser (httptools'): the deadline header, the body's encodings, the trace
context, bounded control bodies, JSON errors and replies, a worker's REST
reply as HTTP headers and body, server-sent events. No state."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import orjson

from poolserve.service.contract.errors import (
    InvalidInput,
    ServingError,
    clip,
)
from poolserve.service.contract.rest import (
    CUSTOM_REPLY,
    ENCODING_NAMES,
    ENCODINGS,
    IDENTITY,
    REPLY_HEAD,
)
from poolserve.service.contract.wire import read_varint
from poolserve.service.grpcserver.status import from_upstream, http_status

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
MODEL_PATH = re.compile(
    r"^/v2/models/([^/]+)(?:/versions/([^/]+))?(?:/(ready|infer|generate|config|stats))?$"
)
SSE_START = {
    "type": "http.response.start",
    "status": 200,
    "headers": [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")],
}


class HttpError(Exception):
    """An answer that is an HTTP status of the door's own (not a model's error)."""

    def __init__(self, status: int, message: str, allow: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.allow = allow  # a 405's methods that the path takes


def parse_timeout(value: bytes) -> float:
    """A ``Grpc-Timeout`` value in seconds; InvalidInput when malformed."""
    match = _TIMEOUT.match(value.strip())
    if match is None:
        raise InvalidInput(
            f"header Grpc-Timeout {clip(value.decode('latin-1'))!r} is not an integer of "
            "at most 8 digits and a unit (H, M, S, m, u, n), e.g. 500m"
        )
    return int(match.group(1)) * _UNIT_S[match.group(2)]


def error_body(message: str) -> bytes:
    return orjson.dumps({"error": message})


class Gone(Exception):
    """The client closed its connection: nobody to answer."""


async def small_json(receive: Receive, limit: int) -> dict[str, Any]:
    """A control call's body (empty: ``{}``); the protocol stops one over ``limit``."""
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise Gone
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


async def no_more() -> AsyncIterator[bytes]:
    """A stream's further requests: none (generate_stream sends one)."""
    nothing: tuple[bytes, ...] = ()
    for message in nothing:
        yield message


def as_is(message: bytes) -> bytes:
    return message


def refusal(item: bytes | ServingError) -> tuple[int, str] | None:
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


def sse_event(item: bytes | ServingError) -> dict[str, Any]:
    """One server-sent event: a response's JSON, or an error."""
    if isinstance(item, ServingError):
        data = error_body(item.message)
    else:
        # a ModelStreamInferResponse: error_message (field 1), or in field 2 the
        # worker's REST reply, which no protobuf parser may read
        tag, pos = read_varint(item, 0) if item else (0, 0)
        size, pos = read_varint(item, pos) if tag & 7 == 2 else (0, pos)
        payload = item[pos : pos + size]
        if tag >> 3 != 2:
            data = error_body(payload.decode("utf-8", "replace") or "an empty response")
        else:
            reply = payload
            json_length, _, binary = REPLY_HEAD.unpack_from(reply)
            start = REPLY_HEAD.size
            if binary:
                data = error_body("binary outputs cannot travel in server-sent events")
            else:
                data = reply[start : start + json_length]
    return {"type": "http.response.body", "body": b"data: " + data + b"\n\n", "more_body": True}


def headers_of(scope: Scope) -> dict[bytes, bytes]:
    return dict(scope["headers"])


def budget_of(scope: Scope, headers: dict[bytes, bytes] | None = None) -> float | None:
    value = (headers if headers is not None else headers_of(scope)).get(TIMEOUT_HEADER)
    return None if value is None else parse_timeout(value)


def encoding_of(headers: dict[bytes, bytes]) -> int:
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


def identity(headers: dict[bytes, bytes]) -> bool:
    return b"content-encoding" not in headers or encoding_of(headers) == IDENTITY


def accepted(headers: dict[bytes, bytes]) -> int:
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


def header_length_of(headers: dict[bytes, bytes]) -> int | None:
    value = headers.get(b"inference-header-content-length")
    if value is None:
        return None
    if not value.strip().isdigit():
        raise InvalidInput("header Inference-Header-Content-Length is not a non-negative integer")
    return int(value)


def carried_of(scope: Scope) -> list[tuple[str, str]]:
    return [
        (key.decode("latin-1"), value.decode("latin-1"))
        for key, value in scope["headers"]
        if key in _CARRIED
    ]


async def respond(
    send: Send,
    status: int,
    body: bytes,
    content_type: bytes = JSON,
    extra: tuple[tuple[bytes, bytes], ...] = (),
) -> None:
    headers = [(b"content-type", content_type), (b"content-length", b"%d" % len(body)), *extra]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def send_reply(send: Send, reply: bytes) -> None:
    """A worker's reply: JSON alone, or JSON and binary outputs (Triton's extension)."""
    json_length, encoding, binary = REPLY_HEAD.unpack_from(reply)
    start = REPLY_HEAD.size
    if binary == CUSTOM_REPLY:  # a custom endpoint's own status, headers and body
        head = orjson.loads(memoryview(reply)[start : start + json_length])
        body = memoryview(reply)[start + json_length :]
        pairs = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in head["headers"]]
        await send({"type": "http.response.start", "status": head["status"], "headers": pairs})
        await send({"type": "http.response.body", "body": body})
        return
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
