"""End to end: `poolserve serve` -> pool servers with pre-forked workers -> router.

Every test starts a real process tree over real sockets and kills every PID
it saw when it ends.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from poolserve.protos import inference_pb2 as pb
from poolserve.protos import inference_pb2_grpc as pbg
from poolserve.service.inference.codec import decode_outputs, encode_inputs

from harness import children_of, pid_alive
from serving import Serving, comm, wait_serving
from support import copy_echo_any, copy_example, run_client, train_iris, wait_until, write_model

pytestmark = pytest.mark.e2e

SLOW_LOAD = """
import os, time
from poolserve.service import Model

class SlowLoad(Model):
    def load(self):
        gate = self.settings.extra["gate"]
        while not os.path.exists(gate):   # the test opens the gate; no timing involved
            time.sleep(0.01)

    def predict(self, inputs, parameters):
        return {"OUTPUT0": inputs["INPUT0"]}
"""

NO_LOAD = """
from poolserve.service import Model

class NoLoad(Model):
    def load(self):
        raise RuntimeError("weights file is corrupt")
"""


def build_repo(root: Path) -> Path:
    """Four models: echo in the default pool, burn+sleep in 'heavy', iris in 'sklearn'."""
    repo = root / "repo"
    copy_example(repo, "echo")
    copy_echo_any(repo)  # every datatype, for tritonclient's sweep
    copy_example(repo, "burn", gid="heavy")
    copy_example(repo, "sleep", gid="heavy")
    iris = copy_example(repo, "iris")
    train_iris(iris)
    settings = json.loads((repo / "burn" / "model-settings.json").read_text())
    settings["parameters"]["extra"]["iterations"] = 20_000
    (repo / "burn" / "model-settings.json").write_text(json.dumps(settings))
    return repo


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Serving]:
    root = tmp_path_factory.mktemp("pipeline")
    with Serving(build_repo(root), root / "run") as serving:
        asyncio.run(wait_ready(serving.address))
        yield serving


async def wait_ready(address: str, timeout: float = 60.0) -> None:
    """Waits on the router's health Watch stream (push) for SERVING."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        stream = stub.Watch(health_pb2.HealthCheckRequest(service=""), timeout=timeout)
        async for reply in stream:
            if reply.status == health_pb2.HealthCheckResponse.SERVING:
                stream.cancel()
                return


def echo_request(payload: np.ndarray, raw: bool = True) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="echo")
    encode_inputs({"INPUT0": payload}, request, raw=raw)
    return request


def full_tree(serving: Serving, expected: int) -> bool:
    """Workers fork after models load; /proc offers no event, so this is polled."""
    tree = serving.tree()
    if len(tree) != expected or any(comm(p) == "python" for p in tree):
        return False
    # a worker is counted from its fork, but named only once it runs its own code
    zygotes = [p for p in tree if comm(p) == "poolserve-zyg"]
    return all(comm(w) == "poolserve-wrk" for z in zygotes for w in children_of(z))


def test_exact_process_tree(served: Serving) -> None:
    expected = 1 + 3 * (2 + 2)
    assert wait_until(lambda: full_tree(served, expected), timeout=30), served.tree()
    pools = children_of(served.pid)
    assert len(pools) == 4, [comm(p) for p in pools]  # 3 pool servers + 1 router
    pool_servers = [p for p in pools if children_of(p)]
    assert len(pool_servers) == 3
    for pool in pool_servers:
        (zygote,) = children_of(pool)
        assert comm(zygote) == "poolserve-zyg"
        workers = children_of(zygote)
        assert len(workers) == 2
        assert all(comm(w) == "poolserve-wrk" for w in workers)
        assert all(not children_of(w) for w in workers)
    assert len(served.tree()) == expected


def test_tritonclient_infers_every_model(served: Serving) -> None:
    report = run_client("triton_echo.py", served.address, "echo", "burn", "sleep", "iris")
    assert report["ready"]
    assert all(report["raw"].values()), report["raw"]
    assert all(report["typed"].values()), report["typed"]
    assert report["unknown_model"] == "StatusCode.NOT_FOUND"
    assert report["malformed"] == "StatusCode.INVALID_ARGUMENT"
    assert report["undeclared_datatype"][0] == "StatusCode.INVALID_ARGUMENT"
    for model in ("burn", "sleep"):
        result = report["models"][model]["infer"]
        assert result["raw_outputs"] == ["OUTPUT0"]
        assert result["typed_outputs"] == ["OUTPUT0"]
        assert result["typed_reads_as_raw"], model
    iris = report["models"]["iris"]["infer"]
    assert "predict" in iris["raw_outputs"]
    assert "predict" in iris["typed_outputs"]
    assert iris["typed_reads_as_raw"]
    assert report["model_ready"] == {"echo": True, "no-such-model": False}


