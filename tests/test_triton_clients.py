"""What Triton's gRPC client users rely on, checked with tritonclient.grpc,
tritonclient.grpc.aio and raw grpc stubs against one real ``poolserve serve``
tree (issue 32: our own tests in place of vendored programs).

The tree serves tests/triton_examples/models (Triton's model names, datatypes
and shapes, computed by our own model.py files), the dyna models of
tests/triton_examples/dyna_models (sequence control tensors START, END, READY,
CORRID), examples/models/repeat_int32 (decoupled) and a settings.json with
``"server_name": "triton"``. Every expected value below follows from those
models' definitions and the Open Inference Protocol / Triton extensions.

System shared memory through tritonclient (numeric and BYTES regions) is
test_triton_shm.py's (tests/clients/triton_shm.py); here shared memory appears
only where infer objects are reused across shm and non-shm calls.
tritonclient and poolserve may share a process: poolserve's generated protos
live in a private descriptor pool.
"""

from __future__ import annotations

import asyncio
import io
import json
import queue
import shutil
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as tc
import tritonclient.grpc.aio as tca
import tritonclient.utils.shared_memory as shm
from tritonclient import utils
from tritonclient.grpc import service_pb2 as tpb
from tritonclient.grpc import service_pb2_grpc as tpbg

from serving import Serving, wait_serving

pytestmark = pytest.mark.e2e

HERE = Path(__file__).resolve().parent
MODELS = HERE / "triton_examples" / "models"
DYNA_MODELS = HERE / "triton_examples" / "dyna_models"
REPEAT = HERE.parent / "examples" / "models" / "repeat_int32"
TIMEOUT = 60  # seconds, per call: CI is a loaded 2-core machine

SERVED = {
    "classifier",
    "inception_graphdef",
    "preprocess_inception_ensemble",
    "repeat_int32",
    "simple",
    "simple_dyna_sequence",
    "simple_identity",
    "simple_int8",
    "simple_sequence",
    "simple_string",
    "simple_string_dyna_sequence",
}

A = np.arange(16, dtype=np.int32).reshape(1, 16)
B = np.ones((1, 16), dtype=np.int32)


