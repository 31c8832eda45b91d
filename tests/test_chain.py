"""An ensemble's steps in one worker (contract/chain.py, inference/chain.py), in-process.

The worker's side of a chain, driven as a worker's handler runs it
(:func:`infer_named` on the models it holds): the steps' tensors passed on
by name, the outputs asked for in their order, typed contents, a step's
declared inputs checked, and every error in the router's words with the
step named. The same through a real tree: tests/test_ensembles.py.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from poolserve.protos import inference_pb2 as pb
from poolserve.service.contract.chain import (
    ChainPlan,
    ChainStep,
    is_chain,
    unwrap,
    wrap,
)
from poolserve.service.contract.errors import Failure, InvalidInput, ServingError
from poolserve.service.contract.repository import ModelSettings, TensorSpec
from poolserve.service.inference.codec import decode_outputs
from poolserve.service.inference.infer import infer_named
from poolserve.service.inference.model import Array, Model


class Scale(Model):
    """X times the parameter ``factor`` (default 2) as Y; refuses a negative factor."""

    def predict(self, inputs: dict[str, Array], parameters: dict[str, object]) -> dict[str, Array]:
        factor = parameters.get("factor", 2)
        assert isinstance(factor, int)
        if factor < 0:
            raise InvalidInput("factor must not be negative")
        return {"Y": inputs["X"] * factor}


class Split(Model):
    """IN as its sum (SUM) and its negation (NEG)."""

    def predict(self, inputs: dict[str, Array], parameters: dict[str, object]) -> dict[str, Array]:
        x = inputs["IN"]
        return {"SUM": np.asarray([x.sum()], dtype=x.dtype), "NEG": -x}


class Words(Model):
    """X's values as strings (a str array), W."""

    def predict(self, inputs: dict[str, Array], parameters: dict[str, object]) -> dict[str, Array]:
        return {"W": np.asarray([str(v) for v in inputs["X"].ravel()])}


class Kinds(Model):
    """The type of each element of W and its length, as KIND (BYTES) and LEN (INT32)."""

    def predict(self, inputs: dict[str, Array], parameters: dict[str, object]) -> dict[str, Array]:
        items = inputs["W"].ravel()
        kinds = [type(v).__name__.encode() for v in items]
        return {
            "KIND": np.asarray(kinds, dtype=object),
            "LEN": np.asarray([len(v) for v in items], dtype=np.int32),
        }


class Broken(Model):
    def predict(self, inputs: dict[str, Array], parameters: dict[str, object]) -> dict[str, Array]:
        raise RuntimeError("the model fell over")


def _model(cls: type[Model], name: str, *inputs: TensorSpec) -> Model:
    return cls(
        ModelSettings(
            name=name,
            implementation=f"model.{cls.__name__}",
            folder=Path(f"/nowhere/{name}"),
            source=Path(f"/nowhere/{name}/model-settings.json"),
            inputs=inputs,
        )
    )


MODELS = {
    "scale": _model(Scale, "scale", TensorSpec("X", "FP32", (-1,))),
    "split": _model(Split, "split"),
    "broken": _model(Broken, "broken"),
    "words": _model(Words, "words"),
    "kinds": _model(Kinds, "kinds"),
}
PLAN = ChainPlan(
    name="pipe",
    version="1",
    inputs=("features",),
    outputs=("total", "negated"),
    steps=(
        ChainStep("scale", "", (("X", "features"),), (("Y", "scaled"),)),
        ChainStep("split", "", (("IN", "scaled"),), (("SUM", "total"), ("NEG", "negated"))),
    ),
)


def _request(values: np.ndarray, *outputs: str, typed: bool = False, **params: int) -> bytes:
    request = pb.ModelInferRequest(model_name="pipe", id="call-7")
    tensor = request.inputs.add(name="features", datatype="FP32", shape=list(values.shape))
    if typed:
        tensor.contents.fp32_contents.extend(values.ravel().tolist())
    else:
        request.raw_input_contents.append(values.tobytes())
    for name in outputs:
        request.outputs.add(name=name)
    for key, value in params.items():
        request.parameters[key].int64_param = value
    return request.SerializeToString()


def _run(plan: ChainPlan, body: bytes) -> pb.ModelInferResponse:
    parts, _ = infer_named(MODELS, wrap(plan.encode(), body))
    return pb.ModelInferResponse.FromString(b"".join(bytes(p) for p in parts))


def _error(plan: ChainPlan, body: bytes) -> ServingError:
    with pytest.raises(ServingError) as caught:
        _run(plan, body)
    return caught.value


