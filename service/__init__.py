"""The data plane: settings and repository, codec, runtime API, workers, pools, router.

Model authors need only :class:`Model` and :class:`InvalidInput`.
Applications that want pre-forked scoring in their own process use
:class:`WorkerPool` (imported on first use, so that models importing this
package do not pay for it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from poolserve.service.contract.errors import InvalidInput
    from poolserve.service.inference.model import Model
    from poolserve.service.scoring import ModelLoadError, ScoreError
    from poolserve.service.workerpool import ScoreStats, WorkerPool

# Imported on first use: the supervisor and router import this package and must
# not carry numpy and the model machinery in their memory.
_LAZY = {
    "InvalidInput": "poolserve.service.contract.errors",
    "Model": "poolserve.service.inference.model",
    "WorkerPool": "poolserve.service.workerpool",
    "ScoreStats": "poolserve.service.workerpool",
    "ScoreError": "poolserve.service.scoring",
    "ModelLoadError": "poolserve.service.scoring",
}

__all__ = [
    "InvalidInput",
    "Model",
    "ModelLoadError",
    "ScoreError",
    "ScoreStats",
    "WorkerPool",
    "__version__",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