@pytest.fixture(scope="module")
def address(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    root = tmp_path_factory.mktemp("triton_clients")
    repo = root / "repo"
    skip = shutil.ignore_patterns("__pycache__")
    shutil.copytree(MODELS, repo, ignore=skip)
    for model in DYNA_MODELS.iterdir():
        if model.is_dir() and model.name != "__pycache__":
            shutil.copytree(model, repo / model.name, ignore=skip)
    shutil.copytree(REPEAT, repo / "repeat_int32", ignore=skip)
    labels = [f"label_{i}" for i in range(1000)]
    (repo / "classifier" / "labels.txt").write_text("\n".join(labels) + "\n")
    (repo / "settings.json").write_text('{"server_name": "triton"}\n')
    with Serving(repo, root / "run", workers=2) as serving:
        asyncio.run(_wait(serving.address))
        yield serving.address


async def _wait(address: str) -> None:
    async with grpc.aio.insecure_channel(address) as channel:
        await wait_serving(channel, timeout=120)


@pytest.fixture
def client(address: str) -> Iterator[tc.InferenceServerClient]:
    with tc.InferenceServerClient(address) as triton:
        yield triton


def add_sub_inputs(module: Any = tc, a: np.ndarray = A, b: np.ndarray = B) -> list[Any]:
    datatype = utils.np_to_triton_dtype(a.dtype)
    inputs = [module.InferInput(f"INPUT{k}", list(a.shape), datatype) for k in (0, 1)]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(b)
    return inputs


def assert_add_sub(result: Any, a: np.ndarray = A, b: np.ndarray = B) -> None:
    for name, want in (("OUTPUT0", a + b), ("OUTPUT1", a - b)):
        got = result.as_numpy(name)
        assert got.dtype == a.dtype, name
        assert got.shape == a.shape, name
        np.testing.assert_array_equal(got, want, err_msg=name)


def server_error(call: Any) -> tc.InferenceServerException:
    with pytest.raises(tc.InferenceServerException) as caught:
        call()
    return caught.value


# -- health, metadata, configuration -----------------------------------------


def test_health_and_readiness(client: tc.InferenceServerClient) -> None:
    assert client.is_server_live(headers={"test": "1", "dummy": "2"})
    assert client.is_server_ready()
    for model in sorted(SERVED):
        assert client.is_model_ready(model), model
    assert not client.is_model_ready("no_such_model")  # OK with ready false, as Triton
    assert not client.is_model_ready("simple", model_version="7")


def test_server_metadata_names_the_server_from_settings(
    client: tc.InferenceServerClient,
) -> None:
    metadata = client.get_server_metadata()
    assert metadata.name == "triton"
    assert metadata.version
    extensions = set(metadata.extensions)
    for extension in ("classification", "sequence", "system_shared_memory", "model_configuration"):
        assert extension in extensions, extensions
    assert "cuda_shared_memory" not in extensions
    as_json = client.get_server_metadata(as_json=True)
    assert as_json["name"] == "triton"


def test_model_metadata_and_config(client: tc.InferenceServerClient) -> None:
    metadata = client.get_model_metadata("simple", headers={"test": "1", "dummy": "2"})
    assert metadata.name == "simple"
    assert [(t.name, t.datatype, list(t.shape)) for t in metadata.inputs] == [
        ("INPUT0", "INT32", [-1, 16]),
        ("INPUT1", "INT32", [-1, 16]),
    ]
    assert [(t.name, t.datatype, list(t.shape)) for t in metadata.outputs] == [
        ("OUTPUT0", "INT32", [-1, 16]),
        ("OUTPUT1", "INT32", [-1, 16]),
    ]
    config = client.get_model_config("simple").config
    assert config.name == "simple"
    assert config.max_batch_size == 8
    assert [(i.name, list(i.dims)) for i in config.input] == [("INPUT0", [16]), ("INPUT1", [16])]
    # BYTES is TYPE_STRING in ModelConfig
    strings = client.get_model_config("simple_string", as_json=True)["config"]
    assert {i["data_type"] for i in strings["input"]} == {"TYPE_STRING"}
    inception = client.get_model_config("inception_graphdef").config
    assert inception.input[0].format == inception.input[0].FORMAT_NHWC
    assert list(inception.input[0].dims) == [299, 299, 3]
    assert inception.output[0].label_filename == "labels.txt"
    for call in (client.get_model_metadata, client.get_model_config):
        error = server_error(lambda call=call: call("no_such_model"))
        assert error.status() == "StatusCode.NOT_FOUND"
        assert "Request for unknown model: 'no_such_model'" in error.message()


def test_raw_stubs_answer_every_health_and_metadata_rpc(address: str) -> None:
    with grpc.insecure_channel(address) as channel:
        stub = tpbg.GRPCInferenceServiceStub(channel)
        assert stub.ServerLive(tpb.ServerLiveRequest(), timeout=TIMEOUT).live
        assert stub.ServerReady(tpb.ServerReadyRequest(), timeout=TIMEOUT).ready
        ready = stub.ModelReady(tpb.ModelReadyRequest(name="inception_graphdef"), timeout=TIMEOUT)
        assert ready.ready
        server = stub.ServerMetadata(tpb.ServerMetadataRequest(), timeout=TIMEOUT)
        assert server.name == "triton"
        meta = stub.ModelMetadata(
            tpb.ModelMetadataRequest(name="inception_graphdef"), timeout=TIMEOUT
        )
        assert [(t.name, t.datatype, list(t.shape)) for t in meta.outputs] == [
            ("InceptionV3/Predictions/Softmax", "FP32", [-1, 1001])
        ]
        config = stub.ModelConfig(tpb.ModelConfigRequest(name="inception_graphdef"))
        assert config.config.max_batch_size == 8


# -- inference: typed and raw contents ---------------------------------------


def test_infer_reads_outputs_typed_and_raw(client: tc.InferenceServerClient) -> None:
    outputs = [tc.InferRequestedOutput("OUTPUT0"), tc.InferRequestedOutput("OUTPUT1")]
    result = client.infer(
        "simple", add_sub_inputs(), outputs=outputs, request_id="7", client_timeout=TIMEOUT
    )
    assert_add_sub(result)
    response = result.get_response()
    assert response.id == "7"
    assert response.model_name == "simple"
    assert [(o.name, o.datatype, list(o.shape)) for o in response.outputs] == [
        ("OUTPUT0", "INT32", [1, 16]),
        ("OUTPUT1", "INT32", [1, 16]),
    ]
    # every output travels in raw_output_contents, little-endian, row-major
    assert list(response.raw_output_contents) == [
        (A + B).astype("<i4").tobytes(),
        (A - B).astype("<i4").tobytes(),
    ]
    assert result.get_output("OUTPUT0").name == "OUTPUT0"
    assert result.get_output("NOT_THERE") is None
    # without requested outputs, every output comes back
    every = client.infer("simple", add_sub_inputs(), client_timeout=TIMEOUT)
    assert sorted(o.name for o in every.get_response().outputs) == ["OUTPUT0", "OUTPUT1"]
    # one requested output: only that one
    one = client.infer(
        "simple", add_sub_inputs(), outputs=[outputs[1]], client_timeout=TIMEOUT
    ).get_response()
    assert [o.name for o in one.outputs] == ["OUTPUT1"]
    assert len(one.raw_output_contents) == 1


def test_a_batch_of_rows(client: tc.InferenceServerClient) -> None:
    a = np.arange(64, dtype=np.int32).reshape(4, 16)
    b = np.full((4, 16), -3, dtype=np.int32)
    result = client.infer("simple", add_sub_inputs(tc, a, b), client_timeout=TIMEOUT)
    assert_add_sub(result, a, b)


def test_int8_through_tritonclient_wraps_as_int8(client: tc.InferenceServerClient) -> None:
    a = np.array([[-128, -1, 0, 1, 127] + [5] * 11], dtype=np.int8)
    b = np.array([[1] * 16], dtype=np.int8)
    result = client.infer("simple_int8", add_sub_inputs(tc, a, b), client_timeout=TIMEOUT)
    assert result.as_numpy("OUTPUT0").dtype == np.int8
    assert result.as_numpy("OUTPUT0")[0, :5].tolist() == [-127, 0, 1, 2, -128]
    assert result.as_numpy("OUTPUT1")[0, :5].tolist() == [127, -2, -1, 0, 126]


def _typed_request(model: str, datatype: str) -> tpb.ModelInferRequest:
    request = tpb.ModelInferRequest(model_name=model, id="typed")
    for k in (0, 1):
        tensor = request.inputs.add(name=f"INPUT{k}", datatype=datatype, shape=[1, 16])
        if datatype == "BYTES":
            strings = [str(i).encode() for i in range(16)] if k == 0 else [b"1"] * 16
            tensor.contents.bytes_contents.extend(strings)
        else:
            numbers = list(range(-8, 8)) if k == 0 else [3] * 16
            tensor.contents.int_contents.extend(numbers)
    request.outputs.add(name="OUTPUT0")
    request.outputs.add(name="OUTPUT1")
    return request


async def _explicit_contents(address: str) -> dict[str, tpb.ModelInferResponse]:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = tpbg.GRPCInferenceServiceStub(channel)
        return {
            datatype: await stub.ModelInfer(_typed_request(model, datatype), timeout=TIMEOUT)
            for model, datatype in (
                ("simple", "INT32"),
                ("simple_int8", "INT8"),
                ("simple_string", "BYTES"),
            )
        }


def test_explicit_int_int8_and_bytes_contents_come_back_raw(address: str) -> None:
    replies = asyncio.run(_explicit_contents(address))
    typed = np.arange(-8, 8)
    for datatype, dtype in (("INT32", "<i4"), ("INT8", "i1")):
        reply = replies[datatype]
        assert reply.id == "typed"
        assert [(o.name, o.datatype, list(o.shape)) for o in reply.outputs] == [
            ("OUTPUT0", datatype, [1, 16]),
            ("OUTPUT1", datatype, [1, 16]),
        ]
        assert not reply.outputs[0].HasField("contents")  # raw, as Triton answers
        sums = np.frombuffer(reply.raw_output_contents[0], dtype=dtype)
        differences = np.frombuffer(reply.raw_output_contents[1], dtype=dtype)
        assert sums.tolist() == (typed + 3).tolist(), datatype
        assert differences.tolist() == (typed - 3).tolist(), datatype
    strings = replies["BYTES"]
    sums = utils.deserialize_bytes_tensor(strings.raw_output_contents[0])
    differences = utils.deserialize_bytes_tensor(strings.raw_output_contents[1])
    assert [int(s) for s in sums] == [i + 1 for i in range(16)]
    assert [int(s) for s in differences] == [i - 1 for i in range(16)]


def test_typed_contents_beside_raw_contents_are_refused(address: str) -> None:
    request = _typed_request("simple", "INT32")
    request.raw_input_contents.append(A.tobytes())
    del request.inputs[1].contents.int_contents[:]
    with grpc.insecure_channel(address) as channel:
        stub = tpbg.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as caught:
            stub.ModelInfer(request, timeout=TIMEOUT)
    error: Any = caught.value
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "contents field must not be specified when using raw_input_contents" in (error.details())
    assert "'simple'" in error.details()


def test_unknown_model_is_not_found_in_tritons_words(client: tc.InferenceServerClient) -> None:
    error = server_error(
        lambda: client.infer("no_such_model", add_sub_inputs(), client_timeout=TIMEOUT)
    )
    assert error.status() == "StatusCode.NOT_FOUND"
    assert "Request for unknown model: 'no_such_model'" in error.message()
    error = server_error(
        lambda: client.infer("simple", add_sub_inputs(), model_version="x", client_timeout=TIMEOUT)
    )
    assert error.status() == "StatusCode.INVALID_ARGUMENT"
    assert "failed to get model version from specified version string 'x'" in error.message()


# -- BYTES ---------------------------------------------------------------------


def test_string_tensors(client: tc.InferenceServerClient) -> None:
    a = np.array([[str(i).encode() for i in range(16)]], dtype=np.object_)
    b = np.array([["1000"] * 16], dtype=np.object_)  # str elements are sent as UTF-8
    inputs = [tc.InferInput(f"INPUT{k}", [1, 16], "BYTES") for k in (0, 1)]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(b)
    result = client.infer("simple_string", inputs, client_timeout=TIMEOUT)
    assert result.as_numpy("OUTPUT0").dtype == np.object_
    assert result.as_numpy("OUTPUT0")[0].tolist() == [str(i + 1000).encode() for i in range(16)]
    assert result.as_numpy("OUTPUT1")[0].tolist() == [str(i - 1000).encode() for i in range(16)]
    assert result.get_output("OUTPUT0").datatype == "BYTES"
    # a string that is not a number: the model's InvalidInput, INVALID_ARGUMENT
    inputs[0].set_data_from_numpy(np.array([["x"] * 16], dtype=np.object_))
    error = server_error(lambda: client.infer("simple_string", inputs, client_timeout=TIMEOUT))
    assert error.status() == "StatusCode.INVALID_ARGUMENT"
    assert "not a decimal integer" in error.message()


def test_bytes_identity_keeps_every_byte(client: tc.InferenceServerClient) -> None:
    values = np.array(
        [[b"", b"\x00\xff\x00", "naïve".encode(), b"x" * 1000], [b"a", b"", b"\n", b"\x01"]],
        dtype=np.object_,
    )
    tensor = tc.InferInput("INPUT0", list(values.shape), "BYTES")
    tensor.set_data_from_numpy(values)
    result = client.infer("simple_identity", [tensor], client_timeout=TIMEOUT)
    got = result.as_numpy("OUTPUT0")
    assert got.shape == (2, 4)
    assert got.tolist() == values.tolist()


# -- asynchronous clients ------------------------------------------------------


def test_async_infer_answers_each_callback(client: tc.InferenceServerClient) -> None:
    done: queue.Queue[tuple[int, Any, Any]] = queue.Queue()
    calls = 12
    for i in range(calls):
        a = np.full((1, 16), i, dtype=np.int32)
        client.async_infer(
            "simple",
            add_sub_inputs(tc, a),
            lambda result, error, i=i: done.put((i, result, error)),
            request_id=f"call-{i}",
            client_timeout=TIMEOUT,
        )
    seen = set()
    for _ in range(calls):
        i, result, error = done.get(timeout=TIMEOUT * 2)
        assert error is None, error
        assert result.get_response().id == f"call-{i}"
        assert_add_sub(result, np.full((1, 16), i, dtype=np.int32))
        seen.add(i)
    assert seen == set(range(calls))


async def _aio_calls(address: str) -> tuple[list[Any], Any, Any]:
    client = tca.InferenceServerClient(address)
    try:
        assert await client.is_server_live()
        assert await client.is_model_ready("simple")
        before = await client.get_inference_statistics(model_name="simple")
        results = await asyncio.gather(
            *(
                client.infer(
                    "simple",
                    add_sub_inputs(tca, np.full((1, 16), i, dtype=np.int32)),
                    outputs=[tca.InferRequestedOutput("OUTPUT0")] if i % 2 else None,
                    request_id=str(i),
                    client_timeout=TIMEOUT,
                    headers={"test": "1"},
                )
                for i in range(8)
            )
        )
        after = await client.get_inference_statistics(model_name="simple")
        return results, before, after
    finally:
        await client.close()


def test_aio_client_infers_concurrently_and_counts_statistics(address: str) -> None:
    results, before, after = asyncio.run(_aio_calls(address))
    for i, result in enumerate(results):
        a = np.full((1, 16), i, dtype=np.int32)
        assert result.get_response().id == str(i)
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + B)
        if i % 2:
            assert result.as_numpy("OUTPUT1") is None
        else:
            np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - B)
    assert [s.name for s in after.model_stats] == ["simple"]
    grew = after.model_stats[0].inference_count - before.model_stats[0].inference_count
    assert grew == 8
    success = after.model_stats[0].inference_stats.success.count
    assert success - before.model_stats[0].inference_stats.success.count == 8


