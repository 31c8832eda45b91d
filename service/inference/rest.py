"""The REST codec: an Open Inference Protocol HTTP/REST body in, its reply out.

Beside the protobuf path (:mod:`poolserve.service.inference.infer`), in the
worker (or an inline model's pool), never in the router. The JSON (orjson)
and Triton's binary tensor extension are turned into the same parsed
ModelInferRequest the gRPC door's bytes become, with every input's bytes as
a raw entry (binary inputs as views of the body, no copy), so that the model
sees the same tensors and parameters, and checks, classification, sequence
controls and errors are the gRPC door's own. The response's outputs then go
back as JSON ``data`` (flat, row-major; BYTES as strings) or, when asked for
(``binary_data_output`` in the request's parameters, ``binary_data`` in an
output's), as binary data after the JSON.

The reply is :data:`poolserve.service.contract.rest.REPLY_HEAD` (the JSON's
length), the JSON, then the binary outputs, in order.
"""

from __future__ import annotations

import base64
import math
import struct
import time
import uuid
import zlib
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import numpy.typing as npt
import orjson

from poolserve.protos import inference_pb2 as pb
from poolserve.service.contract.errors import InvalidInput, MessageTooLarge, clip
from poolserve.service.contract.rest import (
    CUSTOM,
    IDENTITY,
    MAX_PEEK,
    MAX_PEEK_COMPRESSED,
    REPLY_HEAD,
    SCHEDULING,
    V1,
    deflate,
    inflater_of,
    peek_inflate,
    peeked_json,
    scheduling_json,
    unwrap,
)
from poolserve.service.contract.shm import Region
from poolserve.service.inference import json_body
from poolserve.service.inference.codec import dtype_for
from poolserve.service.inference.infer import run_request
from poolserve.service.inference.model import Model, WireModel, tensor_specs
from poolserve.service.inference.rawwire import Buffer
from poolserve.service.poolcore.stats import Timings

BINARY_DATA_SIZE = "binary_data_size"
BINARY_DATA = "binary_data"
BINARY_DATA_OUTPUT = "binary_data_output"
CONTENT_TYPE, BASE64 = "content_type", "base64"  # MLServer's codec parameter
_LENGTH = struct.Struct("<I")
_INT_KINDS = frozenset("iu")
_NUMBER_KINDS = frozenset("iuf")
_INT64 = 1 << 63
MAX_DEPTH = 64  # nesting of a tensor's ``data`` beyond any shape we take


# How one REST call's reply is encoded from its response and raw outputs.
Encoder = Callable[[pb.ModelInferResponse, list[Buffer]], list[Buffer]]


def infer_rest(
    model: Model, data: Buffer, regions: dict[str, Region]
) -> tuple[list[Buffer], Timings]:
    """One REST inference on ``model``: the reply's parts (see the module)."""
    unwrapped = unwrap(data)
    if unwrapped is not None and unwrapped[0].protocol == CUSTOM:  # a @custom_handler call
        from poolserve.service.inference.custom_rest import run_custom

        return run_custom(model, *unwrapped)
    t0 = time.perf_counter_ns()
    request, raw, encode = decode(data, model)
    if isinstance(model, WireModel):
        response, views, timings = _run_wire(model, request, raw, regions)
    else:
        response, views, timings = run_request(model, request, raw, regions, t0)
    t3 = time.perf_counter_ns()
    parts = encode(response, views)
    timings.encode_ns += time.perf_counter_ns() - t3
    return parts, timings


def decode(data: Buffer, model: Model) -> tuple[pb.ModelInferRequest, list[Buffer], Encoder]:
    """A REST wrapper's request (inputs as raw entries) and how to encode its reply."""
    unwrapped = unwrap(data)
    if unwrapped is None:
        raise InvalidInput("not a REST body")
    rest, body = unwrapped
    read: bool | None = None  # whether the pool read the JSON (known once inflated)
    if rest.encoding != IDENTITY:
        body, read = inflate(body, rest.limit, rest.header_length)
    if rest.protocol == V1:
        request, raw, _ = decode_v1(memoryview(body), model)
        return request, raw, lambda response, views: encode_v1(response, views, rest.accept)
    loose = isinstance(model, WireModel) and model.rest_as_mlserver
    request, raw, binary = decode_request(memoryview(body), rest.header_length, loose)
    if request.parameters:
        if read is None:
            read = scheduling_json(rest, unwrapped[1]) is not None
        _scheduled(request, read)

    def encode(response: pb.ModelInferResponse, views: list[Buffer]) -> list[Buffer]:
        return encode_response(request, response, views, binary, rest.accept)

    return request, raw, encode


