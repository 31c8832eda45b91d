"""Triton's sequence control tensors: a sequence model that declares control
inputs (``parameters.extra.sequence.control_inputs``) gets them in its
``inputs``, filled from the request's ``sequence_id``, ``sequence_start`` and
``sequence_end``, as Triton's sequence batcher fills them:

- START, END: 1 (true) on the sequence's first / last request, else 0;
- READY: 1 (a request is always ready: sequences are never batched here);
- CORRID: the sequence id; a 32-bit datatype keeps its low-order 32 bits, a
  BYTES one holds the id as text (a string id needs BYTES).

Each has shape [1], or [batch, 1] for a model with ``max_batch_size`` > 0
(batch: the request's first input's first dimension).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from poolserve.service.contract.errors import InvalidInput
from poolserve.service.contract.sequence import ControlInput
from poolserve.service.inference.model import Array

_FLAGS = {"INT32": np.int32, "FP32": np.float32, "BOOL": np.bool_}
_IDS = {"UINT64": (np.uint64, np.uint64), "INT64": (np.uint64, np.int64),
        "UINT32": (np.uint32, np.uint32), "INT32": (np.uint32, np.int32)}  # fmt: skip


def add_controls(
    model: str,
    inputs: dict[str, Array],
    controls: Sequence[ControlInput],
    parameters: Mapping[str, object],
    batched: bool,
) -> None:
    """Adds the control tensors to ``inputs``; InvalidInput when the request
    sends one itself, or its id does not fit the CORRID datatype."""
    rows = 1
    if batched and inputs:
        first = next(iter(inputs.values()))
        rows = int(first.shape[0]) if first.ndim else 1
    shape = (rows, 1) if batched else (1,)
    for control in controls:
        if control.name in inputs:
            raise InvalidInput(
                f"input '{control.name}' of model '{model}' is its sequence {control.kind} "
                "control: the server fills it in, the request must not send it"
            )
        inputs[control.name] = _tensor(model, control, parameters, shape)


def _tensor(
    model: str, control: ControlInput, parameters: Mapping[str, object], shape: tuple[int, ...]
) -> Array:
    if control.kind != "CORRID":
        on = {"START": parameters.get("sequence_start") is True,
              "END": parameters.get("sequence_end") is True,
              "READY": True}[control.kind]  # fmt: skip
        return np.full(shape, on, dtype=_FLAGS[control.datatype])
    ident = parameters.get("sequence_id")
    if control.datatype == "BYTES":
        return np.full(shape, str(ident).encode(), dtype=object)
    if not isinstance(ident, int) or isinstance(ident, bool):
        raise InvalidInput(
            f"sequence id {ident!r} does not fit control input '{control.name}' of model "
            f"'{model}' ({control.datatype}): a string id needs a BYTES CORRID"
        )
    unsigned, kind = _IDS[control.datatype]
    bits = 64 if unsigned is np.uint64 else 32
    value = np.array(ident & ((1 << bits) - 1), dtype=unsigned).view(kind)
    return np.full(shape, value, dtype=kind)