# -- compression, keepalive, channel arguments, per-call arguments ------------


@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
def test_compressed_requests(client: tc.InferenceServerClient, algorithm: str) -> None:
    a = np.zeros((8, 16), dtype=np.int32)  # compresses well
    a[:, 3] = np.arange(8)
    b = np.ones((8, 16), dtype=np.int32)
    result = client.infer(
        "simple",
        add_sub_inputs(tc, a, b),
        client_timeout=TIMEOUT,
        compression_algorithm=algorithm,
    )
    assert_add_sub(result, a, b)
    done: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client.async_infer(
        "simple",
        add_sub_inputs(),
        lambda result, error: done.put((result, error)),
        client_timeout=TIMEOUT,
        compression_algorithm=algorithm,
    )
    result, error = done.get(timeout=TIMEOUT * 2)
    assert error is None, error
    assert_add_sub(result)


async def _aio_compressed(address: str, algorithm: str) -> Any:
    client = tca.InferenceServerClient(address)
    try:
        return await client.infer(
            "simple", add_sub_inputs(tca), client_timeout=TIMEOUT, compression_algorithm=algorithm
        )
    finally:
        await client.close()


@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
def test_compressed_requests_from_aio(address: str, algorithm: str) -> None:
    assert_add_sub(asyncio.run(_aio_compressed(address, algorithm)))


