"""A pool server: one process per inference pool gid.

Start-up order is the point of this module: the zygote is forked first,
before any gRPC object, thread or exporter exists in this process; then the
grpc.aio server starts on a private unix socket and reports ready while the
zygote loads the models; workers are forked once the models are in memory.
Health is truthful throughout: ``""`` is SERVING only while every model of
the pool is loaded and at least one worker is alive.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import grpc

from poolserve.protos import control_pb2 as cpb
from poolserve.service.catalog import Catalog, ModelEntry, ModelState
from poolserve.service.dispatcher import Dispatcher, WorkerGone
from poolserve.service.errors import DeadlineExceeded, ServingError
from poolserve.service.health import Health
from poolserve.service.procutil import pss_bytes
from poolserve.service.repository import ModelSettings, TensorSpec
from poolserve.service.respawn import Respawner
from poolserve.service.servicer import InferenceServicer, guarded
from poolserve.service.settings import ServerSettings
from poolserve.service.wire import Routing
from poolserve.service.zygote import ZygoteEvents, ZygoteLink

log = logging.getLogger(__name__)

CONTROL_SERVICE = "poolserve.control.v1.PoolControl"
MAX_UNIX_PATH = 107


def pool_socket_path(run_dir: Path, gid: str) -> Path:
    path = run_dir / f"pool-{gid}.sock"
    if len(str(path)) > MAX_UNIX_PATH:
        raise ValueError(f"socket path {path} is longer than {MAX_UNIX_PATH} bytes")
    return path


class PoolBackend:
    """The InferBackend of a pool server: the dispatcher over forked workers."""

    def __init__(self, dispatcher: Dispatcher) -> None:
        self.dispatcher = dispatcher

    def serving(self) -> bool:
        return self.dispatcher.live_workers() > 0

    async def infer(
        self, entry: ModelEntry, request: bytes, deadline: float, routing: Routing
    ) -> bytes:
        began = time.monotonic_ns()
        try:
            result = await self.dispatcher.submit(
                request,
                deadline,
                priority=routing.priority,
                idempotent=routing.idempotent,
                tag=entry.name,
                timeout=entry.settings.timeout_s if entry.settings is not None else None,
            )
        except DeadlineExceeded:
            entry.stats.record_failure(time.monotonic_ns() - began)
            raise
        except ServingError:
            entry.stats.record_failure(time.monotonic_ns() - began)
            raise
        entry.stats.record_success(result.queue_ns, result.timings, time.monotonic_ns() - began)
        return result.body


def bind_private_unix(server: grpc.aio.Server, path: Path) -> None:
    """Binds with a umask so the socket is 0600 from its first instant."""
    path.unlink(missing_ok=True)
    old = os.umask(0o177)
    try:
        server.add_insecure_port(f"unix:{path}")
    finally:
        os.umask(old)


class PoolServer:
    def __init__(
        self,
        gid: str,
        models: Sequence[ModelSettings],
        settings: ServerSettings,
        socket_path: Path,
    ) -> None:
        self.gid = gid
        self.models = list(models)
        self.settings = settings
        self.socket_path = socket_path
        self.workers = settings.workers_for(gid)
        self.zygote = ZygoteLink(self.models, settings.heartbeat_interval_s)
        self.catalog = Catalog.from_settings(self.models)
        self.health = Health()
        self.dispatcher = Dispatcher(
            f"{gid}",
            settings.max_queue,
            on_change=self._sync_health,
            on_worker_gone=self._on_worker_gone,
            heartbeat_timeout=settings.heartbeat_timeout_s,
        )
        self.respawner = Respawner(self.zygote.spawn, self._mark_failed, clock=time.monotonic)
        self.servicer = InferenceServicer(
            self.catalog,
            PoolBackend(self.dispatcher),
            server_name=settings.server_name,
            default_timeout_s=settings.default_timeout_s,
        )
        self._stop = asyncio.Event()
        self.exit_code = 0

    def fork_zygote(self, close_in_child: Sequence[int] = ()) -> None:
        self.zygote.start(close_in_child)

    # -- zygote events -----------------------------------------------------

    def _on_model(
        self,
        name: str,
        ok: bool,
        reason: str,
        inputs: tuple[TensorSpec, ...],
        outputs: tuple[TensorSpec, ...],
    ) -> None:
        if ok:
            log.info("pool %s: model %s loaded", self.gid, name)
            self.catalog.set_state(name, ModelState.READY, "", (inputs, outputs))
        else:
            log.error("pool %s: model %s: %s", self.gid, name, reason)
            self.catalog.set_state(name, ModelState.UNAVAILABLE, reason)

    def _on_loaded(self) -> None:
        for _ in range(self.workers):
            self.zygote.spawn()

    def _on_worker(self, pid: int, sock: socket.socket) -> None:
        log.info("pool %s: worker %d started", self.gid, pid)
        self.dispatcher.add_worker(pid, sock)

    def _on_exit(self, pid: int, status: str) -> None:
        self.dispatcher.worker_exited(pid, status)

    def _on_zygote_lost(self) -> None:
        if not self._stop.is_set():
            log.error("pool %s: zygote %d died; stopping the pool", self.gid, self.zygote.pid)
            self.exit_code = 1
            self._stop.set()

    def _on_worker_gone(self, gone: WorkerGone) -> None:
        running = f" while running model '{gone.tag}'" if gone.tag else ""
        killed = f" (killed: {gone.reason})" if gone.reason else ""
        log.warning("pool %s: worker %d %s%s%s", self.gid, gone.pid, gone.status, running, killed)
        delay = self.respawner.worker_lost(gone.tag, gone.reason or gone.status)
        if delay:
            log.info("pool %s: next worker in %.2f s (crash back-off)", self.gid, delay)

    def _mark_failed(self, name: str, reason: str) -> None:
        log.error("pool %s: model %s marked failed: %s", self.gid, name, reason)
        self.catalog.set_state(name, ModelState.UNAVAILABLE, reason)

    # -- health --------------------------------------------------------------

    def _sync_health(self) -> None:
        ready = self.servicer.ready()
        self.health.set_many({"": ready, "inference.GRPCInferenceService": ready})
        serving = self.servicer.backend.serving()
        for e in self.catalog.entries():
            self.health.set(f"model:{e.name}", e.ready and serving)

    # -- control service -----------------------------------------------------

    async def status(self, _: cpb.PoolStatusRequest, __: Any) -> cpb.PoolStatus:
        pids = [os.getpid(), self.zygote.pid] + [w.pid for w in self.dispatcher.workers()]
        return cpb.PoolStatus(
            gid=self.gid,
            pid=os.getpid(),
            zygote_pid=self.zygote.pid,
            queue_depth=self.dispatcher.queue_depth(),
            workers=[
                cpb.WorkerStatus(pid=w.pid, state=str(w.state), requests_served=w.served)
                for w in self.dispatcher.workers()
            ],
            pss_bytes=sum(pss_bytes(p) for p in pids),
            models=[
                cpb.ModelState(name=e.name, version=e.version, state=str(e.state), reason=e.reason)
                for e in self.catalog.entries()
            ],
            late_replies_dropped=self.dispatcher.late_replies,
        )

    def _control_handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(
            CONTROL_SERVICE,
            {
                "Status": grpc.unary_unary_rpc_method_handler(
                    guarded(self.status),
                    cpb.PoolStatusRequest.FromString,
                    cpb.PoolStatus.SerializeToString,
                )
            },
        )

    # -- lifecycle -------------------------------------------------------------

    def request_stop(self) -> None:
        self._stop.set()

    async def serve(self, ready: Callable[[], None]) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop)
        self.catalog.subscribe(self._sync_health)
        self._sync_health()
        limit = self.settings.max_message_size
        server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", limit),
                ("grpc.max_send_message_length", limit),
            ]
        )
        server.add_generic_rpc_handlers(
            (
                self.servicer.generic_handler(),
                self.health.generic_handler(),
                self._control_handler(),
            )
        )
        bind_private_unix(server, self.socket_path)
        async with asyncio.TaskGroup() as tasks:
            dispatcher_started = asyncio.Event()
            tasks.create_task(self.dispatcher.run(dispatcher_started.set), name="dispatcher")
            await dispatcher_started.wait()
            self.zygote.attach(
                ZygoteEvents(
                    self._on_model,
                    self._on_loaded,
                    self._on_worker,
                    self._on_exit,
                    self._on_zygote_lost,
                )
            )
            await server.start()
            log.info("pool %s: serving on %s (pid %d)", self.gid, self.socket_path, os.getpid())
            ready()
            await self._stop.wait()
            await self._shutdown(server)
        log.info("pool %s: zygote %s", self.gid, await self.zygote.wait(timeout=5.0))
        return self.exit_code

    async def _shutdown(self, server: grpc.aio.Server) -> None:
        self.health.shutdown()
        # Stop taking calls, let in-flight calls finish within the grace period.
        await server.stop(self.settings.stop_grace_s)
        self.respawner.close()
        self.dispatcher.close()
        self.zygote.close()
        self.socket_path.unlink(missing_ok=True)
