"""The router: deadline propagation, truthful health, size limits, streaming, pools down."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry.proto.trace.v1 import trace_pb2

from poolserve.protos import inference_pb2 as pb
from poolserve.protos import inference_pb2_grpc as pbg
from poolserve.service.inference.codec import encode_inputs

from harness import children_of
from otlp_receiver import Receiver, attributes
from serving import Serving, pool_status, wait_idle_workers, wait_serving
from support import copy_example
from test_tracing import otel_env

pytestmark = pytest.mark.e2e

Stub = pbg.GRPCInferenceServiceStub
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def echo(model: str = "echo", shape: tuple[int, ...] = (1, 16)) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name=model)
    encode_inputs({"INPUT0": np.ones(shape, np.float32)}, request, raw=True)
    return request


def two_pools(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    copy_example(repo, "echo")
    copy_example(repo, "sleep", gid="other")
    return repo


def spans_named(receiver: Receiver, suffix: str) -> list[trace_pb2.Span]:
    return [sp for _, sp in receiver.spans if sp.name.endswith(suffix)]


def test_deadline_propagation(tmp_path: Path) -> None:
    async def main() -> None:
        receiver = Receiver()
        port = await receiver.start()
        try:
            with Serving(two_pools(tmp_path), tmp_path / "run", env=otel_env(port)) as serving:
                await calls(serving, receiver)
        finally:
            await receiver.stop()

    async def calls(serving: Serving, receiver: Receiver) -> None:
        async with grpc.aio.insecure_channel(serving.address) as channel:
            await wait_serving(channel)
            stub = Stub(channel)
            # a roomy budget (a loaded CI host once spent 50 ms on the first call)
            await stub.ModelInfer(echo(), timeout=5.0)
            await stub.ModelInfer(echo())  # no deadline at all
            codes = set()
            for _ in range(20):  # budgets below the router's 1 ms margin
                try:
                    await stub.ModelInfer(echo(), timeout=0.0005)
                    codes.add(grpc.StatusCode.OK)  # grpc-timeout rounding gave it room
                except grpc.aio.AioRpcError as exc:
                    codes.add(exc.code())
            assert codes <= {grpc.StatusCode.OK, grpc.StatusCode.DEADLINE_EXCEEDED}

            def exported(spans: object) -> bool:
                spent = [
                    r
                    for r in spans_named(receiver, "GRPCInferenceService/ModelInfer")
                    if attributes(r).get("poolserve.deadline.budget_ms", 99) <= 1
                ]
                return len(spans_named(receiver, "pool ModelInfer")) >= 2 and bool(spent)

            await receiver.wait_for(exported)
            routers = spans_named(receiver, "GRPCInferenceService/ModelInfer")
            pools = {sp.parent_span_id: sp for sp in spans_named(receiver, "pool ModelInfer")}
            with_budget = [r for r in routers if "poolserve.deadline.budget_ms" in attributes(r)]
            roomy = [
                r
                for r in with_budget
                if 1_000 < attributes(r)["poolserve.deadline.budget_ms"] <= 6_000
            ]
            (five,) = roomy
            budget = attributes(five)["poolserve.deadline.budget_ms"]
            pool_side = attributes(pools[five.span_id])["poolserve.deadline.remaining_ms"]
            # what reaches the pool is what was left, never more (grpc-timeout is sent
            # in whole units: allow 1 ms)
            assert 0 < pool_side <= budget + 1
            (unbounded,) = [
                r for r in routers if "poolserve.deadline.budget_ms" not in attributes(r)
            ]
            remaining = attributes(unbounded)["poolserve.deadline.remaining_ms"]
            assert 59_000 < remaining <= 60_000  # the default, not grpc's "infinite"
            forwarded = set(pools)
            tiny = [r for r in with_budget if attributes(r)["poolserve.deadline.budget_ms"] <= 1]
            assert tiny, "no call arrived with its budget (nearly) spent"
            for router in tiny:
                assert router.span_id not in forwarded, "a spent budget was forwarded"
                (event,) = [e for e in router.events if e.name == "deadline_exceeded"]
                stage = {a.key: a.value.string_value for a in event.attributes}
                assert stage["poolserve.deadline.stage"] == "router"

    asyncio.run(main())


def test_health_follows_start_pool_kill_restart_and_stop(tmp_path: Path) -> None:
    async def main(serving: Serving) -> None:
        async with grpc.aio.insecure_channel(serving.address) as channel:
            stub = Stub(channel)
            health = health_pb2_grpc.HealthStub(channel)
            stream = health.Watch(health_pb2.HealthCheckRequest(service=""))
            statuses: asyncio.Queue[int] = asyncio.Queue()

            async def follow() -> None:
                try:
                    async for reply in stream:
                        await statuses.put(reply.status)
                except grpc.aio.AioRpcError:
                    await statuses.put(-1)  # the router went away

            follower = asyncio.ensure_future(follow())

            async def next_status(want: int) -> None:
                while (got := await asyncio.wait_for(statuses.get(), 60)) != want:
                    assert got in (SERVING, NOT_SERVING), got

            await next_status(SERVING)
            assert (await stub.ServerReady(pb.ServerReadyRequest())).ready
            other = (await pool_status(serving, "other")).pid
            os.kill(other, signal.SIGKILL)
            await next_status(NOT_SERVING)
            assert not (await stub.ServerReady(pb.ServerReadyRequest())).ready
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.ModelInfer(echo("sleep"), timeout=30)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            assert (await stub.ModelInfer(echo(), timeout=30)).outputs  # the other pool serves
            await next_status(SERVING)  # the supervisor restarted the pool
            assert (await stub.ServerReady(pb.ServerReadyRequest())).ready
            assert (await pool_status(serving, "other")).pid != other
            assert serving.proc is not None
            serving.proc.send_signal(signal.SIGTERM)
            await next_status(NOT_SERVING)
            await follower

    with Serving(two_pools(tmp_path), tmp_path / "run") as serving:
        asyncio.run(main(serving))
        assert serving.proc is not None and serving.proc.wait(timeout=60) == 0


@pytest.mark.parametrize("engine", ["poolserve", "grpcio"])
def test_size_limit_streaming_and_garbage(tmp_path: Path, engine: str) -> None:
    """Through either engine of the gRPC port (grpc_engine): the same statuses."""
    repo = two_pools(tmp_path)
    (repo / "settings.json").write_text(
        f'{{"max_message_size": 100000, "grpc_engine": "{engine}"}}'
    )

    async def main(serving: Serving) -> None:
        async with grpc.aio.insecure_channel(
            serving.address, options=[("grpc.max_send_message_length", 10_000_000)]
        ) as channel:
            await wait_serving(channel)
            stub = Stub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.ModelInfer(echo(shape=(1, 50_000)), timeout=30)
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "100000" in (info.value.details() or "")

            async def messages() -> object:
                yield echo()
                yield echo("sleep")  # another pool: an in-stream error, not a broken stream
                yield echo()

            replies = [r async for r in stub.ModelStreamInfer(messages(), timeout=30)]
            assert [bool(r.error_message) for r in replies] == [False, True, False]
            assert "sleep" in replies[1].error_message
            raw = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
            for garbage in (b"\xff\xff\xff\xff", b"\x0a\x80", b"\x12"):
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await raw(garbage, timeout=30)
                assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert (await stub.ModelInfer(echo(), timeout=30)).outputs

    with Serving(repo, tmp_path / "run") as serving:
        asyncio.run(main(serving))
        assert len(children_of(serving.pid)) == 3  # two pools and the router, still
        assert f"(grpc_engine {engine})" in serving.log()


def test_queue_bound_is_resource_exhausted_naming_the_pool(tmp_path: Path) -> None:
    repo = two_pools(tmp_path)
    (repo / "settings.json").write_text('{"max_queue": 3}')

    async def main(serving: Serving) -> None:
        async with grpc.aio.insecure_channel(serving.address) as channel:
            await wait_serving(channel)
            await wait_idle_workers(serving, "other", 2)  # both take a call, not one
            stub = Stub(channel)
            sleep = pb.ModelInferRequest(model_name="sleep")
            encode_inputs({"INPUT0": np.ones((1, 4), np.float32)}, sleep, raw=True)
            sleep.parameters["sleep_ms"].int64_param = 2000
            # 2 workers busy + 3 queued fill the pool; the rest are refused at once
            calls = [stub.ModelInfer(sleep, timeout=30) for _ in range(12)]
            results = await asyncio.gather(*calls, return_exceptions=True)
            refused = [r for r in results if isinstance(r, grpc.aio.AioRpcError)]
            served = [r for r in results if not isinstance(r, BaseException)]
            assert len(served) == 5
            assert len(refused) == 7
            for error in refused:
                assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert "pool 'other'" in (error.details() or "")
            assert (await stub.ModelInfer(echo(), timeout=30)).outputs  # other pools unaffected

    with Serving(repo, tmp_path / "run") as serving:
        asyncio.run(main(serving))