def _scheduled(request: pb.ModelInferRequest, read: bool) -> None:
    """InvalidInput when the request carries a parameter the pool schedules by
    in a JSON the pool did not read (over MAX_PEEK bytes): never ignored."""
    keys = [key for key in SCHEDULING if key in request.parameters]
    if keys and not read:
        raise InvalidInput(
            f"request parameter '{keys[0]}' is in a JSON of more than {MAX_PEEK} bytes "
            "(inflated): the server schedules by the parameters of a smaller JSON only; "
            "send the tensors as binary data (Triton's binary tensor extension: "
            "Inference-Header-Content-Length), the JSON then stays small"
        )


def inflate(body: Buffer, limit: int, header_length: int | None = None) -> tuple[bytes, bool]:
    """A gzip or deflate (zlib) body, inflated once, to at most ``limit``
    bytes, and whether the pool read its JSON for scheduling
    (:func:`~poolserve.service.contract.rest.scheduling_json`'s answer, from
    this same inflation, so the worker need not inflate its start again)."""
    inflater = inflater_of()
    view = memoryview(body)
    try:
        if header_length is not None and header_length <= MAX_PEEK:
            # the pool's first step, then on from where it stopped
            first = peek_inflate(inflater, view)
            read = peeked_json(first, inflater.eof, header_length) is not None
            parts = [first]
            for more in (inflater.unconsumed_tail, view[MAX_PEEK_COMPRESSED:]):
                size = sum(map(len, parts))
                if more and size <= limit and not inflater.eof:
                    parts.append(inflater.decompress(more, limit + 1 - size))
            out = first if len(parts) == 1 else b"".join(parts)
        else:
            # in one go: the whole JSON was read when the body ended in its
            # first MAX_PEEK_COMPRESSED bytes and inflated to at most MAX_PEEK
            out = inflater.decompress(view, limit + 1)
            consumed = len(view) - len(inflater.unused_data)
            read = (
                header_length is None
                and inflater.eof
                and consumed <= MAX_PEEK_COMPRESSED
                and len(out) <= MAX_PEEK
            )
    except zlib.error as exc:
        raise InvalidInput(f"the body cannot be inflated (Content-Encoding): {exc}") from None
    if len(out) > limit:
        raise MessageTooLarge(f"the inflated body is over max_message_size ({limit} bytes)")
    if not inflater.eof:
        raise InvalidInput("the compressed body is truncated (Content-Encoding)")
    return out, read


# -- the request -----------------------------------------------------------------


class Binary:
    """Which outputs go as binary data: ``binary_data_output`` for all, an
    output's own ``binary_data`` over it."""

    def __init__(self, default: bool) -> None:
        self.default = default
        self.outputs: dict[str, bool] = {}

    def __call__(self, name: str) -> bool:
        return self.outputs.get(name, self.default)


