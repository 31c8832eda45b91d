"""MLServer's documentation examples, as a new user runs them (issue 30).

The streaming example's folder is written here as MLServer's docs give it: a
``settings.json`` with ``"parallel_workers": 0`` (MLServer streams custom
``predict_stream`` only so) and a text model whose ``predict_stream`` yields
one token per response, with no ``predict`` of its own.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from poolserve.protos import inference_pb2 as pb
from poolserve.protos import inference_pb2_grpc as pbg

from mlserver_peer import mlserver_serving
from serving import (
    Serving,
    pool_status,
    serve_as_settings_say,
    wait_idle_workers,
    wait_serving,
)
from support import CLIENTS, run_client, write_model

pytestmark = pytest.mark.e2e

WAIT = 90.0

TEXT_MODEL = """
import asyncio
from typing import AsyncIterator

from mlserver import MLModel
from mlserver.codecs import StringCodec
from mlserver.types import InferenceRequest, InferenceResponse


class TextModel(MLModel):
    async def predict_stream(
        self, payloads: AsyncIterator[InferenceRequest]
    ) -> AsyncIterator[InferenceResponse]:
        payload = [_ async for _ in payloads][0]
        text = StringCodec.decode_input(payload.inputs[0])[0]
        words = text.split(" ")

        split_text = []
        for i, word in enumerate(words):
            split_text.append(word if i == 0 else " " + word)

        for word in split_text:
            await asyncio.sleep(0.01)
            yield InferenceResponse(
                model_name=self._settings.name,
                outputs=[
                    StringCodec.encode_output(
                        name="output",
                        payload=[word],
                        use_bytes=True,
                    ),
                ],
            )
"""

SUM_MODEL = """
import json

import numpy as np
from mlserver import MLModel
from mlserver.codecs import NumpyCodec
from mlserver.errors import InferenceError
from mlserver.types import InferenceRequest, InferenceResponse


class SumModel(MLModel):
    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        given = NumpyCodec.decode_input(payload.inputs[0])
        if (given < 0).any():
            raise InferenceError("negative input")
        if (given == 13).any():
            json.dumps({"x": b"13"})  # TypeError: Object of type bytes is not JSON serializable
        total = given.sum(keepdims=True)
        return InferenceResponse(
            model_name=self.name,
            model_version=self.version,
            outputs=[NumpyCodec.encode_output("total", total)],
        )
"""

PROMPT = "What is the capital of France?"
TOKENS = ["What", " is", " the", " capital", " of", " France?"]


def streaming_example(repo: Path) -> Path:
    """MLServer's docs/examples/streaming folder, unchanged but for a shorter sleep."""
    (repo / "settings.json").parent.mkdir(parents=True, exist_ok=True)
    (repo / "settings.json").write_text(
        json.dumps(
            {
                "debug": False,
                "parallel_workers": 0,
                "gzip_enabled": False,
                "metrics_endpoint": None,
            }
        )
    )
    folder = write_model(
        repo,
        "text-model",
        {
            "name": "text-model",
            "implementation": "text_model.TextModel",
            "versions": ["text-model/v1.2.3"],
            "platform": "mlserver",
            "inputs": [{"datatype": "BYTES", "name": "prompt", "shape": [1]}],
            "outputs": [{"datatype": "BYTES", "name": "output", "shape": [1]}],
        },
    )
    (folder / "text_model.py").write_text(TEXT_MODEL)
    # beside it, a model with a version and content types (as MLServer's docs write them)
    folder = write_model(
        repo,
        "sum-model",
        {
            "name": "sum-model",
            "implementation": "sum_model.SumModel",
            "versions": ["sum-model/v1.2.3"],
            "parameters": {"version": "v1.2.3", "content_type": "np"},
            "inputs": [
                {
                    "name": "a",
                    "datatype": "FP32",
                    "shape": [-1],
                    "parameters": {"content_type": "np"},
                }
            ],
            "outputs": [
                {
                    "name": "total",
                    "datatype": "FP32",
                    "shape": [1],
                    "parameters": {"content_type": "np"},
                }
            ],
        },
    )
    (folder / "sum_model.py").write_text(SUM_MODEL)
    return repo


def prompt_request(text: str = PROMPT, request_id: str = "p1") -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="text-model", id=request_id)
    given = request.inputs.add(name="prompt", datatype="BYTES", shape=[1])
    given.contents.bytes_contents.append(text.encode())
    return request


