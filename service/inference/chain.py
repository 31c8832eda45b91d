"""An ensemble's steps run in one worker (:mod:`poolserve.service.contract.chain`).

The worker holds every model of its pool, so a chain's steps run here one
after another on the models it already has, the tensors passed from step to
step as the arrays the models returned (no encoding, no copy, no socket).
Each step is checked as a step forwarded by the router would be: its inputs
against what its model declares, the outputs the ensemble takes from it
there; a string tensor reaches the next step as bytes, as it would have
from a request. The ensemble's reply carries the outputs it was asked for,
named as the ensemble names them, encoded once.

Errors are the router's for the same ensemble (:mod:`poolserve.service.router.ensemble`):
the request's checks in its words, and a step's failure with its code and
the step named in front of its message.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import NamedTuple

from poolserve.protos import inference_pb2 as pb
from poolserve.service.contract.chain import ChainPlan, unwrap
from poolserve.service.contract.ensemble import check_input_names
from poolserve.service.contract.errors import (
    InvalidInput,
    ModelError,
    ServingError,
    clip,
    prefixed,
)
from poolserve.service.inference.codec import (
    datatype_for,
    decode_inputs,
    decode_raw,
    encode_outputs,
    encode_raw,
    parameters_to_dict,
)
from poolserve.service.inference.model import Array, Model, check_outputs, declared_inputs
from poolserve.service.inference.named import model_named
from poolserve.service.inference.rawwire import Buffer, raw_output_parts
from poolserve.service.poolcore.stats import Timings

_UNPLACEABLE = ("shared_memory_region", "classification")


class _Meta(NamedTuple):
    """A tensor as a step's declared inputs are checked against it."""

    name: str
    datatype: str
    shape: tuple[int, ...]


def run_chain(models: Mapping[str, Model], data: Buffer) -> tuple[list[Buffer], Timings]:
    """A chain envelope's ensemble, run on ``models``: the reply as parts, and
    the steps' timings added up."""
    plan, body = unwrap(data)
    started = time.perf_counter_ns()
    try:
        request = pb.ModelInferRequest.FromString(bytes(body))
    except Exception:  # DecodeError and kin: a malformed message
        raise InvalidInput("the request is not a ModelInferRequest") from None
    wanted = _wanted(plan, request)
    tensors = _inputs(plan, request)
    parameters = parameters_to_dict(request.parameters)
    timings = Timings(decode_ns=time.perf_counter_ns() - started)
    for index, step in enumerate(plan.steps):
        try:
            model = model_named(models, step.model, step.version)
            began = time.perf_counter_ns()
            outputs = _step(model, step.input_map, step.output_map, tensors, parameters)
            timings.compute_ns += time.perf_counter_ns() - began
        except ServingError as exc:
            raise prefixed(exc, plan.step_name(index)) from None
        for step_output, name in step.output_map:
            tensors[name] = outputs[step_output]
    began = time.perf_counter_ns()
    response = pb.ModelInferResponse(
        model_name=plan.name, model_version=plan.version, id=request.id
    )
    views: list[Buffer] = []
    encode_outputs(request, {name: tensors[name] for name in wanted}, response, raw=views)
    parts: list[Buffer] = [response.SerializeToString(), *raw_output_parts(views)]
    timings.encode_ns += time.perf_counter_ns() - began
    return parts, timings


def _wanted(plan: ChainPlan, request: pb.ModelInferRequest) -> list[str]:
    """The outputs the reply carries: those asked for, in their order, else all the ensemble's."""
    produced = set(plan.outputs)
    for output in request.outputs:
        if output.name not in produced:
            raise InvalidInput(
                f"unexpected inference output '{output.name}' for ensemble "
                f"'{plan.name}' (its outputs: {', '.join(sorted(produced))})"
            )
        for key in _UNPLACEABLE:
            if key in output.parameters:
                raise InvalidInput(f"output '{output.name}': an ensemble's outputs take no '{key}'")
    return [o.name for o in request.outputs] or list(plan.outputs)


def _inputs(plan: ChainPlan, request: pb.ModelInferRequest) -> dict[str, Array]:
    """The ensemble's inputs by name (raw ones as views of the request's bytes)."""
    for tensor in request.inputs:
        if "shared_memory_region" in tensor.parameters:
            raise InvalidInput(
                f"input '{tensor.name}': an ensemble's inputs cannot be in shared memory"
            )
    tensors = decode_inputs(request)  # counts, sizes and duplicates checked
    check_input_names(tensors, plan.inputs)
    return tensors


def _step(
    model: Model,
    input_map: tuple[tuple[str, str], ...],
    output_map: tuple[tuple[str, str], ...],
    tensors: Mapping[str, Array],
    parameters: dict[str, object],
) -> Mapping[str, Array]:
    """One step on the ensemble's tensors, checked as a forwarded step is: its
    inputs against what the model declares, its outputs there. A string
    tensor goes through its wire form, so a step reads what it would have
    read from a forwarded request (bytes, never str)."""
    name = model.settings.name
    inputs = {step_input: _as_sent(tensors[tensor]) for step_input, tensor in input_map}
    declared = declared_inputs(model)
    if declared is not None:
        declared.check([_Meta(k, datatype_for(v), v.shape) for k, v in inputs.items()])
    try:
        outputs = check_outputs(name, model.predict(inputs, dict(parameters)))
    except ServingError:
        raise
    except Exception as exc:
        raise ModelError.from_exception(name, exc) from exc
    for step_output, _ in output_map:
        if step_output not in outputs:
            available = ", ".join(f"'{known}'" for known in outputs) or "none"
            raise InvalidInput(
                f"output '{clip(step_output)}' was requested but the model produced {available}"
            )
    return outputs


def _as_sent(array: Array) -> Array:
    """A string array as a request would carry it: BYTES elements as bytes."""
    if array.dtype.kind not in "OSU":
        return array
    meta = pb.ModelInferRequest.InferInputTensor(name="", datatype="BYTES", shape=array.shape)
    return decode_raw(meta, encode_raw(array, "BYTES", "a step's output"))
