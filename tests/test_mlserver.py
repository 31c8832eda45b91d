"""MLServer models served unchanged (service/runtimes/mlmodel.py), with real
workers and the real MLServer 1.7.1 of the test extra.

One tree serves, in one pool (one zygote): a custom ``mlserver.MLModel``
using ``decode_args``, ``mlserver_sklearn.SKLearnModel`` on a joblib model
trained here, the example folder examples/mlserver/wordcount as it is, an
MLModel whose load raises, one whose load returns False, and a native
poolserve model beside them. The last tests send the same requests to
MLServer 1.7.1 itself (``mlserver start``, the one the [mlserver] extra puts
in this environment: tests/mlserver_peer.py) serving the same folders and
want the same replies.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import joblib
import numpy as np
import pytest
import requests
from google.protobuf.message import Message
from sklearn.datasets import load_iris
from sklearn.linear_model import LogisticRegression

from poolserve.protos import inference_pb2 as pb
from poolserve.protos import inference_pb2_grpc as pbg
from poolserve.protos import model_repository_pb2 as mr

from mlserver_peer import PEER_HTTP, mlserver_serving
from serving import Serving, wait_serving
from support import ROOT, copy_example, wait_until, write_model

pytestmark = pytest.mark.e2e

WAIT = 90.0

CUSTOM = """
from typing import List

import numpy as np
from mlserver import MLModel
from mlserver.codecs import decode_args
from mlserver.errors import InferenceError


class Scaler(MLModel):
    async def load(self) -> bool:
        self.scale = float(self.settings.parameters.extra["scale"])
        return True

    @decode_args
    async def predict(self, x: np.ndarray, tag: List[str]) -> np.ndarray:
        if (x < 0).any():
            raise InferenceError(f"negative input for {tag[0]}")
        if (x == 13).any():
            raise ValueError("unlucky number")
        return x * self.scale + len(tag[0])
"""

BROKEN = """
from mlserver import MLModel


class Broken(MLModel):
    async def load(self) -> bool:
        raise RuntimeError("no weights in " + self.settings.parameters.uri)
"""

SLEEPY = """
import asyncio

from mlserver import MLModel
from mlserver.types import InferenceRequest, InferenceResponse


class Sleepy(MLModel):
    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        await asyncio.sleep(60)
        return InferenceResponse(model_name=self.name, outputs=[])
"""

TOKENS = """
from typing import AsyncIterator

from mlserver import MLModel
from mlserver.codecs import StringCodec
from mlserver.errors import InferenceError
from mlserver.types import InferenceRequest, InferenceResponse


class Tokens(MLModel):
    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        text = StringCodec.decode_input(payload.inputs[0])[0]
        return InferenceResponse(
            model_name=self.name, outputs=[StringCodec.encode_output("token", text.split())]
        )

    async def predict_stream(
        self, payloads: AsyncIterator[InferenceRequest]
    ) -> AsyncIterator[InferenceResponse]:
        async for payload in payloads:
            text = StringCodec.decode_input(payload.inputs[0])[0]
            for i, token in enumerate(text.split()):
                if token == "boom":
                    raise InferenceError(f"cannot say {token} at {i}")
                if token == "crash":
                    raise ValueError(f"crashed at {i}")
                yield InferenceResponse(
                    model_name=self.name,
                    outputs=[StringCodec.encode_output("token", [token])],
                )
"""

TICKER = """
import asyncio
from pathlib import Path
from typing import AsyncIterator

from mlserver import MLModel
from mlserver.codecs import NumpyCodec
from mlserver.types import InferenceRequest, InferenceResponse
import numpy as np


class Ticker(MLModel):
    async def predict_stream(
        self, payloads: AsyncIterator[InferenceRequest]
    ) -> AsyncIterator[InferenceResponse]:
        payload = await payloads.__anext__()
        marker = Path(self.settings.parameters.extra["marker"]) / str(payload.id)
        tick = 0
        try:
            while True:
                yield InferenceResponse(
                    model_name=self.name,
                    outputs=[NumpyCodec.encode_output("tick", np.array([tick]))],
                )
                tick += 1
                await asyncio.sleep(0.02)
        except GeneratorExit:
            marker.write_text(f"closed after {tick}")
            raise
"""

STREAM_ONLY = """
from typing import AsyncIterator

from mlserver import MLModel
from mlserver.types import InferenceRequest, InferenceResponse


class StreamOnly(MLModel):
    async def predict_stream(
        self, payloads: AsyncIterator[InferenceRequest]
    ) -> AsyncIterator[InferenceResponse]:
        async for payload in payloads:
            yield InferenceResponse(model_name=self.name, outputs=[])
"""

MORPH_UNARY = """
from mlserver import MLModel
from mlserver.codecs import StringCodec
from mlserver.types import InferenceRequest, InferenceResponse


class Morph(MLModel):
    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        text = StringCodec.decode_input(payload.inputs[0])[0]
        return InferenceResponse(
            model_name=self.name, outputs=[StringCodec.encode_output("token", [text])]
        )
"""

# the same class, now streaming one response per word: a live reload turns it decoupled
MORPH_STREAM = (
    "from typing import AsyncIterator\n"
    + MORPH_UNARY
    + """
    async def predict_stream(
        self, payloads: AsyncIterator[InferenceRequest]
    ) -> AsyncIterator[InferenceResponse]:
        async for payload in payloads:
            for word in StringCodec.decode_input(payload.inputs[0])[0].split():
                yield InferenceResponse(
                    model_name=self.name, outputs=[StringCodec.encode_output("token", [word])]
                )
"""
)

HOOKS = """
from fastapi import Header, Request
from mlserver import MLModel
from mlserver.errors import InferenceError
from mlserver.handlers import custom_handler


