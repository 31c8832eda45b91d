"""One inference on a loaded model: bytes in, bytes out, with timings.

This is the whole of a worker's job per request (and of an in-process
model's): parse, decode tensors without copying, predict, encode, serialize.
The tensors' bytes stay out of protobuf both ways (:mod:`poolserve.service.inference.rawwire`):
raw inputs are views of the request's bytes, raw outputs views of the model's
arrays, written after the serialized rest of the response as parts.
"""

from __future__ import annotations

import time

from google.protobuf.message import DecodeError

from poolserve.protos import inference_pb2 as pb
from poolserve.service.contract.errors import InvalidInput, ModelError, ServingError
from poolserve.service.inference.codec import decode_inputs, encode_outputs, parameters_to_dict
from poolserve.service.inference.model import Model, check_outputs
from poolserve.service.inference.rawwire import Buffer, raw_output_parts, split_raw_inputs
from poolserve.service.poolcore.stats import Timings


def parse_request(data: bytes) -> pb.ModelInferRequest:
    try:
        return pb.ModelInferRequest.FromString(data)
    except DecodeError as exc:
        raise InvalidInput(f"ModelInferRequest cannot be parsed: {exc}") from None


def infer(model: Model, data: Buffer) -> tuple[bytes, Timings]:
    """Runs one serialized ModelInferRequest; raises ServingError subclasses only."""
    parts, timings = infer_parts(model, data)
    return b"".join(parts), timings


def infer_parts(model: Model, data: Buffer) -> tuple[list[Buffer], Timings]:
    """:func:`infer`, with the serialized response as parts: the response
    without its raw outputs, then each raw output's field head and bytes (a
    view of the model's array). Raw inputs reach the model as views of ``data``."""
    t0 = time.perf_counter_ns()
    head, raw = split_raw_inputs(data)
    request = parse_request(head)
    inputs = decode_inputs(request, raw=raw or None)
    parameters = parameters_to_dict(request.parameters)
    t1 = time.perf_counter_ns()
    name = model.settings.name
    try:
        outputs = check_outputs(name, model.predict(inputs, parameters))
    except ServingError:
        raise
    except Exception as exc:
        raise ModelError.from_exception(name, exc) from exc
    t2 = time.perf_counter_ns()
    response = pb.ModelInferResponse(
        model_name=name, model_version=model.settings.version, id=request.id
    )
    views: list[Buffer] = []
    encode_outputs(request, outputs, response, raw=views)
    parts = [response.SerializeToString(), *raw_output_parts(views)]
    t3 = time.perf_counter_ns()
    return parts, Timings(decode_ns=t1 - t0, compute_ns=t2 - t1, encode_ns=t3 - t2)
