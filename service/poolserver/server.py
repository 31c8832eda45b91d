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
from collections.abc import Callable, Sequence
from pathlib import Path

import grpc

from poolserve.service.contract.errors import ServingError, Unavailable
from poolserve.service.contract.framing import Payload
from poolserve.service.contract.lane import LANE_OVERHEAD, Trace, lane_path
from poolserve.service.contract.repository import (
    Fingerprint,
    InvalidModel,
    ModelSettings,
    Repository,
    TensorSpec,
    TransactionPolicy,
    fingerprint,
    scan,
)
from poolserve.service.contract.rundir import claim_socket, remove_own
from poolserve.service.contract.settings import ServerSettings
from poolserve.service.grpcserver.health import Health
from poolserve.service.grpcserver.pacing import Pacer, Rescanner
from poolserve.service.grpcserver.shm import SharedMemory
from poolserve.service.grpcserver.sockets import bind_private_unix
from poolserve.service.grpcserver.tracing import Tracing
from poolserve.service.inference.cargo import InferenceZygote
from poolserve.service.poolcore.fleet import Fleet
from poolserve.service.poolcore.jobs import Limits, WorkerGone
from poolserve.service.poolcore.started import Started
from poolserve.service.poolcore.zygote_control import ZygoteEvents
from poolserve.service.poolserver.backend import PoolBackend
from poolserve.service.poolserver.catalog import Catalog, ModelState
from poolserve.service.poolserver.control import PoolControl
from poolserve.service.poolserver.inline import InlineRunner, is_inline
from poolserve.service.poolserver.lane_server import LaneServer
from poolserve.service.poolserver.model_control import LiveModels, ModelReply
from poolserve.service.poolserver.response_cache import ResponseCache
from poolserve.service.poolserver.servicer import InferenceServicer

log = logging.getLogger(__name__)


def start_method(settings: ServerSettings, gid: str, models: Sequence[ModelSettings]) -> str:
    """How the pool starts workers: its setting, or "spawn" if one of its models asks."""
    if any(m.extra.get("start_method") == "spawn" for m in models):
        return "spawn"
    return settings.start_method_for(gid)


