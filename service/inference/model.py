"""The runtime API that model authors implement, and how implementations load.

A model subclasses :class:`Model`, implements :meth:`Model.load` and
:meth:`Model.predict`, and is named by ``implementation`` in its
``model-settings.json``. An implementation that lives in the model's folder
(``"model.EchoModel"`` with ``model.py`` beside the settings) is imported
under a private module name per model, so two models may both ship a
``model.py`` without colliding in ``sys.modules``.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

import numpy as np
import numpy.typing as npt

from poolserve.service.contract.repository import ModelSettings, TensorSpec, TransactionPolicy
from poolserve.service.inference.declared import DeclaredInputs
from poolserve.service.poolcore.stats import Timings

Array = npt.NDArray[Any]


class Model:
    """Base class of every model. Subclass it; ``self.settings`` holds the settings."""

    # An inline model ("parallel_workers": 0) that declares itself fast runs its
    # predict on the pool's event loop; keep it well under a millisecond.
    inline_fast = False
    # Set by load_model: the outputs' class labels (a name of ours, not the model's).
    _poolserve_class_labels: Mapping[str, Sequence[bytes]] = MappingProxyType({})
    # Set by declared_inputs on first use (load_model: in the zygote, before forks).
    _poolserve_declared: DeclaredInputs | None

    def __init__(self, settings: ModelSettings) -> None:
        self.settings = settings

    def load(self) -> None:
        """Loads weights. Runs once, in the pool's zygote, before workers fork."""

    def predict(self, inputs: dict[str, Array], parameters: dict[str, object]) -> dict[str, Array]:
        raise NotImplementedError(f"{type(self).__name__}.predict is not implemented")

    def predict_stream(
        self, inputs: dict[str, Array], parameters: dict[str, object]
    ) -> Iterable[dict[str, Array]]:
        """A decoupled model's answer (settings ``parameters.extra.decoupled: true``):
        any number of output dicts, typically a generator, each sent to the
        client as one ModelStreamInfer response as soon as it is yielded. A
        client that goes away closes the generator (GeneratorExit at its yield)."""
        raise NotImplementedError(f"{type(self).__name__}.predict_stream is not implemented")

    def transaction_policy(self) -> TransactionPolicy:
        """Whether ModelStreamInfer runs ``predict_stream`` and ModelInfer runs
        ``predict``; called once after :meth:`load`, in the zygote, and reported
        to the pool server. A native model: its settings' ``decoupled`` decides."""
        return self.settings.policy

    def sequence_ended(self, sequence_id: int | str, reason: str) -> None:
        """A sequence model's sequence ended (settings ``parameters.extra.sequence``):
        ``reason`` "end" (its request with ``sequence_end`` ran) or "timeout" (idle
        past ``idle_timeout_s``). Drop its state here. Runs in the worker that
        ran the sequence's requests, after them."""

    def metadata(self) -> tuple[Sequence[TensorSpec], Sequence[TensorSpec]] | None:
        """Optional (inputs, outputs); by default they come from model-settings.json."""
        return None

    def example(self) -> Mapping[str, Array] | None:
        """Optional inputs for the warm-up prediction each fresh worker runs before
        it takes requests; by default zeros of the declared inputs."""
        return None


class WireModel(Model):
    """A model that answers the serialized ModelInferRequest itself: the
    adapters of other servers' model APIs, which convert with their own code."""

    # Whether an Open Inference Protocol REST body is read as MLServer's types
    # read it (:func:`poolserve.service.inference.rest.decode_request`): a BYTES
    # input's data taken as sent, whatever its shape says; a null parameter
    # unset; a body without "id" given a fresh UUID, as MLServer's data plane
    # gives one. Native models keep the protocol's rules.
    rest_as_mlserver = False

    def infer_wire(self, body: bytes) -> tuple[bytes, Timings]:
        """The serialized ModelInferResponse and its timings; raises ServingError."""
        raise NotImplementedError(f"{type(self).__name__}.infer_wire is not implemented")


# Base classes of other servers' model APIs -> the adapter module that serves
# their subclasses (its ``adapt(cls, settings) -> Model``). Named as strings:
# an adapter and its server's package are imported only by models that use them.
ADAPTERS = {
    ("mlserver.model", "MLModel"): "poolserve.service.runtimes.mlmodel",
}

Factory = Callable[[ModelSettings], Model]


