"""Models loaded and run inside the serving process itself.

Used by unit tests (a real grpc.aio server on a loopback port over the
whole repository) and by ``poolserve serve-inprocess``. Predict runs on one
dedicated thread so a slow model never stalls the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

import grpc

from poolserve.service.contract.errors import DeadlineExceeded, ServingError, decoupled_refusal
from poolserve.service.contract.framing import Payload
from poolserve.service.contract.repository import ModelSettings, Repository
from poolserve.service.contract.settings import ServerSettings
from poolserve.service.contract.wire import Routing
from poolserve.service.contract.worker_limits import configure as configure_worker_limits
from poolserve.service.grpcserver.health import Health
from poolserve.service.grpcserver.shm import SharedMemory
from poolserve.service.inference.infer import infer
from poolserve.service.inference.model import Model, load_model, tensor_specs
from poolserve.service.poolserver.catalog import Catalog, ModelEntry, ModelState
from poolserve.service.poolserver.rest_scheduling import ready_route
from poolserve.service.poolserver.servicer import InferenceServicer, Observer

log = logging.getLogger(__name__)


class InProcessBackend:
    def __init__(self, catalog: Catalog) -> None:
        self._catalog = catalog
        self._models: dict[str, Model] = {}
        self._executor: ThreadPoolExecutor | None = None

    def serving(self) -> bool:
        return True

    def route(self, catalog: Catalog, request: Payload) -> tuple[ModelEntry, Routing]:
        return ready_route(catalog, request)  # (an ensemble's chain comes from a router only)

    def _thread(self) -> ThreadPoolExecutor:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="predict")
        return self._executor

    async def load(self, models: Iterable[ModelSettings]) -> None:
        loop = asyncio.get_running_loop()
        for settings in models:
            try:
                model = await loop.run_in_executor(self._thread(), load_model, settings)
            except Exception as exc:
                reason = f"load failed: {type(exc).__name__}: {exc}"
                log.warning("model %s: %s", settings.name, reason)
                self._catalog.set_state(settings.key, ModelState.UNAVAILABLE, reason)
                continue
            self._models[settings.key] = model
            self._catalog.set_state(settings.key, ModelState.READY, "", tensor_specs(model))

    async def infer(
        self,
        entry: ModelEntry,
        request: Payload,
        deadline: float,
        routing: Routing,
        observe: Observer | None = None,
    ) -> Payload:
        if not entry.policy.unary:
            raise decoupled_refusal(entry.name)
        queued = time.monotonic_ns()
        if time.monotonic() >= deadline:
            raise DeadlineExceeded(f"deadline exceeded before model '{entry.name}' ran")
        model = self._models[entry.key]
        loop = asyncio.get_running_loop()
        try:
            body, timings = await loop.run_in_executor(self._thread(), infer, model, request)
        except ServingError as exc:
            entry.stats.record_failure(time.monotonic_ns() - queued, error=exc)
            raise
        entry.stats.record_success(0, timings, time.monotonic_ns() - queued)
        return body

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)


class InProcessServer:
    """A grpc.aio server with every repository model loaded in this process."""

    def __init__(self, repository: Repository, settings: ServerSettings) -> None:
        self.repository = repository
        self.settings = settings
        self.catalog = Catalog.from_settings(repository.models, repository.invalid)
        self.backend = InProcessBackend(self.catalog)
        self.health = Health()
        # its models run here: the limits a worker would enforce are this process's
        configure_worker_limits(settings.max_message_size, settings.slab_mapped_bytes, export=False)
        self.servicer = InferenceServicer(
            self.catalog,
            self.backend,
            server_name=settings.server_name,
            default_timeout_s=settings.default_timeout_s,
            shared_memory=SharedMemory.from_settings(settings),
        )
        self.port = 0
        self._server: grpc.aio.Server | None = None

    def _sync_health(self) -> None:
        ready = self.servicer.ready()
        self.health.set_many({"": ready, "inference.GRPCInferenceService": ready})
        for name, ready in self.catalog.ready_by_name().items():
            self.health.set(f"model:{name}", ready)

    async def start(self, address: str | None = None) -> int:
        limit = self.settings.max_message_size
        server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", limit),
                ("grpc.max_send_message_length", limit),
            ]
        )
        server.add_generic_rpc_handlers(
            (self.servicer.generic_handler(), self.health.generic_handler())
        )
        bind = address or f"{self.settings.host}:{self.settings.grpc_port}"
        self.port = server.add_insecure_port(bind)
        self.catalog.subscribe(self._sync_health)
        self._sync_health()
        await server.start()
        self._server = server
        await self.backend.load(self.repository.models)
        return self.port

    async def stop(self, grace: float = 5.0) -> None:
        self.health.shutdown()
        if self._server is not None:
            await self._server.stop(grace)
        self.backend.close()