class Hooks(MLModel):
    async def load(self) -> bool:
        self.prefix = self.settings.parameters.extra["prefix"]
        return True

    @custom_handler(rest_path="/invocations")
    async def invocations(self, request: Request, content_type: str = Header(None)) -> dict:
        doc = await request.json()
        return {"prefix": self.prefix, "got": doc, "content_type": content_type}

    @custom_handler(rest_path="/hooks/{item}", rest_method="GET")
    async def item(self, item: str, n: int = 1) -> dict:
        if item == "bad":
            raise InferenceError(f"no item {item}")
        return {"item": item * n}
"""

INLINE_HOOKS = """
from mlserver import MLModel
from mlserver.handlers import custom_handler


class InlineHooks(MLModel):
    @custom_handler(rest_path="/inline/{x}", rest_method="PUT")
    def put(self, x: int, body: dict) -> dict:  # a plain def: FastAPI runs it on a thread
        return {"x": x + 1, "body": body, "name": self.name}
"""

NOT_READY = """
from mlserver import MLModel


class NotReady(MLModel):
    async def load(self) -> bool:
        return False
"""


def mlserver_folders(repo: Path) -> list[str]:
    """The folders both servers get: MLServer models only."""
    write_model(
        repo,
        "scaler",
        {
            "name": "scaler",
            "implementation": "model.Scaler",
            "parameters": {"extra": {"scale": 2.5}},
            "inputs": [
                {"name": "x", "datatype": "FP32", "shape": [-1]},
                {
                    "name": "tag",
                    "datatype": "BYTES",
                    "shape": [1],
                    "parameters": {"content_type": "str"},
                },
            ],
        },
        CUSTOM,
    )
    iris = repo / "iris"
    iris.mkdir(parents=True)
    data = load_iris()
    joblib.dump(LogisticRegression(max_iter=500).fit(data.data, data.target), iris / "m.joblib")
    (iris / "model-settings.json").write_text(
        json.dumps(
            {
                "name": "iris",
                "implementation": "mlserver_sklearn.SKLearnModel",
                # relative: resolved against the model's folder, as MLServer does
                "parameters": {"uri": "./m.joblib", "version": "v2"},
            }
        )
    )
    shutil.copytree(
        ROOT / "examples" / "mlserver" / "wordcount",
        repo / "wordcount",
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    write_model(
        repo,
        "tokens",
        {
            "name": "tokens",
            "implementation": "model.Tokens",  # no poolserve setting: the class streams
            "inputs": [
                {
                    "name": "text",
                    "datatype": "BYTES",
                    "shape": [1],
                    "parameters": {"content_type": "str"},
                }
            ],
        },
        TOKENS,
    )
    write_model(  # MLServer's custom REST endpoints (@custom_handler)
        repo,
        "hooks",
        {
            "name": "hooks",
            "implementation": "model.Hooks",
            "parameters": {"extra": {"prefix": "p"}},
        },
        HOOKS,
    )
    return list(MODELS)


MODELS = ("scaler", "iris", "wordcount", "tokens", "hooks")  # mlserver_folders' models


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Serving]:
    root = tmp_path_factory.mktemp("mlserver")
    repo = root / "repo"
    mlserver_folders(repo)
    write_model(
        repo,
        "broken",
        {"name": "broken", "implementation": "model.Broken", "parameters": {"uri": "w.bin"}},
        BROKEN,
    )
    write_model(
        repo, "notready", {"name": "notready", "implementation": "model.NotReady"}, NOT_READY
    )
    write_model(repo, "sleepy", {"name": "sleepy", "implementation": "model.Sleepy"}, SLEEPY)
    (root / "closed").mkdir()
    write_model(
        repo,
        "ticker",
        {
            "name": "ticker",
            "implementation": "model.Ticker",
            "parameters": {"extra": {"decoupled": True, "marker": str(root / "closed")}},
        },
        TICKER,
    )
    write_model(  # no decoupled setting, no predict: streams, refuses ModelInfer
        repo,
        "streamonly",
        {"name": "streamonly", "implementation": "model.StreamOnly"},
        STREAM_ONLY,
    )
    write_model(
        repo,
        "morph",
        {
            "name": "morph",
            "implementation": "model.Morph",
            "inputs": [{"name": "text", "datatype": "BYTES", "shape": [1]}],
        },
        MORPH_UNARY,
    )
    write_model(  # inline: its custom endpoint runs in the pool process
        repo,
        "inlinehooks",
        {"name": "inlinehooks", "implementation": "model.InlineHooks", "parallel_workers": 0},
        INLINE_HOOKS,
    )
    write_model(  # inline (runs in the pool process): streams there
        repo,
        "inlinetokens",
        {"name": "inlinetokens", "implementation": "model.Tokens", "parallel_workers": 0},
        TOKENS,
    )
    copy_example(repo, "echo")  # a native model in the same pool, so the same zygote
    # an MLServer repository's settings.json: read, with a notice for what is not supported
    (repo / "settings.json").write_text(
        json.dumps({"debug": True, "http_port": 8080, "metrics_port": 8082, "host": "127.0.0.1"})
    )
    # its streams are read with KServe's stubs (tritonclient's, poolserve's): the
    # setting that keeps KServe's messages for MLServer models too (default "auto")
    kserve = {"POOLSERVE_STREAM_MESSAGES": "kserve"}
    with Serving(repo, root / "run", workers=2, env=kserve) as serving:

        async def ready() -> None:
            async with grpc.aio.insecure_channel(serving.address) as channel:
                for name in (
                    "scaler",
                    "iris",
                    "wordcount",
                    "tokens",
                    "ticker",
                    "streamonly",
                    "morph",
                    "inlinetokens",
                    "hooks",
                    "inlinehooks",
                    "echo",
                    "sleepy",
                ):
                    await wait_serving(channel, f"model:{name}", timeout=WAIT)

        asyncio.run(ready())
        yield serving


def scaler_request(x: list[float], tag: str = "ab", request_id: str = "r1") -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="scaler", id=request_id)
    request.inputs.add(name="x", datatype="FP32", shape=[len(x)])
    request.raw_input_contents.append(np.asarray(x, dtype=np.float32).tobytes())
    tag_input = request.inputs.add(name="tag", datatype="BYTES", shape=[1])
    tag_input.parameters["content_type"].string_param = "str"
    request.raw_input_contents.append(len(tag).to_bytes(4, "little") + tag.encode())
    return request


def iris_request(rows: np.ndarray) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="iris", id="iris-1")
    request.inputs.add(name="features", datatype="FP64", shape=list(rows.shape))
    request.raw_input_contents.append(rows.astype(np.float64).tobytes())
    request.outputs.add(name="predict")
    request.outputs.add(name="predict_proba")
    return request


def wordcount_request() -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="wordcount", id="wc-1")
    text = request.inputs.add(name="text", datatype="BYTES", shape=[3])
    text.contents.bytes_contents.extend([b"Hello big World", b"one", b"a b c d"])
    return request


async def call(address: str, request: pb.ModelInferRequest) -> pb.ModelInferResponse:
    async with grpc.aio.insecure_channel(address) as channel:
        reply: pb.ModelInferResponse = await pbg.GRPCInferenceServiceStub(channel).ModelInfer(
            request, timeout=30
        )
        return reply


async def call_error(address: str, request: pb.ModelInferRequest) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call(address, request)
    return info.value.code(), info.value.details() or ""


def raw_output(reply: pb.ModelInferResponse, name: str, dtype: str) -> np.ndarray:
    names = [o.name for o in reply.outputs]
    index = names.index(name)
    shape = tuple(reply.outputs[index].shape)
    return np.frombuffer(reply.raw_output_contents[index], dtype=dtype).reshape(shape)


def test_poolserve_protos_and_mlserver_import_in_one_process() -> None:
    """Before the private descriptor pool: duplicate symbol 'inference.ServerLiveRequest'."""
    code = (
        "import poolserve.protos.inference_pb2 as pb, poolserve.protos.control_pb2\n"
        "import mlserver\n"
        "from mlserver.grpc import dataplane_pb2 as mpb\n"
        "r = pb.ModelInferRequest(model_name='m', id='7')\n"
        "assert mpb.ModelInferRequest.FromString(r.SerializeToString()).id == '7'\n"
        "s = pb.DESCRIPTOR.services_by_name['GRPCInferenceService']\n"
        "assert s.full_name == 'inference.GRPCInferenceService'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]


def test_poolserve_core_never_imports_mlserver() -> None:
    """mlserver is imported by a process only when one of its models subclasses MLModel."""
    code = (
        "import sys\n"
        "import poolserve.service.inference.cargo, poolserve.service.inference.infer\n"
        "import poolserve.service.poolserver.server, poolserve.service.router.router\n"
        "import poolserve.service.runtimes, poolserve.supervisor.cli\n"
        "assert not [m for m in sys.modules if m.split('.')[0] == 'mlserver'], 'mlserver'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]


def test_custom_mlmodel_with_decode_args(served: Serving) -> None:
    reply = asyncio.run(call(served.address, scaler_request([1.0, 2.0, 4.0], tag="abc")))
    assert reply.model_name == "scaler" and reply.id == "r1"
    out = raw_output(reply, "output-0", "<f4")
    # decode_args: x with NumpyCodec, tag with StringCodec; the array back with NumpyCodec
    np.testing.assert_allclose(out.ravel(), [1.0 * 2.5 + 3, 2.0 * 2.5 + 3, 4.0 * 2.5 + 3])


def test_mlserver_sklearn_runtime_predict_and_proba(served: Serving) -> None:
    data = load_iris()
    rows = data.data[::15]
    local = LogisticRegression(max_iter=500).fit(data.data, data.target)
    reply = asyncio.run(call(served.address, iris_request(rows)))
    assert [o.name for o in reply.outputs] == ["predict", "predict_proba"]
    assert reply.model_version == "v2"
    np.testing.assert_array_equal(raw_output(reply, "predict", "<i8").ravel(), local.predict(rows))
    np.testing.assert_allclose(
        raw_output(reply, "predict_proba", "<f8"), local.predict_proba(rows), rtol=1e-6
    )


def test_example_folder_serves_unchanged(served: Serving) -> None:
    reply = asyncio.run(call(served.address, wordcount_request()))
    assert list(reply.outputs[0].contents.int64_contents) == [3, 1, 4]
    assert list(reply.outputs[0].shape) == [3, 1]


def test_inference_error_is_invalid_argument(served: Serving) -> None:
    """In a worker: the text of MLServer's parallel workers (its WorkerError)."""
    code, details = asyncio.run(call_error(served.address, scaler_request([1.0, -1.0])))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details == "mlserver.errors.InferenceError: negative input for ab"


