"""One inference on a loaded model: bytes in, bytes out, with timings.

This is the whole of a worker's job per request (and of an in-process
model's): parse, decode tensors without copying, predict, encode, serialize.
"""

from __future__ import annotations

import time

from google.protobuf.message import DecodeError

from poolserve.protos import inference_pb2 as pb
from poolserve.service.contract.errors import InvalidInput, ModelError, ServingError
from poolserve.service.contract.shm import Region, unwrap
from poolserve.service.inference.classification import classify, requested_classes
from poolserve.service.inference.codec import decode_inputs, encode_outputs, parameters_to_dict
from poolserve.service.inference.model import Model, WireModel, check_outputs, class_labels
from poolserve.service.inference.shm import SharedTensors
from poolserve.service.poolcore.stats import Timings


def parse_request(data: bytes) -> pb.ModelInferRequest:
    try:
        return pb.ModelInferRequest.FromString(data)
    except DecodeError as exc:
        raise InvalidInput(f"ModelInferRequest cannot be parsed: {exc}") from None


def infer(
    model: Model, data: bytes, regions: dict[str, Region] | None = None
) -> tuple[bytes, Timings]:
    """Runs one serialized ModelInferRequest; raises ServingError subclasses only.

    ``data`` may carry the shared-memory registrations it uses in front
    (:mod:`poolserve.service.contract.shm`), or they come as ``regions``.
    """
    if regions is None:
        regions, data = unwrap(data)
    if isinstance(model, WireModel):  # an adapter converts with its own server's code
        if regions:
            raise InvalidInput(
                f"model '{model.settings.name}' is served through an adapter "
                "that reads tensors from the request only: shared memory is not supported"
            )
        return model.infer_wire(data)
    t0 = time.perf_counter_ns()
    request = parse_request(data)
    shared = SharedTensors(regions)
    inputs = decode_inputs(request, shared.read)
    parameters = parameters_to_dict(request.parameters)
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
    response = pb.ModelInferResponse(
        model_name=name, model_version=model.settings.version, id=request.id
    )
    encode_outputs(request, outputs, response, shared.write)
    body = response.SerializeToString()
    t3 = time.perf_counter_ns()
    return body, Timings(decode_ns=t1 - t0, compute_ns=t2 - t1, encode_ns=t3 - t2)
