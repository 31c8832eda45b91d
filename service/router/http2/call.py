"""One gRPC call on one HTTP/2 stream of the router's own gRPC door.

The call reads its headers (path, deadline, encoding, metadata), assembles
the length-prefixed messages of its DATA frames, runs the method's handler
(the same ``grpc.RpcMethodHandler`` objects a grpcio server would run) and
writes the response headers, messages and the status as trailers. It is
also the handler's ``context``: the part of ``grpc.aio.ServicerContext`` the
router's handlers use (peer, time remaining, metadata, abort, trailing
metadata, done callbacks). The client's RST_STREAM, a closed connection and
the call's deadline cancel the handler's task.
"""

from __future__ import annotations

import asyncio
import base64
import inspect
import logging
import time
import zlib
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import grpc

from poolserve.service.router.http2.frames import (
    END_HEADERS,
    ErrorCode,
    Kind,
    frame,
    header_frames,
)
from poolserve.service.router.http2.replies import Metadata, response_headers, trailers

if TYPE_CHECKING:
    from poolserve.service.router.http2.connection import Http2Connection

log = logging.getLogger(__name__)

STREAM_WINDOW = 4 << 20  # each stream's receive window (advertised in our SETTINGS)
_TIMEOUT_UNITS = {
    ord("H"): 3600.0,
    ord("M"): 60.0,
    ord("S"): 1.0,
    ord("m"): 1e-3,
    ord("u"): 1e-6,
    ord("n"): 1e-9,
}
_DECOMPRESS = {b"gzip": 16 + zlib.MAX_WBITS, b"deflate": zlib.MAX_WBITS}  # replies say so


class Sink(Protocol):
    """Where a large unary request's message is received as its DATA comes,
    instead of being joined from the frames (the router's slab): ``view``
    takes exactly the message's bytes, and the handler is given it. ``drop``
    runs once the call holds its request no more (a no-op when someone took
    the sink over meanwhile)."""

    view: memoryview

    def drop(self) -> None: ...


class _Details:
    """What grpc's generic handlers are given to find a method."""

    __slots__ = ("invocation_metadata", "method")

    def __init__(self, method: str, metadata: Metadata) -> None:
        self.method = method
        self.invocation_metadata = metadata


