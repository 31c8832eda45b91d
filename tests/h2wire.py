"""The HTTP/2 conformance suite's two ends (tests/test_http2_conformance.py).

:class:`EngineServer` is the router's gRPC port on either engine
(``grpc_engine``: ``poolserve``, the router's own HTTP/2, or ``grpcio``,
grpc's server with the router's channel options and credentials), serving the door tests'
``Echo`` handlers on a loopback port from an event loop in a thread of its
own, so that a test talks to it over a blocking socket. :class:`Peer` is a
bare client of that socket: it writes frames built with the router's
``frames`` module and HPACK ``Encoder`` (or bytes by hand, for what those
never write), reads the server's frames one by one, and says what the server
made of the frames it was sent (:meth:`Peer.outcome`).
"""

from __future__ import annotations

import asyncio
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import grpc
from test_http2_door import Echo, path, settings

from poolserve.service.router.http2.frames import (
    ACK,
    END_HEADERS,
    END_STREAM,
    HEADER,
    PREFACE,
    SETTINGS_ACK,
    ErrorCode,
    Kind,
    Setting,
    frame,
    ping,
    settings_frame,
)
from poolserve.service.router.http2.hpack import Decoder, Encoder
from poolserve.service.router.http2.server import GrpcServer
from poolserve.service.router.http_connection import tls_context
from poolserve.service.router.router import server_credentials, server_options

ENGINES = ("poolserve", "grpcio")
WAIT = 30.0  # for what the server must send
LATE = 0.5  # after the server showed it read our frames: how long an error may lag (grpcio)
PROBE = b"h2-probe"  # the PING payload that asks "did you read all I sent?"
Fields = list[tuple[bytes, bytes]]


class EngineServer:
    """One engine's gRPC port in this process, on a thread's event loop."""

    def __init__(self, engine: str, **changes: Any) -> None:
        self.engine = engine
        self.settings = settings(**changes)
        self.echo = Echo()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=f"h2-{engine}")
        self.server: GrpcServer | grpc.aio.Server | None = None
        self.address = ""

    def __enter__(self) -> EngineServer:
        self.thread.start()
        try:
            port = asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(WAIT)
        except BaseException:
            self.__exit__()
            raise
        self.address = f"127.0.0.1:{port}"
        return self

    async def _start(self) -> int:
        handlers = [self.echo.handler()]
        if self.engine == "poolserve":
            own = GrpcServer(self.settings, handlers)
            port = await own.bind("127.0.0.1", 0, tls=tls_context(self.settings))
            await own.start()
            self.server = own
            return port
        server = grpc.aio.server(options=server_options(self.settings))
        server.add_generic_rpc_handlers(handlers)
        credentials = server_credentials(self.settings)
        if credentials is None:
            port = server.add_insecure_port("127.0.0.1:0")
        else:
            port = server.add_secure_port("127.0.0.1:0", credentials)
        await server.start()
        self.server = server
        return port

    def __exit__(self, *_: object) -> None:
        try:
            if self.server is not None:
                stopping = self.server.stop(1.0)
                asyncio.run_coroutine_threadsafe(stopping, self.loop).result(WAIT)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(WAIT)
            self.loop.close()

    def peer(self, **kwargs: Any) -> Peer:
        # grpcio may answer an error a moment after the PING ack that follows
        # it; ours
        # answers in order, and promises a GOAWAY before it closes for an error
        own = self.engine == "poolserve"
        return Peer(self.address, late=0.0 if own else LATE, strict=own, **kwargs)


@dataclass
class Frame:
    kind: int
    flags: int
    stream: int
    payload: bytes
    fields: Fields = field(default_factory=list)  # a HEADERS frame's, decoded


@dataclass
class Outcome:
    """What the server made of what it was sent: ``goaway`` (its ``code``),
    ``reset`` (RST_STREAM of the stream asked about), ``closed`` (without
    either), or ``served`` (it read all and went on)."""

    kind: str
    code: int = -1
    frames: list[Frame] = field(default_factory=list)

    def __str__(self) -> str:
        code = f" {ErrorCode(self.code).name}" if self.code in set(ErrorCode) else ""
        seen = ", ".join(
            f"{Kind(f.kind).name if f.kind < 10 else f.kind}/{f.stream}" for f in self.frames
        )
        return f"{self.kind}{code} after [{seen}]"


