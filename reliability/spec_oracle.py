"""A second fuzz oracle, written from the protocol instead of from poolserve's code.

The first oracle (:class:`fuzzing.Oracle`) runs poolserve's own peek and
decoder in-process, so it proves that the network path equals the in-process
path, not that decoding is right. This one reads tensors the way the Open
Inference Protocol (KServe V2, Triton's gRPC API) defines them, with nothing
of poolserve but the generated protobuf classes:

- a datatype fixes the element size (BOOL, INT8 and UINT8 1 byte, INT16,
  UINT16 and FP16 2, INT32, UINT32 and FP32 4, INT64, UINT64 and FP64 8);
  BYTES elements have any length;
- the element count is the product of the shape (every dimension >= 0);
- ``raw_input_contents`` holds one entry per input (all inputs raw, or none):
  the elements little-endian and row-major, so ``numpy.frombuffer`` with the
  datatype's little-endian dtype, exactly count x itemsize bytes; a BYTES
  element is a 4-byte little-endian length and that many bytes, the entry
  holding exactly count elements; a raw BOOL byte is 0 or 1;
- typed ``contents`` use the one field of the datatype (INT8/16/32 in
  ``int_contents``, UINT8/16/32 in ``uint_contents``, ...), exactly count
  values, each within the datatype's range; FP16 has no typed field.

For a request to ``echo`` (which answers OUTPUT<k> = INPUT<k>) it predicts
INVALID_ARGUMENT or OK with the exact tensors, and checks a reply by decoding
it the same independent way. Given the model's declared inputs (name ->
datatype and shape, a model without ``max_batch_size``), it also applies
Triton's rules for them (its core's InferenceRequest::Normalize): exactly the
declared names, each with its declared datatype and as many dimensions, each
dimension equal to the declared one unless that is -1; a request that breaks
one is INVALID_ARGUMENT. It abstains (None) on what is not decoding:
routing, scheduling parameters, requested outputs, input names echo refuses,
messages too large to send, unknown top-level fields, and shapes numpy
cannot represent (more than 32 dimensions, or nonzero dimensions whose
product overflows its index type).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from google.protobuf import unknown_fields
from google.protobuf.message import DecodeError

from poolserve.protos import inference_pb2 as pb

ITEMSIZE = {
    "BOOL": 1, "INT8": 1, "UINT8": 1, "INT16": 2, "UINT16": 2, "FP16": 2,
    "INT32": 4, "UINT32": 4, "FP32": 4, "INT64": 8, "UINT64": 8, "FP64": 8,
}  # fmt: skip
LITTLE_ENDIAN = {
    "BOOL": "<u1", "INT8": "<i1", "UINT8": "<u1", "INT16": "<i2", "UINT16": "<u2",
    "FP16": "<f2", "INT32": "<i4", "UINT32": "<u4", "FP32": "<f4", "INT64": "<i8",
    "UINT64": "<u8", "FP64": "<f8",
}  # fmt: skip
TYPED_FIELD = {
    "BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents",
    "INT32": "int_contents", "INT64": "int64_contents", "UINT8": "uint_contents",
    "UINT16": "uint_contents", "UINT32": "uint_contents", "UINT64": "uint64_contents",
    "FP32": "fp32_contents", "FP64": "fp64_contents", "BYTES": "bytes_contents",
}  # fmt: skip
SCHEDULING = ("priority", "timeout", "idempotent")
NUMPY_MAX_DIMS = 32  # numpy 1.x; poolserve decodes with numpy, the protocol sets no limit
INTP_MAX = (1 << 63) - 1


class SpecError(Exception):
    """A tensor the protocol says is malformed."""


@dataclass(frozen=True)
class Tensor:
    name: str
    datatype: str
    shape: tuple[int, ...]
    data: bytes  # fixed-size: the little-endian elements; BYTES: the length-prefixed form

    @classmethod
    def of(cls, name: str, datatype: str, shape: tuple[int, ...], values: object) -> Tensor:
        if datatype == "BYTES":
            items: list[bytes] = values  # type: ignore[assignment]
            data = b"".join(len(v).to_bytes(4, "little") + v for v in items)
        else:
            data = np.asarray(values, dtype=LITTLE_ENDIAN[datatype]).tobytes()
        return cls(name, datatype, shape, data)


@dataclass(frozen=True)
class Verdict:
    code: str  # "OK" or "INVALID_ARGUMENT"
    outputs: tuple[Tensor, ...] = ()
    reason: str = ""


def _numpy_can_hold(shape: Sequence[int], itemsize: int) -> bool:
    """numpy refuses more than 32 dimensions (numpy 1.x) and shapes whose nonzero
    dimensions multiply past its index type, even with a zero dimension; the
    protocol sets no such limits, so those are not judged here."""
    nonzero = 1
    for dim in shape:
        nonzero *= dim if dim > 0 else 1
    return len(shape) <= NUMPY_MAX_DIMS and nonzero * itemsize <= INTP_MAX


def _count(shape: tuple[int, ...]) -> int:
    if any(dim < 0 for dim in shape):
        raise SpecError(f"negative dimension in {list(shape)}")
    count = 1
    for dim in shape:
        count *= dim
    return count


def _split_bytes(data: bytes, count: int) -> list[bytes]:
    items, pos = [], 0
    for _ in range(count):
        if pos + 4 > len(data):
            raise SpecError("BYTES length prefix past the end")
        length = int.from_bytes(data[pos : pos + 4], "little")
        pos += 4
        if pos + length > len(data):
            raise SpecError("BYTES element past the end")
        items.append(data[pos : pos + length])
        pos += length
    if pos != len(data):
        raise SpecError(f"{len(data) - pos} bytes after the last BYTES element")
    return items


def _from_raw(name: str, datatype: str, shape: tuple[int, ...], raw: bytes) -> Tensor:
    count = _count(shape)
    if datatype == "BYTES":
        return Tensor.of(name, datatype, shape, _split_bytes(raw, count))
    if len(raw) != count * ITEMSIZE[datatype]:
        raise SpecError(f"{len(raw)} raw bytes for {count} x {ITEMSIZE[datatype]}")
    values = np.frombuffer(raw, dtype=LITTLE_ENDIAN[datatype], count=count)
    if datatype == "BOOL" and count and int(values.max()) > 1:
        raise SpecError("a raw BOOL byte other than 0 or 1")
    return Tensor(name, datatype, shape, raw)


def _from_typed(
    name: str, datatype: str, shape: tuple[int, ...], contents: pb.InferTensorContents
) -> Tensor:
    field = TYPED_FIELD.get(datatype)
    if field is None:
        raise SpecError(f"{datatype} has no typed contents field")
    if any(f.name != field for f, _ in contents.ListFields()):
        raise SpecError(f"{datatype} contents in another field than {field}")
    values = list(getattr(contents, field))
    if len(values) != _count(shape):
        raise SpecError(f"{len(values)} values for shape {list(shape)}")
    if datatype in ("INT8", "INT16", "UINT8", "UINT16"):
        bits = 8 * ITEMSIZE[datatype]
        low, high = (
            (0, (1 << bits) - 1) if datatype[0] == "U" else (-(1 << bits - 1), (1 << bits - 1) - 1)
        )
        if any(not low <= v <= high for v in values):
            raise SpecError(f"a value outside the {datatype} range")
    return Tensor.of(name, datatype, shape, values)


def decode(
    tensors: list[pb.ModelInferRequest.InferInputTensor]
    | list[pb.ModelInferResponse.InferOutputTensor],
    raw: list[bytes],
) -> list[Tensor]:
    """The tensors of a request or a response, or SpecError."""
    if raw and len(raw) != len(tensors):
        raise SpecError(f"{len(raw)} raw entries for {len(tensors)} tensors")
    out = []
    for index, tensor in enumerate(tensors):
        shape = tuple(tensor.shape)
        if tensor.datatype not in TYPED_FIELD and tensor.datatype != "FP16":
            raise SpecError(f"unknown datatype {tensor.datatype!r}")
        if raw:
            if tensor.contents.ListFields():
                raise SpecError("typed contents beside raw contents")
            out.append(_from_raw(tensor.name, tensor.datatype, shape, raw[index]))
        else:
            out.append(_from_typed(tensor.name, tensor.datatype, shape, tensor.contents))
    if len({t.name for t in out}) != len(out):
        raise SpecError("an input name appears twice")
    return out


Declared = Mapping[str, tuple[str, tuple[int, ...]]]


def breaks_declaration(inputs: Sequence[Tensor], declared: Declared) -> str:
    """ "" when ``inputs`` are what ``declared`` asks for, else which rule they break."""
    if sorted(t.name for t in inputs) != sorted(declared):
        return f"inputs {[t.name for t in inputs]}, declared {sorted(declared)}"
    for tensor in inputs:
        datatype, shape = declared[tensor.name]
        if tensor.datatype != datatype:
            return f"{tensor.name} is {tensor.datatype}, declared {datatype}"
        if len(tensor.shape) != len(shape) or any(
            want not in (-1, got) for want, got in zip(shape, tensor.shape, strict=True)
        ):
            return f"{tensor.name} has shape {list(tensor.shape)}, declared {list(shape)}"
    return ""


def predict(body: bytes, limit: int, declared: Declared | None = None) -> Verdict | None:
    """What a server serving ``echo`` must answer to ``body``; None: not modelled
    here. ``declared``: echo's declared inputs, when it declares some."""
    if len(body) > limit // 2:
        return None  # size limits: the other oracle's part
    try:
        request = pb.ModelInferRequest.FromString(body)
    except DecodeError:
        return None
    if request.model_name != "echo" or request.model_version not in ("", "1"):
        return None
    if len(unknown_fields.UnknownFieldSet(request)):
        return None  # poolserve's router refuses some (groups) that protobuf skips
    if request.outputs or any(key in request.parameters for key in SCHEDULING):
        return None
    if declared is None and any(not t.name.startswith("INPUT") for t in request.inputs):
        return None
    if any(not _numpy_can_hold(t.shape, ITEMSIZE.get(t.datatype, 8)) for t in request.inputs):
        return None
    try:
        inputs = decode(list(request.inputs), list(request.raw_input_contents))
    except SpecError as exc:
        return Verdict("INVALID_ARGUMENT", reason=str(exc))
    broken = breaks_declaration(inputs, declared) if declared is not None else ""
    if broken:
        return Verdict("INVALID_ARGUMENT", reason=broken)
    outputs = tuple(
        Tensor("OUTPUT" + t.name[len("INPUT") :], t.datatype, t.shape, t.data) for t in inputs
    )
    return Verdict("OK", outputs)


def disagreement(verdict: Verdict, code: str, reply: bytes) -> str:
    """ "" when the server's answer is the verdict's; otherwise what differs."""
    if code != verdict.code:
        return f"spec oracle expected {verdict.code} ({verdict.reason}), got {code}"
    if code != "OK":
        return ""
    response = pb.ModelInferResponse.FromString(reply)
    try:
        got = decode(list(response.outputs), list(response.raw_output_contents))
    except SpecError as exc:
        return f"spec oracle cannot decode the reply: {exc}"
    if sorted(got, key=lambda t: t.name) != sorted(verdict.outputs, key=lambda t: t.name):
        return f"spec oracle expected outputs {verdict.outputs}, got {got}"
    return ""
