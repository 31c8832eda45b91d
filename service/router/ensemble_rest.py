"""An ensemble's REST call: the body as a ModelInferRequest, the answer as JSON.

A model's REST body goes to its worker unparsed (:mod:`contract.rest`); an
ensemble has no worker, so the router reads its body here: the JSON (orjson)
and Triton's binary tensor extension (``Inference-Header-Content-Length``,
each input's ``binary_data_size``), gzip or deflate inflated within
``max_message_size``. Binary inputs stay the bytes they came as; JSON
``data`` is made raw once (:mod:`ensemble_tensors`). The reply is what a
worker's would be (:data:`REPLY_HEAD`, the JSON, the binary outputs), so
the door sends it as any: outputs as binary when the request asks
(``binary_data_output``, or an output's ``binary_data``), else as JSON data.
"""

from __future__ import annotations

import base64
import zlib
from math import prod
from typing import Any

import orjson

from poolserve.protos import inference_pb2 as pb
from poolserve.service.contract.errors import InvalidInput, MessageTooLarge
from poolserve.service.contract.rest import GZIP, IDENTITY, REPLY_HEAD
from poolserve.service.router.ensemble_tensors import check_size, raw_of, values_of

BINARY_DATA_OUTPUT = "binary_data_output"
BINARY_DATA_SIZE = "binary_data_size"


class Wanted:
    """Which outputs a REST call wants as binary (Triton's extension)."""

    def __init__(self, default: bool) -> None:
        self.default = default
        self.outputs: dict[str, bool] = {}

    def binary(self, name: str) -> bool:
        return self.outputs.get(name, self.default)


def _inflate(body: bytes, encoding: int, limit: int) -> bytes:
    if encoding == IDENTITY:
        return body
    inflater = zlib.decompressobj(16 + zlib.MAX_WBITS if encoding == GZIP else zlib.MAX_WBITS)
    try:
        out = inflater.decompress(body, limit + 1)
    except zlib.error as exc:
        raise InvalidInput(f"the body cannot be inflated: {exc}") from None
    if len(out) > limit:
        raise MessageTooLarge(f"the inflated body is over max_message_size ({limit} bytes)")
    return out


def _set_parameter(target: pb.InferParameter, value: object, where: str) -> None:
    if isinstance(value, bool):
        target.bool_param = value
    elif isinstance(value, int):
        target.int64_param = value
    elif isinstance(value, float):
        target.double_param = value
    elif isinstance(value, str):
        target.string_param = value
    else:
        raise InvalidInput(f"{where}: a parameter is a boolean, a number or a string")


def _flat(data: object, where: str) -> list[object]:
    if not isinstance(data, list):
        return [data]
    out: list[object] = []
    for item in data:
        out.extend(_flat(item, where) if isinstance(item, list) else [item])
    return out


