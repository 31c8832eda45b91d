"""Protocol fidelity end to end, with raw gRPC stubs (issue 20 §1, issue 21 §6).

One tree serves echo on workers, a copy of it inline, the same two declaring
no inputs (``echo_any``: every datatype and shape), and a model that
reports the settings it was loaded with. tritonclient's view of the same
answers is in test_pipeline and test_inprocess (it cannot share a process
with our protos).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import struct
from collections.abc import Iterator

import grpc
import numpy as np
import pytest

from poolserve.protos import inference_pb2 as pb
from poolserve.protos import inference_pb2_grpc as pbg
from poolserve.service.inference.codec import decode_outputs

from serving import Serving, pool_status, wait_serving
from support import copy_echo_any, copy_example, write_model

pytestmark = pytest.mark.e2e

Stub = pbg.GRPCInferenceServiceStub
HUGE = "m" * (1 << 20)  # a 1 MiB name

SETTINGS_MODEL = '''
import json

import numpy as np

from poolserve.service import Model


class SettingsModel(Model):
    """Answers with the settings it was loaded with, as the worker sees them."""

    def predict(self, inputs, parameters):
        seen = {"extra": dict(self.settings.extra), "max_batch_size": self.settings.max_batch_size}
        return {"settings": np.array([json.dumps(seen).encode()], dtype=object)}
'''


@pytest.fixture(scope="module")
def serving(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Serving]:
    root = tmp_path_factory.mktemp("protocol")
    repo = root / "repo"
    copy_example(repo, "echo")
    shutil.copytree(repo / "echo", repo / "echo_inline")
    inline = json.loads((repo / "echo" / "model-settings.json").read_text())
    inline.update(name="echo_inline", parallel_workers=0)
    (repo / "echo_inline" / "model-settings.json").write_text(json.dumps(inline))
    copy_echo_any(repo)
    copy_echo_any(repo, "echo_any_inline")
    inline_any = json.loads((repo / "echo_any_inline" / "model-settings.json").read_text())
    inline_any.update(parallel_workers=0)
    (repo / "echo_any_inline" / "model-settings.json").write_text(json.dumps(inline_any))
    write_model(
        repo,
        "settings",
        {
            "name": "settings",
            "implementation": "model.SettingsModel",
            "parameters": {"extra": {"from_file": "yes"}},
            "inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1]}],
            "outputs": [{"name": "settings", "datatype": "BYTES", "shape": [1]}],
        },
        SETTINGS_MODEL,
    )
    with Serving(repo, root / "run", workers=1) as served:
        asyncio.run(_wait(served.address))
        yield served


async def _wait(address: str) -> None:
    async with grpc.aio.insecure_channel(address) as channel:
        await wait_serving(channel)


def run(address: str, body: object) -> None:
    async def main() -> None:
        async with grpc.aio.insecure_channel(address) as channel:
            await body(Stub(channel))  # type: ignore[operator]

    asyncio.run(main())


async def status(call: object) -> tuple[grpc.StatusCode, str]:
    try:
        await call  # type: ignore[misc]
    except grpc.aio.AioRpcError as exc:
        return exc.code(), exc.details() or ""
    return grpc.StatusCode.OK, ""


def typed_request(
    model: str, datatype: str, values: list[object], shape: list[int] | None = None
) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name=model)
    tensor = request.inputs.add(name="INPUT0", datatype=datatype, shape=shape or [len(values)])
    field = {"FP32": "fp32_contents", "BYTES": "bytes_contents", "INT64": "int64_contents"}
    getattr(tensor.contents, field[datatype]).extend(values)
    return request


@pytest.mark.parametrize("model", ["echo_any", "echo_any_inline"])
def test_typed_inputs_are_answered_raw_for_every_datatype_kind(
    serving: Serving, model: str
) -> None:
    """Raw layout checked against the spec, not against our own decoder."""
    cases: list[tuple[str, list[object], bytes]] = [
        ("FP32", [1.5, -2.0], struct.pack("<2f", 1.5, -2.0)),
        ("INT64", [-(2**63), 7], struct.pack("<2q", -(2**63), 7)),
        ("BYTES", [b"ab", b""], b"\x02\0\0\0ab\0\0\0\0"),
    ]

    async def body(stub: Stub) -> None:
        for datatype, values, raw in cases:
            reply = await stub.ModelInfer(typed_request(model, datatype, values), timeout=30)
            assert list(reply.raw_output_contents) == [raw], datatype
            [output] = reply.outputs
            assert not output.HasField("contents")
            assert (output.name, output.datatype, list(output.shape)) == (
                "OUTPUT0",
                datatype,
                [2],
            )

    run(serving.address, body)


def test_model_ready_of_a_missing_model_is_false_at_the_router_and_the_pool(
    serving: Serving,
) -> None:
    async def body(stub: Stub) -> None:
        for name, version in (("no-such-model", ""), ("echo", "99"), (HUGE, "")):
            request = pb.ModelReadyRequest(name=name, version=version)
            assert not (await stub.ModelReady(request, timeout=30)).ready
        assert (await stub.ModelReady(pb.ModelReadyRequest(name="echo"), timeout=30)).ready
        metadata = stub.ModelMetadata(pb.ModelMetadataRequest(name="no-such-model"), timeout=30)
        assert (await status(metadata))[0] is grpc.StatusCode.NOT_FOUND
        infer = stub.ModelInfer(typed_request("no-such-model", "FP32", [1.0]), timeout=30)
        assert (await status(infer))[0] is grpc.StatusCode.NOT_FOUND

    run(serving.address, body)
    run(f"unix:{serving.run_dir / 'pool-default.sock'}", body)


@pytest.mark.parametrize("model", ["echo", "echo_inline"])
def test_declared_datatypes_and_shapes_are_enforced_in_tritons_words(
    serving: Serving, model: str
) -> None:
    """echo declares INPUT0 FP32 [-1,-1] (examples/models/echo), on workers and inline."""
    cases = [
        (
            typed_request(model, "INT64", [1, 2], [1, 2]),
            f"inference input 'INPUT0' data-type is 'INT64', but model '{model}' expects 'FP32'",
        ),
        (
            typed_request(model, "FP32", [1.0, 2.0]),
            f"unexpected shape for input 'INPUT0' for model '{model}'. Expected [-1,-1], got [2].",
        ),
        (
            typed_request(model, "FP32", [1.0], [1, 1]),
            "",
        ),
    ]
    renamed = typed_request(model, "FP32", [1.0], [1, 1])
    renamed.inputs[0].name = "INPUT1"
    cases.append((renamed, f"unexpected inference input 'INPUT1' for model '{model}'"))

    async def body(stub: Stub) -> None:
        for request, message in cases:
            code, details = await status(stub.ModelInfer(request, timeout=30))
            expected = grpc.StatusCode.INVALID_ARGUMENT if message else grpc.StatusCode.OK
            assert (code, details) == (expected, message)

    run(serving.address, body)


@pytest.mark.parametrize("model", ["echo", "echo_inline"])
def test_an_input_in_an_unregistered_region_is_refused_by_its_own_name(
    serving: Serving, model: str
) -> None:
    request = pb.ModelInferRequest(model_name=model)
    in_region = request.inputs.add(name="INPUT_SHM", datatype="FP32", shape=[4])
    in_region.parameters["shared_memory_region"].string_param = "region0"
    in_region.parameters["shared_memory_byte_size"].int64_param = 16
    request.inputs.add(name="INPUT0", datatype="FP32", shape=[2])
    request.raw_input_contents.append(struct.pack("<2f", 1.0, 2.0))

    async def body(stub: Stub) -> None:
        code, details = await status(stub.ModelInfer(request, timeout=30))
        assert code is grpc.StatusCode.INVALID_ARGUMENT
        assert details.startswith("input 'INPUT_SHM' names shared-memory region 'region0'")
        assert "which is not registered" in details and "INPUT0" not in details

    run(serving.address, body)


def test_a_huge_name_gets_its_own_status_with_a_short_message(serving: Serving) -> None:
    async def body(stub: Stub) -> None:
        calls = {
            "ModelInfer": stub.ModelInfer(typed_request(HUGE, "FP32", [1.0]), timeout=30),
            "ModelMetadata": stub.ModelMetadata(pb.ModelMetadataRequest(name=HUGE), timeout=30),
            "ModelConfig": stub.ModelConfig(pb.ModelConfigRequest(name=HUGE), timeout=30),
            "RepositoryModelLoad": stub.RepositoryModelLoad(
                pb.RepositoryModelLoadRequest(model_name=HUGE), timeout=30
            ),
        }
        for method, call in calls.items():
            code, details = await status(call)
            assert code is grpc.StatusCode.NOT_FOUND, (method, code, details[:300])
            assert f"'{'m' * 200}...[{len(HUGE)} characters]'" in details, method
            assert len(details) < 1000, method
        bad = typed_request("echo", "FP32", [1.0])
        bad.inputs[0].name, bad.inputs[0].datatype = "INPUT" + HUGE, HUGE
        code, details = await status(stub.ModelInfer(bad, timeout=30))
        assert code is grpc.StatusCode.INVALID_ARGUMENT and len(details) < 1000, details

    run(serving.address, body)


def settings_seen(reply: pb.ModelInferResponse) -> dict[str, object]:
    seen: dict[str, object] = json.loads(decode_outputs(reply)["settings"][0])
    return seen


def test_a_load_applies_its_config_override_until_the_next_plain_load(serving: Serving) -> None:
    infer = typed_request("settings", "FP32", [0.0])

    async def body(stub: Stub) -> None:
        assert settings_seen(await stub.ModelInfer(infer, timeout=30)) == {
            "extra": {"from_file": "yes"},
            "max_batch_size": 0,
        }
        load = pb.RepositoryModelLoadRequest(model_name="settings")
        load.parameters["config"].string_param = json.dumps(
            {
                "name": "settings",
                "backend": "python",
                "max_batch_size": "16",
                "parameters": {"greeting": {"string_value": "hi"}},
            }
        )
        await stub.RepositoryModelLoad(load, timeout=60)
        config = (await stub.ModelConfig(pb.ModelConfigRequest(name="settings"))).config
        assert config.max_batch_size == 16
        assert settings_seen(await stub.ModelInfer(infer, timeout=30)) == {
            "extra": {"from_file": "yes", "greeting": "hi"},
            "max_batch_size": 16,
        }
        # Without a config, a load goes back to what the repository says (as Triton).
        await stub.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name="settings"))
        config = (await stub.ModelConfig(pb.ModelConfigRequest(name="settings"))).config
        assert config.max_batch_size == 0
        assert settings_seen(await stub.ModelInfer(infer, timeout=30))["max_batch_size"] == 0

    run(serving.address, body)


def test_refused_loads_say_failed_to_load_and_change_nothing(serving: Serving) -> None:
    def load(name: str, config: str | None = None, **files: bytes) -> pb.RepositoryModelLoadRequest:
        request = pb.RepositoryModelLoadRequest(model_name=name)
        if config is not None:
            request.parameters["config"].string_param = config
        for path, content in files.items():
            request.parameters[f"file:{path}"].bytes_param = content
        return request

    refused = [
        (load("echo", "{not json"), "INVALID_ARGUMENT", "config is not valid JSON"),
        (
            load("echo", json.dumps({"max_batch_size": 2, "instance_group": [{"count": 2}]})),
            "INVALID_ARGUMENT",
            "config fields not supported by poolserve: instance_group",
        ),
        (load("echo", json.dumps({"name": "other"})), "INVALID_ARGUMENT", "'name' is 'other'"),
        (load("echo", "{}", model=b"\0"), "UNIMPLEMENTED", "'file:model': file overrides"),
        (load("no-such-model"), "NOT_FOUND", "'no-such-model' is not in this repository"),
    ]

    async def body(stub: Stub) -> None:
        workers = {w.pid for w in (await pool_status(serving)).workers}
        for request, code, text in refused:
            got, details = await status(stub.RepositoryModelLoad(request, timeout=60))
            assert got.name == code, (details, code)
            assert details.startswith(f"failed to load '{request.model_name}': "), details
            assert text in details, details
        assert {w.pid for w in (await pool_status(serving)).workers} == workers
        config = (await stub.ModelConfig(pb.ModelConfigRequest(name="echo"))).config
        assert config.max_batch_size == 0
        reply = await stub.ModelInfer(typed_request("echo", "FP32", [3.0], [1, 1]), timeout=30)
        assert np.frombuffer(reply.raw_output_contents[0], "<f4").tolist() == [3.0]

    run(serving.address, body)