def test_many_channels_each_call_gets_its_own_answer(served: Serving) -> None:
    async def channel_load(index: int) -> int:
        async with grpc.aio.insecure_channel(served.address) as channel:
            stub = pbg.GRPCInferenceServiceStub(channel)

            async def one(k: int) -> bool:
                payload = np.full((1, 16), index * 1000 + k, dtype=np.float32)
                reply = await stub.ModelInfer(echo_request(payload, raw=k % 2 == 0), timeout=60)
                return bool(np.array_equal(decode_outputs(reply)["OUTPUT0"], payload))

            results = await asyncio.gather(*(one(k) for k in range(50)))
            return sum(results)

    async def main() -> list[int]:
        return list(await asyncio.gather(*(channel_load(i) for i in range(20))))

    assert asyncio.run(main()) == [50] * 20


def test_router_statuses(served: Serving) -> None:
    async def main() -> None:
        async with grpc.aio.insecure_channel(served.address) as channel:
            stub = pbg.GRPCInferenceServiceStub(channel)
            assert (await stub.ServerLive(pb.ServerLiveRequest())).live
            assert (await stub.ServerReady(pb.ServerReadyRequest())).ready
            assert (await stub.ModelReady(pb.ModelReadyRequest(name="iris"))).ready
            index = await stub.RepositoryIndex(pb.RepositoryIndexRequest())
            assert {m.name: m.state for m in index.models} == {
                "echo": "READY",
                "echo_any": "READY",
                "burn": "READY",
                "sleep": "READY",
                "iris": "READY",
            }
            stats = await stub.ModelStatistics(pb.ModelStatisticsRequest())
            assert {s.name for s in stats.model_stats} == {
                "echo",
                "echo_any",
                "burn",
                "sleep",
                "iris",
            }
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.ModelInfer(pb.ModelInferRequest(model_name="ghost"))
            assert info.value.code() == grpc.StatusCode.NOT_FOUND
            assert "ghost" in (info.value.details() or "")
            garbage = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await garbage(b"\x0a\xff\xff\xff")
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            # and the router still serves
            assert (await stub.ModelInfer(echo_request(np.ones((1, 16), np.float32)))).outputs

    asyncio.run(main())


def test_ready_only_after_slow_model_loads(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    copy_example(repo, "echo")
    gate = tmp_path / "gate"
    write_model(
        repo,
        "slow",
        {
            "implementation": "model.SlowLoad",
            "parameters": {"inference_pool_gid": "slow", "extra": {"gate": str(gate)}},
        },
        SLOW_LOAD,
    )

    async def main(address: str) -> None:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = pbg.GRPCInferenceServiceStub(channel)
            assert not (await stub.ServerReady(pb.ServerReadyRequest())).ready
            index = await stub.RepositoryIndex(pb.RepositoryIndexRequest())
            assert {m.name: m.state for m in index.models}["slow"] == "LOADING"
            health = health_pb2_grpc.HealthStub(channel)
            check = await health.Check(health_pb2.HealthCheckRequest(service=""))
            assert check.status == health_pb2.HealthCheckResponse.NOT_SERVING
            gate.touch()
            await wait_ready(address)
            assert (await stub.ServerReady(pb.ServerReadyRequest())).ready

    with Serving(repo, tmp_path / "run") as serving:
        asyncio.run(main(serving.address))


def test_failed_load_keeps_not_ready_and_others_serve(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    copy_example(repo, "echo")
    write_model(
        repo,
        "broken",
        {"implementation": "model.NoLoad", "parameters": {"inference_pool_gid": "b"}},
        NO_LOAD,
    )

    async def main(address: str) -> None:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = pbg.GRPCInferenceServiceStub(channel)
            # the router answers before every pool has loaded: wait for echo's health,
            # not only for the connection (a call could find echo still LOADING)
            await wait_serving(channel, "model:echo")
            reply = await stub.ModelInfer(
                echo_request(np.ones((1, 16), np.float32)), wait_for_ready=True, timeout=60
            )
            assert reply.outputs[0].name == "OUTPUT0"

            async def broken_reason() -> str:
                index = await stub.RepositoryIndex(pb.RepositoryIndexRequest())
                states = {m.name: m for m in index.models}
                return states["broken"].reason if states["broken"].state == "UNAVAILABLE" else ""

            reason = await broken_reason()
            for _ in range(500):
                if reason:
                    break
                await asyncio.sleep(0.02)  # polling the index: no event exists to wait on
                reason = await broken_reason()
            assert "weights file is corrupt" in reason
            assert not (await stub.ServerReady(pb.ServerReadyRequest())).ready
            assert not (await stub.ModelReady(pb.ModelReadyRequest(name="broken"))).ready
            assert (await stub.ModelReady(pb.ModelReadyRequest(name="echo"))).ready

    with Serving(repo, tmp_path / "run") as serving:
        asyncio.run(main(serving.address))


def test_sigterm_stops_the_whole_tree(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    copy_example(repo, "echo")
    copy_example(repo, "sleep", gid="other")
    with Serving(repo, tmp_path / "run") as serving:
        asyncio.run(wait_ready(serving.address))
        tree = serving.tree()
        assert len(tree) == 1 + 2 * (2 + 2)
        code = serving.terminate(timeout=30)
        assert code == 0, serving.log()
        assert wait_until(lambda: not any(pid_alive(p) for p in tree), timeout=15)
        assert "Traceback" not in serving.log(), serving.log()
        assert not os.path.exists(tmp_path / "run" / "pool-default.sock")
