"""The whole inference service in-process, through a real grpc.aio server."""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc
import numpy as np
import pytest

from poolserve.protos import inference_pb2 as pb
from poolserve.protos import inference_pb2_grpc as pbg
from poolserve.service.contract.repository import scan
from poolserve.service.contract.settings import ServerSettings
from poolserve.service.inference.codec import decode_outputs, encode_inputs
from poolserve.service.poolserver.inprocess import InProcessServer

from support import BIN, copy_echo_any, copy_example, run_client, write_model

FAULTY = """
from poolserve.service import InvalidInput, Model

class Faulty(Model):
    def predict(self, inputs, parameters):
        if parameters.get("kind") == "invalid":
            raise InvalidInput("INPUT0 must be positive")
        raise ZeroDivisionError("boom")
"""

NOLOAD = """
from poolserve.service import Model

class NoLoad(Model):
    def load(self):
        raise RuntimeError("weights missing")
"""

Stub = pbg.GRPCInferenceServiceStub


def serve(repo: Path, body: Callable[[Stub, int], Awaitable[None]]) -> None:
    async def main() -> None:
        server = InProcessServer(scan(repo), ServerSettings())
        port = await server.start("127.0.0.1:0")
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                await body(Stub(channel), port)
        finally:
            await server.stop(0)

    asyncio.run(main())


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    for name in ("echo", "sleep"):
        copy_example(tmp_path, name)
    write_model(tmp_path, "faulty", {"implementation": "model.Faulty"}, FAULTY)
    return tmp_path


def request(model: str, raw: bool = True) -> pb.ModelInferRequest:
    req = pb.ModelInferRequest(model_name=model, id="r1")
    encode_inputs({"INPUT0": np.arange(16, dtype=np.float32).reshape(1, 16)}, req, raw=raw)
    return req


def test_infer_raw_and_typed_and_statistics(repo: Path) -> None:
    async def body(stub: Stub, _: int) -> None:
        assert (await stub.ServerReady(pb.ServerReadyRequest())).ready
        for raw in (True, False):
            reply = await stub.ModelInfer(request("echo", raw))
            assert reply.id == "r1"
            assert len(reply.raw_output_contents) == 1  # raw answers, as Triton's
            out = decode_outputs(reply)["OUTPUT0"]
            assert out.tolist() == [list(range(16))]
        stats = await stub.ModelStatistics(pb.ModelStatisticsRequest(name="echo"))
        s = stats.model_stats[0].inference_stats
        assert s.success.count == 2
        assert s.compute_infer.count == 2
        assert s.compute_input.ns > 0
        assert s.fail.count == 0
        everything = await stub.ModelStatistics(pb.ModelStatisticsRequest())
        assert {m.name for m in everything.model_stats} == {"echo", "sleep", "faulty"}

    serve(repo, body)


def test_errors_map_to_status_codes(repo: Path) -> None:
    async def code_of(call: Awaitable[object]) -> tuple[grpc.StatusCode, str]:
        try:
            await call
        except grpc.aio.AioRpcError as exc:
            return exc.code(), exc.details() or ""
        raise AssertionError("call succeeded")

    async def body(stub: Stub, _: int) -> None:
        code, msg = await code_of(stub.ModelInfer(request("nope")))
        assert code == grpc.StatusCode.NOT_FOUND and "nope" in msg
        bad = request("echo", raw=False)
        del bad.inputs[0].contents.fp32_contents[3:]
        code, msg = await code_of(stub.ModelInfer(bad))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "INPUT0" in msg
        code, msg = await code_of(stub.ModelInfer(request("faulty")))
        assert code == grpc.StatusCode.INTERNAL
        assert "ZeroDivisionError" in msg and "boom" in msg
        invalid = request("faulty")
        invalid.parameters["kind"].string_param = "invalid"
        code, msg = await code_of(stub.ModelInfer(invalid))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "positive" in msg
        code, _ = await code_of(stub.ModelMetadata(pb.ModelMetadataRequest(name="nope")))
        assert code == grpc.StatusCode.NOT_FOUND
        # the server is still fine
        assert (await stub.ModelInfer(request("echo"))).outputs[0].name == "OUTPUT0"
        stats = await stub.ModelStatistics(pb.ModelStatisticsRequest(name="faulty"))
        assert stats.model_stats[0].inference_stats.fail.count == 2

    serve(repo, body)


