"""OpenTelemetry traces across router and pool, exported to a real OTLP receiver."""

from __future__ import annotations

import asyncio
import os
import socket
import statistics
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import grpc
import numpy as np
import pytest
import requests
from opentelemetry.proto.trace.v1 import trace_pb2

from poolserve.protos import inference_pb2 as pb
from poolserve.protos import inference_pb2_grpc as pbg
from poolserve.service.inference.codec import encode_inputs

from otlp_receiver import Receiver, attributes
from serving import Serving, pool_status, wait_serving
from support import copy_example

pytestmark = pytest.mark.e2e

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
UNSAMPLED_TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
Stub = pbg.GRPCInferenceServiceStub


def otel_env(port: int) -> dict[str, str]:
    return {
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
        "OTEL_EXPORTER_OTLP_INSECURE": "true",
        "OTEL_BSP_SCHEDULE_DELAY": "50",
        "OTEL_SERVICE_NAME": "poolserve-test",
    }


def request(model: str, value: float, **params: int) -> pb.ModelInferRequest:
    req = pb.ModelInferRequest(model_name=model)
    encode_inputs({"INPUT0": np.full((1, 4), value, np.float32)}, req, raw=True)
    for key, v in params.items():
        req.parameters[key].int64_param = v
    return req


def repo(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    copy_example(root, "echo")
    copy_example(root, "sleep")
    # a wide margin: the pool answers well before grpc's own deadline timers fire,
    # even on a loaded machine, so the stage it reports is what the spans show
    (root / "settings.json").write_text('{"deadline_margin_ms": 50}')
    return root


def traced_tree(tmp_path: Path, body: Callable[[Serving, Receiver], Awaitable[None]]) -> None:
    """Runs ``body`` against a tree (one worker) that exports to a real OTLP receiver."""

    async def main() -> None:
        receiver = Receiver()
        port = await receiver.start()
        try:
            with Serving(repo(tmp_path), tmp_path / "run", workers=1, env=otel_env(port)) as s:
                await body(s, receiver)
        finally:
            await receiver.stop()

    asyncio.run(main())


def test_one_trace_through_router_and_pool(tmp_path: Path) -> None:
    async def traced_calls(serving: Serving, receiver: Receiver) -> None:
        async with grpc.aio.insecure_channel(serving.address) as channel:
            await wait_serving(channel)
            stub = Stub(channel)
            # not sampled by the caller: neither router nor pool records anything for it
            unsampled = f"00-{UNSAMPLED_TRACE_ID}-{CLIENT_SPAN}-00"
            await stub.ModelInfer(
                request("echo", 1.0), timeout=5, metadata=(("traceparent", unsampled),)
            )
            parent = f"00-{TRACE_ID}-{CLIENT_SPAN}-01"
            await stub.ModelInfer(
                request("echo", 1.0), timeout=5, metadata=(("traceparent", parent),)
            )

            def complete(spans: list[tuple[dict[str, str], trace_pb2.Span]]) -> bool:
                names = {sp.name for _, sp in spans if sp.trace_id.hex() == TRACE_ID}
                return {"queue", "compute"} <= names and len(names) >= 4

            try:
                await receiver.wait_for(complete)
            except TimeoutError:
                raise AssertionError(
                    [(sp.name, sp.trace_id.hex()) for _, sp in receiver.spans]
                ) from None
            # each process exports in order: the earlier call's spans would be here by now
            # (and no process started a trace of its own for it)
            traces = {sp.trace_id.hex() for _, sp in receiver.spans}
            assert traces == {TRACE_ID}, traces
            mine = [(r, sp) for r, sp in receiver.spans if sp.trace_id.hex() == TRACE_ID]
            by_name = {sp.name: (r, sp) for r, sp in mine}
            router_resource, router = by_name["inference.GRPCInferenceService/ModelInfer"]
            assert router.parent_span_id.hex() == CLIENT_SPAN
            assert router.kind == trace_pb2.Span.SpanKind.SPAN_KIND_SERVER
            assert router_resource["service.name"] == "poolserve-test"
            attrs = attributes(router)
            assert attrs["rpc.system"] == "grpc"
            assert attrs["rpc.method"] == "ModelInfer"
            assert attrs["rpc.grpc.status_code"] == 0
            assert attrs["poolserve.model.name"] == "echo"
            # grpc-timeout travels in coarse units: allow its rounding, and a loaded
            # client's delay before it sends (seen once at load ~8)
            assert 2000 < attrs["poolserve.deadline.budget_ms"] <= 5100
            assert (
                0
                < attrs["poolserve.deadline.remaining_ms"]
                <= attrs["poolserve.deadline.budget_ms"]
            )
            pool = next(sp for _, sp in mine if sp.parent_span_id == router.span_id)
            children = {sp.name for _, sp in mine if sp.parent_span_id == pool.span_id}
            assert children == {"queue", "compute"}
            compute = by_name["compute"][1]
            assert pool.start_time_unix_nano <= compute.start_time_unix_nano
            assert compute.end_time_unix_nano <= pool.end_time_unix_nano

            # a request that expires in the pool queue says so in the router span
            busy = asyncio.ensure_future(
                stub.ModelInfer(request("sleep", 2.0, sleep_ms=1500), timeout=10)
            )
            for _ in range(3000):  # until the only worker is busy (polled: no event)
                if (await pool_status(serving)).workers[0].state == "busy":
                    break
                await asyncio.sleep(0.01)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.ModelInfer(request("sleep", 3.0, sleep_ms=1), timeout=0.3)
            assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            await busy

            def expired(spans: list[tuple[dict[str, str], trace_pb2.Span]]) -> bool:
                return any(
                    e.name == "deadline_exceeded" and sp.name.endswith("/ModelInfer")
                    for _, sp in spans
                    for e in sp.events
                )

            await receiver.wait_for(expired)
            events = [
                e
                for _, sp in receiver.spans
                if sp.name.endswith("/ModelInfer")
                for e in sp.events
                if e.name == "deadline_exceeded"
            ]
            stages = {
                a.value.string_value
                for e in events
                for a in e.attributes
                if a.key == "poolserve.deadline.stage"
            }
            assert "pool queue" in stages

    traced_tree(tmp_path, traced_calls)


def test_a_rest_call_is_traced_as_a_grpc_call(tmp_path: Path) -> None:
    async def traced_calls(serving: Serving, receiver: Receiver) -> None:
        async with grpc.aio.insecure_channel(serving.address) as channel:
            await wait_serving(channel)
        url = f"http://{(serving.run_dir / 'http.addr').read_text().strip()}"
        body = {"inputs": [{"name": "INPUT0", "shape": [1, 2], "datatype": "FP32", "data": [1, 2]}]}
        headers = {"traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01", "Grpc-Timeout": "5S"}
        reply = await asyncio.to_thread(
            requests.post, f"{url}/v2/models/echo/infer", json=body, headers=headers, timeout=30
        )
        assert reply.status_code == 200

        def complete(spans: list[tuple[dict[str, str], trace_pb2.Span]]) -> bool:
            names = {sp.name for _, sp in spans if sp.trace_id.hex() == TRACE_ID}
            return {"queue", "compute"} <= names and len(names) >= 4

        await receiver.wait_for(complete)
        mine = [sp for _, sp in receiver.spans if sp.trace_id.hex() == TRACE_ID]
        router = next(sp for sp in mine if sp.name == "POST /v2/models/echo/infer")
        assert router.parent_span_id.hex() == CLIENT_SPAN
        assert router.kind == trace_pb2.Span.SpanKind.SPAN_KIND_SERVER
        attrs = attributes(router)
        assert attrs["http.response.status_code"] == 200
        assert attrs["poolserve.model.name"] == "echo"
        assert 4000 < attrs["poolserve.deadline.budget_ms"] <= 5000
        pool = next(sp for sp in mine if sp.parent_span_id == router.span_id)
        children = {sp.name for sp in mine if sp.parent_span_id == pool.span_id}
        assert children == {"queue", "compute"}

        stream = await asyncio.to_thread(
            requests.post,
            f"{url}/v2/models/echo/generate_stream",
            json=body,
            headers=headers,
            timeout=30,
        )
        assert stream.status_code == 200

        def streamed(spans: list[tuple[dict[str, str], trace_pb2.Span]]) -> bool:
            return any(sp.name.endswith("/generate_stream") for _, sp in spans)

        await receiver.wait_for(streamed)
        span = next(sp for _, sp in receiver.spans if sp.name.endswith("/generate_stream"))
        assert attributes(span)["poolserve.stream.responses"] == 1
        assert attributes(span)["http.response.status_code"] == 200

    traced_tree(tmp_path, traced_calls)


def test_a_stream_is_one_span_with_its_counts(tmp_path: Path) -> None:
    """ModelStreamInfer through the router: one SERVER span for the stream,
    continuing the client's trace, with its model, pool, requests, responses
    and error responses."""

    async def streamed(serving: Serving, receiver: Receiver) -> None:
        async with grpc.aio.insecure_channel(serving.address) as channel:
            await wait_serving(channel)
            sent = [pb.ModelInferRequest(model_name="nosuch")] + [
                request("echo", float(i)) for i in range(3)
            ]

            async def messages() -> AsyncIterator[bytes]:
                for message in sent:
                    yield message.SerializeToString()

            stream = channel.stream_stream("/inference.GRPCInferenceService/ModelStreamInfer")
            parent = f"00-{TRACE_ID}-{CLIENT_SPAN}-01"
            call = stream(messages(), timeout=30, metadata=(("traceparent", parent),))
            replies = [pb.ModelStreamInferResponse.FromString(r) async for r in call]
            assert [bool(r.error_message) for r in replies] == [True, False, False, False]

            name = "inference.GRPCInferenceService/ModelStreamInfer"

            def arrived(spans: list[tuple[dict[str, str], trace_pb2.Span]]) -> bool:
                return any(sp.name == name for _, sp in spans)

            await receiver.wait_for(arrived)
            (span,) = [sp for _, sp in receiver.spans if sp.name == name]
            assert span.trace_id.hex() == TRACE_ID
            assert span.parent_span_id.hex() == CLIENT_SPAN
            assert span.kind == trace_pb2.Span.SpanKind.SPAN_KIND_SERVER
            attrs = attributes(span)
            assert attrs["rpc.method"] == "ModelStreamInfer"
            assert attrs["rpc.grpc.status_code"] == 0
            assert attrs["poolserve.model.name"] == "echo"
            assert attrs["poolserve.pool"] == "default"
            assert attrs["poolserve.stream.requests"] == 4
            assert attrs["poolserve.stream.responses"] == 4
            assert attrs["poolserve.stream.error_responses"] == 1
            assert 25_000 < attrs["poolserve.deadline.budget_ms"] <= 30_100

    traced_tree(tmp_path, streamed)


def test_collector_down_costs_requests_nothing(tmp_path: Path) -> None:
    """Two trees side by side, one exporting every span to a collector that is
    not there, one with tracing off: echo calls alternate between them (so the
    machine's noise hits both alike) and the median latency with the dead
    collector stays within 3x the median without one. Export happens on the
    batch processor's thread; a slow export on the request path would cost
    each call up to the 1 s export timeout."""
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()  # nothing listens there

    async def timed(stub: Stub, k: int) -> float:
        began = time.perf_counter()
        reply = await stub.ModelInfer(request("echo", float(k)), timeout=10)
        took = time.perf_counter() - began
        assert reply.raw_output_contents
        return took

    async def main(dead: Serving, off: Serving) -> None:
        async with (
            grpc.aio.insecure_channel(dead.address) as dead_channel,
            grpc.aio.insecure_channel(off.address) as off_channel,
        ):
            await wait_serving(dead_channel)
            await wait_serving(off_channel)
            stubs = Stub(dead_channel), Stub(off_channel)
            for k in range(50):  # warm-up: connections, lanes, first spans
                for stub in stubs:
                    await timed(stub, k)
            with_dead: list[float] = []
            without: list[float] = []
            for k in range(300):
                with_dead.append(await timed(stubs[0], k))
                without.append(await timed(stubs[1], k))
        dead_ms = statistics.median(with_dead) * 1000
        off_ms = statistics.median(without) * 1000
        print(f"echo median latency: collector down {dead_ms:.2f} ms, tracing off {off_ms:.2f} ms")
        assert dead_ms <= 3 * off_ms, (dead_ms, off_ms)

    env = otel_env(port)
    env["OTEL_EXPORTER_OTLP_TIMEOUT"] = "1"
    with (
        Serving(repo(tmp_path / "dead"), tmp_path / "run-dead", env=env) as dead,
        Serving(repo(tmp_path / "off"), tmp_path / "run-off") as off,
    ):
        asyncio.run(main(dead, off))
        assert "Traceback" not in dead.log()
        # the dead collector was really in use: the exporter said it could not reach it
        assert f"traces to 127.0.0.1:{port}" in dead.log(), dead.log()


def test_tracing_off_by_default(tmp_path: Path) -> None:
    assert "OTEL_TRACES_EXPORTER" not in os.environ
    from poolserve.service.grpcserver.tracing import Tracing

    assert Tracing.from_env("router", {}) is None
    assert Tracing.from_env("router", {"OTEL_TRACES_EXPORTER": "none"}) is None
    assert Tracing.from_env("router", {"OTEL_TRACES_EXPORTER": "console"}) is not None
