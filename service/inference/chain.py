"""An ensemble's steps run in one worker (:mod:`poolserve.service.contract.chain`).

The worker holds every model of its pool, so a chain's steps run here one
after another on the models it already has: each step is the same
inference a step forwarded by the router would be (:func:`run_request`: its
inputs checked against what the model declares, its outputs encoded raw),
only its request is built in memory and its reply's raw outputs stay views,
handed to the next steps without a copy or a socket. The ensemble's reply
carries the outputs it was asked for, named as the ensemble names them.

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
from poolserve.service.contract.errors import InvalidInput, ModelError, ServingError, error_for
from poolserve.service.inference.codec import decode_inputs, encode_raw
from poolserve.service.inference.infer import run_request
from poolserve.service.inference.model import Model
from poolserve.service.inference.named import model_named
from poolserve.service.inference.rawwire import Buffer, raw_output_parts
from poolserve.service.poolcore.stats import Timings

_UNPLACEABLE = ("shared_memory_region", "classification")


class _Tensor(NamedTuple):
    datatype: str
    shape: tuple[int, ...]
    raw: Buffer


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
    total = Timings(decode_ns=time.perf_counter_ns() - started)
    for index, step in enumerate(plan.steps):
        try:
            model = model_named(models, step.model, step.version)
            outputs, timings = _step(model, request, step.input_map, step.output_map, tensors)
        except ServingError as exc:
            raise _named(exc, plan.step_name(index)) from None
        total.decode_ns += timings.decode_ns
        total.compute_ns += timings.compute_ns
        total.encode_ns += timings.encode_ns
        for step_output, name in step.output_map:
            tensor = outputs.get(step_output)
            if tensor is None:
                raise ModelError(
                    f"{plan.step_name(index)}: the model's reply has no output '{step_output}'"
                )
            tensors[name] = tensor
    began = time.perf_counter_ns()
    response = pb.ModelInferResponse(
        model_name=plan.name, model_version=plan.version, id=request.id
    )
    views: list[Buffer] = []
    for name in wanted:
        tensor = tensors[name]
        response.outputs.add(name=name, datatype=tensor.datatype, shape=tensor.shape)
        views.append(tensor.raw)
    parts: list[Buffer] = [response.SerializeToString(), *raw_output_parts(views)]
    total.encode_ns += time.perf_counter_ns() - began
    return parts, total


def _named(exc: ServingError, where: str) -> ServingError:
    error = error_for(exc.failure, f"{where}: {exc.message}")
    error.stage = exc.stage
    return error


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


def _inputs(plan: ChainPlan, request: pb.ModelInferRequest) -> dict[str, _Tensor]:
    """The ensemble's inputs by name, raw (typed contents made raw)."""
    for tensor in request.inputs:
        if "shared_memory_region" in tensor.parameters:
            raise InvalidInput(
                f"input '{tensor.name}': an ensemble's inputs cannot be in shared memory"
            )
    arrays = decode_inputs(request)  # checks counts, sizes and duplicates
    raw = list(request.raw_input_contents)
    tensors: dict[str, _Tensor] = {}
    for i, tensor in enumerate(request.inputs):
        data: Buffer = raw[i] if raw else encode_raw(arrays[tensor.name], tensor.datatype, "")
        tensors[tensor.name] = _Tensor(tensor.datatype, tuple(tensor.shape), data)
    wanted = set(plan.inputs)
    for name in tensors:
        if name not in wanted:
            raise InvalidInput(
                f"unexpected inference input '{name}' (the ensemble's inputs: "
                f"{', '.join(sorted(wanted))})"
            )
    for name in sorted(wanted - set(tensors)):
        raise InvalidInput(f"expected input '{name}' of the ensemble, none given")
    return tensors


def _step(
    model: Model,
    request: pb.ModelInferRequest,
    input_map: tuple[tuple[str, str], ...],
    output_map: tuple[tuple[str, str], ...],
    tensors: Mapping[str, _Tensor],
) -> tuple[dict[str, _Tensor], Timings]:
    """One step: its request built from the ensemble's tensors, run as a forwarded one would be."""
    call = pb.ModelInferRequest(
        model_name=model.settings.name, model_version=model.settings.version, id=request.id
    )
    for key, value in request.parameters.items():
        call.parameters[key].CopyFrom(value)
    raw: list[Buffer] = []
    for step_input, name in input_map:
        tensor = tensors[name]
        call.inputs.add(name=step_input, datatype=tensor.datatype, shape=tensor.shape)
        raw.append(tensor.raw)
    for step_output, _ in output_map:
        call.outputs.add(name=step_output)
    response, views, timings = run_request(model, call, raw, {}, time.perf_counter_ns())
    outputs = {
        meta.name: _Tensor(meta.datatype, tuple(meta.shape), view)
        for meta, view in zip(response.outputs, views, strict=True)
    }
    return outputs, timings
