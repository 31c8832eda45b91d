"""Which of a worker's models a request names: its name, and its version.

A worker's models are keyed as its pool knows them (``ModelSettings.key``):
a model's name, or ``name:version`` for each version of a model with
numbered version folders. A request that names no version of such a model
gets the highest version this worker holds, as the pool's default is the
highest version served (contract/versions.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from poolserve.service.contract.errors import ModelNotFound, clip

if TYPE_CHECKING:
    from poolserve.service.inference.model import Model


def model_named(models: Mapping[str, Model], name: str, version: str) -> Model:
    """The model a request names; ModelNotFound when this worker holds no such one."""
    model = models.get(name)
    if model is not None and (not version or version == model.settings.version):
        return model
    found = models.get(f"{name}:{version}") if version else _highest(models, name)
    if found is None:
        raise ModelNotFound(f"model '{clip(name)}' is not loaded in this worker")
    return found


def _highest(models: Mapping[str, Model], name: str) -> Model | None:
    best: Model | None = None
    best_number = -1
    for model in models.values():
        settings = model.settings
        if settings.name == name and settings.versioned and int(settings.version) > best_number:
            best, best_number = model, int(settings.version)
    return best