def test_invalid_utf8_in_a_string_input_is_invalid_argument_naming_it(served: Serving) -> None:
    """MLServer's StringCodec decodes ``text`` as UTF-8 in the model's predict;
    bytes that are not UTF-8 are the client's error, not the model's (issue 28 §12)."""
    typed = wordcount_request()
    typed.inputs[0].contents.bytes_contents[1] = b"\xc3\x28 not utf-8"
    raw = pb.ModelInferRequest(model_name="wordcount", id="wc-raw")
    raw.inputs.add(name="text", datatype="BYTES", shape=[1])
    raw.raw_input_contents.append(b"\x03\0\0\0\xff\xfeA")
    for request, element in ((typed, 1), (raw, 0)):
        code, details = asyncio.run(call_error(served.address, request))
        assert code == grpc.StatusCode.INVALID_ARGUMENT, details
        assert details.startswith(
            f"input 'text' of model 'wordcount': BYTES element {element} is not valid UTF-8"
        ), details


def test_declared_shapes_are_not_enforced_for_mlserver_models(served: Serving) -> None:
    """As under `mlserver start`: wordcount declares `text` [-1]; a [3, 1] tensor
    is decoded by MLServer's StringCodec and answered, not refused by shape."""
    request = wordcount_request()
    del request.inputs[0].shape[:]
    request.inputs[0].shape.extend([3, 1])
    reply = asyncio.run(call(served.address, request))
    assert list(reply.outputs[0].contents.int64_contents) == [3, 1, 4]


