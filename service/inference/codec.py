"""Tensor codec: Open Inference Protocol tensors to numpy arrays and back.

This module owns the mapping between protocol datatypes and numpy dtypes, the
validation of every tensor a client sends (a malformed tensor is an
:class:`InvalidInput` naming the tensor, never a numpy or protobuf exception),
and both wire forms: typed ``contents`` and ``raw_*_contents`` (little-endian,
row-major; a BYTES element is a 4-byte little-endian length and its bytes).
Requests may use either form; responses are always raw, as Triton's are
(tritonclient's ``as_numpy`` reads only ``raw_output_contents``).

It runs on the hot path of every worker, so fixed-size tensors are never
touched element by element in Python: raw inputs become read-only
``np.frombuffer`` views of the request's bytes, and typed values move in bulk.
Only BYTES tensors need a Python loop. The client-side mirrors
(:func:`encode_inputs`, :func:`decode_outputs`) share the same code.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable, Mapping, MutableSequence, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn, TypeAlias

import numpy as np
import numpy.typing as npt

from poolserve.protos import inference_pb2
from poolserve.service.contract.errors import InvalidInput, ModelError, ServingError, clip
from poolserve.service.inference.declared import DeclaredInputs

_Tensor: TypeAlias = (
    inference_pb2.ModelInferRequest.InferInputTensor
    | inference_pb2.ModelInferResponse.InferOutputTensor
)


@dataclass(frozen=True, slots=True)
class _Kind:
    dtype: np.dtype[Any]  # the array's dtype; little-endian as on the wire
    field: str | None  # the typed contents field; FP16 has none
    wire: np.dtype[Any]  # dtype of the typed field's values (small ints travel widened)


_OBJECT = np.dtype(object)


def _kind(dtype: str, field: str | None, wire: str | None = None) -> _Kind:
    return _Kind(np.dtype(dtype), field, np.dtype(wire or dtype))


_KINDS: dict[str, _Kind] = {
    "BOOL": _kind("?", "bool_contents"),
    "UINT8": _kind("<u1", "uint_contents", "<u4"),
    "UINT16": _kind("<u2", "uint_contents", "<u4"),
    "UINT32": _kind("<u4", "uint_contents"),
    "UINT64": _kind("<u8", "uint64_contents"),
    "INT8": _kind("<i1", "int_contents", "<i4"),
    "INT16": _kind("<i2", "int_contents", "<i4"),
    "INT32": _kind("<i4", "int_contents"),
    "INT64": _kind("<i8", "int64_contents"),
    "FP16": _kind("<f2", None),
    "FP32": _kind("<f4", "fp32_contents"),
    "FP64": _kind("<f8", "fp64_contents"),
    "BYTES": _Kind(_OBJECT, "bytes_contents", _OBJECT),
}

DATATYPES: tuple[str, ...] = tuple(_KINDS)

# Keyed by (dtype.kind, itemsize) so that byte order does not matter.
_BY_NUMPY: dict[tuple[str, int], str] = {
    (kind.dtype.kind, kind.dtype.itemsize): name for name, kind in _KINDS.items() if name != "BYTES"
}

# An input parameter of Triton's shared-memory extension: the tensor's bytes are
# in that region, so the tensor has no raw_input_contents entry of its own.
SHARED_MEMORY_REGION = "shared_memory_region"

_LENGTH = struct.Struct("<I")
# Reads an input that names a shared-memory region; writes an output requested
# into one (see poolserve.service.inference.shm).
SharedReader = Callable[[inference_pb2.ModelInferRequest.InferInputTensor], "npt.NDArray[Any]"]
SharedWriter = Callable[
    [inference_pb2.ModelInferRequest.InferRequestedOutputTensor, "npt.NDArray[Any]", str], None
]
# numpy refuses any shape whose byte size (zero dims aside) exceeds intp.
_MAX_BYTES = int(np.iinfo(np.intp).max)


def dtype_for(datatype: str) -> np.dtype[Any]:
    """The numpy dtype of a protocol datatype (BYTES is an object array of bytes)."""
    kind = _KINDS.get(datatype)
    if kind is None:
        raise InvalidInput(f"unknown datatype {datatype!r}; expected one of {', '.join(DATATYPES)}")
    return kind.dtype


def datatype_for(array: npt.NDArray[Any]) -> str:
    """The protocol datatype of an array: object, bytes and str arrays are BYTES."""
    dtype = array.dtype
    if dtype.kind in "OSU":
        return "BYTES"
    name = _BY_NUMPY.get((dtype.kind, dtype.itemsize))
    if name is None:
        raise InvalidInput(f"numpy dtype {dtype} has no Open Inference Protocol datatype")
    return name


def uses_raw(request: inference_pb2.ModelInferRequest) -> bool:
    """Whether the request sent raw_input_contents."""
    return len(request.raw_input_contents) > 0


def decode_inputs(
    request: inference_pb2.ModelInferRequest,
    shared: SharedReader | None = None,
    *,
    raw: list[Any] | None = None,
    declared: DeclaredInputs | None = None,
) -> dict[str, npt.NDArray[Any]]:
    """The request's input tensors by name; raises InvalidInput for any malformed one.

    Raw fixed-size inputs are read-only views of the request's bytes; an
    input that names a shared-memory region is read by ``shared``. ``raw``,
    when given, holds the raw entries instead of the request (views of the
    wire bytes, split off by :func:`poolserve.service.inference.rawwire.split_raw_inputs`).
    ``declared``: the model's declared inputs, which the tensors must match
    (:mod:`poolserve.service.inference.declared`; checked once they are read,
    as Triton resolves shared-memory regions before it checks the config).
    """
    entries = list(request.raw_input_contents) if raw is None else raw
    arrays = _decode(request.inputs, entries, "input", shared, model=request.model_name)
    if declared is not None:
        declared.check(request.inputs)
    return arrays


def decode_outputs(response: inference_pb2.ModelInferResponse) -> dict[str, npt.NDArray[Any]]:
    """The client-side mirror of :func:`decode_inputs`, for responses (raw or typed)."""
    raw = list(response.raw_output_contents)
    return _decode(response.outputs, raw, "output", model=response.model_name)


def encode_outputs(
    request: inference_pb2.ModelInferRequest,
    outputs: Mapping[str, npt.NDArray[Any]],
    response: inference_pb2.ModelInferResponse,
    shared: SharedWriter | None = None,
    *,
    raw: list[Any] | None = None,
) -> None:
    """Fills response.outputs with the requested outputs, in the requested order.

    Always in ``raw_output_contents``, whatever form the request used: Triton
    answers raw, and tritonclient reads nothing else. An output requested into
    a shared-memory region is written there by ``shared`` and answered with
    its metadata and an empty raw entry, as Triton does. With ``raw``, the raw
    entries go there instead, as byte views of the arrays where they are
    C-contiguous and little-endian (no copy), for the caller to write after
    the serialized response (:func:`poolserve.service.inference.rawwire.raw_output_parts`).
    """
    target = response.raw_output_contents if raw is None else raw
    placed = _placed_outputs(request) if shared is not None else {}
    for name, arr in _select(request, outputs):
        datatype = _datatype(name, arr, "output")
        tensor = response.outputs.add(name=name, datatype=datatype, shape=arr.shape)
        requested = placed.get(name)
        if requested is not None and shared is not None:
            shared(requested, arr, datatype)
            target.append(b"")
            continue
        _put(tensor, arr, target, "output", view=raw is not None)


def reply_bytes(
    request: inference_pb2.ModelInferRequest, outputs: Mapping[str, npt.NDArray[Any]]
) -> int:
    """At least the raw bytes :func:`encode_outputs` would put in the reply
    (outputs placed in shared memory aside), known before any is encoded: a
    fixed-size tensor's exact size, a BYTES tensor's length prefixes only
    (its strings are counted when encoded, not walked twice)."""
    placed = _placed_outputs(request)
    total = 0
    for name, value in outputs.items():
        if name in placed or (request.outputs and not _requested(request, name)):
            continue
        arr = np.asarray(value)
        total += arr.size * _LENGTH.size if arr.dtype.kind in "OSU" else arr.nbytes
    return total


def _requested(request: inference_pb2.ModelInferRequest, name: str) -> bool:
    return any(o.name == name for o in request.outputs)


def _placed_outputs(
    request: inference_pb2.ModelInferRequest,
) -> dict[str, inference_pb2.ModelInferRequest.InferRequestedOutputTensor]:
    if not request.outputs:
        return {}
    return {o.name: o for o in request.outputs if SHARED_MEMORY_REGION in o.parameters}


def decode_raw(tensor: _Tensor, data: bytes | memoryview) -> npt.NDArray[Any]:
    """One input from its raw bytes (BYTES: the length-prefixed form, as ``bytes``)."""
    return _decode_raw(tensor, data, "input")


def encode_raw(arr: npt.NDArray[Any], datatype: str, where: str) -> bytes:
    """One tensor's raw bytes (BYTES: each element length-prefixed)."""
    return _to_raw(arr, datatype, where)


