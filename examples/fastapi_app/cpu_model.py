"""A CPU-bound "model" for the FastAPI example and the WorkerPool benchmark.

Pure Python on purpose: it holds the GIL the whole time it computes, like a
tree ensemble walked in Python or a tokenizer, so scoring it in the API
process serializes every request on one core, while a pool of N workers runs
N at once. ``load_model`` runs once, in the pool's zygote; ``score`` in a
worker. Both are module-level functions, so the pool can import them by name.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class BurnModel:
    weights: tuple[float, ...]


def load_model(seed: int = 7, size: int = 256) -> BurnModel:
    rng = random.Random(seed)
    return BurnModel(tuple(rng.uniform(-1.0, 1.0) for _ in range(size)))


def score(model: BurnModel, features: list[float], work: int = 200_000) -> float:
    """``work`` multiply-adds over the weights and features: about 20 ms per 100 000."""
    if not features:
        raise ValueError("features must not be empty")
    weights = model.weights
    n, m = len(weights), len(features)
    acc = 0.0
    for i in range(work):
        acc = (acc * 0.999 + weights[i % n] * features[i % m]) % 1_000_003.0
    return acc