def test_raw_stubs_with_compressed_channel_and_call(address: str) -> None:
    """grpc's own compression: a gzip channel, a deflate call."""
    request = tpb.ModelInferRequest(model_name="simple")
    for k, array in enumerate((A, B)):
        request.inputs.add(name=f"INPUT{k}", datatype="INT32", shape=[1, 16])
        request.raw_input_contents.append(array.tobytes())
    with grpc.insecure_channel(address, compression=grpc.Compression.Gzip) as channel:
        stub = tpbg.GRPCInferenceServiceStub(channel)
        reply = stub.ModelInfer(request, timeout=TIMEOUT, compression=grpc.Compression.Deflate)
    assert reply.raw_output_contents[0] == (A + B).tobytes()


def test_keepalive_options_and_channel_arguments(address: str) -> None:
    keepalive = tc.KeepAliveOptions(
        keepalive_time_ms=2**31 - 1,
        keepalive_timeout_ms=20000,
        keepalive_permit_without_calls=False,
        http2_max_pings_without_data=2,
    )
    with tc.InferenceServerClient(address, keepalive_options=keepalive) as client:
        assert_add_sub(client.infer("simple", add_sub_inputs(), client_timeout=TIMEOUT))
    channel_args = [
        ("grpc.max_send_message_length", 1024 * 1024),
        ("grpc.max_receive_message_length", 600),
        ("grpc.keepalive_time_ms", 10_000),
        ("grpc.keepalive_timeout_ms", 20_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.dns_enable_srv_queries", 1),
    ]
    with tc.InferenceServerClient(address, channel_args=channel_args) as client:
        assert_add_sub(client.infer("simple", add_sub_inputs(), client_timeout=TIMEOUT))
        # the arguments reach the channel: a reply over 600 bytes (8 rows, 1 KiB of
        # outputs) is refused by the client's own receive limit
        big = np.zeros((8, 16), dtype=np.int32)
        error = server_error(
            lambda: client.infer("simple", add_sub_inputs(tc, big, big), client_timeout=TIMEOUT)
        )
        assert error.status() == "StatusCode.RESOURCE_EXHAUSTED"


def test_custom_arguments_headers_request_id_and_deadline(
    client: tc.InferenceServerClient,
) -> None:
    result = client.infer(
        "simple",
        add_sub_inputs(),
        request_id="custom-1",
        headers={"test": "1", "x-trace-me": "no"},
        client_timeout=TIMEOUT,
        timeout=30_000_000,  # the request's own timeout parameter, in microseconds
    )
    assert_add_sub(result)
    assert result.get_response().id == "custom-1"
    # a deadline already spent before the call goes out
    error = server_error(lambda: client.infer("simple", add_sub_inputs(), client_timeout=0.000001))
    assert error.status() == "StatusCode.DEADLINE_EXCEEDED"
    # grpc's own "Deadline Exceeded", or the router's refusal to forward it
    assert error.message() in (
        "Deadline Exceeded",
        "deadline spent before the router could forward the call",
    )


def test_priority_follows_the_schedule_policy_extension(
    client: tc.InferenceServerClient,
) -> None:
    result = client.infer("simple", add_sub_inputs(), priority=0, client_timeout=TIMEOUT)
    assert_add_sub(result)
    # simple declares no priority levels: only 0 (the default) is a level; poolserve
    # refuses the rest where Triton demotes them silently (README, Deadlines)
    error = server_error(
        lambda: client.infer("simple", add_sub_inputs(), priority=1, client_timeout=TIMEOUT)
    )
    assert error.status() == "StatusCode.INVALID_ARGUMENT"
    assert "priority" in error.message()


# -- reuse of infer objects across shared-memory and plain calls ---------------


def test_infer_objects_are_reused_with_and_without_shared_memory(
    client: tc.InferenceServerClient,
) -> None:
    prefix = f"ps_reuse_{uuid.uuid4().hex[:12]}"
    size = A.nbytes
    names = ("input0", "input1", "output0", "output1")
    handles = {
        name: shm.create_shared_memory_region(f"{prefix}_{name}", f"/{prefix}_{name}", size)
        for name in names
    }
    try:
        shm.set_shared_memory_region(handles["input0"], [A])
        shm.set_shared_memory_region(handles["input1"], [B])
        for name in names:
            client.register_system_shared_memory(f"{prefix}_{name}", f"/{prefix}_{name}", size)
        status = client.get_system_shared_memory_status(as_json=True)["regions"]
        assert {f"{prefix}_{name}" for name in names} <= set(status)
        assert status[f"{prefix}_input0"]["byte_size"] in (size, str(size))

        inputs = [tc.InferInput(f"INPUT{k}", [1, 16], "INT32") for k in (0, 1)]
        outputs = [tc.InferRequestedOutput(f"OUTPUT{k}") for k in (0, 1)]

        def through_shm() -> None:
            for k in (0, 1):
                inputs[k].set_shared_memory(f"{prefix}_input{k}", size)
                outputs[k].set_shared_memory(f"{prefix}_output{k}", size)
            result = client.infer("simple", inputs, outputs=outputs, client_timeout=TIMEOUT)
            response = result.get_response()
            # the outputs are in the regions; each still has its (empty) raw entry
            assert list(response.raw_output_contents) == [b"", b""]
            for k, want in ((0, A + B), (1, A - B)):
                output = result.get_output(f"OUTPUT{k}")
                assert (output.datatype, list(output.shape)) == ("INT32", [1, 16])
                got = shm.get_contents_as_numpy(
                    handles[f"output{k}"], utils.triton_to_np_dtype(output.datatype), output.shape
                )
                np.testing.assert_array_equal(got, want)

        through_shm()
        # the same objects, now with data: unset_shared_memory on the outputs,
        # set_data_from_numpy on the inputs replaces their regions
        inputs[0].set_data_from_numpy(A)
        inputs[1].set_data_from_numpy(B * 2)
        for output in outputs:
            output.unset_shared_memory()
        shm.set_shared_memory_region(handles["output0"], [np.zeros_like(A)])
        plain = client.infer("simple", inputs, outputs=outputs, client_timeout=TIMEOUT)
        assert_add_sub(plain, A, B * 2)
        got = shm.get_contents_as_numpy(handles["output0"], np.int32, [1, 16])
        assert not got.any()  # the plain call wrote nothing into the region
        through_shm()  # and back again
    finally:
        for name in names:
            try:
                client.unregister_system_shared_memory(f"{prefix}_{name}")
            finally:
                shm.destroy_shared_memory_region(handles[name])
    regions = client.get_system_shared_memory_status(as_json=True).get("regions", {})
    assert not [r for r in regions if r.startswith(prefix)]


def test_cuda_shared_memory_is_out_of_scope_as_documented(
    client: tc.InferenceServerClient,
) -> None:
    # Triton's examples unregister first: that answers OK with nothing registered
    client.unregister_cuda_shared_memory()
    assert not client.get_cuda_shared_memory_status().regions
    error = server_error(
        lambda: client.register_cuda_shared_memory("gpu_region", b"\x00" * 64, 0, 64)
    )
    assert error.status() == "StatusCode.UNIMPLEMENTED"


# -- classification and image classification ----------------------------------


def test_classification_returns_score_index_label(client: tc.InferenceServerClient) -> None:
    image = np.full((2, 3, 32, 32), 3, dtype=np.float32)
    image[1] = 250
    tensor = tc.InferInput("image", list(image.shape), "FP32")
    tensor.set_data_from_numpy(image)
    output = tc.InferRequestedOutput("probs", class_count=3)
    result = client.infer("classifier", [tensor], outputs=[output], client_timeout=TIMEOUT)
    classes = result.as_numpy("probs")
    assert classes.shape == (2, 3)
    assert result.get_output("probs").datatype == "BYTES"
    rows = [[s.decode().split(":") for s in row] for row in classes]
    # the classifier puts an image in class floor(mean), then t-1, t+1 (lower wins a tie)
    assert [[entry[1:] for entry in row] for row in rows] == [
        [["3", "label_3"], ["2", "label_2"], ["4", "label_4"]],
        [["250", "label_250"], ["249", "label_249"], ["251", "label_251"]],
    ]
    for row in rows:
        scores = [float(entry[0]) for entry in row]
        assert scores == sorted(scores, reverse=True)
        assert 0.5 < scores[0] < 1.0
    # more classes than the output has: every class, once
    output = tc.InferRequestedOutput("probs", class_count=5000)
    every = client.infer("classifier", [tensor], outputs=[output], client_timeout=TIMEOUT)
    indices = [int(s.split(b":")[1]) for s in every.as_numpy("probs")[0]]
    assert sorted(indices) == list(range(1000))


def _nhwc(mean: int) -> np.ndarray:
    image = np.full((299, 299, 3), mean, dtype=np.float32)
    image[::2, ::2, :] += 1  # a pattern, mean still floor()s to `mean`
    image[1::2, 1::2, :] -= 1
    return image[None]


def test_image_classification_through_inception(client: tc.InferenceServerClient) -> None:
    config = client.get_model_config("inception_graphdef").config
    assert config.input[0].format == config.input[0].FORMAT_NHWC
    batch = np.concatenate([_nhwc(17), _nhwc(200)])
    tensor = tc.InferInput("input", list(batch.shape), "FP32")
    tensor.set_data_from_numpy(batch)
    name = "InceptionV3/Predictions/Softmax"
    output = tc.InferRequestedOutput(name, class_count=1)
    result = client.infer("inception_graphdef", [tensor], outputs=[output], client_timeout=TIMEOUT)
    top = [row[0].decode().split(":") for row in result.as_numpy(name)]
    assert [entry[1:] for entry in top] == [["17", "class_0017"], ["200", "class_0200"]]
    # the scores themselves, unclassified: a softmax per image
    scores = client.infer("inception_graphdef", [tensor], client_timeout=TIMEOUT).as_numpy(name)
    assert scores.shape == (2, 1001)
    assert scores.dtype == np.float32
    np.testing.assert_allclose(scores.sum(axis=1), [1.0, 1.0], rtol=1e-5)
    assert scores.argmax(axis=1).tolist() == [17, 200]


def test_image_classification_with_raw_stubs(address: str) -> None:
    request = tpb.ModelInferRequest(model_name="inception_graphdef", id="my request id")
    request.inputs.add(name="input", datatype="FP32", shape=[1, 299, 299, 3])
    request.outputs.add(name="InceptionV3/Predictions/Softmax")
    image = _nhwc(42)
    request.raw_input_contents.append(image.astype("<f4").tobytes())
    assert len(request.raw_input_contents[0]) == 299 * 299 * 3 * 4
    with grpc.insecure_channel(address) as channel:
        reply = tpbg.GRPCInferenceServiceStub(channel).ModelInfer(request, timeout=TIMEOUT)
    assert reply.id == "my request id"
    assert list(reply.outputs[0].shape) == [1, 1001]
    scores = np.frombuffer(reply.raw_output_contents[0], dtype="<f4")
    assert int(scores.argmax()) == 42
    # the wrong number of bytes for the shape is refused
    del request.raw_input_contents[:]
    request.raw_input_contents.append(b"\x00" * 1000)
    with grpc.insecure_channel(address) as channel, pytest.raises(grpc.RpcError) as caught:
        tpbg.GRPCInferenceServiceStub(channel).ModelInfer(request, timeout=TIMEOUT)
    error: Any = caught.value
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT


def _png(rgb: tuple[int, int, int], size: tuple[int, int] = (40, 30)) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", size, rgb).save(buffer, format="PNG")
    return buffer.getvalue()


def test_encoded_images_through_the_ensemble_stand_in(client: tc.InferenceServerClient) -> None:
    files = np.array([[_png((200, 200, 200))], [_png((10, 20, 30), (7, 5))]], dtype=np.object_)
    tensor = tc.InferInput("INPUT", [2, 1], "BYTES")
    tensor.set_data_from_numpy(files)
    output = tc.InferRequestedOutput("OUTPUT", class_count=2)
    result = client.infer(
        "preprocess_inception_ensemble", [tensor], outputs=[output], client_timeout=TIMEOUT
    )
    top = [[s.decode().split(":")[1:] for s in row] for row in result.as_numpy("OUTPUT")]
    assert [row[0] for row in top] == [["200", "class_0200"], ["20", "class_0020"]]
    assert {tuple(top[0][1])} <= {("199", "class_0199"), ("201", "class_0201")}
    tensor = tc.InferInput("INPUT", [1, 1], "BYTES")
    tensor.set_data_from_numpy(np.array([[b"not an image"]], dtype=np.object_))
    error = server_error(
        lambda: client.infer("preprocess_inception_ensemble", [tensor], client_timeout=TIMEOUT)
    )
    assert error.status() == "StatusCode.INVALID_ARGUMENT"
    assert "not an image file" in error.message()


# -- model control -------------------------------------------------------------


def test_model_control_with_a_config_override(client: tc.InferenceServerClient) -> None:
    index = {m.name: m.state for m in client.get_model_repository_index().models}
    assert set(index) == SERVED
    assert set(index.values()) == {"READY"}
    try:
        client.load_model("simple", client_timeout=120)
        assert client.is_model_ready("simple")
        # malformed JSON in the config parameter: refused in Triton's words
        error = server_error(
            lambda: client.load_model(
                "simple", config='"parameters": {"config": {{"max_batch_size": "16"}}}'
            )
        )
        assert "failed to load 'simple'" in error.message()
        assert client.get_model_config("simple").config.max_batch_size == 8
        # 64-bit integers as strings, as ModelConfig's JSON writes them
        client.load_model("simple", config='{"max_batch_size":"16"}', client_timeout=120)
        assert client.get_model_config("simple").config.max_batch_size == 16
        a = np.arange(16 * 16, dtype=np.int32).reshape(16, 16)
        assert_add_sub(
            client.infer("simple", add_sub_inputs(tc, a, a), client_timeout=TIMEOUT), a, a
        )
        # the configuration as read, sent back
        read = client.get_model_config("simple", as_json=True)["config"]
        client.load_model("simple", config=json.dumps(read), client_timeout=120)
        assert client.get_model_config("simple").config.max_batch_size == 16

        client.unload_model("simple", client_timeout=120)
        assert not client.is_model_ready("simple")
        index = {m.name: m.state for m in client.get_model_repository_index().models}
        assert set(index) == SERVED  # an unloaded model is still in the index
        # Triton says UNAVAILABLE, reason "unloaded"; poolserve UNLOADED (README)
        assert index["simple"] == "UNLOADED"
        error = server_error(
            lambda: client.infer("simple", add_sub_inputs(), client_timeout=TIMEOUT)
        )
        assert error.status() in ("StatusCode.UNAVAILABLE", "StatusCode.NOT_FOUND")
        ready = client.get_model_repository_index(as_json=True)["models"]
        assert len(ready) == len(SERVED)

        error = server_error(lambda: client.load_model("wrong_model_name", client_timeout=120))
        assert "failed to load 'wrong_model_name'" in error.message()
    finally:
        client.load_model("simple", client_timeout=120)  # without a config: the repository's
    assert client.is_model_ready("simple")
    assert client.get_model_config("simple").config.max_batch_size == 8
    assert_add_sub(client.infer("simple", add_sub_inputs(), client_timeout=TIMEOUT))


# -- sequences -----------------------------------------------------------------

VALUES = [11, 7, 5, 3, 2, 0, 1]
INT_IDS = (1000, 1001)
STRING_ID = "1002"


def sequences(dyna: bool) -> dict[int | str, tuple[str, list[int], list[int]]]:
    """sequence id -> (model, values sent, OUTPUT expected request by request).

    simple_sequence: INPUT + START. simple_dyna_sequence: INPUT + START, + CORRID
    (UINT64) on the END request. simple_string_dyna_sequence: an accumulator
    from START, + CORRID (BYTES, decoded) at END."""
    up = [0, *VALUES]
    down = [100] + [-v for v in VALUES]
    string = [20] + [-v for v in VALUES]
    starts = [1] + [0] * len(VALUES)
    if not dyna:
        plain: dict[int | str, tuple[str, list[int]]] = {
            INT_IDS[0]: ("simple_sequence", up),
            INT_IDS[1]: ("simple_sequence", down),
            f"{uuid.uuid4()}": ("simple_sequence", string),
        }
        return {
            sid: (model, sent, [v + s for v, s in zip(sent, starts, strict=True)])
            for sid, (model, sent) in plain.items()
        }
    ends = [0] * len(VALUES) + [1]

    def dyna_int(sid: int, sent: list[int]) -> list[int]:
        return [v + s + e * sid for v, s, e in zip(sent, starts, ends, strict=True)]

    accumulated = list(np.cumsum(string))
    accumulated[-1] += int(STRING_ID)
    return {
        INT_IDS[0]: ("simple_dyna_sequence", up, dyna_int(INT_IDS[0], up)),
        INT_IDS[1]: ("simple_dyna_sequence", down, dyna_int(INT_IDS[1], down)),
        STRING_ID: ("simple_string_dyna_sequence", string, [int(v) for v in accumulated]),
    }


def test_the_expected_dyna_values_are_tritons() -> None:
    """The values Triton's sequence clients expect in their dyna mode, by hand."""
    plan = sequences(dyna=True)
    assert plan[1000][2] == [1, 11, 7, 5, 3, 2, 0, 1001]
    assert plan[1001][2] == [101, -11, -7, -5, -3, -2, 0, 1000]
    assert plan["1002"][2] == [20, 9, 2, -3, -6, -8, -8, 993]


def value_input(module: Any, value: int) -> list[Any]:
    tensor = module.InferInput("INPUT", [1, 1], "INT32")
    tensor.set_data_from_numpy(np.full((1, 1), value, dtype=np.int32))
    return [tensor]


def sequence_offset(dyna: bool, sid: int | str, salt: int) -> int | str:
    """Distinct ids per test, so that no test meets another's sequence; the dyna
    models' outputs depend on the id, so those keep the planned ones."""
    return sid if dyna or isinstance(sid, str) else sid + salt


@pytest.mark.parametrize("dyna", [False, True], ids=["simple_sequence", "dyna"])
def test_sequences_with_synchronous_calls(client: tc.InferenceServerClient, dyna: bool) -> None:
    plan = sequences(dyna)
    got: dict[int | str, list[int]] = {sid: [] for sid in plan}
    length = len(VALUES) + 1
    for step in range(length):  # the sequences interleaved, request by request
        for sid, (model, sent, _) in plan.items():
            result = client.infer(
                model,
                value_input(tc, sent[step]),
                outputs=[tc.InferRequestedOutput("OUTPUT")],
                sequence_id=sequence_offset(dyna, sid, 10),
                sequence_start=step == 0,
                sequence_end=step == length - 1,
                client_timeout=TIMEOUT,
            )
            got[sid].append(int(result.as_numpy("OUTPUT")[0, 0]))
    assert got == {sid: expected for sid, (_, _, expected) in plan.items()}


@pytest.mark.parametrize("dyna", [False, True], ids=["simple_sequence", "dyna"])
def test_sequences_on_one_stream(address: str, dyna: bool) -> None:
    plan = sequences(dyna)
    length = len(VALUES) + 1
    replies: queue.Queue[tuple[Any, Any]] = queue.Queue()
    with tc.InferenceServerClient(address) as client:
        client.start_stream(
            callback=lambda result, error: replies.put((result, error)),
            stream_timeout=TIMEOUT * 2,
        )
        for sid, (model, sent, _) in plan.items():  # one sequence after the other
            for step in range(length):
                client.async_stream_infer(
                    model,
                    value_input(tc, sent[step]),
                    outputs=[tc.InferRequestedOutput("OUTPUT")],
                    request_id=f"{sid}_{step}",
                    sequence_id=sequence_offset(dyna, sid, 20),
                    sequence_start=step == 0,
                    sequence_end=step == length - 1,
                )
        got: dict[str, dict[int, int]] = {str(sid): {} for sid in plan}
        for _ in range(len(plan) * length):
            result, error = replies.get(timeout=TIMEOUT * 2)
            assert error is None, error
            sid, step = result.get_response().id.rsplit("_", 1)
            got[sid][int(step)] = int(result.as_numpy("OUTPUT")[0, 0])
        client.stop_stream()
    for sid, (_, _, expected) in plan.items():
        assert [got[str(sid)][step] for step in range(length)] == expected, sid


async def _aio_stream(
    address: str, dyna: bool, plan: dict[int | str, tuple[str, list[int], list[int]]]
) -> dict[str, list[int]]:
    length = len(VALUES) + 1

    async def requests() -> AsyncIterator[dict[str, Any]]:
        for step in range(length):  # interleaved on the stream
            for sid, (model, sent, _) in plan.items():
                yield {
                    "model_name": model,
                    "inputs": value_input(tca, sent[step]),
                    "outputs": [tca.InferRequestedOutput("OUTPUT")],
                    "request_id": f"{sid}_{step}",
                    "sequence_id": sequence_offset(dyna, sid, 30),
                    "sequence_start": step == 0,
                    "sequence_end": step == length - 1,
                }

    got: dict[str, list[tuple[int, int]]] = {str(sid): [] for sid in plan}
    client = tca.InferenceServerClient(address)
    try:
        replies = client.stream_infer(requests(), stream_timeout=TIMEOUT * 2)
        count = 0
        async for result, error in replies:
            assert error is None, error
            sid, step = result.get_response().id.rsplit("_", 1)
            got[sid].append((int(step), int(result.as_numpy("OUTPUT")[0, 0])))
            count += 1
            if count == len(plan) * length:
                break
    finally:
        await client.close()
    return {sid: [value for _, value in sorted(steps)] for sid, steps in got.items()}


@pytest.mark.parametrize("dyna", [False, True], ids=["simple_sequence", "dyna"])
def test_sequences_on_an_aio_stream(address: str, dyna: bool) -> None:
    plan = sequences(dyna)
    got = asyncio.run(_aio_stream(address, dyna, plan))
    assert got == {str(sid): expected for sid, (_, _, expected) in plan.items()}


async def _raw_stream(address: str, requests: list[tpb.ModelInferRequest]) -> list[Any]:
    async with grpc.aio.insecure_channel(address) as channel:
        call = tpbg.GRPCInferenceServiceStub(channel).ModelStreamInfer(timeout=TIMEOUT * 2)
        replies = []
        for request in requests:  # one at a time: each answer before the next request
            await call.write(request)
            replies.append(await call.read())
        await call.done_writing()
        assert await call.read() == grpc.aio.EOF  # type: ignore[attr-defined]
        return replies


def test_uint64_and_string_sequence_ids_on_a_raw_aio_stream(address: str) -> None:
    """An id tritonclient cannot send: a uint64_param past int64, interleaved
    with int64 id 1000 (its low 32 bits) and the string id. Were the uint64 id
    cut to 32 or 63 bits, the two integer sequences would be one, and the
    second END would find it ended. CORRID (UINT64) carries the id to the
    model, which adds it at END modulo 2**32 (its output is INT32)."""
    big = 2**63 + 1000
    up = [0, *VALUES]
    down = [100] + [-v for v in VALUES]
    _, string, expected_string = sequences(dyna=True)[STRING_ID]
    last = len(up) - 1
    plan: list[tuple[str, int | str, list[int]]] = [
        ("simple_dyna_sequence", big, up),
        ("simple_dyna_sequence", 1000, down),
        ("simple_string_dyna_sequence", STRING_ID, string),
    ]
    requests = []
    for step in range(last + 1):
        for model, sid, sent in plan:
            request = tpb.ModelInferRequest(model_name=model, id=f"{sid}_{step}")
            request.inputs.add(name="INPUT", datatype="INT32", shape=[1, 1])
            request.raw_input_contents.append(np.int32(sent[step]).tobytes())
            if isinstance(sid, str):
                request.parameters["sequence_id"].string_param = sid
            elif sid > 2**63 - 1:
                request.parameters["sequence_id"].uint64_param = sid
            else:
                request.parameters["sequence_id"].int64_param = sid
            request.parameters["sequence_start"].bool_param = step == 0
            request.parameters["sequence_end"].bool_param = step == last
            requests.append(request)
    replies = asyncio.run(_raw_stream(address, requests))
    assert [r.error_message for r in replies] == [""] * len(requests)
    assert [r.infer_response.id for r in replies] == [r.id for r in requests]
    got: dict[str, list[int]] = {}
    for reply in replies:
        sid = reply.infer_response.id.rsplit("_", 1)[0]
        value = np.frombuffer(reply.infer_response.raw_output_contents[0], "<i4")[0]
        got.setdefault(sid, []).append(int(value))
    assert got == {
        str(big): [1, 11, 7, 5, 3, 2, 0, 1 + 1000],  # + (2**63 + 1000) mod 2**32
        "1000": [101, -11, -7, -5, -3, -2, 0, -1 + 1000],
        STRING_ID: expected_string,
    }


def test_a_sequence_request_without_start_is_refused(client: tc.InferenceServerClient) -> None:
    error = server_error(
        lambda: client.infer(
            "simple_sequence",
            value_input(tc, 1),
            sequence_id=987_654,
            client_timeout=TIMEOUT,
        )
    )
    assert error.status() in ("StatusCode.INVALID_ARGUMENT", "StatusCode.FAILED_PRECONDITION")
    assert "987654" in error.message()


# -- decoupled: many responses per request --------------------------------------


def repeat_inputs(values: np.ndarray, delay_ms: int) -> list[Any]:
    inputs = [
        tc.InferInput("IN", [len(values)], "INT32"),
        tc.InferInput("DELAY", [len(values)], "UINT32"),
        tc.InferInput("WAIT", [1], "UINT32"),
    ]
    inputs[0].set_data_from_numpy(values.astype(np.int32))
    inputs[1].set_data_from_numpy(np.full(len(values), delay_ms, dtype=np.uint32))
    inputs[2].set_data_from_numpy(np.array([delay_ms], dtype=np.uint32))
    return inputs


@pytest.mark.parametrize("compression", [None, "gzip"])
def test_decoupled_repeat_answers_one_request_many_times(
    address: str, compression: str | None
) -> None:
    values = np.arange(100, 110)
    replies: queue.Queue[tuple[Any, Any]] = queue.Queue()
    with tc.InferenceServerClient(address) as client:
        client.start_stream(
            callback=lambda result, error: replies.put((result, error)),
            compression_algorithm=compression,
        )
        client.async_stream_infer(
            "repeat_int32",
            repeat_inputs(values, 5),
            outputs=[tc.InferRequestedOutput("OUT"), tc.InferRequestedOutput("IDX")],
            request_id="repeat",
            enable_empty_final_response=True,
        )
        got = []
        while True:
            result, error = replies.get(timeout=TIMEOUT * 2)
            assert error is None, error
            response = result.get_response()
            assert response.id == "repeat"
            final = response.parameters["triton_final_response"].bool_param
            if final:
                assert not response.outputs
                break
            out, idx = result.as_numpy("OUT"), result.as_numpy("IDX")
            assert out.shape == (1,)
            got.append((int(out[0]), int(idx[0])))
        client.stop_stream()
    assert got == [(100 + i, i) for i in range(10)]  # in order, one element each


def test_decoupled_model_refuses_unary_infer(client: tc.InferenceServerClient) -> None:
    error = server_error(
        lambda: client.infer("repeat_int32", repeat_inputs(np.arange(3), 0), client_timeout=TIMEOUT)
    )
    assert error.status() == "StatusCode.UNIMPLEMENTED"
    assert "doesn't support models with decoupled transaction policy" in error.message()
