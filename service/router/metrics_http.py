"""The router's metrics port: a minimal HTTP/1.1 server on the router's own
event loop (``asyncio.start_server``), no thread and no extra process.

Why not ``prometheus_client.start_http_server``: it serves from a thread that
calls the collectors there, and the collection here is asynchronous (it asks
every pool over gRPC on the router's loop). Serving on the loop keeps one
thread, and a scrape costs the loop only the encoding (the pools' answers are
awaited). One request per connection; ``GET /metrics`` (Accept chooses the
Prometheus text format or OpenMetrics), anything else is 404 or 405.
"""

from __future__ import annotations

import asyncio
import logging

from poolserve.service.router.metrics import MetricsSource, render

log = logging.getLogger(__name__)

MAX_HEAD = 16 * 1024
READ_TIMEOUT_S = 10.0


class MetricsServer:
    def __init__(self, source: MetricsSource) -> None:
        self.source = source
        self.port = 0
        self._server: asyncio.Server | None = None

    async def start(self, host: str, port: int, reuse_port: bool = False) -> int:
        """Listens on ``host:port`` (0: any free port); ``reuse_port``: SO_REUSEPORT,
        a fleet's routers share the port."""
        self._server = await asyncio.start_server(
            self._handle, host, port, limit=MAX_HEAD, reuse_address=True, reuse_port=reuse_port
        )
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(READ_TIMEOUT_S):
                head = await reader.readuntil(b"\r\n\r\n")
            status, body, content_type = await self._answer(head)
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError):
            status, body, content_type = "400 Bad Request", b"bad request\n", "text/plain"
        except ConnectionError:
            writer.close()
            return
        except Exception:  # a scrape must never take the router down
            log.exception("router: metrics scrape failed")
            status, body = "500 Internal Server Error", b"metrics collection failed\n"
            content_type = "text/plain"
        writer.write(
            (
                f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
            ).encode("latin-1")
            + body
        )
        try:
            await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()

    async def _answer(self, head: bytes) -> tuple[str, bytes, str]:
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3:
            return "400 Bad Request", b"bad request\n", "text/plain"
        method, target, _ = parts
        path = target.split("?", 1)[0]
        if path not in ("/metrics", "/"):
            return "404 Not Found", b"not found: try /metrics\n", "text/plain"
        if method not in ("GET", "HEAD"):
            return "405 Method Not Allowed", b"GET /metrics\n", "text/plain"
        if path == "/":
            return "200 OK", b"poolserve: metrics at /metrics\n", "text/plain"
        accept = ""
        for line in lines[1:]:
            name, _, value = line.partition(":")
            if name.strip().lower() == "accept":
                accept = value.strip()
        snapshot = await self.source.snapshot()
        body, content_type = render(snapshot, accept)
        return "200 OK", body if method == "GET" else b"", content_type
