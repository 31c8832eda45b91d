"""One inference on a loaded model: bytes in, bytes out, with timings.

This is the whole of a worker's job per request (and of an in-process
model's): parse, decode tensors without copying, predict, encode, serialize.
"""

from __future__ import annotations

import time

from google.protobuf.message import DecodeError

from poolserve.protos import inference_pb2 as pb
from poolserve.service.contract.errors import InvalidInput, ModelError, ServingError
from poolserve.service.inference.codec import decode_inputs, encode_outputs, parameters_to_dict
from poolserve.service.inference.model import Model, WireModel, check_outputs
from poolserve.service.poolcore.stats import Timings


def parse_request(data: bytes) -> pb.ModelInferRequest:
    try:
        return pb.ModelInferRequest.FromString(data)
    except DecodeError as exc:
        raise InvalidInput(f"ModelInferRequest cannot be parsed: {exc}") from None


def infer(model: Model, data: bytes) -> tuple[bytes, Timings]:
    """Runs one serialized ModelInferRequest; raises ServingError subclasses only."""
    if isinstance(model, WireModel):  # an adapter converts with its own server's code
        return model.infer_wire(data)
    t0 = time.perf_counter_ns()
    request = parse_request(data)
    inputs = decode_inputs(request)
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
    encode_outputs(request, outputs, response)
    body = response.SerializeToString()
    t3 = time.perf_counter_ns()
    return body, Timings(decode_ns=t1 - t0, compute_ns=t2 - t1, encode_ns=t3 - t2)
