"""OpenTelemetry traces that show where each request's deadline budget went.

Configured by the standard environment variables: ``OTEL_TRACES_EXPORTER``
(``otlp`` over gRPC, ``console``, or ``none``, the default),
``OTEL_EXPORTER_OTLP_ENDPOINT``, ``OTEL_SERVICE_NAME``,
``OTEL_TRACES_SAMPLER`` and its argument, ``OTEL_RESOURCE_ATTRIBUTES``. With
``none`` there is no tracer at all, and the request path pays nothing.

Spans are exported by a batch processor on its own thread: exporting never
blocks a request, and an unreachable collector costs a request nothing. A
tracer is only ever created after the process has done all its forking
(workers never get one; they report timings and the pool builds the spans).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

if TYPE_CHECKING:  # the SDK is imported only when tracing is on (memory, start-up time)
    from opentelemetry.sdk.trace import TracerProvider

from poolserve.service import __version__
from poolserve.service.contract.settings import ConfigError

# monotonic -> wall clock, for spans built from timings measured elsewhere
_WALL_OFFSET_NS = time.time_ns() - time.monotonic_ns()
_PROPAGATOR = TraceContextTextMapPropagator()
_CARRIED = ("traceparent", "tracestate")


def wall_ns(monotonic_s: float) -> int:
    return int(monotonic_s * 1e9) + _WALL_OFFSET_NS


class Tracing:
    def __init__(self, provider: TracerProvider, role: str) -> None:
        self.provider = provider
        self.tracer = provider.get_tracer("poolserve", __version__)
        self.role = role

    @classmethod
    def from_env(cls, role: str, environ: Mapping[str, str] | None = None) -> Tracing | None:
        env = os.environ if environ is None else environ
        kind = env.get("OTEL_TRACES_EXPORTER", "none").split(",")[0].strip().lower()
        if kind in ("", "none"):
            return None
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import (
            BatchSpanProcessor,
            ConsoleSpanExporter,
            SpanExporter,
        )

        exporter: SpanExporter
        if kind == "otlp":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter()
        elif kind == "console":
            exporter = ConsoleSpanExporter()
        else:
            raise ConfigError(
                "OTEL_TRACES_EXPORTER", "OTEL_TRACES_EXPORTER", f"unsupported exporter {kind!r}"
            )
        attributes: dict[str, Any] = {"poolserve.role": role}
        named = "OTEL_SERVICE_NAME" in env or "service.name" in env.get(
            "OTEL_RESOURCE_ATTRIBUTES", ""
        )
        if not named:
            attributes["service.name"] = "poolserve"
        provider = TracerProvider(resource=Resource.create(attributes))
        provider.add_span_processor(BatchSpanProcessor(exporter))
        return cls(provider, role)

    def server_span(
        self, name: str, metadata: Iterable[tuple[str, Any]] | None, attributes: Mapping[str, Any]
    ) -> Span:
        """A SERVER span continuing the caller's ``traceparent`` when there is one."""
        carrier = {k: str(v) for k, v in metadata or () if k in _CARRIED}
        parent = _PROPAGATOR.extract(carrier) if carrier else None
        return self.tracer.start_span(
            name, context=parent, kind=SpanKind.SERVER, attributes=dict(attributes)
        )

    @staticmethod
    def carry(span: Span) -> list[tuple[str, str]]:
        """Metadata that carries ``span`` as the parent of the next hop."""
        carrier: dict[str, str] = {}
        _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
        return list(carrier.items())

    def child(
        self,
        parent: Span,
        name: str,
        start_s: float,
        end_s: float,
        attributes: Mapping[str, Any] | None = None,
    ) -> None:
        """A finished child span with explicit (monotonic) start and end times."""
        ctx = trace.set_span_in_context(parent, otel_context.Context())
        span = self.tracer.start_span(
            name, context=ctx, start_time=wall_ns(start_s), attributes=dict(attributes or {})
        )
        span.end(end_time=wall_ns(end_s))

    def shutdown(self) -> None:
        self.provider.shutdown()


def deadline_event(span: Span, stage: str, message: str = "") -> None:
    span.add_event("deadline_exceeded", {"poolserve.deadline.stage": stage, "message": message})


def strip_carried(metadata: Sequence[tuple[str, Any]]) -> list[tuple[str, Any]]:
    return [(k, v) for k, v in metadata if k not in _CARRIED]


def carried(metadata: Iterable[tuple[str, Any]] | None) -> list[tuple[str, str]]:
    """The trace context entries of ``metadata``, to pass on to the next hop."""
    return [(k, str(v)) for k, v in metadata or () if k in _CARRIED]
