"""A model's declared inputs, enforced on every request as Triton enforces its config.

A model that declares inputs (``inputs`` in its model-settings.json, or its
own :meth:`~poolserve.service.inference.model.Model.metadata`) gets only
requests that match them; one that declares none takes anything. The rules
and their messages are Triton's (core ``InferenceRequest::Normalize`` and
``ValidateRequestInputs``), checked in Triton's order:

1. the number of inputs: every declared input is required, none may be added
   ("expected 1 inputs but got 2 inputs for model 'echo'. Got input(s) ..."),
   and none sent twice ("input 'X' already exists in request");
2. each input's name ("unexpected inference input 'X' for model 'm'");
3. with ``max_batch_size`` > 0 the first dimension of every input is the
   batch: all inputs agree on it and it is at most ``max_batch_size``
   ("inference request batch-size must be <= 8 for 'm'"); the declared
   shape's first dimension is that batch dimension, whatever it says;
4. each input's datatype ("inference input 'X' data-type is 'INT32', but
   model 'm' expects 'FP32'") and shape, a declared -1 taking any size
   ("unexpected shape for input 'X' for model 'm'. Expected [-1,16], got
   [2,3]. ...").

(Triton's other wording, "unexpected datatype TYPE_INT32 for inference input
'X', expecting TYPE_FP32", is a backend's load-time check of its config
against the model file, not an answer to a request.)

Where a declaration leaves something out it is not checked: an input
declared without a datatype takes any datatype, one declared without a shape
any shape (Triton requires both, so its configs never leave them out).
Triton's sequence control inputs (``parameters.extra.sequence.control_inputs``)
are filled in by the server: they are neither required nor checked here
(:func:`poolserve.service.inference.controls.add_controls` refuses a request
that sends one).

The table is built once per loaded model (:func:`declared_inputs`); a check
reads only the tensors' names, datatypes and shapes of the request every
path has parsed already, in one pass when the request keeps the rules (the
ordered checks run only to word a refusal). Native models check in
:func:`poolserve.service.inference.codec.decode_inputs`, once the tensors
are read (a malformed tensor or an unregistered region is named first, as
Triton resolves regions before it checks the config): worker and inline
models, batches, streams, shared-memory inputs. The MLServer adapter checks
right after parsing, before MLServer's converters run.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from poolserve.service.contract.errors import InvalidInput, clip
from poolserve.service.contract.repository import TensorSpec


class Tensor(Protocol):
    """What a check reads of a request's input (ours or MLServer's protobuf class)."""

    @property
    def name(self) -> str: ...

    @property
    def datatype(self) -> str: ...

    @property
    def shape(self) -> Sequence[int]: ...


# Triton's words after a shape mismatch of a model with max_batch_size > 0.
_BATCH_NOTE = (
    "NOTE: Setting a non-zero max_batch_size in the model config requires a batch "
    "dimension to be prepended to each input shape. If you want to specify the full "
    "shape including the batch dim in your input dims config, try setting "
    "max_batch_size to zero. See the model configuration docs for more info on "
    "max_batch_size."
)


def dims(shape: Iterable[int]) -> str:
    """A shape as Triton's DimsListToString writes it: ``[-1,16]``."""
    return "[" + ",".join(str(d) for d in shape) + "]"


@dataclass(frozen=True, slots=True)
class _Input:
    datatype: str  # "" takes any
    dims: tuple[int, ...] | None  # without the batch dimension; None takes any
    rank: int = -1  # of the request's shape, batch included; -1 takes any
    fixed: tuple[tuple[int, int], ...] = ()  # (index in the request's shape, size), not -1

    @classmethod
    def of(cls, datatype: str, dims: tuple[int, ...] | None, skip: int) -> _Input:
        if dims is None:
            return cls(datatype, None)
        fixed = tuple((i + skip, d) for i, d in enumerate(dims) if d != -1)
        return cls(datatype, dims, len(dims) + skip, fixed)