def test_the_envelope_carries_the_plan_and_the_request_unchanged() -> None:
    body = _request(np.ones(3, dtype=np.float32))
    wrapped = wrap(PLAN.encode(), body)
    assert is_chain(wrapped) and not is_chain(body)
    plan, inner = unwrap(wrapped)
    assert plan == PLAN and bytes(inner) == body
    no_steps = ChainPlan("pipe", "1", ("features",), (), ())
    with pytest.raises(InvalidInput, match="malformed ensemble chain: no steps"):
        unwrap(wrap(no_steps.encode(), body))
    for broken in (wrapped[:8], wrapped[:12], wrapped[:6] + b"\x05\x00\x00\x00{nope"):
        with pytest.raises(InvalidInput, match="malformed ensemble chain"):
            unwrap(broken)


@pytest.mark.parametrize("typed", [False, True])
def test_each_steps_outputs_feed_the_next_and_the_reply_is_the_ensembles(typed: bool) -> None:
    x = np.arange(4, dtype=np.float32)
    reply = _run(PLAN, _request(x, typed=typed, factor=3))
    assert (reply.model_name, reply.model_version, reply.id) == ("pipe", "1", "call-7")
    assert [o.name for o in reply.outputs] == ["total", "negated"]
    got = decode_outputs(reply)
    np.testing.assert_array_equal(got["total"], [x.sum() * 3])
    np.testing.assert_array_equal(got["negated"], -x * 3)


def test_the_outputs_asked_for_come_in_their_order_and_no_other() -> None:
    reply = _run(PLAN, _request(np.ones(2, dtype=np.float32), "negated"))
    assert [o.name for o in reply.outputs] == ["negated"]
    error = _error(PLAN, _request(np.ones(2, dtype=np.float32), "scaled"))
    assert error.failure is Failure.INVALID_INPUT
    assert "unexpected inference output 'scaled' for ensemble 'pipe'" in error.message


def test_the_requests_mistakes_are_said_as_the_router_says_them() -> None:
    request = pb.ModelInferRequest(model_name="pipe")
    request.inputs.add(name="other", datatype="FP32", shape=[1])
    request.raw_input_contents.append(bytes(4))
    error = _error(PLAN, request.SerializeToString())
    assert "unexpected inference input 'other' (the ensemble's inputs: features)" in error.message
    assert "ModelInferRequest" in _error(PLAN, b"\xff\xff\xff").message


def test_a_failing_step_is_named_with_its_code_kept() -> None:
    refused = _error(PLAN, _request(np.ones(2, dtype=np.float32), factor=-1))
    assert refused.failure is Failure.INVALID_INPUT
    assert refused.message.startswith("ensemble 'pipe' step 1 (model 'scale'): ")
    assert "factor must not be negative" in refused.message
    # a step's declared input checked as a forwarded step's is: scale takes FP32 X
    as_int = pb.ModelInferRequest(model_name="pipe")
    as_int.inputs.add(name="features", datatype="INT32", shape=[2])
    as_int.raw_input_contents.append(np.ones(2, dtype=np.int32).tobytes())
    wrong = _error(PLAN, as_int.SerializeToString())
    assert wrong.message.startswith("ensemble 'pipe' step 1 (model 'scale'): ")
    assert "INT32" in wrong.message and "FP32" in wrong.message
    broken = ChainPlan(
        "pipe",
        "1",
        ("features",),
        ("out",),
        (*PLAN.steps[:1], ChainStep("broken", "", (("A", "scaled"),), (("B", "out"),))),
    )
    crashed = _error(broken, _request(np.ones(2, dtype=np.float32)))
    assert crashed.message.startswith("ensemble 'pipe' step 2 (model 'broken'): ")
    assert "the model fell over" in crashed.message
    missing = ChainPlan(
        "pipe",
        "1",
        ("features",),
        ("z",),
        (ChainStep("scale", "", (("X", "features"),), (("Z", "z"),)),),
    )
    gone = _error(missing, _request(np.ones(2, dtype=np.float32)))
    assert "step 1 (model 'scale'): output 'Z' was requested" in gone.message
    unknown = ChainPlan(
        "pipe",
        "1",
        ("features",),
        ("z",),
        (ChainStep("nope", "", (("X", "features"),), (("Z", "z"),)),),
    )
    assert (
        "step 1 (model 'nope')" in _error(unknown, _request(np.ones(2, dtype=np.float32))).message
    )


def test_a_string_tensor_reaches_the_next_step_as_a_request_would_carry_it() -> None:
    plan = ChainPlan(
        "pipe",
        "1",
        ("features",),
        ("kind", "length"),
        (
            ChainStep("words", "", (("X", "features"),), (("W", "w"),)),
            ChainStep("kinds", "", (("W", "w"),), (("KIND", "kind"), ("LEN", "length"))),
        ),
    )
    reply = decode_outputs(_run(plan, _request(np.asarray([1.5, 20.0], dtype=np.float32))))
    assert reply["kind"].tolist() == [b"bytes", b"bytes"]  # never str, as from a request
    assert reply["length"].tolist() == [3, 4]  # "1.5", "20.0"
