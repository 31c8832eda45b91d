"""The models of a WorkerPool: what ``add_model`` pickled and where each model
stands (loading, serving, failed, disabled)."""

from __future__ import annotations

import pickle
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from poolserve.service.contract.batching import BatchPolicy
from poolserve.service.workerpool.scoring import MAX_CODE
from poolserve.service.workerpool.status import ScoreStats


@dataclass(eq=False)
class PoolModel:
    """A model as the pool holds it: its pickled code, counters and state."""

    name: str
    code: bytes  # pickle of (load, score)
    idempotent: bool
    max_compute_s: float | None
    example: bytes | None = None  # pickle of score's arguments for the warm-up
    batch: BatchPolicy | None = None  # score takes stacked arrays: calls batch
    stats: ScoreStats = field(default_factory=ScoreStats)
    pending: int = 0  # loads sent to the zygote, reply not in yet
    loaded: bool = False  # a version of it is in the zygote
    ready_gen: int = 0  # workers of this generation or later hold the latest version
    serving: bool = False  # calls may go to any non-retiring worker
    load_error: str = ""  # why the latest load failed ("" if it did not)
    disabled: str = ""  # why it was taken out of service (it kept killing workers)
    removed: bool = False

    def describe(self) -> str:
        if self.disabled:
            return f"disabled: {self.disabled}"
        if self.serving:
            return "serving"
        if self.pending:
            return "loading"
        return f"failed: {self.load_error}" if self.load_error else "loading"


def pickle_callables(name: str, load: Callable[[], Any], score: Callable[..., Any]) -> bytes:
    try:
        code = pickle.dumps((load, score), protocol=5)
    except (pickle.PicklingError, AttributeError, TypeError) as exc:
        raise TypeError(
            f"add_model('{name}'): load and score must be picklable by reference: "
            "module-level functions, or functools.partial of them with picklable "
            "arguments, because they are imported by name in the pool's zygote (a fresh "
            f"interpreter, started by exec). Lambdas and nested functions are not. ({exc})"
        ) from exc
    if len(code) > MAX_CODE:
        raise TypeError(
            f"add_model('{name}'): load and score pickle to {len(code)} bytes, more than "
            f"{MAX_CODE}: bind a path or a small config with partial, not the data itself"
        )
    main = sys.modules.get("__main__")
    if b"__main__" in code and not getattr(main, "__file__", None):
        spec = getattr(main, "__spec__", None)
        if spec is None:
            raise TypeError(
                f"add_model('{name}'): load or score is defined in an interactive "
                "session's __main__, which the pool's zygote cannot import: move it to a "
                "module"
            )
    return code


def pickle_example(name: str, example: tuple[Any, ...] | None) -> bytes | None:
    if example is None:
        return None
    if not isinstance(example, tuple):
        raise TypeError(f"add_model('{name}'): example must be a tuple of score's arguments")
    try:
        data = pickle.dumps(example, protocol=5)
    except Exception as exc:
        raise TypeError(f"add_model('{name}'): example cannot be pickled: {exc}") from exc
    if len(data) > MAX_CODE:
        raise TypeError(
            f"add_model('{name}'): example pickles to {len(data)} bytes, more than {MAX_CODE}"
        )
    return data