@dataclass(frozen=True, slots=True)
class DeclaredInputs:
    """One model's declared inputs, by name, ready for :meth:`check`."""

    model: str
    max_batch_size: int
    inputs: dict[str, _Input]
    order: tuple[str, ...]  # as declared, for messages
    controls: frozenset[str]  # filled in by the server, not the client's to send

    @classmethod
    def build(
        cls,
        model: str,
        specs: Sequence[TensorSpec],
        max_batch_size: int = 0,
        controls: Iterable[str] = (),
    ) -> DeclaredInputs | None:
        """The table, or None for a model that declares no inputs (takes anything)."""
        skipped = frozenset(controls)
        batch = 1 if max_batch_size > 0 else 0
        inputs = {
            s.name: _Input.of(s.datatype, tuple(s.shape[batch:]) if s.shape else None, batch)
            for s in specs
            if s.name not in skipped
        }
        if not inputs:
            return None
        return cls(model, max_batch_size, inputs, tuple(inputs), skipped)

    def check(self, tensors: Sequence[Tensor]) -> None:
        """Raises InvalidInput, in Triton's words, for the first rule a request breaks."""
        if not self._fits(tensors):
            self._refuse(tensors)

    def _fits(self, tensors: Sequence[Tensor]) -> bool:
        """One pass, reading each field once: whether the request keeps every
        rule (the hot path; :meth:`_refuse` finds which one it breaks)."""
        inputs = self.inputs
        batched = self.max_batch_size > 0
        batch = -1
        count = 0
        for tensor in tensors:
            declared = inputs.get(tensor.name)
            if declared is None:
                if tensor.name in self.controls:
                    continue  # add_controls refuses it, in its own words
                return False
            count += 1
            if declared.datatype and tensor.datatype != declared.datatype:
                return False
            shape = tensor.shape
            if batched:
                if not shape:
                    return False
                if batch < 0:
                    batch = shape[0]
                elif shape[0] != batch:
                    return False
            if declared.rank >= 0:
                if len(shape) != declared.rank:
                    return False
                for index, size in declared.fixed:
                    if shape[index] != size:
                        return False
        if count != len(inputs) or batch > self.max_batch_size:
            return False
        # as many as declared, each declared: all there unless one came twice
        return count == 1 or len({t.name for t in tensors} - self.controls) == count

    def _refuse(self, tensors: Sequence[Tensor]) -> None:
        sent = [t for t in tensors if t.name not in self.controls] if self.controls else tensors
        model = clip(self.model)
        if len(sent) != len(self.inputs):
            self._wrong_count(sent, model)
        if len({t.name for t in sent}) != len(sent):
            self._twice(sent)
        for tensor in sent:
            if tensor.name not in self.inputs:
                raise InvalidInput(
                    f"unexpected inference input '{clip(tensor.name)}' for model '{model}'"
                )
        skip = 0
        if self.max_batch_size > 0:
            self._check_batch(sent, model)
            skip = 1
        for tensor in sent:
            declared = self.inputs[tensor.name]
            if declared.datatype and tensor.datatype != declared.datatype:
                raise InvalidInput(
                    f"inference input '{clip(tensor.name)}' data-type is "
                    f"'{clip(tensor.datatype)}', but model '{model}' expects "
                    f"'{declared.datatype}'"
                )
            expected = declared.dims
            if expected is None:
                continue
            shape = tensor.shape
            if len(shape) - skip != len(expected) or any(
                want != -1 and want != got for want, got in zip(expected, shape[skip:], strict=True)
            ):
                full = (-1, *expected) if skip else expected
                note = f" {_BATCH_NOTE}" if skip else ""
                raise InvalidInput(
                    f"unexpected shape for input '{clip(tensor.name)}' for model '{model}'. "
                    f"Expected {dims(full)}, got {clip(dims(shape))}.{note}"
                )

    def _wrong_count(self, sent: Sequence[Tensor], model: str) -> None:
        names = {t.name for t in sent}
        got = ",".join(f"'{clip(t.name)}'" for t in sent)
        missing = ",".join(f"'{n}'" for n in self.order if n not in names)
        raise InvalidInput(
            f"expected {len(self.inputs)} inputs but got {len(sent)} inputs for model "
            f"'{model}'. Got input(s) [{got}], but missing required input(s) "
            f"[{missing}]. Please provide all required input(s)."
        )

    @staticmethod
    def _twice(sent: Sequence[Tensor]) -> None:
        seen: set[str] = set()
        for tensor in sent:
            if tensor.name in seen:
                raise InvalidInput(f"input '{clip(tensor.name)}' already exists in request")
            seen.add(tensor.name)

    def _check_batch(self, sent: Sequence[Tensor], model: str) -> None:
        batch: int | None = None
        for tensor in sent:
            shape = tensor.shape
            if not shape:
                raise InvalidInput(
                    f"input '{clip(tensor.name)}' has no shape but model requires "
                    f"batch dimension for '{model}'"
                )
            if batch is None:
                batch = shape[0]
            elif shape[0] != batch:
                raise InvalidInput(
                    f"input '{clip(tensor.name)}' batch size does not match other "
                    f"inputs for '{model}'"
                )
        if batch is not None and batch > self.max_batch_size:
            raise InvalidInput(
                f"inference request batch-size must be <= {self.max_batch_size} for '{model}'"
            )