def _adapter(cls: type) -> Factory | None:
    for base in cls.__mro__:
        name = ADAPTERS.get((base.__module__, base.__qualname__))
        if name is not None:
            adapt = importlib.import_module(name).adapt
            return functools.partial(adapt, cls)
    return None


class ImplementationError(Exception):
    """The implementation cannot be imported or is not a Model subclass."""


def _import_from_folder(settings: ModelSettings, module_name: str) -> Any:
    # A version of a numbered model: its own folder's file, else the model's
    # (one model.py beside model-settings.json serving every version folder).
    relative = module_name.replace(".", "/") + ".py"
    file = settings.folder / relative
    if not file.is_file() and settings.versioned:
        file = settings.model_folder / relative
    if not file.is_file():
        return None
    # Imported afresh on every load, so that a live reload sees the new code;
    # each version under its own name.
    owner = settings.name + (f".v{settings.version}" if settings.versioned else "")
    private = f"poolserve_models.{owner}.{module_name}"
    spec = importlib.util.spec_from_file_location(private, file)
    if spec is None or spec.loader is None:
        raise ImplementationError(f"cannot import {file}")
    module = importlib.util.module_from_spec(spec)
    folder = str(file.parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)  # sibling imports of the model's own files
    previous = sys.modules.get(private)
    sys.modules[private] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        if previous is not None:
            sys.modules[private] = previous
        else:
            del sys.modules[private]
        raise
    return module


def resolve_implementation(settings: ModelSettings) -> Factory:
    """What builds the model: its Model subclass, or the adapter of a model
    written for another server (:data:`ADAPTERS`, e.g. an ``mlserver.MLModel``)."""
    module_name, _, class_name = settings.implementation.rpartition(".")
    if not module_name:
        raise ImplementationError(
            f"implementation {settings.implementation!r} must be 'module.Class'"
        )
    try:
        module = _import_from_folder(settings, module_name)
        if module is None:
            module = importlib.import_module(module_name)
    except ImplementationError:
        raise
    except Exception as exc:
        raise ImplementationError(
            f"cannot import {settings.implementation!r}: {type(exc).__name__}: {exc}"
        ) from exc
    cls = getattr(module, class_name, None)
    if isinstance(cls, type) and issubclass(cls, Model):
        return cls
    adapter = _adapter(cls) if isinstance(cls, type) else None
    if adapter is None:
        raise ImplementationError(
            f"{settings.implementation!r} is not a subclass of poolserve.service.Model "
            "(nor of mlserver.MLModel)"
        )
    return adapter


def instantiate(settings: ModelSettings) -> Model:
    return resolve_implementation(settings)(settings)


def load_model(settings: ModelSettings) -> Model:
    """A model instantiated and loaded, with the class labels its outputs name
    (``parameters.label_filename``) read; a label file that cannot be read
    fails the load like a raising ``load()``."""
    from poolserve.service.inference.classification import read_labels

    model = instantiate(settings)
    model.load()
    _, outputs = tensor_specs(model)
    model._poolserve_class_labels = read_labels(settings.model_folder, outputs)
    declared_inputs(model)
    return model


def declared_inputs(model: Model) -> DeclaredInputs | None:
    """The inputs ``model`` declares, as every request to it is checked against
    (None: it declares none and takes anything); built once per model instance,
    after its load (an MLServer model's load may set its inputs)."""
    try:
        return model._poolserve_declared
    except AttributeError:
        pass
    settings = model.settings
    inputs, _ = tensor_specs(model)
    controls = settings.sequence.controls if settings.sequence is not None else ()
    table = DeclaredInputs.build(
        settings.name, inputs, settings.max_batch_size, (c.name for c in controls)
    )
    model._poolserve_declared = table
    return table


def class_labels(model: Model) -> Mapping[str, Sequence[bytes]]:
    """The labels read by :func:`load_model`, by output name."""
    return model._poolserve_class_labels


def tensor_specs(model: Model) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
    declared = model.metadata()
    if declared is None:
        return model.settings.inputs, model.settings.outputs
    inputs, outputs = declared
    return tuple(inputs), tuple(outputs)


def as_array(value: object) -> Array:
    return value if isinstance(value, np.ndarray) else np.asarray(value)


def check_outputs(name: str, outputs: object) -> Mapping[str, Array]:
    if not isinstance(outputs, Mapping):
        raise TypeError(f"predict of '{name}' returned {type(outputs).__name__}, expected a dict")
    return {str(k): as_array(v) for k, v in outputs.items()}
