"""The router's gRPC port on its own HTTP/2, on the router's event loop.

It serves the same generic handlers a ``grpc.aio.server`` would (the
router's doors, health, shared memory), found by path once and kept. It
exists for the CPU of a light call: grpcio's server hands every call from
its poller thread to the event loop, some ten context switches a call on
this path; here the call is read, forwarded and answered in the loop's own
turns, as the REST door's are (docs/request-path.md). TLS, with ALPN ``h2``,
and mutual TLS use the same files as the REST door.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Callable, Sequence
from typing import Any

import grpc

from poolserve.service.contract.settings import ServerSettings
from poolserve.service.lifecycle.limits import trim_freed_memory
from poolserve.service.router.http2.budget import RequestBudget
from poolserve.service.router.http2.call import Call, Sink, _Details
from poolserve.service.router.http2.connection import Http2Connection

BACKLOG = 2048


class GrpcServer:
    """A gRPC server for generic handlers, over :class:`Http2Connection`."""

    def __init__(
        self,
        settings: ServerSettings,
        handlers: Sequence[grpc.GenericRpcHandler],
        after_burst: Callable[[], object] = trim_freed_memory,
        sink: Callable[[str, int], Sink | None] | None = None,
    ) -> None:
        self.settings = settings
        self.handlers = tuple(handlers)
        # (path, message size): where a large unary request is received (call.Sink), or None
        self.sink = sink
        self.connections: set[Http2Connection] = set()
        self.requests = RequestBudget(
            settings.max_request_bytes_held,
            settings.max_request_bytes_held_total,
            trim=after_burst,
        )
        self.stopping = False
        self._methods: dict[str, grpc.RpcMethodHandler[Any, Any]] = {}
        self._server: asyncio.Server | None = None

    def find(self, path: str, call: Call) -> grpc.RpcMethodHandler[Any, Any] | None:
        """The method handler of ``path`` (handlers that serve a path are asked once)."""
        known = self._methods.get(path)
        if known is not None:
            return known
        details = _Details(path, call.invocation_metadata())
        for generic in self.handlers:
            handler = generic.service(details)  # type: ignore[arg-type]
            if handler is not None:
                self._methods[path] = handler
                return handler
        return None

    def open_call(
        self, conn: Http2Connection, stream: int, headers: list[tuple[bytes, bytes]]
    ) -> Call:
        return Call(conn, stream, headers, self.find)

    async def bind(
        self, host: str, port: int, reuse_port: bool = False, tls: ssl.SSLContext | None = None
    ) -> int:
        """Binds ``host:port`` (serving from :meth:`start`); the port bound
        (``port`` 0: any free one). ``reuse_port``: a fleet's routers share it."""
        loop = asyncio.get_running_loop()
        if tls is not None:
            tls.set_alpn_protocols(["h2"])
        self._server = await loop.create_server(
            lambda: Http2Connection(self),
            host.strip("[]") or None,
            port,
            backlog=BACKLOG,
            reuse_port=reuse_port or None,
            ssl=tls,
            ssl_handshake_timeout=self.settings.handshake_timeout_s if tls else None,
            start_serving=False,
        )
        return int(self._server.sockets[0].getsockname()[1])

    async def start(self) -> None:
        assert self._server is not None
        await self._server.start_serving()

    async def stop(self, grace_s: float) -> None:
        """No new connections or calls (GOAWAY); the calls in flight have
        ``grace_s`` to finish, then are cancelled; every connection is closed."""
        self.stopping = True
        if self._server is None:
            return
        self._server.close()
        for conn in list(self.connections):
            conn.go_away("the server is stopping")
        tasks = [task for conn in self.connections for task in conn.tasks]
        if tasks:
            await asyncio.wait(tasks, timeout=grace_s)
        tasks = [task for conn in self.connections for task in conn.tasks]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)
        for conn in list(self.connections):
            conn.close()
        for conn in list(self.connections):  # closed for an error: no longer lingering
            conn.drop()
        await self._server.wait_closed()
