"""One inference on a loaded model: bytes in, bytes out, with timings.

This is the whole of a worker's job per request (and of an in-process
model's): parse, decode tensors without copying, predict, encode, serialize.
The tensors' bytes stay out of protobuf both ways (:mod:`poolserve.service.inference.rawwire`):
raw inputs are views of the request's bytes, raw outputs views of the model's
arrays, written after the serialized rest of the response as parts.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import cast

from google.protobuf.message import DecodeError

from poolserve.protos import inference_pb2 as pb
from poolserve.service.contract.chain import is_chain
from poolserve.service.contract.errors import (
    InvalidInput,
    MessageTooLarge,
    ModelError,
    ServingError,
)
from poolserve.service.contract.rest import is_rest
from poolserve.service.contract.shm import Region, unwrap
from poolserve.service.contract.wire import peek_model
from poolserve.service.contract.worker_limits import LIMITS
from poolserve.service.inference.classification import classify, requested_classes
from poolserve.service.inference.codec import (
    decode_inputs,
    encode_outputs,
    parameters_to_dict,
    reply_bytes,
)
from poolserve.service.inference.controls import add_controls
from poolserve.service.inference.model import (
    Array,
    Model,
    WireModel,
    check_outputs,
    class_labels,
    declared_inputs,
)
from poolserve.service.inference.named import model_named
from poolserve.service.inference.rawwire import Buffer, raw_output_parts, split_raw_inputs
from poolserve.service.inference.shm import SharedTensors
from poolserve.service.poolcore.stats import Timings

SPLIT_MIN = 16 * 1024
"""A request this large or larger has its raw tensors split off before protobuf
parses it (:func:`~poolserve.service.inference.rawwire.split_raw_inputs`: no
copies of them); a smaller one is parsed whole, the copies of its few tensor
bytes cheaper than walking its fields in Python."""


def parse_request(data: Buffer) -> pb.ModelInferRequest:
    """The request; ``data`` may be a view (a large request is one of its frame)."""
    try:
        # upb parses any buffer (a view of a frame) without copying it to bytes first
        return pb.ModelInferRequest.FromString(cast(bytes, data))
    except DecodeError as exc:
        raise InvalidInput(f"ModelInferRequest cannot be parsed: {exc}") from None


def check_reply_size(
    name: str, request: pb.ModelInferRequest, outputs: Mapping[str, Array]
) -> None:
    """A reply that could not be sent is refused before it is built: its
    tensors would be copied or encoded for nothing (a 1 GiB echo of a sparse
    shared-memory object costs its client nothing, the worker 1 GiB)."""
    size = reply_bytes(request, outputs)
    if size > LIMITS.max_message_size:
        raise MessageTooLarge.reply(name, size, LIMITS.max_message_size)


def infer(
    model: Model, data: Buffer, regions: dict[str, Region] | None = None
) -> tuple[bytes, Timings]:
    """Runs one serialized ModelInferRequest; raises ServingError subclasses only.

    ``data`` may carry the shared-memory registrations it uses in front
    (:mod:`poolserve.service.contract.shm`), or they come as ``regions``.
    """
    parts, timings = infer_parts(model, data, regions)
    whole = parts[0] if len(parts) == 1 and isinstance(parts[0], bytes) else b"".join(parts)
    return whole, timings


def infer_parts(
    model: Model, data: Buffer, regions: dict[str, Region] | None = None
) -> tuple[list[Buffer], Timings]:
    """:func:`infer`, with the serialized response as parts: the response
    without its raw outputs, then each raw output's field head and bytes (a
    view of the model's array). Raw inputs reach the model as views of ``data``."""
    if regions is None:
        regions, data = unwrap(data)
    if is_rest(data):  # an HTTP/REST body: JSON (and binary tensors) in and out
        from poolserve.service.inference.rest import infer_rest

        return infer_rest(model, data, regions)
    if isinstance(model, WireModel):  # an adapter converts with its own server's code
        if regions:
            raise InvalidInput(
                f"model '{model.settings.name}' is served through an adapter "
                "that reads tensors from the request only: shared memory is not supported"
            )
        body, timings = model.infer_wire(data if isinstance(data, bytes) else bytes(data))
        return [body], timings
    t0 = time.perf_counter_ns()
    head, raw = _split(data)
    return _answer(model, parse_request(head), raw, regions, t0)


