"""One request to a decoupled model: bytes in, a stream of response frames out.

The worker's side of ModelStreamInfer for a model whose settings say
``parameters.extra.decoupled: true``: the model's ``predict_stream``
generator runs here, and each output dict it yields becomes one PART frame
(a serialized ModelInferResponse) at once. The last frame is the REPLY that
ends the stream, with the timings of the whole stream; its body is Triton's
empty final response (parameter ``triton_final_response`` true) when the
client asked for one (request parameter ``triton_enable_empty_final_response``),
else empty (nothing more to send). With that flag every part says
``triton_final_response`` false. Closing the iterator (the client went away)
closes the model's generator.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from poolserve.protos import inference_pb2 as pb
from poolserve.service.contract.errors import InvalidInput, ModelError, ServingError
from poolserve.service.contract.framing import HEADER
from poolserve.service.contract.rest import is_rest
from poolserve.service.contract.shm import Region
from poolserve.service.contract.wire import Wire
from poolserve.service.inference.codec import decode_inputs, encode_outputs, parameters_to_dict
from poolserve.service.inference.controls import add_controls
from poolserve.service.inference.infer import check_reply_size, parse_request

if TYPE_CHECKING:
    from poolserve.service.inference.rest import Encoder
from poolserve.service.inference.model import Model, WireModel, check_outputs, declared_inputs
from poolserve.service.inference.rawwire import Buffer
from poolserve.service.inference.shm import SharedTensors
from poolserve.service.poolcore.frames import PART, Frame, part_frame, reply_frame
from poolserve.service.poolcore.stats import Timings

FINAL_FLAG = "triton_enable_empty_final_response"
FINAL = "triton_final_response"


def stream_infer(model: Model, data: Wire, regions: dict[str, Region], seq: int) -> Iterator[Frame]:
    """PART frames, one per yielded output dict, then the final REPLY frame;
    raises ServingError subclasses only. An HTTP/REST body (MLServer's
    ``generate_stream``) is decoded, and its parts encoded, by the REST codec."""
    if is_rest(data):
        from poolserve.service.inference import rest

        request, raw, encode = rest.decode(data, model)
        if isinstance(model, WireModel):
            request.raw_input_contents.extend(bytes(entry) for entry in raw)
            frames = _wire_stream(model, request.SerializeToString(), regions, seq)
            yield from _rest_parts(frames, encode, seq)
            return
        yield from _stream(model, request, list(raw), regions, seq, encode)
        return
    if isinstance(model, WireModel):  # an adapter streams with its own server's code
        yield from _wire_stream(model, data, regions, seq)
        return
    yield from _stream(model, parse_request(data), None, regions, seq, None)


def _wire_stream(
    model: WireModel, data: Wire, regions: dict[str, Region], seq: int
) -> Iterator[Frame]:
    name = model.settings.name
    stream_wire = getattr(model, "stream_wire", None)  # (body, seq) -> frames
    if stream_wire is None:
        raise InvalidInput(f"model '{name}' is served through an adapter: it cannot stream")
    if regions:
        raise InvalidInput(
            f"model '{name}' is served through an adapter "
            "that reads tensors from the request only: shared memory is not supported"
        )
    yield from stream_wire(data if isinstance(data, bytes) else bytes(data), seq)


def _rest_parts(frames: Iterator[Frame], encode: Encoder, seq: int) -> Iterator[Frame]:
    """An adapter's PART frames (serialized responses) re-encoded as REST replies."""
    try:
        for frame in frames:
            if isinstance(frame, bytes) and len(frame) >= HEADER.size:
                _, kind, _ = HEADER.unpack_from(frame)
                if kind == PART:
                    response = pb.ModelInferResponse.FromString(frame[HEADER.size :])
                    views: list[Buffer] = list(response.raw_output_contents)
                    del response.raw_output_contents[:]
                    frame = part_frame(seq, b"".join(map(bytes, encode(response, views))))
            yield frame
    finally:
        close = getattr(frames, "close", None)
        if close is not None:
            close()  # the client went away: the adapter's stream ends


def _stream(
    model: Model,
    request: pb.ModelInferRequest,
    raw: list[Buffer] | None,
    regions: dict[str, Region],
    seq: int,
    encode: Encoder | None,
) -> Iterator[Frame]:
    name = model.settings.name
    t0 = time.perf_counter_ns()
    shared = SharedTensors(regions)
    inputs = decode_inputs(request, shared.read, raw=raw, declared=declared_inputs(model))
    parameters = parameters_to_dict(request.parameters)
    sequence = model.settings.sequence
    if sequence is not None and sequence.controls:
        batched = model.settings.max_batch_size > 0
        add_controls(name, inputs, sequence.controls, parameters, batched)
    flagged = parameters.get(FINAL_FLAG) is True
    timings = Timings(decode_ns=time.perf_counter_ns() - t0)
    try:
        produced = model.predict_stream(inputs, parameters)
    except ServingError:
        raise
    except Exception as exc:
        raise ModelError.from_exception(name, exc) from exc
    items = iter(produced)
    try:
        while True:
            t1 = time.perf_counter_ns()
            try:
                item = next(items)
            except StopIteration:
                break
            except ServingError:
                raise
            except Exception as exc:
                raise ModelError.from_exception(name, exc) from exc
            t2 = time.perf_counter_ns()
            outputs = check_outputs(name, item)
            check_reply_size(name, request, outputs)
            response = _response(model, request)
            views: list[Buffer] = []
            encode_outputs(
                request, outputs, response, shared.write, raw=None if encode is None else views
            )
            if flagged:
                response.parameters[FINAL].bool_param = False
            frame = part_frame(seq, _body(response, views, encode))
            timings.compute_ns += t2 - t1
            timings.encode_ns += time.perf_counter_ns() - t2
            yield frame
    finally:
        close = getattr(items, "close", None)
        if close is not None:
            close()  # the client went away, or the stream failed: the model's generator ends
    final = b""
    if flagged:
        response = _response(model, request)
        response.parameters[FINAL].bool_param = True
        final = _body(response, [], encode)
    yield reply_frame(seq, timings, final)


def _body(response: pb.ModelInferResponse, views: list[Buffer], encode: Encoder | None) -> bytes:
    if encode is None:
        return response.SerializeToString()
    return b"".join(map(bytes, encode(response, views)))


def _response(model: Model, request: pb.ModelInferRequest) -> pb.ModelInferResponse:
    return pb.ModelInferResponse(
        model_name=model.settings.name, model_version=model.settings.version, id=request.id
    )