def _object(value: object, where: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidInput(f"{where} must be a JSON object")
    return value


def parse(
    body: bytes, header_length: int | None, encoding: int, limit: int
) -> tuple[pb.ModelInferRequest, Wanted]:
    """A REST inference body as a ModelInferRequest with raw inputs."""
    body = _inflate(body, encoding, limit)
    if header_length is not None and header_length > len(body):
        raise InvalidInput(
            f"Inference-Header-Content-Length {header_length} is past the end of "
            f"the {len(body)}-byte body"
        )
    end = len(body) if header_length is None else header_length
    try:
        doc = orjson.loads(memoryview(body)[:end])
    except orjson.JSONDecodeError as exc:
        raise InvalidInput(f"the request body is not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise InvalidInput("the request body must be a JSON object")
    request = pb.ModelInferRequest()
    ident = doc.get("id")
    if ident is not None:
        if not isinstance(ident, str):
            raise InvalidInput("'id' must be a string")
        request.id = ident
    params = dict(_object(doc.get("parameters"), "'parameters'"))
    wanted = Wanted(params.pop(BINARY_DATA_OUTPUT, False) is True)
    for key, value in params.items():
        _set_parameter(request.parameters[key], value, f"parameter '{key}'")
    inputs = doc.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        raise InvalidInput("'inputs' must be a non-empty list of tensors")
    offset = end
    for item in inputs:
        offset = _input(request, item, body, offset)
    if offset != len(body):
        raise InvalidInput(f"the body holds {len(body) - offset} bytes no input claims")
    outputs = doc.get("outputs")
    if outputs is not None:
        if not isinstance(outputs, list):
            raise InvalidInput("'outputs' must be a list")
        for item in outputs:
            if not isinstance(item, dict) or not isinstance(item.get("name"), str):
                raise InvalidInput("each of 'outputs' is {name, parameters}")
            out_params = dict(_object(item.get("parameters"), f"output '{item['name']}'"))
            binary = out_params.pop("binary_data", None)
            if binary is not None:
                wanted.outputs[item["name"]] = binary is True
            output = request.outputs.add(name=item["name"])
            for key, value in out_params.items():
                _set_parameter(output.parameters[key], value, f"output '{item['name']}'")
    return request, wanted


def _input(request: pb.ModelInferRequest, item: object, body: bytes, offset: int) -> int:
    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
        raise InvalidInput("each of 'inputs' is {name, shape, datatype, data}")
    name = item["name"]
    where = f"input '{name}'"
    shape, datatype = item.get("shape"), item.get("datatype")
    if not isinstance(shape, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
    ):
        raise InvalidInput(f"{where}: 'shape' must be a list of sizes")
    if not isinstance(datatype, str):
        raise InvalidInput(f"{where}: 'datatype' must be a string")
    params = _object(item.get("parameters"), f"{where} 'parameters'")
    tensor = request.inputs.add(name=name, datatype=datatype, shape=shape)
    size = params.get(BINARY_DATA_SIZE)
    if size is not None:
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise InvalidInput(f"{where}: '{BINARY_DATA_SIZE}' must be a size")
        if offset + size > len(body):
            raise InvalidInput(f"{where}: its {size} binary bytes run past the body's end")
        raw = body[offset : offset + size]
        offset += size
    elif "data" in item:
        values = _flat(item["data"], where)
        if datatype == "BYTES" and len(values) == 1 and prod(shape) != 1:
            raise InvalidInput(f"{where}: 1 value for shape {shape}")
        raw = raw_of(datatype, shape, values, where)
    else:
        raise InvalidInput(f"{where}: no 'data' and no '{BINARY_DATA_SIZE}'")
    for key, value in params.items():
        if key.startswith("shared_memory_"):
            raise InvalidInput(f"{where}: an ensemble's inputs cannot be in shared memory")
        if key != BINARY_DATA_SIZE:
            _set_parameter(tensor.parameters[key], value, where)
    check_size(datatype, shape, raw, where)
    request.raw_input_contents.append(raw)
    return offset


def _json_values(datatype: str, raw: bytes) -> list[object]:
    values = values_of(datatype, raw)
    if datatype != "BYTES":
        return values
    try:
        return [v.decode() for v in values]  # type: ignore[attr-defined]
    except UnicodeDecodeError:
        return [base64.b64encode(v).decode("ascii") for v in values]  # type: ignore[arg-type]


def reply(response: pb.ModelInferResponse, wanted: Wanted) -> bytes:
    """The ensemble's answer as a worker's REST reply: head, JSON, binary outputs."""
    doc: dict[str, Any] = {"model_name": response.model_name}
    if response.model_version:
        doc["model_version"] = response.model_version
    if response.id:
        doc["id"] = response.id
    tail: list[bytes] = []
    outputs = []
    for tensor, raw in zip(response.outputs, response.raw_output_contents, strict=True):
        out: dict[str, Any] = {
            "name": tensor.name,
            "datatype": tensor.datatype,
            "shape": list(tensor.shape),
        }
        if wanted.binary(tensor.name):
            out["parameters"] = {BINARY_DATA_SIZE: len(raw)}
            tail.append(raw)
        else:
            out["data"] = _json_values(tensor.datatype, raw)
        outputs.append(out)
    doc["outputs"] = outputs
    text = orjson.dumps(doc)
    return b"".join([REPLY_HEAD.pack(len(text), IDENTITY, 1 if tail else 0), text, *tail])
