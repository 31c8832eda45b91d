"""RepositoryModelLoad's parameters: Triton's config override, applied or refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from poolserve.protos import inference_pb2 as pb
from poolserve.service.contract.errors import InvalidInput, Unimplemented
from poolserve.service.contract.repository import ModelSettings, TensorSpec
from poolserve.service.poolserver.load_request import LoadRequest, parse_load_request

ECHO = ModelSettings(
    name="echo",
    implementation="model.EchoModel",
    folder=Path("/repo/echo"),
    source=Path("/repo/echo/model-settings.json"),
    extra={"kept": 1},
    inputs=(TensorSpec("INPUT0", "FP32", (1, 16)),),
    outputs=(TensorSpec("OUTPUT0", "FP32", (1, 16)),),
)
SPECS = (ECHO.inputs, ECHO.outputs)


def load(config: object = None, **params: pb.ModelRepositoryParameter) -> LoadRequest:
    request = pb.RepositoryModelLoadRequest(model_name="echo")
    if isinstance(config, pb.ModelRepositoryParameter):
        request.parameters["config"].CopyFrom(config)
    elif config is not None:
        text = config if isinstance(config, str) else json.dumps(config)
        request.parameters["config"].string_param = text
    for key, value in params.items():
        request.parameters[key.replace("__", ":")].CopyFrom(value)
    return parse_load_request(request)


def test_no_parameters_is_a_plain_load() -> None:
    request = load()
    assert request == LoadRequest("echo")
    assert request.apply(ECHO, SPECS) == ECHO
    assert request.overrides(ECHO) == {}


def test_max_batch_size_and_parameters_are_applied_in_tritons_json_form() -> None:
    request = load({"max_batch_size": "16", "parameters": {"k": {"string_value": "v"}, "n": 2}})
    applied = request.apply(ECHO, SPECS)
    assert applied.max_batch_size == 16
    assert applied.extra == {"kept": 1, "k": "v", "n": 2}
    assert request.overrides(applied) == {"max_batch_size": 16, "extra": applied.extra}
    assert load({"max_batch_size": 4}).apply(ECHO, SPECS).max_batch_size == 4


def test_equal_overrides_have_equal_keys_whatever_the_field_order() -> None:
    a = load('{"max_batch_size": 2, "parameters": {"a": 1}}')
    b = load('{"parameters": {"a": 1}, "max_batch_size": 2}')
    assert a.key == b.key != load().key


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ("{not json", "config is not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
        ({"max_batch_size": "sixteen"}, "'max_batch_size' must be an integer"),
        ({"max_batch_size": True}, "'max_batch_size' must be an integer"),
        ({"max_batch_size": -1}, "out of range"),
        ({"max_batch_size": str(2**40)}, "out of range"),
        ({"parameters": [1]}, "'parameters' must be an object"),
        ({"parameters": {"k": {"int_value": 1}}}, "'parameters.k' must be"),
        (
            {"instance_group": [], "dynamic_batching": {}, "max_batch_size": 1},
            "config fields not supported by poolserve: dynamic_batching, instance_group",
        ),
        ("x" * 20_000, "larger than"),
    ],
)
def test_config_poolserve_cannot_honour_is_refused_by_name(config: object, message: str) -> None:
    with pytest.raises(InvalidInput, match=message):
        load(config)


def test_file_overrides_are_unimplemented_and_say_so() -> None:
    content = pb.ModelRepositoryParameter(bytes_param=b"\0")
    with pytest.raises(Unimplemented, match=r"'file:1/model\.onnx': file overrides"):
        load({"max_batch_size": 1}, **{"file__1/model.onnx": content})


def test_unknown_parameters_and_a_config_that_is_not_a_string_are_refused() -> None:
    with pytest.raises(InvalidInput, match="unknown parameter 'zap'"):
        load(zap=pb.ModelRepositoryParameter(bool_param=True))
    with pytest.raises(InvalidInput, match="'config' must be a string_param"):
        load(config=pb.ModelRepositoryParameter(bytes_param=b"{}"))


def test_fields_that_agree_with_the_model_are_accepted() -> None:
    config = {
        "name": "echo",
        "platform": "poolserve_python",
        "backend": "python",
        "max_batch_size": 0,
        "input": [{"name": "INPUT0", "data_type": "TYPE_FP32", "dims": ["1", "16"]}],
        "output": [{"name": "OUTPUT0", "data_type": 11, "dims": [1, 16]}],  # 11: TYPE_FP32
    }
    assert load(config).apply(ECHO, SPECS) == ECHO
    batched = {"max_batch_size": 8, "input": [{"name": "INPUT0", "dims": [16]}]}
    assert load(batched).apply(ECHO, SPECS).max_batch_size == 8  # dims without the batch


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"name": "other"}, "'name' is 'other' but the model's is 'echo'"),
        ({"backend": "onnxruntime"}, "'backend' is 'onnxruntime'"),
        ({"platform": "tensorflow_savedmodel"}, "'platform'"),
        ({"input": [{"name": "X"}]}, r"'input\[0\]' names 'X'"),
        ({"input": [{"name": "INPUT0", "data_type": "TYPE_INT8"}]}, "is FP32"),
        ({"input": [{"name": "INPUT0", "dims": [16]}]}, r"has dims \[1, 16\]"),
        ({"output": [{"name": "OUTPUT0", "format": "FORMAT_NCHW"}]}, "'output\\[0\\].format'"),
        ({"input": "INPUT0"}, "'input' must be a list"),
    ],
)
def test_fields_that_disagree_with_the_model_are_refused(config: object, message: str) -> None:
    with pytest.raises(InvalidInput, match=message):
        load(config).apply(ECHO, SPECS)


def test_tensors_cannot_be_checked_against_a_model_that_declares_none() -> None:
    request = load({"input": [{"name": "INPUT0"}]})
    with pytest.raises(InvalidInput, match="cannot be checked"):
        request.apply(ECHO, ((), ()))