class PoolServer(LiveModels):
    def __init__(
        self,
        gid: str,
        models: Sequence[ModelSettings],
        settings: ServerSettings,
        socket_path: Path,
        repo: Path | None = None,
        unserved: Sequence[InvalidModel] = (),
    ) -> None:
        self.gid = gid
        self.repo = repo
        self._load_tracebacks: dict[str, str] = {}  # model -> its failed load's traceback
        self.models = list(models)
        self.settings = settings
        self.socket_path = socket_path
        self.workers = settings.workers_for(gid)
        self.inline_models = [m for m in self.models if self._runs_inline(m)]
        self.worker_models = [m for m in self.models if not self._runs_inline(m)]
        self.start_method = start_method(settings, gid, self.worker_models)
        self.zygote = InferenceZygote(
            self.worker_models, settings.heartbeat_interval_s, self.start_method
        )
        # with the versions its models' policies pick that cannot be served
        self.catalog = Catalog.from_settings(self.models, unserved)
        self.health = Health()
        limits = Limits(
            settings.max_queue,
            settings.heartbeat_timeout_s,
            settings.warmup_timeout_s,
            settings.abandon_grace_s,
        )
        self.fleet = Fleet.with_dispatcher(
            f"pool {gid}",
            gid,
            self.workers,
            self.zygote.spawn,
            limits,
            mark_failed=self._mark_failed,
            on_worker_gone=self._on_worker_gone,
            retry_model=self._retry_model,
            spawned=self.start_method == "spawn",
            on_change=self._sync_health,
        )
        self.dispatcher = self.fleet.dispatcher
        self.inline = InlineRunner(self.catalog, gid, settings.max_queue, settings.max_message_size)
        self.cache = ResponseCache(settings.response_cache_bytes, settings.response_cache_entries)
        self.pool_control = PoolControl(
            gid, self.zygote, self.dispatcher, self.inline, self.catalog, self.fleet, self.cache
        )
        self.backend = PoolBackend(
            self.dispatcher,
            self.inline,
            bool(self.worker_models),
            settings.reject_hopeless,
            settings.max_message_size,
            self.cache,
        )
        # a model loaded again (or unloaded) answers from its new load only
        self.catalog.watch_models(self.cache.forget)
        self._caching = False  # some model of the pool caches its replies
        self.catalog.subscribe(self._sync_caching)
        self._sync_caching()
        self.servicer = InferenceServicer(
            self.catalog,
            self.backend,
            server_name=settings.server_name,
            default_timeout_s=settings.default_timeout_s,
            control=self,
            margin_s=settings.deadline_margin_ms / 1000,
            # its socket is private: the router's calls come with their registrations
            shared_memory=SharedMemory.from_settings(settings, accept_attached=True),
            stream_messages=settings.stream_messages,
        )
        self.lane = LaneServer(
            lane_path(socket_path),
            self.servicer.infer_lane,
            f"pool '{gid}'",
            max_frame=settings.max_message_size + LANE_OVERHEAD,
            immediate=self._lane_now,
            streamer=self.servicer.stream_lane,
            begin=self._lane_begin,
        )
        self._stop = asyncio.Event()
        self.exit_code = 0
        self._model_ops = asyncio.Lock()  # one rolling replacement at a time
        # One load per (name, config override): concurrent ones share it.
        self._flights: dict[tuple[str, str], asyncio.Task[ServingError | None]] = {}
        self._model_replies: dict[str, asyncio.Future[ModelReply]] = {}
        self._own_metadata: dict[str, bytes] = {}  # a loaded model's, until the catalog takes it
        self._custom_routes: dict[str, tuple[tuple[str, str], ...]] = {}  # the same
        self._rescanner: Rescanner[Repository] | None = None
        self._rescan_task: asyncio.Task[None] | None = None
        self._reloads = Pacer(settings.repository_rescan_s)
        self._loaded_from: dict[str, Fingerprint | None] = {}  # the files each model came from
        self._tasks: asyncio.TaskGroup | None = None

    def _sync_caching(self) -> None:
        self._caching = any(self.cache.caches(e) for e in self.catalog.entries())

    def _lane_now(self, request: Payload, deadline: float, trace: Trace) -> bytes | None:
        """A lane call answered without a task, untraced: a hit of the response
        cache, or an inline model declared fast."""
        if self.servicer.tracing is not None or not (self._caching or self.inline.has_fast()):
            return None
        entry, routing = self.backend.route(self.catalog, request)
        deadline -= self.servicer.margin_s
        return self.backend.infer_now(entry, request, deadline, routing)

    def _lane_begin(
        self,
        request: Payload,
        deadline: float,
        trace: Trace,
        reply: Callable[[Payload | Exception], None],
    ) -> Started | None:
        """A lane call started without a task: untraced, on a forked worker, alone."""
        if self.servicer.tracing is not None:
            return None
        entry, routing = self.backend.route(self.catalog, request)
        deadline -= self.servicer.margin_s
        return self.backend.begin(entry, request, deadline, routing, reply)

    def _runs_inline(self, settings: ModelSettings) -> bool:
        # A pool of 0 workers runs its models inline, as MLServer's parallel_workers 0.
        return self.workers == 0 or is_inline(settings)

    def fork_zygote(self, close_in_child: Sequence[int] = ()) -> None:
        # Before the zygote reads them: a file changed after this is seen as changed.
        self._loaded_from = {m.key: fingerprint(m) for m in self.models}
        self.zygote.start(close_in_child)

    # -- zygote events -----------------------------------------------------

    def _on_model(
        self,
        name: str,
        ok: bool,
        reason: str,
        inputs: tuple[TensorSpec, ...],
        outputs: tuple[TensorSpec, ...],
        policy: TransactionPolicy,
    ) -> None:
        trace = self._load_tracebacks.pop(name, "")
        waiting = self._model_replies.pop(name, None)
        if waiting is not None:  # a live load: _load decides what the catalog says
            if not ok:  # the client hears the reason; the log has the traceback too
                extra = {"model": name, "traceback": trace} if trace else {"model": name}
                log.error("pool %s: live load of model %s: %s", self.gid, name, reason, extra=extra)
            if not waiting.done():
                waiting.set_result(ModelReply(ok, reason, (inputs, outputs), policy))
            return
        if ok:
            log.info("pool %s: model %s loaded", self.gid, name)
            entry = self.catalog.find(name)
            if entry is not None:
                entry.own_metadata = self._own_metadata.pop(name, None)
                entry.custom_routes = self._custom_routes.pop(name, ())
            self.catalog.set_state(name, ModelState.READY, "", (inputs, outputs), policy)
        else:
            # The traceback goes in a field of its own (log_format json); a text
            # line stays one line.
            extra = {"model": name, "traceback": trace} if trace else {"model": name}
            log.error("pool %s: model %s: %s", self.gid, name, reason, extra=extra)
            self.catalog.set_state(name, ModelState.UNAVAILABLE, reason)

    def _on_load_traceback(self, name: str, trace: str) -> None:
        self._load_tracebacks[name] = trace

    def _on_metadata(self, name: str, data: bytes) -> None:
        self._own_metadata[name] = data  # the catalog takes it with the model's load

    def _on_custom_routes(self, name: str, routes: tuple[tuple[str, str], ...]) -> None:
        self._custom_routes[name] = routes  # the same

    def _on_loaded(self) -> None:
        if not self.worker_models:
            return  # only inline models: no worker to fork
        self.fleet.start()

    def _on_worker(self, pid: int, sock: socket.socket) -> None:
        log.info("pool %s: worker %d started", self.gid, pid)
        self.fleet.arrived(pid, sock)

    def _on_unloaded(self, name: str) -> None:
        waiting = self._model_replies.pop(f"unload:{name}", None)
        if waiting is not None and not waiting.done():
            waiting.set_result(ModelReply(True, "", ((), ()), TransactionPolicy()))

    def _on_exit(self, pid: int, status: str) -> None:
        self.dispatcher.worker_exited(pid, status)

    def _on_zygote_lost(self) -> None:
        if not self._stop.is_set():
            log.error("pool %s: zygote %d died; stopping the pool", self.gid, self.zygote.pid)
            self.dispatcher.refuse(
                Unavailable(f"pool '{self.gid}' lost its zygote and is restarting")
            )
            self.exit_code = 1
            self._stop.set()

    def _on_worker_gone(self, gone: WorkerGone) -> None:
        if gone.retired:
            log.info("pool %s: worker %d retired (%s)", self.gid, gone.pid, gone.status)
        self.fleet.gone(gone)

    def _mark_failed(self, name: str, reason: str) -> None:
        log.error("pool %s: model %s marked failed: %s", self.gid, name, reason)
        self.catalog.set_state(name, ModelState.UNAVAILABLE, reason)

    def _retry_model(self, name: str) -> None:
        entry = self.catalog.find(name)
        if entry is not None and entry.state is ModelState.UNAVAILABLE:
            log.info("pool %s: model %s gets another chance after its cooldown", self.gid, name)
            self.catalog.set_state(name, ModelState.READY, "")

    # -- health --------------------------------------------------------------

    def _share_workers(self) -> None:
        """Keeps ``unary_workers`` of the workers from the pool's streams while a
        model the pool runs on its workers answers other calls (ModelInfer,
        REST, a stream's requests to it); a pool of decoupled models only keeps
        none back (docs/streaming.md)."""
        others = any(
            e.ready and e.policy.unary and e.key not in self.inline for e in self.catalog.entries()
        )
        self.dispatcher.share.reserve = self.settings.unary_workers_for(self.gid) if others else 0

    def _sync_health(self) -> None:
        ready = self.servicer.ready()
        self.health.set_many({"": ready, "inference.GRPCInferenceService": ready})
        serving = self.servicer.backend.serving()
        for name, ready in self.catalog.ready_by_name().items():
            self.health.set(f"model:{name}", ready and serving)

    # -- lifecycle -------------------------------------------------------------

    def request_stop(self) -> None:
        self._stop.set()

    async def serve(self, ready: Callable[[], None]) -> int:
        # The zygote is forked already: from here on threads (the exporter's) are fine.
        self.servicer.tracing = Tracing.from_env(f"pool:{self.gid}")
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop)
        self.catalog.subscribe(self._sync_health)
        self.catalog.subscribe(self._share_workers)
        self._sync_health()
        self._share_workers()
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
                self.pool_control.generic_handler(),
            )
        )
        claim_socket(self.lane.path)  # both paths checked before either is bound
        bound = bind_private_unix(server, self.socket_path)
        async with asyncio.TaskGroup() as tasks:
            self._tasks = tasks
            dispatcher_started = asyncio.Event()
            tasks.create_task(self.dispatcher.run(dispatcher_started.set), name="dispatcher")
            await dispatcher_started.wait()
            if self.repo is not None:
                repo = self.repo
                self._rescanner = Rescanner(lambda: scan(repo), self.settings.repository_rescan_s)
                self._rescan_task = tasks.create_task(self._rescanner.serve(), name="rescanner")
            self.zygote.attach(
                ZygoteEvents(
                    self._on_model,
                    self._on_loaded,
                    self._on_worker,
                    self._on_exit,
                    self._on_zygote_lost,
                    self._on_unloaded,
                    self._on_load_traceback,
                    self._on_metadata,
                    self._on_custom_routes,
                )
            )
            # The lane listens before the gRPC socket answers: the router follows
            # health over the gRPC socket and sends calls down the lane as soon as
            # a model says SERVING (a model that loads during server.start() would
            # otherwise be routed to a lane that refuses connections).
            await self.lane.start(tasks)
            await server.start()
            log.info("pool %s: serving on %s (pid %d)", self.gid, self.socket_path, os.getpid())
            if self.start_method == "spawn":
                log.info("pool %s: workers start by spawn: each loads the models itself", self.gid)
            ready()
            if self.inline_models:
                tasks.create_task(self.inline.load(self.inline_models), name="inline-load")
            await self._stop.wait()
            await self._shutdown(server)
        remove_own(self.socket_path, bound)
        log.info("pool %s: zygote %s", self.gid, await self.zygote.wait(timeout=5.0))
        if self.servicer.tracing is not None:
            await asyncio.to_thread(self.servicer.tracing.shutdown)
        return self.exit_code

    async def _shutdown(self, server: grpc.aio.Server) -> None:
        self.health.shutdown()
        # Stop taking calls, let in-flight calls finish within the grace period.
        grace = self.settings.stop_grace_s
        await asyncio.gather(server.stop(grace), self.lane.stop(grace))
        self.fleet.stop()
        self.inline.close()
        for flight in list(self._flights.values()):
            flight.cancel()
        if self._rescan_task is not None:
            self._rescan_task.cancel()
        self.dispatcher.close()
        self.zygote.close()