def test_other_exception_is_internal_with_type_and_message(served: Serving) -> None:
    code, details = asyncio.run(call_error(served.address, scaler_request([13.0])))
    assert code == grpc.StatusCode.INTERNAL
    assert details == "builtins.ValueError: unlucky number"


def test_failed_loads_are_unavailable_with_reason_and_server_not_ready(served: Serving) -> None:
    async def look() -> tuple[dict[str, str], bool]:
        async with grpc.aio.insecure_channel(served.address) as channel:
            stub = pbg.GRPCInferenceServiceStub(channel)
            index = await stub.RepositoryIndex(pb.RepositoryIndexRequest(), timeout=10)
            ready = await stub.ServerReady(pb.ServerReadyRequest(), timeout=10)
            states = {m.name: f"{m.state}: {m.reason}" for m in index.models}
            return states, ready.ready

    def failed_both() -> bool:
        states, _ = asyncio.run(look())
        return all("UNAVAILABLE" in states.get(n, "") for n in ("broken", "notready"))

    assert wait_until(failed_both, WAIT, interval=0.2)
    states, ready = asyncio.run(look())
    assert "RuntimeError: no weights in" in states["broken"], states
    assert "w.bin" in states["broken"], states  # the uri, resolved by MLServer's settings
    assert "returned False" in states["notready"], states
    assert ready is False
    for name in ("scaler", "iris", "wordcount", "tokens", "ticker", "echo", "sleepy"):
        assert states[name].startswith("READY"), states


def test_mlserver_settings_json_is_read_with_notices(served: Serving) -> None:
    log = served.log()
    assert "http_port" not in log  # MLServer's REST port is poolserve's too (its flag wins)
    for field in ("debug: ignored",):
        assert f"settings.json: {field}" in log, log[-3000:]
    assert "Traceback" not in log


def test_deadline_and_statistics_as_for_native_models(served: Serving) -> None:
    async def main() -> tuple[grpc.StatusCode, pb.ModelStatisticsResponse]:
        async with grpc.aio.insecure_channel(served.address) as channel:
            stub = pbg.GRPCInferenceServiceStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.ModelInfer(pb.ModelInferRequest(model_name="sleepy"), timeout=1.5)
            # the other worker (and the replacement of the one left on sleepy) still serve
            for _ in range(4):
                await stub.ModelInfer(scaler_request([1.0]), timeout=60)
            stats = await stub.ModelStatistics(pb.ModelStatisticsRequest(name="scaler"), timeout=10)
            return info.value.code(), stats

    code, stats = asyncio.run(main())
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    scaler = stats.model_stats[0].inference_stats
    assert scaler.success.count >= 4
    assert scaler.compute_infer.ns > 0  # the adapter's timings reach the statistics


def test_native_model_shares_the_pool(served: Serving) -> None:
    request = pb.ModelInferRequest(model_name="echo")
    request.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 16])
    payload = np.arange(16, dtype=np.float32).reshape(1, 16)
    request.raw_input_contents.append(payload.tobytes())
    reply = asyncio.run(call(served.address, request))
    assert reply.raw_output_contents[0] == payload.tobytes()


# -- predict_stream through ModelStreamInfer -------------------------------------------


def text_request(text: str, request_id: str, model: str = "tokens") -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name=model, id=request_id)
    given = request.inputs.add(name="text", datatype="BYTES", shape=[1])
    given.parameters["content_type"].string_param = "str"
    given.contents.bytes_contents.append(text.encode())
    return request


async def stream(address: str, requests: list[pb.ModelInferRequest]) -> list[tuple[str, str, str]]:
    """(id, first output's first element or "", error_message) per stream response."""
    got: list[tuple[str, str, str]] = []
    async with grpc.aio.insecure_channel(address) as channel:
        call = pbg.GRPCInferenceServiceStub(channel).ModelStreamInfer(iter(requests), timeout=60)
        async for reply in call:
            response = reply.infer_response
            first = ""
            if response.outputs:
                contents = response.outputs[0].contents
                first = contents.bytes_contents[0].decode() if contents.bytes_contents else "?"
            got.append((response.id, first, reply.error_message))
    return got


def test_predict_stream_yields_one_response_per_token(served: Serving) -> None:
    got = asyncio.run(
        stream(served.address, [text_request("a b c", "s1"), text_request("hello world", "s2")])
    )
    assert got == [
        ("s1", "a", ""),
        ("s1", "b", ""),
        ("s1", "c", ""),
        ("s2", "hello", ""),
        ("s2", "world", ""),
    ]


def test_predict_stream_errors_map_as_for_predict(served: Serving) -> None:
    got = asyncio.run(stream(served.address, [text_request("x boom y", "e1")]))
    assert got[0] == ("e1", "x", "")
    assert got[1][2] == "INVALID_ARGUMENT: cannot say boom at 1"
    assert len(got) == 2
    got = asyncio.run(stream(served.address, [text_request("crash", "e2")]))
    # MLServer streams inline only: its inline models' text, the exception's message
    assert got == [("", "", "INTERNAL: crashed at 0")], got
    # the stream's worker serves on
    assert asyncio.run(stream(served.address, [text_request("ok", "e3")])) == [("e3", "ok", "")]


def test_client_going_away_closes_the_async_generator(served: Serving) -> None:
    async def main() -> int:
        async with grpc.aio.insecure_channel(served.address) as channel:
            call = pbg.GRPCInferenceServiceStub(channel).ModelStreamInfer(
                iter([pb.ModelInferRequest(model_name="ticker", id="gone")]), timeout=60
            )
            seen = 0
            async for reply in call:
                assert reply.error_message == ""
                seen += 1
                if seen == 3:
                    call.cancel()
                    break
            return seen

    assert asyncio.run(main()) == 3
    marker = served.repo.parent / "closed" / "gone"
    assert wait_until(marker.exists, WAIT, interval=0.1), "the generator was never closed"
    assert marker.read_text().startswith("closed after ")


