"""Live model load and unload through the router, while other models keep serving."""

from __future__ import annotations

import asyncio
import http.client
import json
import shutil
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from poolserve.protos import inference_pb2 as pb
from poolserve.protos import inference_pb2_grpc as pbg
from poolserve.service.inference.codec import encode_inputs

from serving import Serving, pool_status, wait_serving
from support import copy_example, wait_until

pytestmark = pytest.mark.e2e

Stub = pbg.GRPCInferenceServiceStub


def echo_request(model: str, value: float) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name=model)
    encode_inputs({"INPUT0": np.full((1, 16), value, np.float32)}, request, raw=True)
    return request


def add_echo_copy(repo: Path, name: str) -> None:
    target = repo / name
    shutil.copytree(repo / "echo", target)
    settings = json.loads((target / "model-settings.json").read_text())
    settings["name"] = name
    (target / "model-settings.json").write_text(json.dumps(settings))


def test_load_new_model_while_echo_serves(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    copy_example(repo, "echo")
    copy_example(repo, "sleep", gid="other")

    async def main(serving: Serving) -> None:
        async with grpc.aio.insecure_channel(serving.address) as channel:
            await wait_serving(channel)
            stub = Stub(channel)
            before = {w.pid for w in (await pool_status(serving)).workers}
            other_pool = (await pool_status(serving, "other")).pid
            stop = asyncio.Event()
            failures: list[str] = []
            served = 0

            async def load(k: int) -> None:
                nonlocal served
                n = 0
                while not stop.is_set():
                    n += 1
                    value = float(k * 100_000 + n)
                    try:
                        reply = await stub.ModelInfer(echo_request("echo", value), timeout=30)
                    except grpc.aio.AioRpcError as exc:
                        failures.append(f"{exc.code()}: {exc.details()}")
                        continue
                    expected = np.full((1, 16), value, np.float32).tobytes()
                    if reply.raw_output_contents[0] != expected:
                        failures.append("wrong payload")
                    served += 1

            loaders = [asyncio.ensure_future(load(k)) for k in range(8)]
            add_echo_copy(repo, "echo2")
            loads = [
                stub.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name="echo2"))
                for _ in range(3)
            ]
            await asyncio.wait_for(asyncio.gather(*loads), timeout=60)
            reply = await stub.ModelInfer(echo_request("echo2", 7.0), timeout=30)
            assert reply.model_name == "echo2"
            assert (await stub.ModelReady(pb.ModelReadyRequest(name="echo2"))).ready
            stop.set()
            await asyncio.gather(*loaders)
            assert served > 0
            assert failures == []
            after = {w.pid for w in (await pool_status(serving)).workers}
            assert len(after) == 2
            assert not after & before, "every worker was replaced by a fresh fork"
            assert (await pool_status(serving, "other")).pid == other_pool
            assert (await stub.ServerReady(pb.ServerReadyRequest())).ready

            # unload: the model stops answering, the server stays ready
            await stub.RepositoryModelUnload(pb.RepositoryModelUnloadRequest(model_name="echo2"))
            assert not (await stub.ModelReady(pb.ModelReadyRequest(name="echo2"))).ready
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.ModelInfer(echo_request("echo2", 1.0), timeout=30)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            assert (await stub.ServerReady(pb.ServerReadyRequest())).ready
            assert (await stub.ModelInfer(echo_request("echo", 3.0), timeout=30)).outputs

    with Serving(repo, tmp_path / "run") as serving:
        asyncio.run(main(serving))
        assert serving.log().count("model echo2 loaded live") == 1


def test_failed_reload_keeps_previous_version(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    copy_example(repo, "echo")

    async def main(serving: Serving) -> None:
        async with grpc.aio.insecure_channel(serving.address) as channel:
            await wait_serving(channel)
            stub = Stub(channel)
            (repo / "echo" / "model.py").write_text("raise ImportError('half-written file')\n")
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name="echo"))
            assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "half-written" in (info.value.details() or "")
            assert "previous version keeps serving" in (info.value.details() or "")
            assert (await stub.ModelInfer(echo_request("echo", 2.0), timeout=30)).outputs
            assert (await stub.ServerReady(pb.ServerReadyRequest())).ready
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name="nope"))
            assert info.value.code() == grpc.StatusCode.NOT_FOUND

    with Serving(repo, tmp_path / "run") as serving:
        asyncio.run(main(serving))


def test_a_failed_live_load_is_logged_once_with_its_traceback(tmp_path: Path) -> None:
    """A live load whose model raises (gRPC RepositoryModelLoad, REST
    /v2/repository/models/{m}/load) is answered with the reason, and its pool
    logs it once, naming the model, with the model's traceback (the
    ``traceback`` field of log_format json; a text line stays one line)."""
    repo = tmp_path / "repo"
    copy_example(repo, "echo")

    async def main(serving: Serving) -> None:
        async with grpc.aio.insecure_channel(serving.address) as channel:
            await wait_serving(channel)
            stub = Stub(channel)
            (repo / "echo" / "model.py").write_text("raise ImportError('half-written file')\n")
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name="echo"))
            assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION

    def failed_loads(log: str, model: str) -> list[dict[str, Any]]:
        records = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
        return [r for r in records if r.get("model") == model and r["level"] == "ERROR"]

    with Serving(repo, tmp_path / "run", "--log-format", "json") as serving:
        asyncio.run(main(serving))
        assert wait_until(lambda: failed_loads(serving.log(), "echo"), 60), serving.log()[-3000:]
        (record,) = failed_loads(serving.log(), "echo")
        assert record["role"] == "pool:default", record
        assert "live load of model echo" in record["msg"], record
        assert "half-written file" in record["msg"], record
        trace = record["traceback"]
        assert trace.startswith("Traceback (most recent call last)"), trace
        assert "raise ImportError('half-written file')" in trace, trace

        # through REST: a model added after start whose load raises
        add_echo_copy(repo, "broken")
        (repo / "broken" / "model.py").write_text("raise OSError('weights missing')\n")
        host, port = (serving.run_dir / "http.addr").read_text().strip().rsplit(":", 1)
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        try:
            conn.request("POST", "/v2/repository/models/broken/load", b"{}")
            reply = conn.getresponse()
            assert reply.status >= 400 and b"weights missing" in reply.read()
        finally:
            conn.close()
        assert wait_until(lambda: failed_loads(serving.log(), "broken"), 60), serving.log()[-3000:]
        (record,) = failed_loads(serving.log(), "broken")
        assert record["role"] == "pool:default" and "live load" in record["msg"], record
        assert "raise OSError('weights missing')" in record["traceback"], record


def test_model_control_can_be_disabled(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    copy_example(repo, "echo")
    (repo / "settings.json").write_text(json.dumps({"model_control": False}))

    async def main(serving: Serving) -> None:
        async with grpc.aio.insecure_channel(serving.address) as channel:
            await wait_serving(channel)
            stub = Stub(channel)
            add_echo_copy(repo, "echo3")
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name="echo"))
            assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name="echo3"))
            assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "model_control" in (info.value.details() or "")
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.RepositoryModelUnload(pb.RepositoryModelUnloadRequest(model_name="echo"))
            assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert (await stub.ModelReady(pb.ModelReadyRequest(name="echo"))).ready

    with Serving(repo, tmp_path / "run") as serving:
        asyncio.run(main(serving))