class Peer:
    """A client of bare frames over a blocking socket. It acknowledges the
    server's SETTINGS and PINGs as it reads them (as any client must)."""

    def __init__(
        self,
        address: str,
        *,
        preface: bool = True,
        settings: dict[Setting, int] | None = None,
        table_size: int = 4096,
        late: float = 0.0,
        strict: bool = True,
    ) -> None:
        host, port = address.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=WAIT)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.late = late
        self.strict = strict  # a connection error must come with its GOAWAY
        self.buffer = bytearray()
        self.decoder = Decoder(max_table_size=table_size, max_header_list_size=1 << 20)
        self.server_settings: dict[int, int] = {}
        self.closed = False
        self.seen: list[Frame] = []
        self.sizes: list[tuple[int, int]] = []  # every frame's kind and payload size, as sent
        self._block: Frame | None = None  # a HEADERS frame whose CONTINUATION is to come
        self._unsent = bytearray()
        if preface:
            self.send(PREFACE + settings_frame(settings or {}))

    def close(self) -> None:
        self._flush()
        self.sock.close()

    def __enter__(self) -> Peer:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    # -- writing -------------------------------------------------------------

    def send(self, *chunks: bytes) -> None:
        """Queues ``chunks``: they go out in one write with what follows them
        until the next read (so a case and the PING after it arrive together,
        and a server that closes at the case has read it all)."""
        self._unsent += b"".join(chunks)

    def _flush(self) -> None:
        if self._unsent:
            try:
                self.sock.sendall(self._unsent)
            except OSError:  # a server that already closed is an outcome, not an error
                self.closed = True
            self._unsent.clear()

    def call(self, stream: int, message: bytes, method: str = "Unary", end: bool = True) -> None:
        """A whole gRPC request: its HEADERS and one DATA frame with ``message``."""
        self.send(headers(stream, request(method)), data(stream, grpc_message(message), end))

    # -- reading -------------------------------------------------------------

    def read(self, timeout: float = WAIT) -> Frame | None:
        """The server's next frame; None once it closed the connection, or
        after ``timeout`` with nothing (TimeoutError when ``timeout`` is WAIT:
        the server owed an answer)."""
        deadline = time.monotonic() + timeout
        self._flush()
        while True:
            got = self._parse()
            if got is not None:
                return got
            if self.closed:
                return None
            left = deadline - time.monotonic()
            if left <= 0:
                if timeout >= WAIT:
                    raise TimeoutError(f"the server sent nothing in {timeout} s: {self.seen}")
                return None
            self.sock.settimeout(left)
            try:
                chunk = self.sock.recv(1 << 16)
            except TimeoutError:
                continue
            except OSError:
                chunk = b""
            if not chunk:
                self.closed = True
            self.buffer += chunk

    def _parse(self) -> Frame | None:
        """The next whole frame in the buffer (a header block continued in
        CONTINUATION frames: one HEADERS frame with the whole block)."""
        while len(self.buffer) >= 9:
            high, low, kind, flags, stream = HEADER.unpack_from(self.buffer)
            size = high << 16 | low
            if len(self.buffer) < 9 + size:
                return None
            payload = bytes(self.buffer[9 : 9 + size])
            del self.buffer[: 9 + size]
            self.sizes.append((kind, size))
            got = Frame(kind, flags, stream & 0x7FFFFFFF, payload)
            if kind == Kind.CONTINUATION and self._block is not None:
                got, self._block = self._block, None
                got.payload += payload
                got.flags |= flags & END_HEADERS
            if got.kind == Kind.HEADERS:
                if not got.flags & END_HEADERS:
                    self._block = got  # (the server sends whole blocks, unpadded)
                    continue
                got.fields = self.decoder.decode(got.payload)
            elif kind == Kind.SETTINGS and not flags & ACK:
                for at in range(0, len(payload) - 5, 6):
                    key, value = struct.unpack_from(">HI", payload, at)
                    self.server_settings[key] = value
                self.send(SETTINGS_ACK)
            elif kind == Kind.PING and not flags & ACK:
                self.send(ping(payload, ack=True))
            self.seen.append(got)
            return got
        return None

    def settings_seen(self) -> dict[int, int]:
        """Reads up to the server's SETTINGS (its preface); the values."""
        while not any(f.kind == Kind.SETTINGS and not f.flags & ACK for f in self.seen):
            if self.read() is None:
                raise AssertionError(f"closed before the server's SETTINGS: {self.seen}")
        return self.server_settings

    def outcome(self, stream: int | None = None) -> Outcome:
        """Sends a PING and reads until the server ends the connection (GOAWAY,
        or closed), resets ``stream`` (any stream when None), or acknowledges
        the PING and sends nothing more of note for ``late`` seconds: served."""
        self.send(ping(PROBE))
        frames: list[Frame] = []
        acked_at: float | None = None
        while True:
            if acked_at is None:
                got = self.read()
            else:
                got = self.read(max(acked_at + self.late - time.monotonic(), 0.0))
                if got is None and not self.closed:
                    return Outcome("served", frames=frames)
            if got is None:
                return Outcome("closed", frames=frames)
            frames.append(got)
            if got.kind == Kind.GOAWAY:
                return Outcome("goaway", struct.unpack_from(">I", got.payload, 4)[0], frames)
            if got.kind == Kind.RST_STREAM and stream in (None, got.stream):
                return Outcome("reset", struct.unpack(">I", got.payload)[0], frames)
            if got.kind == Kind.PING and got.flags & ACK and got.payload == PROBE:
                if self.late <= 0:
                    return Outcome("served", frames=frames)
                acked_at = time.monotonic()

    def response(self, stream: int) -> Response:
        """Reads ``stream``'s answer up to its END_STREAM (or its reset, or the
        connection's end)."""
        answer = Response()
        while True:
            got = self.read()
            if got is None:
                answer.ended_by = "closed"
                return answer
            if got.kind == Kind.GOAWAY and struct.unpack_from(">I", got.payload, 4)[0]:
                answer.ended_by = "goaway"
                return answer
            if got.stream != stream:
                continue
            if got.kind == Kind.DATA:
                answer.data += got.payload
                answer.data_frames.append(len(got.payload))
            elif got.kind == Kind.HEADERS:
                answer.blocks.append(dict(got.fields))
            elif got.kind == Kind.RST_STREAM:
                answer.ended_by = "reset"
                answer.reset = struct.unpack(">I", got.payload)[0]
                return answer
            if got.kind in (Kind.DATA, Kind.HEADERS) and got.flags & END_STREAM:
                answer.ended_by = "end_stream"
                return answer


