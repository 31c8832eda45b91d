"""Inline models ("parallel_workers": 0) run inside the pool server, no worker hop."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import grpc
import numpy as np
import pytest

from poolserve.protos import inference_pb2 as pb
from poolserve.protos import inference_pb2_grpc as pbg
from poolserve.service.inference.codec import encode_inputs

from harness import children_of
from serving import Serving, pool_status, wait_serving
from support import copy_example

pytestmark = pytest.mark.e2e
Stub = pbg.GRPCInferenceServiceStub


def make_inline(folder: Path, fast: bool) -> None:
    path = folder / "model-settings.json"
    settings = json.loads(path.read_text())
    settings["parallel_workers"] = 0
    settings.setdefault("parameters", {})["inference_pool_gid"] = "inline"
    settings["parameters"].setdefault("extra", {})["inline_fast"] = fast
    path.write_text(json.dumps(settings))


def request(model: str, value: float, **params: int) -> pb.ModelInferRequest:
    req = pb.ModelInferRequest(model_name=model)
    encode_inputs({"INPUT0": np.full((1, 4), value, np.float32)}, req, raw=True)
    for key, v in params.items():
        req.parameters[key].int64_param = v
    return req


def test_inline_models_deadlines_cancel_and_no_stall(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    make_inline(copy_example(repo, "echo"), fast=True)
    make_inline(copy_example(repo, "sleep"), fast=False)

    async def main(serving: Serving) -> None:
        async with grpc.aio.insecure_channel(serving.address) as channel:
            await wait_serving(channel)
            stub = Stub(channel)
            status = await pool_status(serving, "inline")
            assert len(status.workers) == 0  # no worker hop, no worker
            (zygote,) = children_of(status.pid)
            assert children_of(zygote) == []
            reply = await stub.ModelInfer(request("echo", 5.0), timeout=10)
            assert reply.raw_output_contents[0] == np.full((1, 4), 5.0, np.float32).tobytes()

            # a slow inline model runs on its own thread: echo keeps answering meanwhile
            slow = asyncio.ensure_future(
                stub.ModelInfer(request("sleep", 1.0, sleep_ms=1500), timeout=30)
            )
            for k in range(20):  # round trips on the same connection: slow is in by now
                await stub.ModelInfer(request("echo", float(k)), timeout=10)
            queued_expired = asyncio.ensure_future(
                stub.ModelInfer(request("sleep", 2.0, sleep_ms=1), timeout=0.3)
            )
            queued_cancelled = stub.ModelInfer(request("sleep", 3.0, sleep_ms=1), timeout=30)
            for k in range(50):
                echo = await stub.ModelInfer(request("echo", float(k)), timeout=10)
                assert echo.outputs
            assert not slow.done(), "echo answered only after the slow inline model finished"
            queued_cancelled.cancel()
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await queued_expired
            assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert (await slow).outputs
            stats = await stub.ModelStatistics(pb.ModelStatisticsRequest(name="sleep"))
            assert stats.model_stats[0].execution_count == 1  # expired and cancelled never ran
            echo_stats = await stub.ModelStatistics(pb.ModelStatisticsRequest(name="echo"))
            assert echo_stats.model_stats[0].inference_stats.success.count == 71

    with Serving(repo, tmp_path / "run") as serving:
        asyncio.run(main(serving))


def inline_copy(repo: Path, example: str, name: str, fast: bool, **extra: object) -> None:
    folder = copy_example(repo, example)
    folder = folder.rename(repo / name)
    make_inline(folder, fast)
    path = folder / "model-settings.json"
    settings = json.loads(path.read_text())
    settings["name"] = name
    settings["parameters"]["extra"].update(extra)
    path.write_text(json.dumps(settings))


def test_inline_queue_is_bounded_and_ordered_like_the_pools(tmp_path: Path) -> None:
    """A slow inline model's waiting calls: at most max_queue of them (then
    RESOURCE_EXHAUSTED naming the pool and the model), served by priority, then
    deadline, then arrival, as the dispatcher serves worker models."""
    repo = tmp_path / "repo"
    inline_copy(repo, "sleep", "sleep", fast=False, priority_levels=2)
    (repo / "settings.json").write_text(json.dumps({"max_queue": 3}))

    async def main(serving: Serving) -> None:
        async with grpc.aio.insecure_channel(serving.address) as channel:
            await wait_serving(channel)
            stub = Stub(channel)
            running = asyncio.ensure_future(
                stub.ModelInfer(request("sleep", 0.0, sleep_ms=2000), timeout=60)
            )
            finished: list[str] = []

            async def queue_depth(depth: int) -> None:
                for _ in range(3000):  # the pool's status has no event to wait on
                    if (await pool_status(serving, "inline")).queue_depth == depth:
                        return
                    await asyncio.sleep(0.01)
                raise AssertionError(f"the inline queue never held {depth} calls")

            async def queued(name: str, timeout: float, **params: int) -> None:
                await stub.ModelInfer(request("sleep", 1.0, sleep_ms=1, **params), timeout=timeout)
                finished.append(name)

            calls = []
            for name, timeout, params in (
                ("low, late", 40.0, {}),
                ("low, early", 20.0, {}),
                ("high", 50.0, {"priority": 1}),
            ):
                calls.append(asyncio.ensure_future(queued(name, timeout, **params)))
                await queue_depth(len(calls))  # queued behind the running call, in this order
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.ModelInfer(request("sleep", 2.0, sleep_ms=1), timeout=30)
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, info.value
            details = info.value.details() or ""
            assert "pool 'inline'" in details and "'sleep'" in details, details
            assert not running.done(), "the queue drained before the bound was tested"
            await asyncio.gather(running, *calls)
            assert finished == ["high", "low, early", "low, late"]

    with Serving(repo, tmp_path / "run") as serving:
        asyncio.run(main(serving))


@pytest.mark.parametrize("fast", [True, False], ids=["on the loop", "on its thread"])
def test_inline_reply_over_max_message_size_is_a_clear_resource_exhausted(
    tmp_path: Path, fast: bool
) -> None:
    """echo's reply is a few bytes longer than its request: a request just under
    max_message_size makes a reply just over it, refused in the pool with a
    message that says so, not inside gRPC at the router."""
    limit = 64 * 1024
    repo = tmp_path / "repo"
    inline_copy(repo, "echo", "echo", fast=fast)
    (repo / "settings.json").write_text(json.dumps({"max_message_size": limit}))
    body = b""
    for size in range(limit - 64, limit):  # the largest request that fits
        req = pb.ModelInferRequest(model_name="echo")
        req.inputs.add(name="INPUT0", datatype="FP32", shape=[1, size // 4])  # echo's
        req.raw_input_contents.append(b"\0" * (size // 4 * 4))
        if len(req.SerializeToString()) <= limit:
            body = req.SerializeToString()

    async def main(serving: Serving) -> None:
        async with grpc.aio.insecure_channel(serving.address) as channel:
            await wait_serving(channel)
            call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await call(body, timeout=30)
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, info.value
            details = info.value.details() or ""
            assert "model 'echo' replied" in details and "max_message_size" in details, details
            reply = await Stub(channel).ModelInfer(request("echo", 1.0), timeout=30)
            assert reply.outputs  # and it keeps serving
            stats = await Stub(channel).ModelStatistics(pb.ModelStatisticsRequest(name="echo"))
            assert stats.model_stats[0].inference_stats.fail.count == 1

    with Serving(repo, tmp_path / "run") as serving:
        asyncio.run(main(serving))
        assert "Traceback" not in serving.log()
