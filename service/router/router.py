"""The router process: the only door clients see.

It stays thin: request bytes in, response bytes out. This module owns the
process's life: the ports it listens on (TLS and connection limits for
gRPC), the private control socket the supervisor sends route tables to,
the /metrics port, start-up and the drain at stop. What it serves lives in
its own modules: the routes and the pools' health (``routes``), the one
forwarding core (``forwarding``: lane, deadline, cancel, trace span), and
one module per door (``grpc_door``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import grpc

from poolserve.protos import control_pb2 as cpb
from poolserve.service.contract.repository import Repository
from poolserve.service.contract.rundir import (
    ADDRESS_FILE,
    HTTP_ADDRESS_FILE,
    METRICS_ADDRESS_FILE,
    FileId,
    file_id,
    remove_own,
    router_control_socket,
)
from poolserve.service.contract.settings import ConfigError, ServerSettings
from poolserve.service.contract.slab import MAX_BODY as SLAB_MAX_BODY
from poolserve.service.contract.slab import Arena
from poolserve.service.grpcserver.handlers import guarded
from poolserve.service.grpcserver.shm import SharedMemory
from poolserve.service.grpcserver.shm_store import SharedStore
from poolserve.service.grpcserver.sockets import bind_private_unix
from poolserve.service.grpcserver.tracing import Tracing
from poolserve.service.lifecycle.limits import (
    return_large_frees,
    trim_freed_memory,
    trim_heap,
    watch_descriptors,
)
from poolserve.service.router.ensemble import Ensembles
from poolserve.service.router.fleet import Fleet
from poolserve.service.router.forwarding import Forwarder
from poolserve.service.router.grpc_door import GrpcDoor
from poolserve.service.router.http2.server import GrpcServer
from poolserve.service.router.http_connection import tls_context
from poolserve.service.router.http_door import HttpDoor
from poolserve.service.router.metrics import MetricsSource, RouterCounts
from poolserve.service.router.metrics_http import MetricsServer
from poolserve.service.router.model_repository import model_repository_handler
from poolserve.service.router.replybudget import ReplyBudget
from poolserve.service.router.repository import RepositoryCalls
from poolserve.service.router.routes import Routes
from poolserve.service.router.slab_sink import slab_sinks
from poolserve.service.router.streams import StreamLimit

log = logging.getLogger(__name__)

DESCRIPTOR_CHECK_S = 1.0
HEAP_CHECK_S = 1.0  # freed memory given back within this (limits.HeapTrimmer)
ROUTER_CONTROL_SERVICE = "poolserve.control.v1.RouterControl"


def server_credentials(settings: ServerSettings) -> grpc.ServerCredentials | None:
    """TLS for the router's port when configured; mutual TLS with a client CA."""
    if not settings.tls_cert_file:
        return None
    key = Path(settings.tls_key_file).read_bytes()
    cert = Path(settings.tls_cert_file).read_bytes()
    client_ca = (
        Path(settings.tls_client_ca_file).read_bytes() if settings.tls_client_ca_file else None
    )
    return grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=client_ca, require_client_auth=client_ca is not None
    )


def server_options(settings: ServerSettings, shared: bool = False) -> list[tuple[str, int]]:
    """The router port's channel options: message sizes, and how long a
    connection may sit in its handshake, idle, or silent under a call.

    ``shared``: a fleet's router, sharing the port with the others
    (SO_REUSEPORT; the supervisor checked and holds the port,
    supervisor/fleet.py). Alone, the router does not share: a port in use is
    an error at once."""
    limit = settings.max_message_size
    options = [
        ("grpc.max_receive_message_length", limit),
        ("grpc.max_send_message_length", limit),
        # No grpc.max_concurrent_streams: in grpcio 1.81 it bounds the whole
        # server, not one connection; the router counts them (streams.py).
        ("grpc.so_reuseport", 1 if shared else 0),
        # The client's HTTP/2 SETTINGS (and the TLS handshake) must come within
        # this, or the connection is closed: a connection that only sent the
        # preface no longer holds a descriptor for gRPC's default 120 s.
        ("grpc.server_handshake_timeout_ms", _ms(settings.handshake_timeout_s)),
        # Pings on connections with calls in flight find peers that vanished;
        # idle connections are closed by max_connection_idle_ms instead.
        ("grpc.keepalive_time_ms", _ms(settings.keepalive_time_s)),
        ("grpc.keepalive_timeout_ms", _ms(settings.keepalive_timeout_s)),
        ("grpc.keepalive_permit_without_calls", 0),
        ("grpc.http2.max_pings_without_data", 0),
    ]
    if settings.max_connection_idle_s > 0:
        options.append(("grpc.max_connection_idle_ms", _ms(settings.max_connection_idle_s)))
    if settings.max_connection_age_s > 0:
        options.append(("grpc.max_connection_age_ms", _ms(settings.max_connection_age_s)))
        grace = _ms(settings.max_connection_age_grace_s)
        options.append(("grpc.max_connection_age_grace_ms", grace))
    return options


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))