def encode_inputs(
    inputs: Mapping[str, npt.NDArray[Any]],
    request: inference_pb2.ModelInferRequest,
    *,
    raw: bool,
) -> None:
    """The client-side mirror of :func:`encode_outputs`: fills request.inputs."""
    for name, value in inputs.items():
        arr = np.asarray(value)
        datatype = _datatype(name, arr, "input")
        if not raw and datatype == "FP16":
            raise InvalidInput(f"input '{clip(name)}': FP16 has no typed contents field; use raw")
        tensor = request.inputs.add(name=name, datatype=datatype, shape=arr.shape)
        _put(tensor, arr, request.raw_input_contents if raw else None, "input")


def parameters_to_dict(
    params: Mapping[str, inference_pb2.InferParameter],
) -> dict[str, object]:
    """Parameters as Python values; a parameter with no value set is None."""
    if not params:
        return {}
    return {key: _parameter_value(param) for key, param in params.items()}


def _parameter_value(param: inference_pb2.InferParameter) -> object:
    choice = param.WhichOneof("parameter_choice")
    return None if choice is None else getattr(param, choice)


# --- decoding ---------------------------------------------------------------


def _where(role: str, tensor: _Tensor) -> str:
    return f"{role} '{clip(tensor.name)}'"


def _decode(
    tensors: Sequence[_Tensor],
    raw: list[bytes],
    role: str,
    shared: SharedReader | None = None,
    *,
    model: str = "",
) -> dict[str, npt.NDArray[Any]]:
    # `raw` is a list because every index into a upb repeated bytes field copies.
    # Inputs in shared memory have no raw entry: the others take the entries in order.
    in_memory = [_in_shared_memory(t) for t in tensors] if role == "input" else []
    slots = _raw_slots(tensors, in_memory, len(raw), role, model) if raw else []
    arrays: dict[str, npt.NDArray[Any]] = {}
    for index, tensor in enumerate(tensors):
        if tensor.name in arrays:
            raise InvalidInput(f"{_where(role, tensor)} appears more than once")
        if in_memory and in_memory[index]:
            if shared is None:
                _refuse_shared_memory(tensor)
            assert isinstance(tensor, inference_pb2.ModelInferRequest.InferInputTensor)
            arrays[tensor.name] = shared(tensor)
            continue
        if raw:
            arrays[tensor.name] = _decode_raw(tensor, raw[slots[index]], role)
        else:
            arrays[tensor.name] = _decode_typed(tensor, role)
    return arrays