@dataclass
class Response:
    blocks: list[dict[bytes, bytes]] = field(default_factory=list)  # headers, trailers
    data: bytearray = field(default_factory=bytearray)
    data_frames: list[int] = field(default_factory=list)  # each DATA frame's size
    ended_by: str = ""
    reset: int = -1

    @property
    def status(self) -> bytes | None:
        """grpc-status, from the last header block."""
        return self.blocks[-1].get(b"grpc-status") if self.blocks else None

    @property
    def message(self) -> bytes:
        """The one gRPC message of a unary reply."""
        return bytes(self.data[5:])


# -- what the tests send ---------------------------------------------------------


def request(
    method: str = "Unary", *extra: tuple[bytes, bytes], drop: tuple[bytes, ...] = ()
) -> Fields:
    """A gRPC request's header fields, ``extra`` after them, ``drop`` left out."""
    fields = [
        (b":method", b"POST"),
        (b":scheme", b"http"),
        (b":path", path(method).encode()),
        (b":authority", b"conformance"),
        (b"content-type", b"application/grpc"),
        (b"te", b"trailers"),
        *extra,
    ]
    return [(name, value) for name, value in fields if name not in drop]


def block(fields: Fields) -> bytes:
    return Encoder().encode(fields)


def headers(stream: int, fields: Fields, flags: int = END_HEADERS) -> bytes:
    return frame(Kind.HEADERS, flags, stream, block(fields))


def data(stream: int, payload: bytes, end: bool = True) -> bytes:
    return frame(Kind.DATA, END_STREAM if end else 0, stream, payload)


def grpc_message(body: bytes) -> bytes:
    return b"\0" + struct.pack(">I", len(body)) + body


def literal(name: bytes, value: bytes, first: int = 0x00) -> bytes:
    """An HPACK literal with a new name (RFC 7541 6.2; ``first`` 0x40: indexed),
    raw strings of under 127 bytes."""
    return bytes((first, len(name))) + name + bytes((len(value),)) + value


__all__ = [
    "END_HEADERS",
    "END_STREAM",
    "ENGINES",
    "EngineServer",
    "Outcome",
    "Peer",
    "Response",
    "block",
    "data",
    "grpc_message",
    "headers",
    "literal",
    "request",
]