class Call:
    """One gRPC call, and the handler's context."""

    # a handler's reply may be a memoryview: sent as it is, and what it views must
    # stay until the done callbacks run (router/grpc_door.py lender)
    sends_views = True

    __slots__ = (
        "_callbacks",
        "_chunks",
        "_code",
        "_deadline_timer",
        "_details",
        "_have",
        "_metadata",
        "_pending",
        "_refusal",
        "_requests",
        "_size",
        "_trailing",
        "conn",
        "deadline",
        "encoding",
        "finished",
        "handler",
        "headers",
        "headers_sent",
        "held",
        "owed",
        "partial",
        "path",
        "receive_window",
        "remote_done",
        "send_window",
        "sink",
        "stream",
        "task",
        "timeout",
        "was_cancelled",
    )

    def __init__(
        self,
        conn: Http2Connection,
        stream: int,
        headers: list[tuple[bytes, bytes]],
        find: Callable[[str, Call], grpc.RpcMethodHandler[Any, Any] | None],
    ) -> None:
        self.conn = conn
        self.stream = stream
        self.headers = headers
        self.send_window = conn.peer_stream_window
        self.receive_window = STREAM_WINDOW  # what the client may still send on this stream
        self.remote_done = False
        self.finished = False
        self.was_cancelled = False
        self.headers_sent = False
        self.deadline: float | None = None
        self.timeout = 0.0  # the grpc-timeout it came with (seconds), if any
        self.encoding = b""
        self.path = ""
        self.task: asyncio.Task[Any] | None = None
        self._pending = bytearray()  # a streaming call's bytes of messages still coming
        self._chunks: list[bytes | memoryview] = []  # a unary call's request, as it came
        self._have = 0  # their bytes
        self._size = -1  # its message's size, once its prefix came
        self.sink: Sink | None = None  # where a large one is received instead (GrpcServer.sink)
        self.held = 0  # request bytes held here (budget.RequestBudget)
        self.partial = 0  # of those, in a message still coming (in _pending)
        self.owed = 0  # stream window taken and not given back yet (a bound held it)
        self._requests: _Requests | None = None
        self._metadata: Metadata | None = None
        self._code: grpc.StatusCode | None = None
        self._details = ""
        self._trailing: Metadata = ()
        self._callbacks: list[Callable[[Any], None]] = []
        self._deadline_timer: asyncio.TimerHandle | None = None
        self.handler: grpc.RpcMethodHandler[Any, Any] | None = None
        refusal = self._read_headers()
        if refusal is None:
            self.handler = find(self.path, self)
            if self.handler is None:
                refusal = (grpc.StatusCode.UNIMPLEMENTED, f"Method not found: {self.path}")
        self._refusal = refusal

    def _read_headers(self) -> tuple[grpc.StatusCode, str] | None:
        method = content_type = b""
        for name, value in self.headers:
            if name == b":path":
                self.path = value.decode("latin-1")
            elif name == b":method":
                method = value
            elif name == b"content-type":
                content_type = value
            elif name == b"grpc-timeout":
                timeout = parse_timeout(value)
                if timeout is None:
                    return grpc.StatusCode.INTERNAL, f"malformed grpc-timeout {value!r}"
                self.deadline = time.monotonic() + timeout
                self.timeout = timeout
            elif name == b"grpc-encoding":
                self.encoding = value
        if method != b"POST":
            return grpc.StatusCode.UNIMPLEMENTED, f"HTTP method {method!r} is not POST"
        if not content_type.startswith(b"application/grpc"):
            return grpc.StatusCode.UNKNOWN, f"content-type {content_type!r} is not application/grpc"
        if self.encoding not in (b"", b"identity") and self.encoding not in _DECOMPRESS:
            return grpc.StatusCode.UNIMPLEMENTED, f"grpc-encoding {self.encoding!r} not supported"
        return None

    # -- from the connection -------------------------------------------------------

    def start(self, end: bool) -> None:
        """The headers are here (``end``: and no body will come)."""
        if self._refusal is not None:
            self.remote_done = end
            self._status(*self._refusal)
            return
        loop = self.conn.loop
        if self.deadline is not None:
            self._deadline_timer = loop.call_at(self.deadline, self._deadline_passed)
        handler = self.handler
        assert handler is not None
        if handler.request_streaming:
            self._requests = _Requests(self)
            self.task = self.conn.spawn(self._run(None))
        if end:
            self.received(b"", True, 0)

    def received(self, data: bytes | memoryview, end: bool, flow: int) -> None:
        """DATA of this stream (``flow``: its size with padding, for the window);
        a large frame's payload may come in parts, views of the connection's reads."""
        if self.finished:
            return
        limit = self.conn.server.settings.max_message_size
        requests = self._requests
        if requests is None and end and not self._have and _whole(data, limit):
            self.remote_done = True  # one frame, one whole uncompressed message
            self._hold(len(data))  # until the handler returns
            self.task = self.conn.spawn(self._run(bytes(data[5:])))
            return
        self._hold(len(data), len(data))
        if requests is None:  # one request: its window given back as it comes (within bounds)
            if data:
                if self.sink is not None:
                    self._into_sink(data, self._have)
                else:
                    self._chunks.append(data)
                self._have += len(data)
                if self._size < 0 and self._have >= 5:
                    head = self._first(5)
                    self._size = int.from_bytes(head[1:5], "big")
                    if self._size > limit:
                        self._too_large(self._size, limit)
                        return
                    sinks = self.conn.server.sink
                    if sinks is not None and head[0] == 0 and self._have <= 5 + self._size:
                        self._sink_chunks(sinks(self.path, self._size))
                if self._size >= 0 and self._have > 5 + self._size:  # (the window lets it come)
                    self._one_message("more")
                    return
            if not end:
                self.conn.grant(self, flow)
                return
            self.remote_done = True
            message = self._message(limit)
            if message is None:
                return
            # held until the handler returns: an inflated message counts its own size
            self._hold(max(len(message) + 5 - self.held, 0))
            self.task = self.conn.spawn(self._run(message))
            return
        self._pending += data
        requests.unread += flow - len(data)  # padding is given back with the next message
        messages = self._messages(limit)
        if messages is None:
            return
        requests.add(messages)
        if end:
            self.remote_done = True
            requests.end()

    def _first(self, size: int) -> bytes:
        """The first ``size`` bytes of a unary request's chunks."""
        head = b""
        for chunk in self._chunks:
            head += bytes(chunk[: size - len(head)])
            if len(head) == size:
                break
        return head

    def _sink_chunks(self, sink: Sink | None) -> None:
        """A sink for the message (None: none): what came so far is copied into it."""
        if sink is None:
            return
        self.sink = sink
        chunks, self._chunks = self._chunks, []
        at = 0
        for chunk in chunks:
            self._into_sink(chunk, at)
            at += len(chunk)

    def _into_sink(self, data: bytes | memoryview, at: int) -> None:
        """``data``, the request's bytes from ``at`` on (the length prefix
        counted), into the sink: the message's part of them (the one copy)."""
        assert self.sink is not None
        skip = max(5 - at, 0)
        start = at + skip - 5
        size = min(len(data) - skip, self._size - start)
        if size > 0:
            self.sink.view[start : start + size] = data[skip : skip + size]

    def _message(self, limit: int) -> bytes | memoryview | None:
        """A unary request's one message, joined from its chunks once (the one
        copy of it in the router), or the sink's view it was received into;
        None once the call failed."""
        if not self._have:
            self._one_message("0")
            return None
        if self._have < 5 + self._size or self._size < 0:
            self._status(grpc.StatusCode.INTERNAL, "the request ended inside a message")
            return None
        if self.sink is not None:
            self._hold(0, -self._have)  # a whole message now: no longer waiting for more data
            return self.sink.view
        compressed = self._first(1) != b"\x00"
        parts: list[bytes | memoryview] = []
        skip = 5
        for chunk in self._chunks:
            if skip >= len(chunk):
                skip -= len(chunk)
            elif skip:
                parts.append(memoryview(chunk)[skip:])
                skip = 0
            else:
                parts.append(chunk)
        self._chunks = []
        self._hold(0, -self._have)  # a whole message now: no longer waiting for more data
        message = b"".join(parts)
        del parts
        if compressed:
            return self._inflate(message, limit)
        return message

    def _one_message(self, sent: str) -> None:
        self._status(
            grpc.StatusCode.INTERNAL,
            f"a unary call takes one request message, this one sent {sent}",
        )

    def _hold(self, size: int, partial: int = 0) -> None:
        """``size`` more request bytes held (less, when negative), ``partial`` more
        of them in a message still coming."""
        if size or partial:
            self.conn.requests.change(self.conn, self, size, partial)

    def _release(self) -> None:
        """The call holds no request bytes any more (its handler returned, or it ended)."""
        if self.held or self.partial:
            self._hold(-self.held, -self.partial)
        if self._pending:
            self._pending = bytearray()  # a request cut short: its bytes go now
        if self._chunks:
            self._chunks = []
        if self.sink is not None:
            self.sink.drop()
            self.sink = None

    def _messages(self, limit: int) -> list[bytes] | None:
        """The whole messages received so far; None once the call failed."""
        pending = self._pending
        messages = []
        at = 0
        while len(pending) - at >= 5:
            flag = pending[at]
            size = int.from_bytes(pending[at + 1 : at + 5], "big")
            if size > limit:
                self._too_large(size, limit)
                return None
            if len(pending) - at - 5 < size:
                break
            with memoryview(pending) as view:
                message: bytes | None = bytes(view[at + 5 : at + 5 + size])
            at += 5 + size
            if flag:
                message = self._inflate(message, limit)  # type: ignore[arg-type]
            if message is None:
                return None
            messages.append(message)
        if at:
            del pending[:at]
            self._hold(0, -at)  # whole messages now: no longer waiting for more data
        if self.remote_done and pending:
            self._status(grpc.StatusCode.INTERNAL, "the request ended inside a message")
            return None
        return messages

    def _inflate(self, message: bytes, limit: int) -> bytes | None:
        wbits = _DECOMPRESS.get(self.encoding)
        if wbits is None:
            self._status(grpc.StatusCode.INTERNAL, "a compressed message without a grpc-encoding")
            return None
        inflater = zlib.decompressobj(wbits)
        try:
            plain = inflater.decompress(message, limit + 1)
        except zlib.error as exc:
            self._status(grpc.StatusCode.INTERNAL, f"cannot decompress the message: {exc}")
            return None
        if len(plain) > limit:
            self._too_large(len(plain), limit)
            return None
        return plain

    def _too_large(self, size: int, limit: int) -> None:
        self._status(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"Received message larger than max ({size} vs. {limit})",
        )

    def reset_by_peer(self) -> None:
        """The client reset the stream, or went away: the handler is cancelled."""
        if self.finished:
            return
        self.finished = True
        self.was_cancelled = True
        self._cancel()

    def _cancel(self) -> None:
        if self._deadline_timer is not None:
            self._deadline_timer.cancel()
        task = self.task
        if task is not None and not task.done():
            if inspect.getcoroutinestate(task.get_coro()) == inspect.CORO_CREATED:  # type: ignore[arg-type]
                self._ended()  # never run, it never runs its finally: the bytes it held
            task.cancel()
            task.add_done_callback(self._forget_task)
        elif task is None:
            self._ended()

    def _forget_task(self, _: asyncio.Task[Any]) -> None:
        """A task cancelled before its first turn keeps its CancelledError, whose
        traceback holds the frame (the request), which holds this call, which
        holds the task: a cycle only the garbage collector frees (issue 42 §4)."""
        self.task = None

    def _deadline_passed(self) -> None:
        self._deadline_timer = None
        if not self.finished:
            self._status(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
            self.was_cancelled = True
            self._cancel()

    # -- running the handler -----------------------------------------------------

    async def _run(self, message: bytes | memoryview | None) -> None:
        handler: Any = self.handler  # (grpc's stubs type its fields loosely)
        assert handler is not None
        try:
            if self._requests is not None:
                requests: Any = self._requests.iterate(handler.request_deserializer)
            else:
                assert message is not None
                deserialize = handler.request_deserializer
                try:
                    request = deserialize(message) if deserialize is not None else message
                except Exception as exc:
                    self._status(grpc.StatusCode.INTERNAL, f"cannot parse the request: {exc}")
                    return
            serialize = handler.response_serializer
            if handler.response_streaming:
                if handler.request_streaming:
                    replies = handler.stream_stream(requests, self)
                else:
                    replies = handler.unary_stream(request, self)
                async for reply in replies:
                    await self._send(serialize(reply) if serialize is not None else reply)
                self._status(self._code or grpc.StatusCode.OK, self._details)
                return
            if handler.request_streaming:
                reply = await handler.stream_unary(requests, self)
            else:
                reply = await handler.unary_unary(request, self)
                request = message = None  # forwarded and answered: its bytes go now
                self._release()
            body = serialize(reply) if serialize is not None else reply
            if self._code is not None and self._code is not grpc.StatusCode.OK:
                self._status(self._code, self._details)
            else:
                reply = None
                await self._send(body)
                self._status(grpc.StatusCode.OK, self._details)
        except grpc.aio.AbortError as exc:
            # handlers.abort keeps the exception until the call's done callbacks run,
            # which wait for a client that reads: its frames (the request) go now
            exc.__traceback__ = None
            self._status(self._code or grpc.StatusCode.UNKNOWN, self._details)
        except asyncio.CancelledError:
            if not self.finished:  # the server stops: the call is cancelled
                self._status(grpc.StatusCode.CANCELLED, "the server is stopping")
        except Exception as exc:
            log.exception("router: unexpected error in %s", self.path)
            self._status(grpc.StatusCode.UNKNOWN, f"Unexpected {type(exc)}: {exc}")
        finally:
            self._ended()

    async def _send(self, body: bytes | memoryview) -> None:
        """One response message (the response headers first): its length prefix
        and its bytes go out as they are, without joining them first."""
        conn = self.conn
        if not self.headers_sent:
            self.headers_sent = True
            block = response_headers(conn.encoder)
            conn.write(frame(Kind.HEADERS, END_HEADERS, self.stream, block))
        prefix = len(body).to_bytes(5, "big")
        if not conn.data_frames(self, prefix, body):
            await conn.send_data(self, prefix, body)

    def _status(self, code: grpc.StatusCode, details: str) -> None:
        """The trailers (or, with nothing sent yet, the only headers), once."""
        if self.finished:
            return
        self.finished = True
        conn = self.conn
        only = not self.headers_sent
        self.headers_sent = True
        block = trailers(conn.encoder, code, details, self._trailing, only)
        conn.write(header_frames(self.stream, block, True, conn.peer_frame_size))
        if not self.remote_done:
            conn.reset(self, ErrorCode.NO_ERROR)  # the client may stop sending
        conn.ended(self)
        if self._requests is not None:
            self._requests.end()
        if self.task is None:
            self._ended()

    def _ended(self) -> None:
        """The call is over: the handler's done callbacks run once its bytes left."""
        self._release()
        self.conn.owing.pop(self.stream, None)
        if self._deadline_timer is not None:
            self._deadline_timer.cancel()
            self._deadline_timer = None
        if not self.finished:
            self.finished = True
            self.conn.ended(self)
        callbacks, self._callbacks = self._callbacks, []
        if callbacks:
            self.conn.when_sent(lambda: _run_callbacks(self, callbacks))

    # -- grpc.aio.ServicerContext, the part the router uses -----------------------------

    def peer(self) -> str:
        return self.conn.peer

    def time_remaining(self) -> float | None:
        if self.deadline is None:
            return None
        return max(self.deadline - time.monotonic(), 0.0)

    def invocation_metadata(self) -> Metadata:
        if self._metadata is None:
            self._metadata = _metadata_of(self.headers)
        return self._metadata

    async def abort(
        self, code: grpc.StatusCode, details: str = "", trailing_metadata: Metadata = ()
    ) -> None:
        if code is grpc.StatusCode.OK:
            raise ValueError("abort() with OK")
        self._code = code
        self._details = details
        if trailing_metadata:
            self._trailing = trailing_metadata
        raise grpc.aio.AbortError(f"aborted with {code.name}")

    def set_code(self, code: grpc.StatusCode) -> None:
        self._code = code

    def code(self) -> grpc.StatusCode | None:
        return self._code

    def set_details(self, details: str) -> None:
        self._details = details

    def details(self) -> str:
        return self._details

    def set_trailing_metadata(self, trailing_metadata: Metadata) -> None:
        self._trailing = tuple(trailing_metadata)

    def trailing_metadata(self) -> Metadata:
        return self._trailing

    async def send_initial_metadata(self, initial_metadata: Metadata) -> None:
        if self.headers_sent:
            raise RuntimeError("the response headers are already sent")
        self.headers_sent = True
        block = response_headers(self.conn.encoder, tuple(initial_metadata))
        self.conn.write(header_frames(self.stream, block, False, self.conn.peer_frame_size))

    def reply_waits(self, size: int) -> None:
        """The handler's reply of ``size`` bytes waits for room among the unread
        replies (replybudget.py): held with the request until the handler returns."""
        if not self.finished:
            self._hold(size)

    def add_done_callback(self, callback: Callable[[Any], None]) -> None:
        self._callbacks.append(callback)

    def done(self) -> bool:
        return self.finished

    def cancelled(self) -> bool:
        return self.was_cancelled

    def auth_context(self) -> dict[str, list[bytes]]:
        return {}


class _Requests:
    """A streaming call's requests, as the handler takes them; the client's
    window is given back as it does, so an unread stream holds at most one window."""

    __slots__ = ("_arrived", "_ended", "call", "messages", "unread")

    def __init__(self, call: Call) -> None:
        self.call = call
        self.messages: deque[bytes] = deque()
        self.unread = 0  # flow-control bytes to give back with the next message taken
        self._ended = False
        self._arrived: asyncio.Future[None] | None = None

    def add(self, messages: Sequence[bytes]) -> None:
        self.messages.extend(messages)
        self._wake()

    def end(self) -> None:
        self._ended = True
        self._wake()

    def _wake(self) -> None:
        if self._arrived is not None and not self._arrived.done():
            self._arrived.set_result(None)

    async def iterate(self, deserialize: Callable[[bytes], Any] | None) -> AsyncIterator[Any]:
        call = self.call
        while True:
            while not self.messages:
                if self._ended:
                    return
                self._arrived = call.conn.loop.create_future()
                try:
                    await self._arrived
                finally:
                    self._arrived = None
            message = self.messages.popleft()
            call._hold(-min(len(message) + 5, call.held - call.partial))
            call.conn.grant(call, len(message) + 5 + self.unread)
            self.unread = 0
            yield deserialize(message) if deserialize is not None else message


def _whole(data: bytes | memoryview, limit: int) -> bool:
    """``data`` is exactly one uncompressed message within ``limit``."""
    size = len(data) - 5
    return 0 <= size <= limit and data[0] == 0 and int.from_bytes(data[1:5], "big") == size


def _run_callbacks(call: Call, callbacks: list[Callable[[Any], None]]) -> None:
    for callback in callbacks:
        try:
            callback(call)
        except Exception:
            log.exception("router: a call's done callback failed")


def parse_timeout(value: bytes) -> float | None:
    """grpc-timeout: up to 8 digits and a unit (H M S m u n); None if malformed."""
    if not 2 <= len(value) <= 9 or not value[:-1].isdigit():
        return None
    unit = _TIMEOUT_UNITS.get(value[-1])
    if unit is None:
        return None
    return int(value[:-1]) * unit


def _metadata_of(headers: list[tuple[bytes, bytes]]) -> Metadata:
    """The call's metadata as grpc gives it: no pseudo-headers; ``-bin`` values decoded."""
    items: list[tuple[str, str | bytes]] = []
    for name, value in headers:
        if name[:1] == b":" or name in (b"te", b"content-type", b"grpc-timeout"):
            continue
        key = name.decode("latin-1")
        if key.endswith("-bin"):
            try:
                items.append((key, base64.b64decode(value + b"==")))
            except ValueError:
                continue
        else:
            items.append((key, value.decode("latin-1")))
    return tuple(items)