def decode_request(
    body: memoryview, header_length: int | None, loose: bool = False
) -> tuple[pb.ModelInferRequest, list[Buffer], Binary]:
    """(the request, each input's raw bytes in order, which outputs go as binary).

    ``loose``: read as MLServer's types read a body (its REST endpoint's
    pydantic ``InferenceRequest``), for a model served through its adapter
    (:attr:`~poolserve.service.inference.model.WireModel.rest_as_mlserver`):
    a BYTES input's ``data`` is taken whatever its count, the shape left as
    sent (MLServer's custom-json example sends one JSON string with shape
    [its length]); a parameter that is null is unset (MLServer's own clients
    send ``"headers": null``); a body without ``"id"`` gets a fresh UUID, as
    MLServer's data plane gives a request whose id is unset (over gRPC an
    empty id stays empty, there as here)."""
    if header_length is None:
        text, binary = body, body[len(body) :]
    else:
        if header_length > len(body):
            raise InvalidInput(
                f"Inference-Header-Content-Length {header_length} is past the end of "
                f"the {len(body)}-byte body"
            )
        text, binary = body[:header_length], body[header_length:]
    doc = _loads(text)
    if not isinstance(doc, dict):
        raise InvalidInput("the request body must be a JSON object")
    request = pb.ModelInferRequest()
    ident = doc.get("id")
    if ident is not None:
        if not isinstance(ident, str):
            raise InvalidInput("'id' must be a string")
        request.id = ident
    elif loose:
        request.id = str(uuid.uuid4())
    params = _object(doc.get("parameters"), "'parameters'", loose)
    binary_output = Binary(_flag(params.pop(BINARY_DATA_OUTPUT, False), BINARY_DATA_OUTPUT))
    _set_parameters(request.parameters, params, "request")
    inputs = doc.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        raise InvalidInput("'inputs' must be a non-empty list of tensors")
    raw: list[Buffer] = []
    offset = 0
    for tensor in inputs:
        entry, offset = _input(request, tensor, binary, offset, loose)
        if entry is not None:  # None: its bytes are in a shared-memory region
            raw.append(entry)
    if offset != len(binary):
        raise InvalidInput(
            f"the body holds {len(binary) - offset} bytes of binary data no input claims"
        )
    outputs = doc.get("outputs")
    if outputs is not None:
        if not isinstance(outputs, list):
            raise InvalidInput("'outputs' must be a list")
        for output in outputs:
            _requested_output(request, output, binary_output, loose)
    return request, raw, binary_output


