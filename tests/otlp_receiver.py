"""A minimal OTLP/gRPC trace receiver for tests, on a loopback port."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.trace.v1 import trace_pb2


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.spans: list[tuple[dict[str, Any], trace_pb2.Span]] = []
        self._changed = asyncio.Event()
        self.server: grpc.aio.Server | None = None
        self.port = 0

    async def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: Any
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        for resource_spans in request.resource_spans:
            resource = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
            for scope in resource_spans.scope_spans:
                for span in scope.spans:
                    self.spans.append((resource, span))
        self._changed.set()
        self._changed = asyncio.Event()
        return trace_service_pb2.ExportTraceServiceResponse()

    async def start(self) -> int:
        self.server = grpc.aio.server()
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        return self.port

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop(0)

    async def wait_for(self, predicate: Any, timeout: float = 30.0) -> None:
        """Waits (on export events, not a timer) until ``predicate(spans)`` holds."""

        async def until() -> None:
            while not predicate(self.spans):
                await self._changed.wait()

        await asyncio.wait_for(until(), timeout)


def attributes(span: trace_pb2.Span) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for a in span.attributes:
        kind = a.value.WhichOneof("value")
        values[a.key] = getattr(a.value, kind) if kind else None
    return values
