"""A model's warm-up input: what each fresh worker predicts on in its self-test.

In order: nothing if ``parameters.extra.warmup`` is false; the model's own
:meth:`~poolserve.service.inference.model.Model.example`; ``parameters.extra.example``
(input name -> nested list, with the declared datatype where there is one);
else zeros of the declared inputs, a dimension of -1 taken as 1, unless the
model is one that is not called on inputs no client sent unless it asks
(``warm_up_by_default`` false: a custom MLServer runtime, whose ``predict``
may have side effects; ``parameters.extra.warmup: true`` asks). A model
with none of these (no declared inputs) gets no warm-up: the reason says so.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from poolserve.service.contract.errors import InvalidInput
from poolserve.service.contract.repository import TensorSpec
from poolserve.service.inference.codec import dtype_for
from poolserve.service.inference.model import Array, Model


def warmup_inputs(
    model: Model, inputs: Sequence[TensorSpec]
) -> tuple[dict[str, Array] | None, str]:
    """(the warm-up inputs or None, where they come from or why there are none)."""
    extra = model.settings.extra
    if extra.get("warmup") is False:
        return None, "no warm-up: parameters.extra.warmup is false"
    example = model.example()
    if example is not None:
        return {str(k): np.asarray(v) for k, v in example.items()}, "the model's example()"
    given = extra.get("example")
    if isinstance(given, Mapping):
        return _from_settings(given, inputs), "parameters.extra.example"
    if extra.get("warmup") is not True and not getattr(model, "warm_up_by_default", True):
        return None, (
            "no warm-up: its predict is not called on inputs no client sent "
            "(parameters.extra.warmup true or parameters.extra.example asks for one)"
        )
    if not inputs:
        return None, "no warm-up: no declared inputs and no example"
    try:
        return {s.name: _zeros(s) for s in inputs}, "zeros of the declared inputs"
    except InvalidInput as exc:
        return None, f"no warm-up: {exc}"


def _from_settings(given: Mapping[str, Any], inputs: Sequence[TensorSpec]) -> dict[str, Array]:
    datatypes = {s.name: s.datatype for s in inputs}
    arrays: dict[str, Array] = {}
    for name, value in given.items():
        datatype = datatypes.get(str(name))
        dtype = dtype_for(datatype) if datatype else None
        arrays[str(name)] = np.asarray(value, dtype=dtype)
    return arrays


def _zeros(spec: TensorSpec) -> Array:
    shape = tuple(1 if d < 0 else d for d in spec.shape)
    dtype = dtype_for(spec.datatype)
    if dtype == np.dtype(object):
        return np.full(shape, b"", dtype=object)
    return np.zeros(shape, dtype=dtype)