def _object(value: object, where: str, loose: bool = False) -> dict[str, Any]:
    """A JSON object (parameters); null is none; ``loose``: its null members too."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidInput(f"{where} must be a JSON object")
    if loose:
        return {k: v for k, v in value.items() if v is not None}
    return dict(value)


def _set_parameters(target: Any, params: Mapping[str, Any], where: str) -> None:
    """JSON parameters as InferParameters: true/false bool, integers int64 (uint64
    beyond), other numbers double, strings string."""
    for key, value in params.items():
        param = target[key]
        if isinstance(value, bool):
            param.bool_param = value
        elif isinstance(value, int):
            if value >= 1 << 63:
                param.uint64_param = value
            else:
                param.int64_param = value
        elif isinstance(value, float):
            param.double_param = value
        elif isinstance(value, str):
            param.string_param = value
        else:
            raise InvalidInput(
                f"{where} parameter '{clip(key)}' must be a boolean, a number or a string"
            )


def _input(
    request: pb.ModelInferRequest,
    tensor: object,
    binary: memoryview,
    offset: int,
    loose: bool = False,
) -> tuple[Buffer | None, int]:
    if not isinstance(tensor, dict):
        raise InvalidInput("each of 'inputs' must be a JSON object")
    name = tensor.get("name")
    datatype = tensor.get("datatype")
    shape = tensor.get("shape")
    if not isinstance(name, str):
        raise InvalidInput("an input has no 'name' string")
    where = f"input '{clip(name)}'"
    if not isinstance(datatype, str):
        raise InvalidInput(f"{where} has no 'datatype' string")
    if not isinstance(shape, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) and -_INT64 <= d < _INT64 for d in shape
    ):
        raise InvalidInput(f"{where}: 'shape' must be a list of integers")
    if any(d < 0 for d in shape):  # -1 is for declarations, not for a request's tensor
        raise InvalidInput(f"{where}: negative dimension in shape {shape}")
    params = _object(tensor.get("parameters"), f"{where}: 'parameters'", loose)
    size = params.pop(BINARY_DATA_SIZE, None)
    entry = request.inputs.add(name=name, datatype=datatype, shape=shape)
    _set_parameters(entry.parameters, params, where)
    if size is not None:
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise InvalidInput(f"{where}: 'binary_data_size' must be a non-negative integer")
        if offset + size > len(binary):
            raise InvalidInput(
                f"{where}: binary_data_size {size} runs past the end of the body's binary data"
            )
        return binary[offset : offset + size], offset + size
    if "data" not in tensor:
        if "shared_memory_region" in params:
            return None, offset
        raise InvalidInput(f"{where} has neither 'data' nor binary data")
    return _json_data(tensor["data"], datatype, shape, where, loose), offset


def _json_data(
    data: object, datatype: str, shape: list[int], where: str, loose: bool = False
) -> bytes:
    """An input's JSON ``data`` (flat or nested, row-major) as its raw bytes;
    ``loose``: BYTES elements whatever their count (:func:`decode_request`)."""
    count = math.prod(shape) if all(d >= 0 for d in shape) else -1
    if datatype == "BYTES":
        items = _flat(data, where)
        if len(items) != count and not loose:
            raise InvalidInput(
                f"{where}: {len(items)} elements in 'data', shape {shape} holds {count}"
            )
        out = bytearray()
        for item in items:
            if not isinstance(item, str):
                raise InvalidInput(f"{where}: BYTES elements must be strings")
            encoded = item.encode()
            out += _LENGTH.pack(len(encoded))
            out += encoded
        return bytes(out)
    dtype = dtype_for(datatype)
    try:
        arr = np.asarray(data)
    except ValueError as exc:  # ragged nesting
        raise InvalidInput(f"{where}: 'data' is not a regular array: {exc}") from None
    if dtype.kind in _INT_KINDS and arr.dtype.kind in "fO":
        arr = _integers(data, dtype, datatype, where)  # 64-bit ones past float precision
    if arr.ndim > MAX_DEPTH:
        raise InvalidInput(f"{where}: 'data' is nested deeper than {MAX_DEPTH}")
    if arr.size != count:
        raise InvalidInput(f"{where}: {arr.size} elements in 'data', shape {shape} holds {count}")
    return _cast(arr, dtype, datatype, where).tobytes()


_NOT_INTEGERS = "numbers that are not integers (fractions, NaN or infinities)"


def _integers(data: object, dtype: np.dtype[Any], datatype: str, where: str) -> npt.NDArray[Any]:
    """Integers numpy read as floats (beyond int64, or int64 and uint64 mixed)."""
    values = np.asarray(data, dtype=object)
    if not all(type(v) is int for v in values.flat):
        raise InvalidInput(f"{where}: 'data' holds {_NOT_INTEGERS}, not {datatype} values")
    try:
        return np.array(values.tolist(), dtype=dtype)
    except OverflowError:
        raise InvalidInput(f"{where}: a value in 'data' is out of range for {datatype}") from None


def _flat(data: object, where: str, depth: int = 0) -> list[object]:
    if not isinstance(data, list):
        return [data]
    if depth > MAX_DEPTH:
        raise InvalidInput(f"{where}: 'data' is nested deeper than {MAX_DEPTH}")
    if not any(isinstance(item, list) for item in data):
        return data
    out: list[object] = []
    for item in data:
        out.extend(_flat(item, where, depth + 1))
    return out


def _cast(
    arr: npt.NDArray[Any], dtype: np.dtype[Any], datatype: str, where: str
) -> npt.NDArray[Any]:
    kind = arr.dtype.kind
    if arr.size == 0:
        return np.zeros(0, dtype)
    if dtype.kind == "b":
        ok = kind == "b"
    elif dtype.kind in _INT_KINDS:
        ok = kind in _INT_KINDS
        if ok:
            info = np.iinfo(dtype)
            ok = bool(arr.min() >= info.min and arr.max() <= info.max)
            if not ok:
                raise InvalidInput(f"{where}: a value in 'data' is out of range for {datatype}")
    else:
        ok = kind in _NUMBER_KINDS
    if not ok:
        raise InvalidInput(f"{where}: 'data' holds {_json_kind(kind)}, not {datatype} values")
    return np.ascontiguousarray(arr, dtype=dtype)


def _json_kind(kind: str) -> str:
    return {"b": "booleans", "f": _NOT_INTEGERS, "U": "strings", "O": "mixed values"}.get(
        kind, "integers" if kind in _INT_KINDS else "other values"
    )


def _flag(value: object, name: str) -> bool:
    if not isinstance(value, bool):
        raise InvalidInput(f"parameter '{name}' must be true or false")
    return value


def _requested_output(
    request: pb.ModelInferRequest, output: object, binary: Binary, loose: bool = False
) -> None:
    if not isinstance(output, dict) or not isinstance(output.get("name"), str):
        raise InvalidInput("each of 'outputs' must be a JSON object with a 'name'")
    where = f"output '{clip(output['name'])}'"
    params = _object(output.get("parameters"), f"{where}: 'parameters'", loose)
    if BINARY_DATA in params:
        binary.outputs[output["name"]] = _flag(params.pop(BINARY_DATA), BINARY_DATA)
    entry = request.outputs.add(name=output["name"])
    _set_parameters(entry.parameters, params, where)


def _run_wire(
    model: WireModel, request: pb.ModelInferRequest, raw: list[Buffer], regions: dict[str, Region]
) -> tuple[pb.ModelInferResponse, list[Buffer], Timings]:
    """An adapter's model: the request as protobuf bytes, its answer parsed back."""
    if regions:
        raise InvalidInput(
            f"model '{model.settings.name}' is served through an adapter "
            "that reads tensors from the request only: shared memory is not supported"
        )
    request.raw_input_contents.extend(bytes(entry) for entry in raw)
    body, timings = model.infer_wire(request.SerializeToString())
    response = pb.ModelInferResponse.FromString(body)
    entries: list[Buffer] = list(response.raw_output_contents)
    del response.raw_output_contents[:]
    return response, entries, timings


