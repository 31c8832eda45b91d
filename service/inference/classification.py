"""Triton's classification extension: an output answered as its top classes.

A requested output with the parameter ``classification`` (int64 k > 0;
tritonclient's ``InferRequestedOutput(name, class_count=k)``) is answered,
instead of its values, as BYTES strings ``"score:index"`` or
``"score:index:label"`` for its k highest values, as Triton's server does
(``src/grpc/infer_handler.h`` and ``src/classification.cc``):

- a model with ``max_batch_size > 0`` classifies each batch entry (the first
  dimension) over all its other elements, flattened; the answer's shape is
  ``[batch, min(k, elements)]``. Otherwise the whole tensor is one entry,
  shape ``[min(k, elements)]``.
- scores are printed as C's ``std::to_string`` prints them: ``%f`` for FP32
  and FP64 (six decimals), decimal for integers; FP16, BOOL and BYTES
  outputs cannot be classified (INVALID_ARGUMENT, as in Triton).
- the order is Triton's ``std::sort`` with ``probs[a] > probs[b]``; where
  equal values (or NaN) decide which indices come first, libstdc++'s sort is
  replayed (:mod:`poolserve.service.inference.introsort`), so ties come out
  in Triton's order.
- labels: line i of the output's ``label_filename`` names class i; an empty
  line or an index past the last line gives ``"score:index"``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from poolserve.protos import inference_pb2
from poolserve.service.contract.errors import InvalidInput, clip
from poolserve.service.contract.repository import TensorSpec
from poolserve.service.inference.codec import SHARED_MEMORY_REGION, datatype_for
from poolserve.service.inference.introsort import triton_sort

CLASSIFICATION = "classification"  # the output parameter, and the extension's name
MAX_ELEMENTS = 1_000_000  # per batch entry, as Triton's kMaxClassificationElements
# Replaying libstdc++'s sort in Python costs ~1 us per element: beyond this many
# elements a tie is broken by index (lower first) instead.
REPLAY_LIMIT = 65_536
_SCORED = {"UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64", "FP32", "FP64"}

Labels = Mapping[str, Sequence[bytes]]  # output name -> class labels


class LabelFileError(Exception):
    """A label file named in the settings cannot be used: the model does not load."""


def read_labels(folder: Path, outputs: Sequence[TensorSpec]) -> dict[str, tuple[bytes, ...]]:
    """Every output's labels from its ``label_filename``, read as Triton reads
    them (one per line, ``\\n``-separated, bytes as they are)."""
    labels: dict[str, tuple[bytes, ...]] = {}
    root = folder.resolve()
    for spec in outputs:
        if not spec.label_filename:
            continue
        path = (folder / spec.label_filename).resolve()
        where = f"label file '{spec.label_filename}' of output '{spec.name}'"
        if not path.is_relative_to(root):
            raise LabelFileError(f"{where} is outside the model folder {folder}")
        try:
            data = path.read_bytes()
        except OSError as exc:
            reason = exc.strerror or str(exc)
            raise LabelFileError(f"{where} cannot be read: {reason} ({path})") from None
        lines = data.split(b"\n")
        if lines[-1] == b"":  # the last line's newline ends it, it starts no line
            lines.pop()
        labels[spec.name] = tuple(lines)
    return labels


def requested_classes(request: inference_pb2.ModelInferRequest) -> dict[str, int]:
    """The outputs asked for as classes, with their k; checked before predict."""
    classes: dict[str, int] = {}
    for output in request.outputs:
        if not output.parameters or CLASSIFICATION not in output.parameters:
            continue
        where = f"output '{clip(output.name)}'"
        param = output.parameters[CLASSIFICATION]
        if param.WhichOneof("parameter_choice") != "int64_param":
            raise InvalidInput(
                f"{where}: invalid value type for 'classification' parameter, expected int64_param"
            )
        if param.int64_param <= 0:
            raise InvalidInput(
                f"{where}: invalid value for 'classification' parameter, expected > 0, "
                f"got {param.int64_param}"
            )
        if SHARED_MEMORY_REGION in output.parameters:
            raise InvalidInput(
                f"{where}: output can't set both 'shared_memory_region' and 'classification'"
            )
        classes[output.name] = param.int64_param
    return classes


def classify(
    outputs: Mapping[str, npt.NDArray[Any]],
    classes: Mapping[str, int],
    labels: Labels,
    batched: bool,
) -> dict[str, npt.NDArray[Any]]:
    """``outputs`` with each output of ``classes`` replaced by its top classes."""
    answered = dict(outputs)
    for name, count in classes.items():
        array = outputs.get(name)
        if array is not None:  # a missing output is named by the encoder
            answered[name] = top_classes(name, array, count, labels.get(name, ()), batched)
    return answered


def top_classes(
    name: str,
    array: npt.NDArray[Any],
    count: int,
    labels: Sequence[bytes] = (),
    batched: bool = False,
) -> npt.NDArray[Any]:
    """One output's classes as a BYTES array (see the module's docstring)."""
    where = f"output '{clip(name)}'"
    try:
        datatype = datatype_for(array)
    except InvalidInput as exc:
        raise InvalidInput(f"{where}: {exc.message}") from None
    if datatype not in _SCORED:
        raise InvalidInput(
            f"{where}: class result not available for output due to unsupported type '{datatype}'"
        )
    batch = array.shape[0] if batched and array.ndim > 0 and array.shape[0] > 0 else 0
    rows = array.reshape(batch, -1) if batch else array.reshape(1, -1)
    per_entry = rows.shape[1]
    if per_entry > MAX_ELEMENTS:
        raise InvalidInput(
            f"{where}: classification output tensor too large ({per_entry} elements per "
            f"entry, at most {MAX_ELEMENTS})"
        )
    kept = min(count, per_entry)
    score = _integer if rows.dtype.kind in "iu" else _decimal
    found: list[bytes] = []
    for row in rows:
        for index in _top_indices(row, kept):
            text = f"{score(row[index].item())}:{index}".encode()
            label = labels[index] if index < len(labels) else b""
            found.append(text + b":" + label if label else text)
    out = np.empty(len(found), dtype=object)
    out[:] = found
    return out.reshape((batch, kept) if batch else (kept,))


def _top_indices(row: npt.NDArray[Any], kept: int) -> list[int]:
    """The first ``kept`` indices of ``row`` in Triton's order (descending values)."""
    size = row.shape[0]
    if kept == 0:
        return []
    # The kept + 1 highest, by value: a tie between the last kept and the next
    # decides which index is kept, so it counts as a tie too.
    if kept < size:
        candidates = np.argpartition(row, size - kept - 1)[size - kept - 1 :]
    else:
        candidates = np.arange(size)
    ordered = candidates[np.argsort(row[candidates], kind="stable")[::-1]]
    values = row[ordered]
    undecided = bool(np.any(values[:-1] == values[1:]))
    if row.dtype.kind == "f":
        undecided = undecided or bool(np.isnan(row).any())
    if not undecided:
        return ordered[:kept].tolist()  # type: ignore[no-any-return]
    if size <= REPLAY_LIMIT:  # equal values (or NaN) in the top: up to std::sort
        return triton_sort(row.tolist())[:kept]
    # Descending, equal values by index: a stable ascending sort of the reversed row.
    order = (size - 1) - np.argsort(row[::-1], kind="stable")[::-1]
    return order[:kept].tolist()  # type: ignore[no-any-return]


def _integer(value: int) -> str:
    return str(value)


def _decimal(value: float) -> str:
    # std::to_string(float) is printf("%f"); glibc prints a NaN's sign ("-nan").
    if math.isnan(value):
        return "-nan" if math.copysign(1.0, value) < 0 else "nan"
    return f"{value:f}"