def test_metadata_and_config(repo: Path) -> None:
    async def body(stub: Stub, _: int) -> None:
        meta = await stub.ModelMetadata(pb.ModelMetadataRequest(name="echo"))
        assert [(t.name, t.datatype, list(t.shape)) for t in meta.inputs] == [
            ("INPUT0", "FP32", [-1, -1])
        ]
        config = (await stub.ModelConfig(pb.ModelConfigRequest(name="echo"))).config
        assert config.name == "echo"
        assert config.input[0].data_type == pb.TYPE_FP32
        assert list(config.input[0].dims) == [-1, -1]
        server = await stub.ServerMetadata(pb.ServerMetadataRequest())
        assert server.name == "poolserve" and server.version

    serve(repo, body)


def test_failed_load_keeps_server_not_ready(repo: Path) -> None:
    write_model(repo, "noload", {"implementation": "model.NoLoad"}, NOLOAD)
    (repo / "broken").mkdir()
    (repo / "broken" / "model-settings.json").write_text('{"implementation": 3}')

    async def body(stub: Stub, _: int) -> None:
        assert not (await stub.ServerReady(pb.ServerReadyRequest())).ready
        assert not (await stub.ModelReady(pb.ModelReadyRequest(name="noload"))).ready
        assert (await stub.ModelReady(pb.ModelReadyRequest(name="echo"))).ready
        index = await stub.RepositoryIndex(pb.RepositoryIndexRequest())
        states = {m.name: (m.state, m.reason) for m in index.models}
        assert states["noload"][0] == "UNAVAILABLE"
        assert "weights missing" in states["noload"][1]
        assert states["broken"][0] == "UNAVAILABLE"
        assert "implementation" in states["broken"][1]
        assert states["echo"] == ("READY", "")
        ready = await stub.RepositoryIndex(pb.RepositoryIndexRequest(ready=True))
        assert "noload" not in {m.name for m in ready.models}
        # the other models keep serving
        assert (await stub.ModelInfer(request("echo"))).outputs

    serve(repo, body)


def test_tritonclient_raw_typed_every_datatype(repo: Path) -> None:
    copy_echo_any(repo)  # the sweep's model: echo itself declares FP32 only

    async def body(stub: Stub, port: int) -> None:
        report = await asyncio.to_thread(run_client, "triton_echo.py", f"127.0.0.1:{port}")
        assert report["live"] and report["ready"]
        assert all(report["raw"].values()), report["raw"]
        assert len(report["raw"]) == 13
        assert all(report["typed"].values()), report["typed"]
        assert report["unknown_model"] == "StatusCode.NOT_FOUND"
        assert report["malformed"] == "StatusCode.INVALID_ARGUMENT"
        assert report["undeclared_datatype"] == [
            "StatusCode.INVALID_ARGUMENT",
            "inference input 'INPUT0' data-type is 'INT32', but model 'echo' expects 'FP32'",
        ]
        assert report["models"]["echo"]["config_name"] == "echo"
        assert report["models"]["echo"]["infer"]["typed_reads_as_raw"]
        assert report["model_ready"] == {"echo": True, "no-such-model": False}

    serve(repo, body)


def test_the_command_says_which_flags_it_has_no_use_for(repo: Path) -> None:
    """`serve-inprocess` is one process serving gRPC: a REST or metrics port (or
    routers, workers) asked for on its command line is said to be ignored."""
    argv = [str(BIN / "poolserve"), "serve-inprocess", str(repo), "--grpc-port", "0"]
    argv += ["--http-port", "0", "--metrics-port", "0"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stderr is not None
        line = proc.stdout.readline()  # printed once it serves: the warning came before
        assert line.startswith("poolserve: serving in-process on "), line
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=60)
    assert "serving gRPC only: --http-port, --metrics-port ignored" in err, err
