"""An ensemble's tensors as the router keeps them: a datatype, a shape and the
raw little-endian bytes of the Open Inference Protocol's ``raw_input_contents``.

Steps pass raw bytes to each other untouched. Only what a client sends as
values (a gRPC request's typed ``contents``, a REST body's JSON ``data``)
is turned into raw bytes here, and only what a REST client asks for as JSON
is turned back: with the standard library's ``array`` and ``struct``, never
numpy (the router does not load it).
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Iterable, Sequence
from math import prod
from typing import Any, NamedTuple

from poolserve.protos import inference_pb2 as pb
from poolserve.service.contract.ensemble import check_input_names
from poolserve.service.contract.errors import InvalidInput

# array's typecodes of each fixed-size datatype (sizes checked at import below)
_TYPECODES = {
    "INT8": "b",
    "UINT8": "B",
    "INT16": "h",
    "UINT16": "H",
    "INT32": "i",
    "UINT32": "I",
    "INT64": "q",
    "UINT64": "Q",
    "FP32": "f",
    "FP64": "d",
}
_SIZES = {"INT8": 1, "UINT8": 1, "INT16": 2, "UINT16": 2, "INT32": 4, "UINT32": 4}
_SIZES |= {"INT64": 8, "UINT64": 8, "FP32": 4, "FP64": 8, "FP16": 2, "BF16": 2, "BOOL": 1}
assert all(array(code).itemsize == _SIZES[dt] for dt, code in _TYPECODES.items())
_SWAP = sys.byteorder != "little"
_LENGTH = struct.Struct("<I")

# the InferTensorContents field of each datatype's values
_CONTENTS = {"BOOL": "bool_contents", "BYTES": "bytes_contents", "FP32": "fp32_contents"}
_CONTENTS |= {"INT8": "int_contents", "INT16": "int_contents", "INT32": "int_contents"}
_CONTENTS |= {"UINT8": "uint_contents", "UINT16": "uint_contents", "UINT32": "uint_contents"}
_CONTENTS |= {"INT64": "int64_contents", "UINT64": "uint64_contents", "FP64": "fp64_contents"}


class Tensor(NamedTuple):
    datatype: str
    shape: tuple[int, ...]
    raw: bytes


def raw_of(datatype: str, shape: Sequence[int], values: Sequence[object], where: str) -> bytes:
    """``values`` (flat, row-major) as raw bytes; InvalidInput naming ``where``."""
    if len(values) != prod(shape):
        raise InvalidInput(
            f"{where}: {len(values)} values for shape {list(shape)} ({prod(shape)} elements)"
        )
    try:
        if datatype == "BYTES":
            parts = []
            for value in values:
                item = value.encode() if isinstance(value, str) else value
                if not isinstance(item, bytes):
                    raise TypeError("BYTES elements are strings")
                parts += [_LENGTH.pack(len(item)), item]
            return b"".join(parts)
        if datatype == "BOOL":
            if not all(isinstance(v, bool) for v in values):
                raise TypeError("BOOL elements are true or false")
            return bytes(1 if v else 0 for v in values)
        if datatype == "FP16":
            return struct.pack(f"<{len(values)}e", *values)
        code = _TYPECODES.get(datatype)
        if code is None:
            raise TypeError(f"datatype {datatype} cannot be sent as values")
        if code not in "fd" and not all(
            isinstance(v, int) and not isinstance(v, bool) for v in values
        ):
            raise TypeError(f"{datatype} elements are integers")
        data: array[Any] = array(code, values)
    except (TypeError, OverflowError, struct.error) as exc:
        raise InvalidInput(f"{where}: {exc}") from None
    if _SWAP:
        data.byteswap()
    return data.tobytes()


def values_of(datatype: str, raw: bytes) -> list[object]:
    """Raw bytes as flat values (BYTES: bytes); ValueError when they do not fit."""
    if datatype == "BYTES":
        items: list[object] = []
        at = 0
        while at < len(raw):
            (length,) = _LENGTH.unpack_from(raw, at)
            at += _LENGTH.size
            if at + length > len(raw):
                raise ValueError("a BYTES element runs past the tensor's end")
            items.append(raw[at : at + length])
            at += length
        return items
    if datatype == "BOOL":
        return [b != 0 for b in raw]
    if datatype == "FP16":
        return list(struct.unpack(f"<{len(raw) // 2}e", raw))
    code = _TYPECODES.get(datatype)
    if code is None:
        raise ValueError(f"datatype {datatype} cannot be sent as JSON values")
    out: array[Any] = array(code)
    out.frombytes(raw)
    if _SWAP:
        out.byteswap()
    values: list[object] = out.tolist()
    return values


def check_size(datatype: str, shape: Sequence[int], raw: bytes, where: str) -> None:
    """A fixed-size tensor's bytes fit its shape (BYTES: any length)."""
    size = _SIZES.get(datatype)
    if size is None:
        if datatype != "BYTES":
            raise InvalidInput(f"{where}: unknown datatype {datatype!r}")
        return
    if len(raw) != size * prod(shape):
        raise InvalidInput(
            f"{where}: {len(raw)} bytes for {datatype} shape {list(shape)} "
            f"({size * prod(shape)} expected)"
        )


def request_tensors(request: pb.ModelInferRequest, declared: Iterable[str]) -> dict[str, Tensor]:
    """A gRPC request's inputs, raw or typed, as the ensemble's tensors."""
    raw = request.raw_input_contents
    if raw and len(raw) != len(request.inputs):
        raise InvalidInput(
            f"expected {len(request.inputs)} raw_input_contents, got {len(raw)} "
            "(one per input, or none: typed contents)"
        )
    tensors: dict[str, Tensor] = {}
    for i, tensor in enumerate(request.inputs):
        where = f"input '{tensor.name}'"
        if "shared_memory_region" in tensor.parameters:
            raise InvalidInput(f"{where}: an ensemble's inputs cannot be in shared memory")
        if raw:
            data = raw[i]
        else:
            field = _CONTENTS.get(tensor.datatype)
            if field is None:
                raise InvalidInput(f"{where}: datatype {tensor.datatype!r} has no typed contents")
            values = list(getattr(tensor.contents, field))
            data = raw_of(tensor.datatype, tensor.shape, values, where)
        check_size(tensor.datatype, tensor.shape, data, where)
        tensors[tensor.name] = Tensor(tensor.datatype, tuple(tensor.shape), data)
    check_input_names(tensors, declared)
    return tensors


def response_tensors(response: pb.ModelInferResponse) -> dict[str, Tensor]:
    """A step's reply's outputs by name (raw, or typed contents made raw)."""
    raw = response.raw_output_contents
    tensors = {}
    for i, tensor in enumerate(response.outputs):
        if raw:
            data = raw[i]
        else:
            values = list(
                getattr(tensor.contents, _CONTENTS.get(tensor.datatype, "bytes_contents"))
            )
            data = raw_of(tensor.datatype, tensor.shape, values, f"output '{tensor.name}'")
        tensors[tensor.name] = Tensor(tensor.datatype, tuple(tensor.shape), data)
    return tensors