def infer_named(models: Mapping[str, Model], data: Buffer) -> tuple[list[Buffer], Timings]:
    """:func:`infer_parts` on the model of ``models`` the request names
    (ModelNotFound when it names another, or another version).

    A ModelInferRequest is parsed first and its model found by the parsed
    name: walking its fields in Python for the name first cost a light
    request a tenth of the worker's time. A REST body, or a worker that
    holds an adapter (which reads the request's bytes itself), is peeked at.
    """
    if is_chain(data):  # an ensemble whose steps all run here
        from poolserve.service.inference.chain import run_chain  # (it imports this module)

        return run_chain(models, data)
    regions, data = unwrap(data)
    if is_rest(data) or any(isinstance(m, WireModel) for m in models.values()):
        name, version = peek_model(data)
        return infer_parts(_model_named(models, name, version), data, regions)
    t0 = time.perf_counter_ns()
    head, raw = _split(data)
    request = parse_request(head)
    model = _model_named(models, request.model_name, request.model_version)
    return _answer(model, request, raw, regions, t0)


def _model_named(models: Mapping[str, Model], name: str, version: str) -> Model:
    return model_named(models, name, version)


def _split(data: Buffer) -> tuple[Buffer, list[memoryview]]:
    """:func:`split_raw_inputs` for a request of :data:`SPLIT_MIN` bytes or more;
    a smaller one goes to protobuf whole (no raw entries split off)."""
    if len(data) < SPLIT_MIN:
        return data, []
    return split_raw_inputs(data)


def _answer(
    model: Model,
    request: pb.ModelInferRequest,
    raw: list[memoryview],
    regions: dict[str, Region],
    t0: int,
) -> tuple[list[Buffer], Timings]:
    response, views, timings = run_request(model, request, raw or None, regions, t0)
    t3 = time.perf_counter_ns()
    parts: list[Buffer] = [response.SerializeToString(), *raw_output_parts(views)]
    timings.encode_ns += time.perf_counter_ns() - t3
    return parts, timings


def run_request(
    model: Model,
    request: pb.ModelInferRequest,
    raw: Sequence[Buffer] | None,
    regions: dict[str, Region],
    t0: int,
) -> tuple[pb.ModelInferResponse, list[Buffer], Timings]:
    """One parsed request on the model: the response without its raw outputs,
    each raw output's bytes (a view of the model's array where it can be), and
    the timings since ``t0`` (when decoding began). Both doors' requests take it."""
    shared = SharedTensors(regions)
    inputs = decode_inputs(
        request,
        shared.read,
        raw=None if raw is None else list(raw),
        declared=declared_inputs(model),
    )
    parameters = parameters_to_dict(request.parameters)
    sequence = model.settings.sequence
    if sequence is not None and sequence.controls:
        batched = model.settings.max_batch_size > 0
        add_controls(model.settings.name, inputs, sequence.controls, parameters, batched)
    classes = requested_classes(request) if request.outputs else None
    t1 = time.perf_counter_ns()
    name = model.settings.name
    try:
        outputs = check_outputs(name, model.predict(inputs, parameters))
    except ServingError:
        raise
    except Exception as exc:
        raise ModelError.from_exception(name, exc) from exc
    t2 = time.perf_counter_ns()
    if classes:  # Triton's classification extension, counted as encoding
        batched = model.settings.max_batch_size > 0
        outputs = classify(outputs, classes, class_labels(model), batched)
    check_reply_size(name, request, outputs)
    response = pb.ModelInferResponse(
        model_name=name, model_version=model.settings.version, id=request.id
    )
    views: list[Buffer] = []
    encode_outputs(request, outputs, response, shared.write, raw=views)
    t3 = time.perf_counter_ns()
    return response, views, Timings(decode_ns=t1 - t0, compute_ns=t2 - t1, encode_ns=t3 - t2)