def test_rest_client_going_away_closes_the_async_generator(served: Serving) -> None:
    """generate_stream over HTTP: closing the connection ends the stream on the worker."""
    host, port = (served.run_dir / "http.addr").read_text().strip().rsplit(":", 1)
    tensor = {"name": "x", "shape": [1], "datatype": "INT32", "data": [0]}
    body = json.dumps({"id": "gone-rest", "inputs": [tensor]}).encode()
    with socket.create_connection((host, int(port)), timeout=WAIT) as sock:
        sock.sendall(
            b"POST /v2/models/ticker/generate_stream HTTP/1.1\r\nhost: x\r\n"
            b"content-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body) + body
        )
        received = b""
        while received.count(b"data: ") < 3:  # three ticks, as they come
            chunk = sock.recv(65536)
            assert chunk, received
            received += chunk
    assert received.startswith(b"HTTP/1.1 200 ")
    marker = served.repo.parent / "closed" / "gone-rest"
    assert wait_until(marker.exists, WAIT, interval=0.1), "the generator was never closed"
    assert marker.read_text().startswith("closed after ")


def test_predict_only_mlmodel_answers_each_stream_request(served: Serving) -> None:
    async def main() -> list[pb.ModelStreamInferResponse]:
        async with grpc.aio.insecure_channel(served.address) as channel:
            call = pbg.GRPCInferenceServiceStub(channel).ModelStreamInfer(
                iter(
                    [scaler_request([1.0], request_id="p1"), scaler_request([2.0], request_id="p2")]
                ),
                timeout=60,
            )
            return [reply async for reply in call]

    replies = asyncio.run(main())
    assert [r.infer_response.id for r in replies] == ["p1", "p2"]
    unary = asyncio.run(call(served.address, scaler_request([2.0], request_id="p2")))
    assert replies[1].infer_response == unary


def test_triton_empty_final_response_when_asked(served: Serving) -> None:
    request = text_request("a b", "f1")
    request.parameters["triton_enable_empty_final_response"].bool_param = True

    async def main() -> list[pb.ModelStreamInferResponse]:
        async with grpc.aio.insecure_channel(served.address) as channel:
            call = pbg.GRPCInferenceServiceStub(channel).ModelStreamInfer(
                iter([request]), timeout=60
            )
            return [reply async for reply in call]

    replies = [r.infer_response for r in asyncio.run(main())]
    assert [len(r.outputs) for r in replies] == [1, 1, 0]
    assert [r.parameters["triton_final_response"].bool_param for r in replies] == [
        False,
        False,
        True,
    ]
    assert {r.id for r in replies} == {"f1"} and replies[-1].model_name == "tokens"


def test_class_with_predict_stream_streams_without_the_setting(served: Serving) -> None:
    """Tokens' folder has no ``decoupled`` setting (as written for MLServer):
    its class's predict_stream answers ModelStreamInfer, many responses per
    request, and its predict answers ModelInfer, as MLServer serves them."""
    words = [f"w{i}" for i in range(40)]
    got = asyncio.run(stream(served.address, [text_request(" ".join(words), "many")]))
    assert got == [("many", w, "") for w in words]
    reply = asyncio.run(call(served.address, text_request("a b c", "u1")))
    assert reply.id == "u1" and list(reply.outputs[0].contents.bytes_contents) == [
        b"a",
        b"b",
        b"c",
    ]
    assert asyncio.run(decoupled_in_config(served.address, "tokens")) is True
    assert asyncio.run(decoupled_in_config(served.address, "scaler")) is False
    assert asyncio.run(decoupled_in_config(served.address, "ticker")) is True  # the setting
    assert "overrides predict_stream" not in served.log()


def test_stream_only_class_without_the_setting_streams_and_refuses_model_infer(
    served: Serving,
) -> None:
    got = asyncio.run(
        stream(
            served.address,
            [
                pb.ModelInferRequest(model_name="streamonly", id="o1"),
                pb.ModelInferRequest(model_name="streamonly", id="o2"),
            ],
        )
    )
    assert got == [("o1", "", ""), ("o2", "", "")]
    code, details = asyncio.run(
        call_error(served.address, pb.ModelInferRequest(model_name="streamonly"))
    )
    assert code == grpc.StatusCode.UNIMPLEMENTED
    assert "'streamonly' is decoupled" in details and "use ModelStreamInfer" in details


def test_inline_class_with_predict_stream_streams(served: Serving) -> None:
    """Inline (parallel_workers 0, as MLServer requires for streaming): the
    class's predict_stream answers ModelStreamInfer, its predict ModelInfer."""
    request = text_request("a b", "i1", model="inlinetokens")
    replies = asyncio.run(stream(served.address, [request]))
    assert replies == [("i1", "a", ""), ("i1", "b", "")]
    assert asyncio.run(decoupled_in_config(served.address, "inlinetokens")) is True
    unary = asyncio.run(call(served.address, text_request("a b", "i2", model="inlinetokens")))
    assert list(unary.outputs[0].contents.bytes_contents) == [b"a", b"b"]


async def decoupled_in_config(address: str, model: str) -> bool:
    async with grpc.aio.insecure_channel(address) as channel:
        reply = await pbg.GRPCInferenceServiceStub(channel).ModelConfig(
            pb.ModelConfigRequest(name=model), timeout=30
        )
        return bool(reply.config.model_transaction_policy.decoupled)


