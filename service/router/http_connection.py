"""One HTTP connection of the router's REST door: uvicorn's httptools
protocol with the door's limits (request line and headers in size and time,
body size, open connections), refusals that linger instead of resetting, the
hook that cancels a call whose client closed its connection, and a client's
half-close after a whole request answered before the connection closes.

A FIN after a whole request may be a half-close (the client still reads) or
a close (it left): TCP does not tell them apart until the server writes. So
the door writes an interim ``100 Continue`` at once (an HTTP/1.1 client must
read any 1xx before the final answer, RFC 9110 15.2) and then looks at the
socket: a client that closed answers the write with a reset, and its call is
cancelled as if it had reset first (:meth:`HttpConnection.eof_received`)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
from collections.abc import Iterator
from typing import Any

import httptools
from uvicorn.protocols.http.flow_control import HIGH_WATER_LIMIT
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from poolserve.service.contract.settings import ServerSettings
from poolserve.service.router.http_io import Body, Corked, forwarded
from poolserve.service.router.http_wire import error_body
from poolserve.service.router.replybudget import ReplyBudget

LINGER_S = 1.0
INTERIM = b"HTTP/1.1 100 Continue\r\n\r\n"
PEER_CHECKS_S = (0.01, 0.05, 0.25, 1.0)  # after a FIN: is the client still there? then each 1 s
TCP_CLOSE = 7  # tcp_info's tcpi_state once a reset came (linux/tcp_states.h)


class HttpConnection(HttpToolsProtocol):
    """uvicorn's httptools protocol with the door's limits, and a hook that
    cancels a call whose client closed its connection."""

    def __init__(self, settings: ServerSettings, replies: ReplyBudget, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.settings = settings
        self.replies = replies
        self.peer = f"http {id(self)}"  # this connection in the router's reply budget
        self.held = 0  # reply bytes written to the transport, not yet taken by the client
        self.refused = False
        self.lost = False
        self.forwarding: asyncio.Task[Any] | None = None
        self._head_bytes = 0
        self._body_bytes = 0
        self._head_timer: asyncio.TimerHandle | None = None
        self._in_head = False  # a request began and its headers are not all here
        self._in_message = False  # a request began and its body is not all here
        self._linger: asyncio.TimerHandle | None = None
        self._peer_check: asyncio.TimerHandle | None = None
        self.writer: Corked | None = None  # the transport as response cycles see it
        self._body: Body | None = None  # the body of the call being parsed, when forwarded

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        if len(self.connections) >= self.settings.http_max_connections:
            self.refused = True
            body = error_body("too many connections to the HTTP port (http_max_connections)")
            transport.write(raw_response(503, body))
            self._linger_close(transport)
            return
        super().connection_made(transport)
        self.writer = Corked(transport)
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
        if self._peer_check is not None:
            self._peer_check.cancel()
        self.settle(gone=True)
        if self.refused and self not in self.connections:
            return  # refused in connection_made: uvicorn never saw it
        if self.forwarding is not None:
            self.forwarding.cancel()  # the client went: the pool drops its call
        super().connection_lost(exc)

    def eof_received(self) -> bool | None:  # type: ignore[override]  # asyncio.Protocol's
        """The client shut its write side. A request it sent whole is answered,
        then the connection closes (as nginx does: ``nc -N``, ``curl`` and some
        proxies half-close after a request); EOF before any request or in the
        middle of one (its body cut short) closes it now, cancelling a call in
        flight. A TLS connection has no half-close: asyncio closes it.

        A client that closed (rather than shut its write side) must not keep
        its call running: unless its answer already began, an HTTP/1.1 one is
        sent ``100 Continue`` and the socket is looked at (:meth:`_check_peer`);
        a reset there cancels the call. An HTTP/1.0 client may not be sent a
        1xx: its call runs to its answer, as before."""
        self._unset_keepalive_if_required()
        cycle = self.cycle
        if (
            self.refused
            or self._in_message
            or cycle is None
            or cycle.response_complete
            or self.transport.get_extra_info("sslcontext") is not None
        ):
            return None  # the transport closes: connection_lost
        cycle.keep_alive = False  # the last request parsed: its answer closes the connection
        if not cycle.response_started and cycle.scope["http_version"] == "1.1":
            assert self.writer is not None
            self.writer.write(INTERIM)
            self._peer_check = self.loop.call_later(PEER_CHECKS_S[0], self._check_peer, 1)
        return True

    def _check_peer(self, step: int) -> None:
        """After a FIN: the client that reset our interim answer is gone (its
        call is cancelled, :meth:`connection_lost`); one that still reads is
        looked at again, less and less often, until its answer is written."""
        self._peer_check = None
        transport = self.transport
        if self.lost or transport is None or transport.is_closing():
            return
        if peer_reset(transport):
            transport.abort()
            return
        delay = PEER_CHECKS_S[min(step, len(PEER_CHECKS_S) - 1)]
        self._peer_check = self.loop.call_later(delay, self._check_peer, step + 1)

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
        if self._in_head and self._head_timer is None and not self.refused:
            self._arm_head_timer()  # a head split over reads: it has handshake_timeout_s

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
            self.transport.write(raw_response(status, error_body(message)))
        if self.writer is not None:
            self.writer.end()  # a response half gathered goes nowhere, as the app's
        if cycle is not None:
            cycle.disconnected = True  # the app's answer, if any, goes nowhere
            cycle.message_event.set()
        self.lost = True  # nobody to answer: a call in flight is dropped
        if self.forwarding is not None:
            self.forwarding.cancel()
        self._linger_close(self.transport)

    @contextlib.contextmanager
    def corked(self) -> Iterator[None]:
        """A response's writes, gathered into one (see :class:`Corked`)."""
        writer = self.writer
        if writer is None:
            yield
            return
        writer.cork()
        try:
            yield
        finally:
            writer.uncork()

    def _arm_head_timer(self) -> None:
        self._disarm_head_timer()
        limit = self.settings.handshake_timeout_s
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

    def hold(self, size: int) -> None:
        """Counts a large reply about to be written (RepliesUnread: over a bound)."""
        self.replies.hold(self.peer, size)
        self.held += size

    def settle(self, gone: bool = False) -> None:
        """Releases the held replies once the client took them (the transport's
        buffer is empty) or left."""
        if not self.held:
            return
        if gone or self.transport is None or self.transport.get_write_buffer_size() == 0:
            self.replies.release(self.peer, self.held)
            self.held = 0

    def resume_writing(self) -> None:
        super().resume_writing()
        self.settle()

    def on_message_begin(self) -> None:
        self.settle()
        super().on_message_begin()
        self._head_bytes = self._body_bytes = 0
        self._in_message = True
        self.scope["poolserve.connection"] = self  # type: ignore[typeddict-unknown-key]
        self._in_head = True  # timed from the end of this read unless the head ends in it

    def on_url(self, url: bytes) -> None:
        self._count_head(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count_head(len(name) + len(value) + 4)
        super().on_header(name, value)

    def _count_head(self, size: int) -> None:
        self._head_bytes += size
        if self._head_bytes > self.settings.http_max_header_bytes:
            self.refuse(431, "the request line and headers are over http_max_header_bytes")
            raise Refused

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._disarm_head_timer()
        self._body = None
        super().on_headers_complete()
        cycle = self.cycle
        if cycle is None or cycle.scope is not self.scope:
            return  # an upgrade: refused in data_received
        assert self.writer is not None
        cycle.transport = self.writer
        if forwarded(self.scope["method"], self.scope["path"]):
            self._body = Body()
            self.scope["poolserve.body"] = self._body  # type: ignore[typeddict-unknown-key]

    def on_body(self, body: bytes) -> None:
        self._body_bytes += len(body)
        if self._body_bytes > self.settings.max_message_size:
            self.refuse(
                413,
                f"the body is over max_message_size ({self.settings.max_message_size} bytes)",
            )
            raise Refused
        sink, cycle = self._body, self.cycle
        if sink is None or cycle is None:
            super().on_body(body)
            return
        if cycle.response_complete:
            return
        sink.add(body)  # kept as httptools made it: the door joins the chunks once
        if sink.unread > HIGH_WATER_LIMIT:
            self.flow.pause_reading()  # until the door asks for more (uvicorn's receive)
        cycle.message_event.set()

    def on_message_complete(self) -> None:
        self._in_message = False
        if self._body is not None:
            self._body.complete = True
        super().on_message_complete()


class Refused(Exception):
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


def peer_reset(transport: asyncio.BaseTransport) -> bool:
    """Whether the connection was reset by its peer (a pending error, or TCP's
    state CLOSE), read without reading the socket: its reader is off after EOF."""
    sock = transport.get_extra_info("socket")
    if sock is None:
        return False
    try:
        if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
            return True
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 8)
    except OSError:
        return True  # the socket is gone
    return bool(info) and info[0] == TCP_CLOSE


def raw_response(status: int, body: bytes) -> bytes:
    reason = _REASONS.get(status, b"Error")
    return (
        b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
        b"connection: close\r\n\r\n" % (status, reason, len(body))
    ) + body


def tls_context(settings: ServerSettings) -> ssl.SSLContext | None:
    """TLS for the HTTP port when the router's port has it (the same files):
    mutual TLS with a client CA, as for gRPC."""
    if not settings.tls_cert_file:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    # RFC 9113 9.2 (the gRPC port's HTTP/2 shares this context): TLS 1.2 or
    # later without renegotiation or compression, and under TLS 1.2 only the
    # ephemeral AEAD suites (Appendix A prohibits the CBC ones Python allows)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.options |= ssl.OP_NO_RENEGOTIATION | ssl.OP_NO_COMPRESSION
    context.set_ciphers("ECDHE+AESGCM:ECDHE+CHACHA20:DHE+AESGCM:DHE+CHACHA20")
    context.load_cert_chain(settings.tls_cert_file, settings.tls_key_file)
    if settings.tls_client_ca_file:
        context.load_verify_locations(settings.tls_client_ca_file)
        context.verify_mode = ssl.CERT_REQUIRED
    return context