def _in_shared_memory(tensor: _Tensor) -> bool:
    return bool(tensor.parameters) and SHARED_MEMORY_REGION in tensor.parameters


def _refuse_shared_memory(tensor: _Tensor) -> NoReturn:
    region = tensor.parameters[SHARED_MEMORY_REGION].string_param
    raise InvalidInput(
        f"{_where('input', tensor)} names shared-memory region '{clip(region)}' "
        "(parameter shared_memory_region), but no shared memory is read here: "
        "send this input's bytes in raw_input_contents or contents"
    )


def _raw_slots(
    tensors: Sequence[_Tensor], in_memory: Sequence[bool], entries: int, role: str, model: str
) -> list[int]:
    """Each tensor's index into the raw contents (-1 for an input in shared memory).

    Typed contents beside raw ones are refused first, in Triton's words (its
    grpc_explicit_int_content_client.py matches on them), before any count.
    """
    for tensor in tensors:
        if tensor.contents.ListFields():
            raise InvalidInput(
                f"contents field must not be specified when using raw_{role}_contents "
                f"for '{clip(tensor.name)}' for model '{clip(model)}' "
                f"(all {role}s must use one form)"
            )
    slots: list[int] = []
    carried = 0
    for index in range(len(tensors)):
        if in_memory and in_memory[index]:
            slots.append(-1)
        else:
            slots.append(carried)
            carried += 1
    if entries < carried:
        missing = tensors[slots.index(entries)]
        in_regions = len(tensors) - carried
        shared = f" (and {in_regions} in shared memory)" if in_regions else ""
        raise InvalidInput(
            f"{_where(role, missing)} has no raw contents entry: "
            f"{carried} {role}s{shared} but {entries} raw contents entries"
        )
    if entries > carried:
        names = ", ".join(f"'{clip(tensor.name)}'" for tensor in tensors)
        raise InvalidInput(f"{entries} raw contents entries but only {carried} {role}s ({names})")
    return slots


