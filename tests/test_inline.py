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
from poolserve.service.codec import encode_inputs

from serving import Serving, pool_status, wait_serving
from support import children_of, copy_example

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
