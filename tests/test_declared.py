"""Declared input datatypes and shapes are enforced, in Triton's words (issue 28 §10).

Each path a request takes to a model is driven here in-process: a worker's
or inline model's :func:`infer`, a batch (:func:`run_batch`), a decoupled
stream (:func:`stream_infer`) and an input in shared memory. The same
checks through real trees are in test_protocol (workers and inline),
test_pipeline and test_inprocess (tritonclient), and test_mlserver (MLServer
models, and their strings that are not UTF-8). The messages are Triton core's (src/infer_request.cc,
src/model.cc, r24.10).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from poolserve.protos import inference_pb2 as pb
from poolserve.service.contract.errors import Failure, InvalidInput
from poolserve.service.contract.repository import ModelSettings, TensorSpec
from poolserve.service.contract.sequence import ControlInput, SequencePolicy
from poolserve.service.inference.batch import run_batch
from poolserve.service.inference.codec import decode_inputs, decode_outputs, encode_inputs
from poolserve.service.inference.declared import DeclaredInputs
from poolserve.service.inference.infer import infer
from poolserve.service.inference.model import Array, Model, declared_inputs
from poolserve.service.inference.stream import stream_infer
from poolserve.service.poolcore.frames import HEADER, Reply, join_frames, parse_reply
from poolserve.service.runtimes.mlmodel import not_utf8


class Identity(Model):
    """Answers every input as an output of the same name, prefixed OUT_."""

    def predict(self, inputs: dict[str, Array], parameters: dict[str, object]) -> dict[str, Array]:
        return {"OUT_" + name: value for name, value in inputs.items()}

    def predict_stream(self, inputs: dict[str, Array], parameters: dict[str, object]) -> Any:
        yield self.predict(inputs, parameters)


def spec(name: str, datatype: str, *shape: int) -> TensorSpec:
    return TensorSpec(name, datatype, tuple(shape))


def model(*specs: TensorSpec, max_batch_size: int = 0, **fields: Any) -> Identity:
    return Identity(
        ModelSettings(
            name="m",
            implementation="model.Identity",
            folder=Path("/nowhere/m"),
            source=Path("/nowhere/m/model-settings.json"),
            inputs=specs,
            max_batch_size=max_batch_size,
            **fields,
        )
    )


def body(**inputs: np.ndarray) -> bytes:
    request = pb.ModelInferRequest(model_name="m")
    encode_inputs(inputs, request, raw=True)
    return request.SerializeToString()


def refused(m: Model, **inputs: np.ndarray) -> str:
    with pytest.raises(InvalidInput) as info:
        infer(m, body(**inputs))
    return info.value.message


def answered(m: Model, **inputs: np.ndarray) -> dict[str, np.ndarray]:
    reply, _ = infer(m, body(**inputs))
    return decode_outputs(pb.ModelInferResponse.FromString(reply))


FP32_16 = spec("INPUT0", "FP32", 1, 16)


def test_a_datatype_other_than_the_declared_one_is_refused() -> None:
    message = refused(model(FP32_16), INPUT0=np.zeros((1, 16), np.int32))
    assert message == "inference input 'INPUT0' data-type is 'INT32', but model 'm' expects 'FP32'"


def test_a_shape_other_than_the_declared_one_is_refused() -> None:
    message = refused(model(FP32_16), INPUT0=np.zeros((1, 3), np.float32))
    assert message == (
        "unexpected shape for input 'INPUT0' for model 'm'. Expected [1,16], got [1,3]."
    )
    message = refused(model(FP32_16), INPUT0=np.zeros(16, np.float32))  # another rank
    assert message.endswith("Expected [1,16], got [16].")


def test_a_wildcard_dimension_takes_any_size() -> None:
    for shape in ((1, 16), (7, 16), (0, 16)):
        got = answered(model(spec("INPUT0", "FP32", -1, 16)), INPUT0=np.ones(shape, np.float32))
        assert got["OUT_INPUT0"].shape == shape
    free = model(spec("INPUT0", "FP32", -1, -1))
    assert answered(free, INPUT0=np.ones((2, 9), np.float32))["OUT_INPUT0"].shape == (2, 9)
    assert "Expected [-1,-1], got [18]." in refused(free, INPUT0=np.ones(18, np.float32))
    assert "Expected [-1,16], got [7,15]." in refused(
        model(spec("INPUT0", "FP32", -1, 16)), INPUT0=np.ones((7, 15), np.float32)
    )


def test_with_max_batch_size_the_first_dimension_is_the_batch() -> None:
    batched = model(spec("INPUT0", "FP32", -1, 16), max_batch_size=8)
    assert answered(batched, INPUT0=np.ones((8, 16), np.float32))["OUT_INPUT0"].shape == (8, 16)
    assert (
        refused(batched, INPUT0=np.ones((9, 16), np.float32))
        == "inference request batch-size must be <= 8 for 'm'"
    )
    message = refused(batched, INPUT0=np.ones((2, 15), np.float32))
    assert message.startswith(
        "unexpected shape for input 'INPUT0' for model 'm'. Expected [-1,16], got [2,15]. "
        "NOTE: Setting a non-zero max_batch_size in the model config requires a batch "
        "dimension to be prepended to each input shape."
    )
    assert "Expected [-1,16], got [4]." in refused(batched, INPUT0=np.ones(4, np.float32))
    assert refused(batched, INPUT0=np.float32(1.0).reshape(())) == (
        "input 'INPUT0' has no shape but model requires batch dimension for 'm'"
    )
    # the declared first dimension is the batch's, whatever it says (Triton: -1)
    fixed = model(spec("INPUT0", "FP32", 1, 16), max_batch_size=8)
    assert answered(fixed, INPUT0=np.ones((5, 16), np.float32))["OUT_INPUT0"].shape == (5, 16)
    two = model(spec("A", "FP32", -1, 2), spec("B", "INT64", -1), max_batch_size=4)
    assert refused(two, A=np.ones((2, 2), np.float32), B=np.ones(3, np.int64)) == (
        "input 'B' batch size does not match other inputs for 'm'"
    )
    got = answered(two, A=np.ones((3, 2), np.float32), B=np.ones(3, np.int64))
    assert got["OUT_B"].shape == (3,)


def test_a_model_that_declares_no_inputs_takes_anything() -> None:
    bare = model()
    assert declared_inputs(bare) is None
    got = answered(bare, INPUT0=np.ones((2, 3), np.int32), x=np.array([b"a"], dtype=object))
    assert got["OUT_INPUT0"].dtype == np.int32 and got["OUT_x"].tolist() == [b"a"]


def test_a_missing_an_unknown_or_an_extra_input_is_refused_as_triton_does() -> None:
    two = model(spec("A", "FP32", -1), spec("B", "FP32", -1))
    one = np.ones(2, np.float32)
    assert refused(two, A=one) == (
        "expected 2 inputs but got 1 inputs for model 'm'. Got input(s) ['A'], but missing "
        "required input(s) ['B']. Please provide all required input(s)."
    )
    assert refused(two, A=one, C=one) == "unexpected inference input 'C' for model 'm'"
    assert refused(two, A=one, B=one, C=one) == (
        "expected 2 inputs but got 3 inputs for model 'm'. Got input(s) ['A','B','C'], but "
        "missing required input(s) []. Please provide all required input(s)."
    )


def test_what_a_declaration_leaves_out_is_not_checked() -> None:
    loose = model(spec("any_type", "", 2), spec("any_shape", "INT32"))
    got = answered(
        loose, any_type=np.array([b"a", b"b"], dtype=object), any_shape=np.ones((3, 1), np.int32)
    )
    assert set(got) == {"OUT_any_type", "OUT_any_shape"}
    assert "expects 'INT32'" in refused(
        loose, any_type=np.ones(2, np.int8), any_shape=np.ones(3, np.int64)
    )


def test_sequence_control_inputs_are_the_servers_to_fill_not_required() -> None:
    policy = SequencePolicy(controls=(ControlInput("START", "START", "INT32"),))
    seq = model(spec("INPUT", "INT32", 1), spec("START", "INT32", 1), sequence=policy)
    table = declared_inputs(seq)
    assert table is not None and set(table.inputs) == {"INPUT"}
    request = pb.ModelInferRequest(model_name="m")
    encode_inputs({"INPUT": np.ones(1, np.int32)}, request, raw=True)
    request.parameters["sequence_id"].int64_param = 5
    request.parameters["sequence_start"].bool_param = True
    reply, _ = infer(seq, request.SerializeToString())
    got = decode_outputs(pb.ModelInferResponse.FromString(reply))
    assert got["OUT_START"].tolist() == [1]
    with pytest.raises(InvalidInput, match="the server fills it in"):
        infer(seq, body(INPUT=np.ones(1, np.int32), START=np.ones(1, np.int32)))


def test_an_input_in_shared_memory_is_checked_like_any_other() -> None:
    request = pb.ModelInferRequest(model_name="m")
    tensor = request.inputs.add(name="INPUT0", datatype="INT32", shape=[1, 16])
    tensor.parameters["shared_memory_region"].string_param = "r"

    def read(_: Any) -> np.ndarray:
        return np.zeros((1, 16), np.int32)

    table = declared_inputs(model(FP32_16))
    with pytest.raises(InvalidInput, match="data-type is 'INT32', but model 'm' expects 'FP32'"):
        decode_inputs(request, read, declared=table)
    tensor.datatype = "FP32"
    assert decode_inputs(request, lambda _: np.zeros((1, 16), np.float32), declared=table)


def replies(frames: Sequence[Any]) -> list[Reply]:
    out = []
    for frame in frames:
        data = join_frames([frame])
        _, kind, seq = HEADER.unpack_from(data)
        out.append(parse_reply(kind, seq, data[HEADER.size :]))
    return out


def test_a_batch_refuses_the_request_that_breaks_the_declaration_and_runs_the_rest() -> None:
    batched = model(spec("INPUT0", "FP32", -1, 4), max_batch_size=8)
    good, bad = np.ones((2, 4), np.float32), np.ones((2, 4), np.float64)
    got = replies(run_batch({"m": batched}, [body(INPUT0=good), body(INPUT0=bad)]))
    assert got[0].failure is None
    assert got[1].failure is Failure.INVALID_INPUT
    assert got[1].message == (
        "inference input 'INPUT0' data-type is 'FP64', but model 'm' expects 'FP32'"
    )


def test_a_stream_is_refused_before_the_model_runs() -> None:
    frames = stream_infer(model(FP32_16), body(INPUT0=np.ones((1, 16), np.int64)), {}, 1)
    with pytest.raises(InvalidInput, match="data-type is 'INT64', but model 'm' expects 'FP32'"):
        next(iter(frames))


def test_the_table_is_built_once_per_model() -> None:
    m = model(FP32_16)
    first = declared_inputs(m)
    assert isinstance(first, DeclaredInputs) and declared_inputs(m) is first
    assert first.inputs["INPUT0"].dims == (1, 16)


def test_names_and_shapes_a_client_sends_are_clipped_in_messages() -> None:
    huge = "x" * 5000
    message = refused(model(FP32_16), **{huge: np.ones((1, 16), np.float32)})
    assert message.startswith("unexpected inference input 'xxx") and len(message) < 400


# -- MLServer models --------------------------------------------------------------
# Served by workers in test_mlserver (invalid UTF-8 and a declared datatype,
# through a real tree): MLServer's dataplane_pb2 cannot be imported in this
# process once test_triton_client_examples has imported tritonclient (both
# register protobuf package "inference"). Here, the mapping alone.


@pytest.mark.parametrize("raw", [True, False])
def test_the_input_that_is_not_utf8_is_named(raw: bool) -> None:
    request = pb.ModelInferRequest(model_name="wordcount")
    request.inputs.add(name="n", datatype="INT64", shape=[1]).contents.int64_contents.append(1)
    values = [b"fine", "caf\u00e9".encode(), b"\xe9t\xe9"]
    text = request.inputs.add(name="text", datatype="BYTES", shape=[3])
    if raw:
        request.inputs[0].ClearField("contents")
        request.raw_input_contents.append(np.ones(1, "<i8").tobytes())
        request.raw_input_contents.append(
            b"".join(len(v).to_bytes(4, "little") + v for v in values)
        )
    else:
        text.contents.bytes_contents.extend(values)
    try:
        b"\xe9t\xe9".decode()
    except UnicodeDecodeError as exc:
        error = not_utf8("wordcount", request, exc)
    assert isinstance(error, InvalidInput)
    assert error.message == (
        "input 'text' of model 'wordcount': BYTES element 2 is not valid UTF-8 "
        "(invalid continuation byte at byte 0); a string input must be UTF-8"
    )