# -- KServe's V1 protocol -------------------------------------------------------


def decode_v1(body: memoryview, model: Model) -> tuple[pb.ModelInferRequest, list[Buffer], Binary]:
    """``{"instances": [...]}`` (or ``"inputs"``) as the model's first input:
    its declared name and datatype, the instances' shape (one row each)."""
    doc = _loads(body)
    instances = doc.get("instances", doc.get("inputs")) if isinstance(doc, dict) else None
    if not isinstance(instances, list) or not instances:
        raise InvalidInput('the request body must be {"instances": [...]} with one or more rows')
    declared = tensor_specs(model)[0]
    name = declared[0].name if declared else "input-0"
    try:
        arr = np.asarray(instances)
    except ValueError as exc:
        raise InvalidInput(f"'instances' is not a regular array: {exc}") from None
    if declared:
        datatype = declared[0].datatype
    elif arr.dtype.kind in "US":
        datatype = "BYTES"
    elif arr.dtype.kind == "b":
        datatype = "BOOL"
    else:
        datatype = "INT64" if arr.dtype.kind in _INT_KINDS else "FP64"
    where = f"input '{clip(name)}'"
    request = pb.ModelInferRequest()
    request.inputs.add(name=name, datatype=datatype, shape=list(arr.shape))
    return request, [_json_data(instances, datatype, list(arr.shape), where)], Binary(False)


def encode_v1(response: pb.ModelInferResponse, views: list[Buffer], encoding: int) -> list[Buffer]:
    """``{"predictions": [...]}``: the model's first output, nested by its shape."""
    if not response.outputs:
        raise InvalidInput(f"model '{response.model_name}' returned no outputs")
    tensor = response.outputs[0]
    data: object
    if tensor.datatype == "BYTES":  # text, or {"b64": ...} (KServe's V1, TF Serving's)
        items = [_v1_bytes(item) for item in _bytes_items(views[0])]
        data = np.asarray(items, dtype=object).reshape(tuple(tensor.shape)).tolist()
    else:
        data = _json_numbers(_numbers(tensor.datatype, views[0]).reshape(tuple(tensor.shape)))
    text = orjson.dumps({"predictions": data}, option=orjson.OPT_SERIALIZE_NUMPY)
    head = REPLY_HEAD.pack(len(text), encoding, 0)
    if encoding != IDENTITY:
        return [head, deflate([text], encoding)]
    return [head, text]


# -- the response ----------------------------------------------------------------


