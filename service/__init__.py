"""The data plane: one folder per process and layer (docs/architecture.md).

contract/ and lifecycle/ (standard library only), poolcore/ (zygote, workers,
dispatcher: no gRPC), inference/ and grpcserver/, and the doors: poolserver/,
router/, workerpool/, runtimes/.

Model authors need only :class:`Model`, :data:`Array` and :class:`InvalidInput`;
clients of the Open Inference Protocol :func:`encode_inputs` and
:func:`decode_outputs`; callers of WorkerPool its errors (:class:`ServingError`
and its family).
Applications that want pre-forked scoring in their own process use
:class:`WorkerPool` (imported on first use, so that models importing this
package do not pay for it).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from collections.abc import Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from poolserve.service.contract.errors import (
        Cancelled,
        DeadlineExceeded,
        InvalidInput,
        ModelNotFound,
        ModelNotReady,
        QueueFull,
        ServingError,
        Unavailable,
    )
    from poolserve.service.inference.codec import decode_outputs, encode_inputs
    from poolserve.service.inference.model import Array, Model
    from poolserve.service.workerpool.pool import ScoreStats, WorkerPool
    from poolserve.service.workerpool.scoring import ModelLoadError, ScoreError

# Imported on first use: the supervisor and router import this package and must
# not carry numpy and the model machinery in their memory.
_LAZY = {
    **dict.fromkeys(
        [
            "Cancelled",
            "DeadlineExceeded",
            "InvalidInput",
            "ModelNotFound",
            "ModelNotReady",
            "QueueFull",
            "ServingError",
            "Unavailable",
        ],
        "poolserve.service.contract.errors",
    ),
    "Array": "poolserve.service.inference.model",
    "Model": "poolserve.service.inference.model",
    "encode_inputs": "poolserve.service.inference.codec",
    "decode_outputs": "poolserve.service.inference.codec",
    "WorkerPool": "poolserve.service.workerpool.pool",
    "ScoreStats": "poolserve.service.workerpool.pool",
    "ScoreError": "poolserve.service.workerpool.scoring",
    "ModelLoadError": "poolserve.service.workerpool.scoring",
}

__all__ = [
    "Array",
    "Cancelled",
    "DeadlineExceeded",
    "InvalidInput",
    "Model",
    "ModelLoadError",
    "ModelNotFound",
    "ModelNotReady",
    "QueueFull",
    "ScoreError",
    "ScoreStats",
    "ServingError",
    "Unavailable",
    "WorkerPool",
    "__version__",
    "decode_outputs",
    "encode_inputs",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


# Module paths from before the folders (issue 15), kept for one release: a model
# folder on disk may say ``from poolserve.service.model import Array``. The old
# name is the very module object of the new one (class identity and pickles hold).
_MOVED = {
    "poolserve.service.model": "poolserve.service.inference.model",
    "poolserve.service.errors": "poolserve.service.contract.errors",
    "poolserve.service.codec": "poolserve.service.inference.codec",
}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds and loads a moved module under its old name, with a DeprecationWarning."""

    def __init__(self) -> None:
        self.specs: dict[str, ModuleSpec | None] = {}

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname not in _MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: ModuleSpec) -> ModuleType:
        import warnings

        new = _MOVED[spec.name]
        warnings.warn(  # stacklevel 2: the importer (warnings skips importlib's frames)
            f"{spec.name} has moved to {new}; import from poolserve.service or {new} "
            "(the old path goes in the next release)",
            DeprecationWarning,
            stacklevel=2,
        )
        module = importlib.import_module(new)
        self.specs[spec.name] = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # The import machinery set the alias spec on the real module: give its own back.
        assert module.__spec__ is not None
        module.__spec__ = self.specs.pop(module.__spec__.name)


if not any(isinstance(finder, _MovedModules) for finder in sys.meta_path):
    sys.meta_path.append(_MovedModules())