def serve(repo: Path, run_dir: Path, env: dict[str, str] | None = None) -> Serving:
    """``poolserve serve`` on the folder, its settings.json deciding the workers
    (the folder says parallel_workers 0)."""
    return serve_as_settings_say(repo, run_dir, ("text-model", "sum-model"), env, WAIT)


@pytest.fixture(scope="module")
def streaming(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Serving]:
    """The folder served with KServe's stream messages (``stream_messages:
    "kserve"``, from its POOLSERVE_ variable): its streams are read with
    KServe's stubs (poolserve's, tritonclient's) here; the default ("auto")
    answers MLServer's for these models (tests/test_mlserver_readme_examples.py)."""
    root = tmp_path_factory.mktemp("streaming")
    env = {"POOLSERVE_STREAM_MESSAGES": "kserve"}
    serving = serve(streaming_example(root / "repo"), root / "run", env)
    try:
        yield serving
    finally:
        serving.__exit__(None, None, None)


async def kserve_stream(
    address: str, requests: list[pb.ModelInferRequest]
) -> list[pb.ModelStreamInferResponse]:
    async with grpc.aio.insecure_channel(address) as channel:
        call = pbg.GRPCInferenceServiceStub(channel).ModelStreamInfer(iter(requests), timeout=60)
        return [reply async for reply in call]


def tokens_of(replies: list[pb.ModelStreamInferResponse]) -> list[str]:
    return [r.infer_response.outputs[0].contents.bytes_contents[0].decode() for r in replies]


# -- 1. an inline MLModel's predict_stream streams ------------------------------------


def test_inline_streaming_example_streams_tokens(streaming: Serving) -> None:
    """parallel_workers 0 in settings.json (inline, in the pool server's
    process): the class's predict_stream answers ModelStreamInfer, one
    response per token."""
    assert not asyncio.run(pool_status(streaming)).workers  # inline: no worker at all
    replies = asyncio.run(kserve_stream(streaming.address, [prompt_request()]))
    assert [r.error_message for r in replies] == [""] * len(TOKENS)
    assert tokens_of(replies) == TOKENS
    assert {r.infer_response.id for r in replies} == {"p1"}
    assert {r.infer_response.model_name for r in replies} == {"text-model"}
    # two requests on one stream: each streams in turn
    two = asyncio.run(
        kserve_stream(streaming.address, [prompt_request("a b", "x"), prompt_request("c", "y")])
    )
    assert [(r.infer_response.id, *tokens_of([r])) for r in two] == [
        ("x", "a"),
        ("x", " b"),
        ("y", "c"),
    ]


def test_inline_stream_error_and_statistics(streaming: Serving) -> None:
    """A request the model cannot read ends that request's stream with its
    error; the next request streams; statistics count each stream once."""
    bad = pb.ModelInferRequest(model_name="text-model", id="bad")
    replies = asyncio.run(kserve_stream(streaming.address, [bad, prompt_request("ok", "good")]))
    # the text as MLServer's inline models say it: the exception's message
    assert replies[0].error_message == "INTERNAL: list index out of range", replies[0]
    assert tokens_of(replies[1:]) == ["ok"]

    async def stats() -> pb.ModelStatisticsResponse:
        async with grpc.aio.insecure_channel(streaming.address) as channel:
            return await pbg.GRPCInferenceServiceStub(channel).ModelStatistics(
                pb.ModelStatisticsRequest(name="text-model"), timeout=30
            )

    inference = asyncio.run(stats()).model_stats[0].inference_stats
    assert inference.success.count >= 1 and inference.fail.count >= 1


# -- 2. MLServer's stream messages (setting stream_messages) ---------------------------


@pytest.fixture(scope="module")
def mlserver_streams(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Serving]:
    """The same folder, unchanged, served with MLServer's stream messages (the
    server setting ``stream_messages``, here from its POOLSERVE_ variable)."""
    root = tmp_path_factory.mktemp("streaming-mlserver")
    env = {"POOLSERVE_STREAM_MESSAGES": "mlserver"}
    serving = serve(streaming_example(root / "repo"), root / "run", env)
    try:
        yield serving
    finally:
        serving.__exit__(None, None, None)


def test_mlserver_stubs_stream_with_mlserver_stream_messages(mlserver_streams: Serving) -> None:
    """MLServer's generated stubs (its example's client) read each message as
    a ModelInferResponse: they get the tokens, with the request's id."""
    got = run_client("mlserver_stream.py", mlserver_streams.address, "text-model", PROMPT)
    assert got == {"tokens": TOKENS, "ids": ["r0"] * len(TOKENS), "status": None}
    got = run_client("mlserver_stream.py", mlserver_streams.address, "text-model", "a b", "c")
    assert got == {"tokens": ["a", " b", "c"], "ids": ["r0", "r0", "r1"], "status": None}