def encode_response(
    request: pb.ModelInferRequest,
    response: pb.ModelInferResponse,
    views: list[Buffer],
    binary: Binary,
    encoding: int = IDENTITY,
) -> list[Buffer]:
    """The reply's parts: its head, the JSON, then the binary outputs (all
    compressed together when the client accepts ``encoding``)."""
    wanted = {o.name: o for o in request.outputs}
    doc: dict[str, Any] = {"model_name": response.model_name}
    if response.model_version:
        doc["model_version"] = response.model_version
    if response.id:
        doc["id"] = response.id
    if response.parameters:
        doc["parameters"] = {k: _value(v) for k, v in response.parameters.items()}
    tail: list[Buffer] = []
    outputs: list[dict[str, Any]] = []
    for tensor, view in zip(response.outputs, views, strict=True):
        out: dict[str, Any] = {
            "name": tensor.name,
            "datatype": tensor.datatype,
            "shape": list(tensor.shape),
        }
        params = {k: _value(v) for k, v in tensor.parameters.items()}
        requested = wanted.get(tensor.name)
        if requested is not None and "shared_memory_region" in requested.parameters:
            for key, value in requested.parameters.items():  # where it was written
                if key.startswith("shared_memory_"):
                    params[key] = _value(value)
            out["parameters"] = params
            outputs.append(out)
            continue
        if binary(tensor.name):
            params[BINARY_DATA_SIZE] = memoryview(view).nbytes
            tail.append(view)
        elif tensor.datatype == "BYTES":
            out["data"] = _json_bytes(_bytes_items(view), params)
        else:
            out["data"] = _json_numbers(_numbers(tensor.datatype, view))
        if params:
            out["parameters"] = params
        outputs.append(out)
    doc["outputs"] = outputs
    text = orjson.dumps(doc, option=orjson.OPT_SERIALIZE_NUMPY)
    head = REPLY_HEAD.pack(len(text), encoding, 1 if tail else 0)
    if encoding != IDENTITY:
        return [head, deflate([text, *tail], encoding)]
    return [head, text, *tail]


def _value(param: pb.InferParameter) -> object:
    choice = param.WhichOneof("parameter_choice")
    return None if choice is None else getattr(param, choice)


def _numbers(datatype: str, view: Buffer) -> npt.NDArray[Any]:
    return np.frombuffer(view, dtype_for(datatype))


def _json_numbers(arr: npt.NDArray[Any]) -> npt.NDArray[Any] | orjson.Fragment:
    """An array as JSON numbers: as it is (orjson's fast path) unless it holds NaN or
    an infinity, which orjson would write as null; those are written NaN, Infinity
    and -Infinity, as Triton's REST does (rapidjson's kWriteNanAndInfFlag) and as
    Python's json and tritonclient read them back."""
    if arr.dtype.kind != "f" or np.isfinite(arr).all():
        return arr
    flat = arr.ravel()
    # orjson's own numbers (float32's shortest form), then the non-finite ones' words
    tokens = orjson.dumps(flat, option=orjson.OPT_SERIALIZE_NUMPY)[1:-1].split(b",")
    for index in np.flatnonzero(~np.isfinite(flat)):
        value = flat[index]
        tokens[index] = b"NaN" if np.isnan(value) else b"Infinity" if value > 0 else b"-Infinity"
    return orjson.Fragment(_nested(tokens, arr.shape))


def _nested(tokens: list[bytes], shape: tuple[int, ...]) -> bytes:
    """JSON numbers (``tokens``, row-major) nested as ``shape``."""
    if not shape:
        return tokens[0]
    if len(shape) == 1:
        return b"[" + b",".join(tokens) + b"]"
    step = len(tokens) // shape[0]
    rows = (_nested(tokens[i * step : (i + 1) * step], shape[1:]) for i in range(shape[0]))
    return b"[" + b",".join(rows) + b"]"


def _loads(text: Buffer) -> Any:
    """A JSON body (NaN and the infinities read as Triton reads them), or InvalidInput."""
    try:
        return json_body.loads(text)
    except json_body.NotJson as exc:
        raise InvalidInput(f"the request body is not valid JSON: {exc}") from None


def _v1_bytes(item: bytes) -> object:
    try:
        return item.decode()
    except UnicodeDecodeError:
        return {"b64": base64.b64encode(item).decode("ascii")}


def _bytes_items(view: Buffer) -> list[bytes]:
    items: list[bytes] = []
    data = memoryview(view).cast("B")
    pos = 0
    while pos < len(data):
        (size,) = _LENGTH.unpack_from(data, pos)
        pos += _LENGTH.size
        items.append(bytes(data[pos : pos + size]))
        pos += size
    return items


def _json_bytes(items: list[bytes], params: dict[str, Any]) -> list[str]:
    """A BYTES output's elements as JSON strings: as text when all are UTF-8
    (Triton, MLServer), else all base64, with the output parameter
    ``content_type: base64`` (MLServer's Base64Codec reads them back)."""
    try:
        return [item.decode() for item in items]
    except UnicodeDecodeError:
        params[CONTENT_TYPE] = BASE64
        return [base64.b64encode(item).decode("ascii") for item in items]