def _kind_of(tensor: _Tensor, role: str) -> _Kind:
    kind = _KINDS.get(tensor.datatype)
    if kind is None:
        raise InvalidInput(
            f"{_where(role, tensor)}: unknown datatype {clip(tensor.datatype)!r}; "
            f"expected one of {', '.join(DATATYPES)}"
        )
    return kind


def _element_count(tensor: _Tensor, kind: _Kind, role: str) -> int:
    """Checks the shape itself; allocates nothing, so huge shapes fail here or on size."""
    shape = list(tensor.shape)
    if any(dim < 0 for dim in shape):
        raise InvalidInput(f"{_where(role, tensor)}: negative dimension in shape {shape}")
    nonzero = math.prod(dim for dim in shape if dim)
    if nonzero * kind.dtype.itemsize > _MAX_BYTES:
        raise InvalidInput(
            f"{_where(role, tensor)}: shape {shape} is too large ({nonzero} elements overflow)"
        )
    return 0 if 0 in shape else nonzero


def _reshape(flat: npt.NDArray[Any], tensor: _Tensor, role: str) -> npt.NDArray[Any]:
    try:
        return flat.reshape(tuple(tensor.shape))
    except ValueError as exc:  # e.g. more dimensions than numpy supports
        raise InvalidInput(
            f"{_where(role, tensor)}: unusable shape {list(tensor.shape)}: {exc}"
        ) from None


def _decode_raw(tensor: _Tensor, data: bytes | memoryview, role: str) -> npt.NDArray[Any]:
    kind = _kind_of(tensor, role)
    count = _element_count(tensor, kind, role)
    if tensor.datatype == "BYTES":
        # elements are bytes objects: cut them from bytes, not from a view of the wire
        whole = data if isinstance(data, bytes) else bytes(data)
        return _reshape(_split_bytes(tensor, whole, count, role), tensor, role)
    size = kind.dtype.itemsize
    if len(data) % size:
        raise InvalidInput(
            f"{_where(role, tensor)}: raw contents hold {len(data)} bytes, "
            f"not a multiple of the {tensor.datatype} element size {size}"
        )
    if len(data) != count * size:
        raise InvalidInput(
            f"{_where(role, tensor)}: raw contents hold {len(data) // size} {tensor.datatype} "
            f"elements, shape {list(tensor.shape)} needs {count}"
        )
    flat = np.frombuffer(data, dtype=kind.dtype)
    # Any byte but 0 and 1 would make a numpy bool that compares unequal to True.
    if tensor.datatype == "BOOL" and count and np.frombuffer(data, dtype=np.uint8).max() > 1:
        raise InvalidInput(f"{_where(role, tensor)}: raw BOOL bytes must be 0 or 1")
    return _reshape(flat, tensor, role)


def _split_bytes(tensor: _Tensor, data: bytes, count: int, role: str) -> npt.NDArray[Any]:
    where = _where(role, tensor)
    # Every element has a 4-byte prefix: reject impossible counts before allocating.
    if count * _LENGTH.size > len(data):
        raise InvalidInput(
            f"{where}: raw contents hold {len(data)} bytes, too few for the "
            f"{count} BYTES elements of shape {list(tensor.shape)}"
        )
    items: list[bytes] = []
    # Local names keep this per-element loop about a third faster.
    append, unpack, end, position = items.append, _LENGTH.unpack_from, len(data), 0
    for index in range(count):
        start = position + _LENGTH.size
        if start > end:
            raise InvalidInput(f"{where}: BYTES element {index} length prefix runs past the end")
        (length,) = unpack(data, position)
        position = start + length
        if position > end:
            raise InvalidInput(
                f"{where}: BYTES element {index} of length {length} runs past the end"
            )
        append(data[start:position])
    if position != len(data):
        raise InvalidInput(
            f"{where}: {len(data) - position} bytes left after the {count} BYTES elements "
            f"of shape {list(tensor.shape)}"
        )
    return np.fromiter(items, dtype=_OBJECT, count=count)