def test_mlserver_stream_errors_end_the_stream_with_a_status(mlserver_streams: Serving) -> None:
    """As MLServer: an error ends the stream with its gRPC status (no
    ModelStreamInferResponse.error_message in MLServer's messages), after the
    responses already sent; an unknown model too."""
    got = run_client(
        "mlserver_stream.py", mlserver_streams.address, "text-model", "a", "<no inputs>", "b"
    )
    assert got["tokens"] == ["a"]
    assert got["status"] == ["INTERNAL", "list index out of range"], got
    got = run_client("mlserver_stream.py", mlserver_streams.address, "nobody", "a")
    assert got["tokens"] == [] and got["status"][0] == "NOT_FOUND", got


def test_kserve_stream_messages_when_set(streaming: Serving) -> None:
    """With ``stream_messages: "kserve"``, the same folder streams to
    tritonclient (Triton's ModelStreamInferResponse), and MLServer's stubs get
    no outputs: the example's client fails with IndexError reading them."""
    got = run_client("triton_stream.py", streaming.address, "text-model", PROMPT, "x y")
    assert got == {
        "tokens": [*TOKENS, "x", " y"],
        "ids": ["r0"] * len(TOKENS) + ["r1", "r1"],
        "errors": [],
    }
    proc = subprocess.run(
        [
            sys.executable,
            "-P",
            str(CLIENTS / "mlserver_stream.py"),
            streaming.address,
            "text-model",
            "a",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode != 0 and "IndexError" in proc.stderr


def test_stream_messages_setting_is_checked(tmp_path: Path) -> None:
    from poolserve.service.contract.settings import ConfigError, load_server_settings

    (tmp_path / "settings.json").write_text(json.dumps({"stream_messages": "mlserver"}))
    assert load_server_settings(tmp_path, environ={}).stream_messages == "mlserver"
    assert load_server_settings(tmp_path / "..", environ={}).stream_messages == "auto"
    with pytest.raises(ConfigError, match="expected 'auto', 'kserve' or 'mlserver'"):
        load_server_settings(tmp_path, environ={"POOLSERVE_STREAM_MESSAGES": "triton"})


# -- 3. MLServer's model repository service ---------------------------------------------


def test_mlserver_model_repository_service(streaming: Serving) -> None:
    """inference.model_repository.ModelRepositoryService, through MLServer's own
    generated stub: the index with MLServer's state names, unload and load
    through the same model control as the Open Inference Protocol's calls."""
    got = run_client(
        "mlserver_repository.py",
        streaming.address,
        "index",
        "unload:text-model",
        "index",
        "ready-index",
        "load:text-model",
        "index",
        "ready-index",
        "load:nobody",
        "unload:nobody",
    )
    # no version: an MLServer model without parameters.version, as MLServer lists it
    # the states as MLServer 1.7.1's gRPC writes them (its enum's str())
    ready = ["text-model", "", "State.READY", ""]
    summed = ["sum-model", "v1.2.3", "State.READY", ""]
    assert got[:2] == [[summed, ready], "unloaded"]
    # MLServer: no UNLOADED, and no reason
    assert got[2][1] == ["text-model", "", "State.UNAVAILABLE", ""]
    assert got[3:7] == [[summed], "loaded", [summed, ready], [summed, ready]]
    assert got[7][0] == "NOT_FOUND" and got[8][0] == "NOT_FOUND", got
    # the model streams again after its reload
    replies = asyncio.run(kserve_stream(streaming.address, [prompt_request("again", "z")]))
    assert tokens_of(replies) == ["again"]


# -- 4. ModelMetadata of MLServer models, as MLServer answers it ------------------------


@pytest.fixture(scope="module")
def mlserver(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """MLServer 1.7.1 itself (``mlserver start`` of this environment) on the same folder."""
    root = tmp_path_factory.mktemp("streaming-peer")
    repo = streaming_example(root / "repo")
    with mlserver_serving(repo, root / "mlserver.log", "text-model", "sum-model") as address:
        yield address


async def raw_call(address: str, method: str, request: bytes) -> bytes | tuple[str, str]:
    """A unary call's reply bytes, or its status (code name, details)."""
    async with grpc.aio.insecure_channel(address) as channel:
        call = channel.unary_unary(f"/inference.GRPCInferenceService/{method}")
        try:
            return bytes(await call(request, timeout=60))
        except grpc.aio.AioRpcError as exc:
            return exc.code().name, str(exc.details())


def test_model_metadata_as_mlserver_answers_it(streaming: Serving, mlserver: str) -> None:
    """Byte for byte MLServer's answer: its versions (the settings' ``versions``,
    "sum-model/v1.2.3"), its platform, the tensors' content_type parameters
    (and the model's), no version or platform where the settings have none."""
    for name, version in (("text-model", ""), ("sum-model", ""), ("sum-model", "v1.2.3")):
        request = pb.ModelMetadataRequest(name=name, version=version).SerializeToString()
        ours = asyncio.run(raw_call(streaming.address, "ModelMetadata", request))
        theirs = asyncio.run(raw_call(mlserver, "ModelMetadata", request))
        assert ours == theirs, (name, version, ours, theirs)
    request = pb.ModelMetadataRequest(name="sum-model").SerializeToString()
    reply = asyncio.run(raw_call(streaming.address, "ModelMetadata", request))
    assert isinstance(reply, bytes)
    metadata = pb.ModelMetadataResponse.FromString(reply)
    assert list(metadata.versions) == ["sum-model/v1.2.3"] and metadata.platform == ""
    request = pb.ModelMetadataRequest(name="text-model").SerializeToString()
    reply = asyncio.run(raw_call(streaming.address, "ModelMetadata", request))
    assert isinstance(reply, bytes)
    metadata = pb.ModelMetadataResponse.FromString(reply)
    assert list(metadata.versions) == ["text-model/v1.2.3"] and metadata.platform == "mlserver"


def test_same_predictions_as_mlserver(streaming: Serving, mlserver: str) -> None:
    request = pb.ModelInferRequest(model_name="sum-model", model_version="v1.2.3", id="s")
    given = request.inputs.add(name="a", datatype="FP32", shape=[3])
    given.contents.fp32_contents.extend([1.0, 2.0, 3.5])
    body = request.SerializeToString()
    ours = asyncio.run(raw_call(streaming.address, "ModelInfer", body))
    theirs = asyncio.run(raw_call(mlserver, "ModelInfer", body))
    assert isinstance(ours, bytes) and ours == theirs
    assert pb.ModelInferResponse.FromString(ours).outputs[0].contents.fp32_contents == [6.5]


# -- 5. versions a model does not have ---------------------------------------------------


def test_wrong_versions_as_mlserver_answers_them(streaming: Serving, mlserver: str) -> None:
    """NOT_FOUND with MLServer's text, for a model without a version asked for
    one (the issue's "v1.2.3") and for one with another version."""
    calls = []
    for name, version in (("text-model", "v1.2.3"), ("sum-model", "v9"), ("sum-model", "2")):
        calls.append(("ModelMetadata", pb.ModelMetadataRequest(name=name, version=version)))
        request = pb.ModelInferRequest(model_name=name, model_version=version)
        given = request.inputs.add(name="a", datatype="FP32", shape=[1])
        given.contents.fp32_contents.append(1.0)
        calls.append(("ModelInfer", request))
    for method, message in calls:
        body = message.SerializeToString()
        ours = asyncio.run(raw_call(streaming.address, method, body))
        theirs = asyncio.run(raw_call(mlserver, method, body))
        assert ours == theirs, (method, message, ours, theirs)
    assert asyncio.run(
        raw_call(streaming.address, *("ModelInfer", calls[1][1].SerializeToString()))
    ) == (
        "NOT_FOUND",
        "Model text-model with version v1.2.3 not found",
    )


# -- 7. errors of MLServer models, in MLServer's words ------------------------------------


def sum_request(values: list[float], datatype: str = "FP32") -> bytes:
    request = pb.ModelInferRequest(model_name="sum-model")
    given = request.inputs.add(name="a", datatype=datatype, shape=[len(values)])
    given.contents.fp32_contents.extend(values)
    return request.SerializeToString()


def test_errors_as_mlserver_answers_them_inline(streaming: Serving, mlserver: str) -> None:
    """parallel_workers 0 on both sides: an MLServerError keeps its status and
    text, another exception is INTERNAL with its text, as MLServer's inline
    models answer; an invalid datatype is INVALID_ARGUMENT here with MLServer's
    text, where MLServer says INTERNAL (a mistake: listed in the guide)."""
    for values in ([1.0, -2.0], [13.0]):
        ours = asyncio.run(raw_call(streaming.address, "ModelInfer", sum_request(values)))
        theirs = asyncio.run(raw_call(mlserver, "ModelInfer", sum_request(values)))
        assert ours == theirs, (values, ours, theirs)
    assert ours == ("INTERNAL", "Object of type bytes is not JSON serializable")
    bad = sum_request([1.0], datatype="INT322")
    ours = asyncio.run(raw_call(streaming.address, "ModelInfer", bad))
    theirs = asyncio.run(raw_call(mlserver, "ModelInfer", bad))
    assert isinstance(ours, tuple) and isinstance(theirs, tuple)
    assert (ours[0], theirs[0]) == ("INVALID_ARGUMENT", "INTERNAL"), (ours, theirs)
    assert ours[1] == theirs[1] and "INT322" in ours[1]


# -- 6. no warm-up surprise for a custom runtime -----------------------------------------

COUNTER = """
import os

from mlserver import MLModel
from mlserver.codecs import NumpyCodec
from mlserver.types import InferenceRequest, InferenceResponse


class Counter(MLModel):
    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        with open(self.settings.parameters.extra["calls"], "a") as calls:
            calls.write(f"{os.getpid()} {payload.id}\\n")  # a side effect: an audit log
        given = NumpyCodec.decode_input(payload.inputs[0])
        return InferenceResponse(
            model_name=self.name, outputs=[NumpyCodec.encode_output("y", given + 1)]
        )
"""


def test_custom_runtime_sees_only_the_clients_requests(tmp_path: Path) -> None:
    """Each fresh worker's self-test does not call a custom MLModel's predict
    on zeros: its audit log shows the client's one request, not the warm-ups."""
    repo = tmp_path / "repo"
    for name, extra in (("counter", {}), ("warmed", {"warmup": True})):
        write_model(
            repo,
            name,
            {
                "name": name,
                "implementation": "model.Counter",
                "parameters": {"extra": {"calls": str(tmp_path / f"{name}.log"), **extra}},
                "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1]}],
            },
            COUNTER,
        )
    with Serving(repo, tmp_path / "run", workers=2) as serving:

        async def main() -> pb.ModelInferResponse:
            async with grpc.aio.insecure_channel(serving.address) as channel:
                await wait_serving(channel, "model:counter", timeout=WAIT)
                await wait_idle_workers(serving, "default", 2, timeout=WAIT)
                request = pb.ModelInferRequest(model_name="counter", id="client-1")
                given = request.inputs.add(name="x", datatype="FP32", shape=[1])
                given.contents.fp32_contents.append(1.0)
                stub = pbg.GRPCInferenceServiceStub(channel)
                return await stub.ModelInfer(request, timeout=60)

        reply = asyncio.run(main())
        assert reply.outputs[0].contents.fp32_contents == [2.0]
        counted = (tmp_path / "counter.log").read_text().splitlines()
        assert [line.split()[1] for line in counted] == ["client-1"]
        # asked for (parameters.extra.warmup true): each fresh worker's self-test runs it
        warmed = (tmp_path / "warmed.log").read_text().splitlines()
        assert len(warmed) == 2 and len({line.split()[0] for line in warmed}) == 2
        assert "model counter: self-test in each fresh worker: no warm-up" in serving.log()


async def raw_stream(address: str, request: bytes) -> tuple[list[bytes], tuple[str, str] | None]:
    """A one-request ModelStreamInfer: the messages' bytes, and its status if not OK."""
    got: list[bytes] = []
    async with grpc.aio.insecure_channel(address) as channel:
        method = channel.stream_stream("/inference.GRPCInferenceService/ModelStreamInfer")
        call = method(iter([request]), timeout=60)
        try:
            async for reply in call:
                got.append(bytes(reply))
        except grpc.aio.AioRpcError as exc:
            return got, (exc.code().name, str(exc.details()))
    return got, None


def test_mlserver_stream_messages_are_mlserver_s_bytes(
    mlserver_streams: Serving, mlserver: str
) -> None:
    """With stream_messages "mlserver", the same messages as MLServer's own
    ModelStreamInfer, byte for byte, and the same status for an error."""
    for request in (
        prompt_request(PROMPT, "b1"),
        pb.ModelInferRequest(model_name="text-model", id="b2"),  # no input: IndexError
    ):
        body = request.SerializeToString()
        ours = asyncio.run(raw_stream(mlserver_streams.address, body))
        theirs = asyncio.run(raw_stream(mlserver, body))
        assert ours == theirs
    assert ours == ([], ("INTERNAL", "list index out of range"))