class Router:
    """One router process: its doors over one set of routes and one forwarding core."""

    def __init__(
        self,
        repository: Repository,
        settings: ServerSettings,
        run_dir: Path,
        repo: Path | None = None,
        fleet: Fleet | None = None,
    ) -> None:
        self.settings = settings
        self.fleet = fleet or Fleet(run_dir, 0, 1)
        self.address_file = run_dir / ADDRESS_FILE
        # large ModelInfer bodies go to the workers through these (contract/slab.py)
        self.arena = Arena(min(settings.max_message_size, SLAB_MAX_BODY))
        self.routes = Routes(repository, settings, run_dir, self.arena, repo)
        self.health = self.routes.health
        # the one registry of the whole server (a fleet's: in the run dir, shared)
        self.shared_memory = (
            SharedStore.in_run_dir(settings, run_dir)
            if self.fleet.shared
            else SharedMemory.from_settings(settings)
        )
        self.replies = ReplyBudget(
            settings.max_unread_reply_bytes,
            settings.max_unread_reply_bytes_total,
            give_back=trim_freed_memory,
            grace=settings.unread_reply_grace_s,
        )
        self.streams = StreamLimit(settings.max_concurrent_streams)  # per connection
        self.core = Forwarder(settings, self.routes, self.shared_memory)
        self.repository = RepositoryCalls(
            settings,
            self.routes,
            self.core,
            Ensembles(repository.ensembles, self.routes, self.core),
            self.fleet.learned if self.fleet.shared else None,
        )
        self.grpc_door = GrpcDoor(
            settings, self.routes, self.core, self.shared_memory, self.replies, self.repository
        )
        self.http_door: HttpDoor | None = None  # made in serve() when http_port is not -1
        self.http_port = 0
        self.http_address_file = run_dir / HTTP_ADDRESS_FILE
        self._http_written: FileId | None = None
        self._stop = asyncio.Event()
        self.control_path = run_dir / router_control_socket(self.fleet.index)
        self._control_bound: FileId | None = None  # what we bound and wrote, we remove
        self._address_written: FileId | None = None
        self.port = 0
        self.metrics_port = 0  # bound by serve() when metrics_port is not -1
        self.metrics_address_file = run_dir / METRICS_ADDRESS_FILE
        self._metrics_written: FileId | None = None
        self.metrics = MetricsSource(
            lambda: {gid: route.channel for gid, route in self.routes.pools.items()},
            self.own_counts,
            peers=self.fleet.counts if self.fleet.shared else None,
        )

    def own_counts(self) -> RouterCounts:
        return RouterCounts(
            self.core.router_deadlines,
            self.routes.routed_models(),
            requests={str(self.fleet.index): self.core.requests},
            stalled=self.core.streams_stalled,
        )

    def _control_server(self) -> grpc.aio.Server:
        server = grpc.aio.server()
        handler = grpc.method_handlers_generic_handler(
            ROUTER_CONTROL_SERVICE,
            {
                "SetRoutes": grpc.unary_unary_rpc_method_handler(
                    guarded(self.routes.set_routes),
                    cpb.RouteTable.FromString,
                    cpb.SetRoutesResponse.SerializeToString,
                )
            },
        )
        # Health here too: the supervisor follows it to say when the server is ready.
        server.add_generic_rpc_handlers((handler, self.health.generic_handler()))
        if self.fleet.shared:
            fleet = self.fleet.handlers(self.repository.learn, self.own_counts)
            server.add_generic_rpc_handlers((fleet,))
        self._control_bound = bind_private_unix(server, self.control_path)
        return server

    def request_stop(self) -> None:
        self.health.shutdown()  # NOT_SERVING from the first moment of the stop
        self._stop.set()

    async def serve(self, ready: Callable[[], None]) -> None:
        self.core.tracing = Tracing.from_env("router")
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop)
        self.routes.open_channels()
        self.routes.sync_health()
        if return_large_frees():  # (tests/test_client_limits.py looks for this line)
            log.info("router: malloc maps buffers of 16 MiB and up on their own, reuses smaller")
        mlserver_repository = model_repository_handler(  # MLServer's, over the same calls
            self.grpc_door.repository_index,
            self.grpc_door.routed_by_field2("RepositoryModelLoad"),
            self.grpc_door.routed_by_field2("RepositoryModelUnload"),
        )
        handlers = (
            self.streams.bound(self.grpc_door.generic_handler()),
            self.streams.bound(mlserver_repository),
            self.streams.bound(self.health.generic_handler()),
        )
        address = f"{self.settings.host}:{self.settings.grpc_port}"
        server = await self._grpc_server(handlers, address)
        control = self._control_server()
        metrics = await self._start_metrics()
        http = await self._start_http()
        async with asyncio.TaskGroup() as tasks:
            fds = tasks.create_task(watch_descriptors("router", DESCRIPTOR_CHECK_S))
            heap = tasks.create_task(trim_heap(HEAP_CHECK_S))
            rescanner = tasks.create_task(self.routes.rescanner.serve(), name="rescanner")
            self.routes.start_watching(tasks)
            await server.start()
            await control.start()
            self._publish_address()
            log.info("router: listening on %s (grpc_engine %s)", address, self.settings.grpc_engine)
            ready()
            await self._stop.wait()
            began = time.monotonic()
            await control.stop(0)
            if metrics is not None:
                await metrics.stop()
            grace = self.settings.stop_grace_s
            if http is not None:
                await asyncio.gather(server.stop(grace), http.stop(grace))
            else:
                await server.stop(grace)
            log.info("router: drained in %.3f s", time.monotonic() - began)
            rescanner.cancel()
            self.routes.stop_watching()
            fds.cancel()
            heap.cancel()
        remove_own(self.control_path, self._control_bound)
        if not self.fleet.shared:  # a fleet's: the others still serve there (serve.py removes)
            remove_own(self.address_file, self._address_written)
            remove_own(self.http_address_file, self._http_written)
            remove_own(self.metrics_address_file, self._metrics_written)
        if self.core.tracing is not None:
            await asyncio.to_thread(self.core.tracing.shutdown)  # flushes, off the loop
        await self.routes.close()
        self.arena.close()  # every slab closed

    async def _grpc_server(
        self, handlers: tuple[grpc.GenericRpcHandler, ...], address: str
    ) -> grpc.aio.Server | GrpcServer:
        """The gRPC port, bound (not yet serving): the router's own HTTP/2
        (grpc_engine "poolserve") or grpcio's server ("grpcio")."""
        settings = self.settings
        if settings.grpc_engine == "poolserve":
            own = GrpcServer(settings, handlers, sink=slab_sinks(self.arena))
            try:
                self.port = await own.bind(
                    settings.host, settings.grpc_port, self.fleet.shared, tls_context(settings)
                )
            except OSError as exc:
                raise ConfigError(
                    "router", "grpc_port", f"cannot listen on {address}: {exc}"
                ) from None
            return own
        server = grpc.aio.server(options=server_options(settings, self.fleet.shared))
        server.add_generic_rpc_handlers(handlers)
        credentials = server_credentials(settings)
        try:
            if credentials is None:
                self.port = server.add_insecure_port(address)
            else:
                self.port = server.add_secure_port(address, credentials)
        except RuntimeError as exc:
            self.port = 0
            reason = str(exc)
        else:
            reason = "the address is in use or not ours"
        if self.port == 0:
            raise ConfigError("router", "grpc_port", f"cannot listen on {address}: {reason}")
        return server

    def _publish_address(self) -> None:
        self._address_written = _publish(self.address_file, self.settings.host, self.port)

    async def _start_http(self) -> HttpDoor | None:
        """The HTTP/REST door (http_port; -1: none), on this event loop."""
        if self.settings.http_port < 0:
            return None
        door = HttpDoor(
            self.settings, self.routes, self.core, self.repository, self.shared_memory, self.replies
        )
        host = self.settings.host
        try:
            self.http_port = await door.start(
                host, self.settings.http_port, reuse_port=self.fleet.shared
            )
        except OSError as exc:
            raise ConfigError(
                "router", "http_port", f"cannot listen on {host}:{self.settings.http_port}: {exc}"
            ) from None
        self.http_door = door
        self._http_written = _publish(self.http_address_file, host, self.http_port)
        log.info("router: HTTP/REST on http://%s/v2", _host_port(host, self.http_port))
        return door

    async def _start_metrics(self) -> MetricsServer | None:
        """The HTTP /metrics port (metrics_port; -1: none), on this event loop.
        In a fleet, every router serves it (SO_REUSEPORT), each with the others'
        counts (fleet.py): a scrape is answered while any router is up."""
        if self.settings.metrics_port < 0:
            return None
        metrics = MetricsServer(self.metrics)
        host = self.settings.host
        try:
            self.metrics_port = await metrics.start(
                host, self.settings.metrics_port, reuse_port=self.fleet.shared
            )
        except OSError as exc:
            raise ConfigError(
                "router",
                "metrics_port",
                f"cannot listen on {host}:{self.settings.metrics_port}: {exc}",
            ) from None
        self._metrics_written = _publish(self.metrics_address_file, host, self.metrics_port)
        log.info("router: metrics on http://%s/metrics", _host_port(host, self.metrics_port))
        return metrics


def _host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _publish(path: Path, host: str, port: int) -> FileId | None:
    """Writes ``host:port`` to ``path`` at once (a reader never sees half of it)."""
    partial = path.with_suffix(f".{os.getpid()}.tmp")  # a fleet's routers write the same file
    partial.write_text(_host_port(host, port) + "\n")
    partial.replace(path)
    return file_id(path)