def _decode_typed(tensor: _Tensor, role: str) -> npt.NDArray[Any]:
    where = _where(role, tensor)
    kind = _kind_of(tensor, role)
    if kind.field is None:
        raise InvalidInput(f"{where}: {tensor.datatype} has no typed contents field; use raw")
    stray = [field.name for field, _ in tensor.contents.ListFields() if field.name != kind.field]
    if stray:
        raise InvalidInput(
            f"{where}: {tensor.datatype} tensor has {', '.join(stray)} set, expected {kind.field}"
        )
    values = getattr(tensor.contents, kind.field)
    count = _element_count(tensor, kind, role)
    if len(values) != count:
        raise InvalidInput(
            f"{where}: {len(values)} values in {kind.field}, "
            f"shape {list(tensor.shape)} needs {count}"
        )
    # fromiter with a count is the fastest bulk read of a upb repeated field.
    flat = np.fromiter(values, dtype=kind.wire, count=count)
    if kind.wire != kind.dtype:
        flat = _narrow(flat, kind.dtype, where, tensor.datatype)
    return _reshape(flat, tensor, role)


def _narrow(
    flat: npt.NDArray[Any], dtype: np.dtype[Any], where: str, datatype: str
) -> npt.NDArray[Any]:
    # astype would wrap out-of-range values silently.
    info = np.iinfo(dtype)
    if flat.size and (flat.min() < info.min or flat.max() > info.max):
        raise InvalidInput(f"{where}: values outside the {datatype} range [{info.min}, {info.max}]")
    return flat.astype(dtype)


# --- encoding ---------------------------------------------------------------


def _select(
    request: inference_pb2.ModelInferRequest, outputs: Mapping[str, npt.NDArray[Any]]
) -> list[tuple[str, npt.NDArray[Any]]]:
    if not request.outputs:
        return [(name, np.asarray(arr)) for name, arr in outputs.items()]
    selected: dict[str, npt.NDArray[Any]] = {}
    for requested in request.outputs:
        name = requested.name
        if name in selected:
            raise InvalidInput(f"output '{clip(name)}' is requested more than once")
        if name not in outputs:
            available = ", ".join(f"'{known}'" for known in outputs) or "none"
            raise InvalidInput(
                f"output '{clip(name)}' was requested but the model produced {available}"
            )
        selected[name] = np.asarray(outputs[name])
    return list(selected.items())


def _datatype(name: str, arr: npt.NDArray[Any], role: str) -> str:
    try:
        return datatype_for(arr)
    except InvalidInput as exc:
        raise _unsendable(role, f"{role} '{clip(name)}': {exc.message}") from None


def _unsendable(role: str, message: str) -> ServingError:
    """An array that has no wire form: the client's fault for an input it encodes,
    the model's (INTERNAL, as for any other bad return value) for an output."""
    if role == "output":
        return ModelError(f"{message} (the model returned it; it cannot be sent)")
    return InvalidInput(message)


def _put(
    tensor: _Tensor,
    arr: npt.NDArray[Any],
    raw: MutableSequence[Any] | None,
    role: str,
    view: bool = False,
) -> None:
    where = _where(role, tensor)
    if raw is not None:
        if view and tensor.datatype != "BYTES":
            raw.append(_raw_view(arr))
        else:
            raw.append(_to_raw(arr, tensor.datatype, where))
        return
    kind = _KINDS[tensor.datatype]
    assert kind.field is not None  # callers send FP16 raw
    if tensor.datatype == "BYTES":
        values: list[Any] = _bytes_items(arr, where)
    else:
        values = arr.ravel().tolist()
    getattr(tensor.contents, kind.field).extend(values)


def _raw_view(arr: npt.NDArray[Any]) -> memoryview:
    """The array's bytes in C order, little-endian, as a flat byte view: of the
    array's own memory when it is so already (a copy only to reorder or swap)."""
    little = np.ascontiguousarray(arr.astype(arr.dtype.newbyteorder("<"), copy=False))
    return little.reshape(-1).view(np.uint8).data


def _to_raw(arr: npt.NDArray[Any], datatype: str, where: str) -> bytes:
    if datatype != "BYTES":
        # astype(copy=False) only copies to swap byte order; tobytes copies in C order.
        return arr.astype(arr.dtype.newbyteorder("<"), copy=False).tobytes()
    parts: list[bytes] = []
    for item in _bytes_items(arr, where):
        parts += (_LENGTH.pack(len(item)), item)
    return b"".join(parts)


def _bytes_items(arr: npt.NDArray[Any], where: str) -> list[bytes]:
    items: list[bytes] = []
    for item in arr.ravel().tolist():
        if isinstance(item, bytes):
            items.append(item)
        elif isinstance(item, str):
            items.append(item.encode())
        else:
            message = f"{where}: BYTES element of type {type(item).__name__} is not bytes or str"
            role = "output" if where.startswith("output ") else "input"  # _where's words
            raise _unsendable(role, message)
    return items
