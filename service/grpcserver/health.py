"""grpc.health.v1 for poolserve processes, with a synchronous ``set``.

grpcio-health-checking's asyncio servicer has an awaitable ``set`` and forgets
every watcher of a service as soon as one of them disconnects. This one keeps
the statuses in a dict owned by the event loop and wakes all watchers through
a broadcast event that is replaced on each change, so setting a status is a
plain call from any callback on the loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from typing import Any

import grpc
from grpc_health.v1 import health_pb2

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVICE_UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
HEALTH_SERVICE = "grpc.health.v1.Health"


class Health:
    def __init__(self) -> None:
        self._status: dict[str, int] = {"": NOT_SERVING}
        self._changed = asyncio.Event()
        self._shutting_down = False

    def set(self, service: str, serving: bool) -> None:
        if self._shutting_down:
            return
        status = SERVING if serving else NOT_SERVING
        if self._status.get(service) != status:
            self._status[service] = status
            self._broadcast()

    def set_many(self, statuses: Mapping[str, bool]) -> None:
        for service, serving in statuses.items():
            self.set(service, serving)

    def shutdown(self) -> None:
        """NOT_SERVING for every service, for good (the first step of a stop)."""
        self._shutting_down = True
        for service in self._status:
            self._status[service] = NOT_SERVING
        self._broadcast()

    def status(self, service: str) -> int | None:
        return self._status.get(service)

    def _broadcast(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def check(
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> health_pb2.HealthCheckResponse:
        status = self._status.get(request.service)
        if status is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service!r}")
        return health_pb2.HealthCheckResponse(status=status)

    async def watch(
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[health_pb2.HealthCheckResponse]:
        last = None
        while True:
            changed = self._changed
            status = self._status.get(request.service, SERVICE_UNKNOWN)
            if status != last:
                yield health_pb2.HealthCheckResponse(status=status)
                last = status
            if self._shutting_down:
                return  # said NOT_SERVING; an open stream must not hold up the stop
            await changed.wait()

    def generic_handler(self) -> grpc.GenericRpcHandler:
        req = health_pb2.HealthCheckRequest
        resp = health_pb2.HealthCheckResponse
        return grpc.method_handlers_generic_handler(
            HEALTH_SERVICE,
            {
                "Check": grpc.unary_unary_rpc_method_handler(
                    self.check, req.FromString, resp.SerializeToString
                ),
                "Watch": grpc.unary_stream_rpc_method_handler(
                    self.watch, req.FromString, resp.SerializeToString
                ),
            },
        )