def test_reload_turns_a_class_streaming_and_back(served: Serving) -> None:
    """A live reload (rolling the workers) of a class that gains, then loses,
    predict_stream: the catalog takes the new class's word each time."""
    folder = served.repo / "morph"

    async def reload(source: str) -> None:
        (folder / "model.py").write_text(source)
        async with grpc.aio.insecure_channel(served.address) as channel:
            await pbg.GRPCInferenceServiceStub(channel).RepositoryModelLoad(
                pb.RepositoryModelLoadRequest(model_name="morph"), timeout=WAIT
            )

    def streamed() -> list[tuple[str, str, str]]:
        return asyncio.run(stream(served.address, [text_request("x y z", "m", model="morph")]))

    assert streamed() == [("m", "x y z", "")]
    assert asyncio.run(decoupled_in_config(served.address, "morph")) is False
    asyncio.run(reload(MORPH_STREAM))
    assert streamed() == [("m", "x", ""), ("m", "y", ""), ("m", "z", "")]
    assert asyncio.run(decoupled_in_config(served.address, "morph")) is True
    unary = asyncio.run(call(served.address, text_request("x y", "u", model="morph")))
    assert list(unary.outputs[0].contents.bytes_contents) == [b"x y"]  # predict, as MLServer
    asyncio.run(reload(MORPH_UNARY))
    assert streamed() == [("m", "x y z", "")]
    assert asyncio.run(decoupled_in_config(served.address, "morph")) is False


# -- the same requests to MLServer 1.7.1 ------------------------------------------------


@pytest.fixture(scope="module")
def mlserver(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """MLServer 1.7.1 of this environment (the [mlserver] extra) on the same folders."""
    root = tmp_path_factory.mktemp("mlserver-peer")
    repo = root / "repo"
    models = mlserver_folders(repo)
    (repo / "settings.json").write_text(json.dumps({"parallel_workers": 0}))
    with mlserver_serving(repo, root / "mlserver.log", *models) as address:
        yield address
    shutil.rmtree(repo, ignore_errors=True)


def test_same_replies_as_mlserver(served: Serving, mlserver: str) -> None:
    rows = load_iris().data[::10]
    requests = [
        scaler_request([0.5, 3.0], tag="xyz", request_id="cmp"),
        scaler_request([7.0], request_id=""),  # MLServer keeps an empty id empty
        iris_request(rows),
        wordcount_request(),
        text_request("a b c", "tok"),  # tokens' predict: its folder has no poolserve setting
    ]
    for request in requests:
        ours = asyncio.run(call(served.address, request))
        theirs = asyncio.run(call(mlserver, request))
        assert ours == theirs, (ours, theirs)
    for bad in (scaler_request([-2.0]), scaler_request([13.0])):
        ours_error = asyncio.run(call_error(served.address, bad))
        theirs_error = asyncio.run(call_error(mlserver, bad))
        assert ours_error[0] == theirs_error[0]  # the texts: test_same_errors_as_mlserver...


@pytest.fixture(scope="module")
def mlserver_workers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """MLServer with a parallel worker (its default, parallel_workers 1), as
    poolserve's ``served`` runs scaler in its workers."""
    root = tmp_path_factory.mktemp("mlserver-workers")
    repo = root / "repo"
    write_model(
        repo,
        "scaler",
        {
            "name": "scaler",
            "implementation": "model.Scaler",
            "parameters": {"extra": {"scale": 2.5}},
        },
        CUSTOM,
    )
    (repo / "settings.json").write_text(json.dumps({"parallel_workers": 1}))
    with mlserver_serving(repo, root / "mlserver.log", "scaler") as address:
        yield address
    shutil.rmtree(repo, ignore_errors=True)


def test_same_errors_as_mlserver_parallel_workers(served: Serving, mlserver_workers: str) -> None:
    """An exception in a worker: MLServer's WorkerError text and status, the same."""
    for bad in (scaler_request([-2.0]), scaler_request([13.0])):
        ours = asyncio.run(call_error(served.address, bad))
        theirs = asyncio.run(call_error(mlserver_workers, bad))
        assert ours == theirs


def test_same_rest_replies_as_mlserver(served: Serving, mlserver: str) -> None:
    """MLServer's documented REST calls, to both servers: the same JSON back."""
    ours = f"http://{(served.run_dir / 'http.addr').read_text().strip()}"
    theirs = f"http://{PEER_HTTP[mlserver]}"
    calls = [
        (
            "scaler",
            {
                "id": "cmp",
                "inputs": [
                    {"name": "x", "shape": [2], "datatype": "FP32", "data": [0.5, 3.0]},
                    {
                        "name": "tag",
                        "shape": [1],
                        "datatype": "BYTES",
                        "data": ["xyz"],
                        "parameters": {"content_type": "str"},
                    },
                ],
            },
        ),
        (
            "iris",
            {
                "id": "i",
                "inputs": [
                    {
                        "name": "predict",
                        "shape": [2, 4],
                        "datatype": "FP64",
                        "data": load_iris().data[::75].ravel().tolist(),
                    }
                ],
            },
        ),
    ]
    for model, body in calls:
        mine = requests.post(f"{ours}/v2/models/{model}/infer", json=body, timeout=WAIT)
        peer = requests.post(f"{theirs}/v2/models/{model}/infer", json=body, timeout=WAIT)
        assert mine.status_code == peer.status_code == 200, (mine.text, peer.text)
        a, b = mine.json(), peer.json()
        for reply in (a, b):
            reply.pop("parameters", None)  # MLServer adds its own (content types, headers)
            for output in reply["outputs"]:
                output.pop("parameters", None)
        assert a == b, (a, b)
    for path in ("/v2/health/live", "/v2/models/scaler/ready"):  # ours has broken models
        mine = requests.get(f"{ours}{path}", timeout=WAIT)
        peer = requests.get(f"{theirs}{path}", timeout=WAIT)
        assert mine.status_code == peer.status_code == 200


def test_same_generate_stream_as_mlserver(served: Serving, mlserver: str) -> None:
    """MLServer's REST stream (server-sent events) of a predict_stream model: the
    same events from both servers."""
    ours = f"http://{(served.run_dir / 'http.addr').read_text().strip()}"
    theirs = f"http://{PEER_HTTP[mlserver]}"
    body = {
        "id": "gen-1",
        "inputs": [
            {
                "name": "text",
                "shape": [1],
                "datatype": "BYTES",
                "data": ["one two three"],
                "parameters": {"content_type": "str"},
            }
        ],
    }

    def events(base: str) -> list[dict[str, object]]:
        reply = requests.post(f"{base}/v2/models/tokens/generate_stream", json=body, timeout=WAIT)
        assert reply.status_code == 200, reply.text
        assert reply.headers["content-type"].startswith("text/event-stream")
        found = []
        for chunk in reply.content.split(b"\n\n"):
            if chunk.startswith(b"data: "):
                event = json.loads(chunk[len(b"data: ") :])
                event.pop("parameters", None)
                for output in event.get("outputs", []):
                    output.pop("parameters", None)
                found.append(event)
        return found

    mine, peer = events(ours), events(theirs)
    assert [e["outputs"][0]["data"] for e in mine] == [["one"], ["two"], ["three"]]
    assert mine == peer, (mine, peer)


def test_same_stream_as_mlserver(served: Serving, mlserver: str) -> None:
    """MLServer's ModelStreamInfer answers bare ModelInferResponses (its own
    proto); poolserve answers KServe's ModelStreamInferResponse around them.
    One request per stream: MLServer feeds all of a stream's requests to one
    predict_stream call, poolserve calls it per request. Bytes on MLServer's
    side: importing MLServer's generated protos here would clash with
    tritonclient's (both in the default descriptor pool) in a whole-suite run."""

    async def theirs(request: pb.ModelInferRequest) -> tuple[list[bytes], str]:
        got: list[bytes] = []
        async with grpc.aio.insecure_channel(mlserver) as channel:
            method = channel.stream_stream("/inference.GRPCInferenceService/ModelStreamInfer")
            call = method(iter([request.SerializeToString()]), timeout=60)
            try:
                async for reply in call:
                    got.append(bytes(reply))
            except grpc.aio.AioRpcError as exc:
                return got, f"{exc.code().name}: {exc.details()}"
        return got, ""

    async def ours(request: pb.ModelInferRequest) -> tuple[list[bytes], str]:
        got: list[bytes] = []
        async with grpc.aio.insecure_channel(served.address) as channel:
            call = pbg.GRPCInferenceServiceStub(channel).ModelStreamInfer(
                iter([request]), timeout=60
            )
            async for reply in call:
                if reply.error_message:
                    return got, reply.error_message
                got.append(reply.infer_response.SerializeToString())
        return got, ""

    for request in (
        text_request("one two three", "cmp-1"),
        text_request("x boom", "cmp-2"),
        # a predict-only class: MLModel's own predict_stream, its predict's one response
        scaler_request([1.0, 2.0], request_id="cmp-3"),
        text_request("crash", "cmp-4"),
    ):
        our_parts, our_error = asyncio.run(ours(request))
        their_parts, their_error = asyncio.run(theirs(request))
        assert [pb.ModelInferResponse.FromString(p) for p in our_parts] == [
            pb.ModelInferResponse.FromString(p) for p in their_parts
        ]
        assert our_error == their_error
    assert len(asyncio.run(ours(text_request("one two three", "n")))[0]) == 3


def test_same_metadata_as_mlserver(served: Serving, mlserver: str) -> None:
    """ModelMetadata of models loaded in a pool's zygote (workers): byte for byte
    MLServer's answer (content types, versions, platform as its settings say)."""

    async def metadata(address: str, name: str, version: str = "") -> bytes:
        async with grpc.aio.insecure_channel(address) as channel:
            call = channel.unary_unary("/inference.GRPCInferenceService/ModelMetadata")
            request = pb.ModelMetadataRequest(name=name, version=version)
            return bytes(await call(request.SerializeToString(), timeout=60))

    for name, version in (
        ("scaler", ""),
        ("iris", ""),
        ("iris", "v2"),
        ("wordcount", ""),
        ("tokens", ""),
    ):
        ours = asyncio.run(metadata(served.address, name, version))
        theirs = asyncio.run(metadata(mlserver, name, version))
        assert ours == theirs, (name, ours, theirs)
    scaler = pb.ModelMetadataResponse.FromString(asyncio.run(metadata(served.address, "scaler")))
    assert list(scaler.versions) == [] and scaler.platform == ""  # none in its settings


def test_same_versions_as_mlserver(served: Serving, mlserver: str) -> None:
    """A model whose model-settings.json declares no version: both repository
    indexes show none, and a request for version "1" is NOT_FOUND in MLServer's
    words, as MLServer answers (Triton's "1" is for poolserve's own models)."""

    async def unary(address: str, service: str, method: str, request: Message) -> bytes:
        async with grpc.aio.insecure_channel(address) as channel:
            call = channel.unary_unary(f"/{service}/{method}")
            return bytes(await call(request.SerializeToString(), timeout=60))

    async def failed(address: str, method: str, request: Message) -> tuple[str, str]:
        try:
            await unary(address, "inference.GRPCInferenceService", method, request)
        except grpc.aio.AioRpcError as exc:
            return exc.code().name, exc.details() or ""
        return "OK", ""

    def indexes(address: str) -> list[list[tuple[str, str, str]]]:
        found = []
        for service, reply_type in (
            ("inference.GRPCInferenceService", pb.RepositoryIndexResponse),
            ("inference.model_repository.ModelRepositoryService", mr.RepositoryIndexResponse),
        ):
            request = mr.RepositoryIndexRequest()
            reply = reply_type.FromString(
                asyncio.run(unary(address, service, "RepositoryIndex", request))
            )
            # MLServer 1.7.1 writes str() of its State enum ("State.READY"): poolserve
            # writes the name (docs/migrating-from-mlserver.md)
            states = [(m.name, m.version, m.state.removeprefix("State.")) for m in reply.models]
            found.append(sorted(s for s in states if s[0] in MODELS))
        return found

    ours, theirs = indexes(served.address), indexes(mlserver)
    assert ours == theirs, (ours, theirs)
    assert ("scaler", "", "READY") in ours[0] and ("iris", "v2", "READY") in ours[1]
    asked = [
        ("ModelReady", pb.ModelReadyRequest(name="scaler", version="1")),
        ("ModelReady", pb.ModelReadyRequest(name="iris", version="1")),
        ("ModelMetadata", pb.ModelMetadataRequest(name="scaler", version="1")),
        ("ModelInfer", pb.ModelInferRequest(model_name="scaler", model_version="1")),
    ]
    for method, request in asked:
        mine = asyncio.run(failed(served.address, method, request))
        peer = asyncio.run(failed(mlserver, method, request))
        assert mine[0] == "NOT_FOUND", (method, mine)
        if method == "ModelReady":  # MLServer's ModelReady lacks its error handler: UNKNOWN,
            # "Unexpected <class 'mlserver.errors.ModelNotFound'>: " before the text
            assert peer[0] == "UNKNOWN" and peer[1].endswith(": " + mine[1]), (mine, peer)
        else:
            assert mine == peer, (method, mine, peer)
    ready = pb.ModelReadyResponse.FromString(
        asyncio.run(
            unary(
                served.address,
                "inference.GRPCInferenceService",
                "ModelReady",
                pb.ModelReadyRequest(name="scaler"),
            )
        )
    )
    assert ready.ready  # no version asked: its only one
    ours_http = f"http://{(served.run_dir / 'http.addr').read_text().strip()}"
    theirs_http = f"http://{PEER_HTTP[mlserver]}"
    rest_index = []
    for base in (ours_http, theirs_http):
        reply = requests.post(f"{base}/v2/repository/index", json={}, timeout=WAIT)
        assert reply.status_code == 200, reply.text
        rest_index.append(
            sorted((m["name"], m.get("version")) for m in reply.json() if m["name"] in MODELS)
        )
    assert rest_index[0] == rest_index[1], rest_index
    assert ("scaler", None) in rest_index[0]
    for path in ("/v2/models/scaler/versions/1/ready", "/v2/models/scaler/versions/1"):
        mine_http = requests.get(f"{ours_http}{path}", timeout=WAIT)
        peer_http = requests.get(f"{theirs_http}{path}", timeout=WAIT)
        assert mine_http.status_code == peer_http.status_code == 404, (path, mine_http.text)
        assert mine_http.json() == peer_http.json(), (mine_http.text, peer_http.text)


def test_same_custom_endpoints_as_mlserver(served: Serving, mlserver: str) -> None:
    """An MLServer model's @custom_handler endpoints (as mlserver-mlflow's
    /invocations) on the REST door: the same status and JSON as MLServer's,
    the handler run in a worker on the body the router forwarded unparsed."""
    ours = f"http://{(served.run_dir / 'http.addr').read_text().strip()}"
    theirs = f"http://{PEER_HTTP[mlserver]}"
    zipped = {"Content-Encoding": "gzip", "Content-Type": "application/json"}
    calls: list[tuple[str, str, dict[str, object]]] = [
        ("POST", "/invocations", {"json": {"instances": [[1, 2]], "k": "v"}}),
        ("POST", "/invocations", {"data": b"[1, 2]", "headers": {"Content-Type": "text/csv"}}),
        ("POST", "/invocations", {"data": gzip.compress(b'{"z": 1}'), "headers": zipped}),
        ("POST", "/invocations", {"json": {"long": "x" * 2000}}),  # a gzip reply (over 500 B)
        ("GET", "/hooks/ab?n=3", {}),
        ("GET", "/hooks/bad", {}),  # MLServer's InferenceError: 400 {"error": ...}
        ("GET", "/hooks/ab?n=x", {}),  # FastAPI's validation: 422 {"detail": [...]}
    ]
    for method, path, options in calls:
        mine = requests.request(method, f"{ours}{path}", timeout=WAIT, **options)  # type: ignore[arg-type]
        peer = requests.request(method, f"{theirs}{path}", timeout=WAIT, **options)  # type: ignore[arg-type]
        assert mine.status_code == peer.status_code, (path, mine.text, peer.text)
        assert mine.json() == peer.json(), (path, mine.text, peer.text)
        for header in ("content-type", "content-encoding"):
            assert mine.headers.get(header) == peer.headers.get(header), (path, header)
    assert requests.get(f"{ours}/hooks/ab?n=3", timeout=WAIT).json() == {"item": "ababab"}
    # a declared path with another method, and a path nobody declared
    for method, path, status in (("POST", "/hooks/ab", 405), ("GET", "/nothing/here", 404)):
        mine = requests.request(method, f"{ours}{path}", timeout=WAIT)
        peer = requests.request(method, f"{theirs}{path}", timeout=WAIT)
        assert mine.status_code == peer.status_code == status, (path, mine.text, peer.text)
        assert "error" in mine.json()
        allowed = (answer.headers.get("allow") for answer in (mine, peer))
        assert len({frozenset((a or "").replace(" ", "").split(",")) for a in allowed}) == 1
    head = [requests.head(f"{url}/hooks/ab?n=3", timeout=WAIT) for url in (ours, theirs)]
    assert [(h.status_code, h.headers.get("allow"), h.content) for h in head] == [
        (405, "GET", b"")
    ] * 2  # FastAPI's routes take no HEAD beside a GET


def test_custom_endpoint_of_an_inline_model(served: Serving) -> None:
    """A @custom_handler of a model run in the pool process (parallel_workers 0),
    a plain ``def`` with an int path parameter and a JSON body, on PUT."""
    ours = f"http://{(served.run_dir / 'http.addr').read_text().strip()}"
    reply = requests.put(f"{ours}/inline/41", json={"a": [1]}, timeout=WAIT)
    assert reply.status_code == 200, reply.text
    assert reply.json() == {"x": 42, "body": {"a": [1]}, "name": "inlinehooks"}
    bad = requests.put(f"{ours}/inline/x", json={}, timeout=WAIT)
    assert bad.status_code == 422, bad.text  # FastAPI validates the int, as under MLServer
    assert bad.json()["detail"][0]["loc"] == ["path", "x"]
    assert requests.get(f"{ours}/inline/41", timeout=WAIT).status_code == 405
