"""Load and score functions for the WorkerPool tests.

They live in a module of their own because the pool's zygote is a fresh
interpreter that imports them by name. Each ``load`` returns a dict; tests
steer a call through files and FIFOs under a directory they pass in, never
through timing.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np


def load_counter(name: str, log: str | None = None) -> dict[str, Any]:
    """A model that remembers which process loaded it (the zygote)."""
    if log is not None:
        with open(log, "a") as f:
            f.write(f"{name} {os.getpid()}\n")
    return {"name": name, "loaded_by": os.getpid(), "weights": np.arange(1000, dtype=np.float64)}


def load_failing(reason: str) -> dict[str, Any]:
    raise RuntimeError(reason)


def whoami(model: dict[str, Any]) -> dict[str, Any]:
    return {"name": model["name"], "loaded_by": model["loaded_by"], "pid": os.getpid()}


def add(model: dict[str, Any], a: float, b: float = 0.0, *, scale: float = 1.0) -> float:
    return (a + b) * scale


def dot(model: dict[str, Any], features: np.ndarray) -> float:
    return float(features @ model["weights"][: features.shape[0]])


def echo_array(model: dict[str, Any], array: np.ndarray, add: float = 0.0) -> np.ndarray:
    array += add  # arguments arrive writable (copy-on-write when mapped)
    return array


def make_array(model: dict[str, Any], n: int, value: float) -> np.ndarray:
    return np.full(n, value, dtype=np.float64)


def fail(model: dict[str, Any], message: str) -> None:
    raise ValueError(message)


class Unpicklable(Exception):
    def __init__(self, a: int, b: int) -> None:  # two required args: does not unpickle
        super().__init__(f"custom failure {a}/{b}")


def fail_custom(model: dict[str, Any]) -> None:
    raise Unpicklable(1, 2)


def touch_then_gate(model: dict[str, Any], marker: str, gate: str, value: Any = None) -> Any:
    """Records that it started, then blocks until the test writes to the ``gate`` FIFO."""
    Path(marker).touch()
    with open(gate) as f:
        f.read()
    return value


def mark(model: dict[str, Any], marker: str, value: Any = None) -> Any:
    """Records that it ran (tests assert it never did)."""
    Path(marker).touch()
    return value


def die_once(model: dict[str, Any], marker: str) -> int:
    """Kills its own worker the first time (per marker), then answers with its pid."""
    if not os.path.exists(marker):
        Path(marker).touch()
        os.kill(os.getpid(), signal.SIGKILL)
    return os.getpid()


def die_always(model: dict[str, Any]) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def spin(model: dict[str, Any], seconds: float) -> float:
    """Burns CPU for ``seconds`` (the caller's deadline or a kill ends it sooner)."""
    end = time.monotonic() + seconds
    n = 0
    while time.monotonic() < end:
        n += 1
    return float(n)


def buffer_owner(model: dict[str, Any], array: np.ndarray) -> str:
    """What holds the memory of an argument: 'mmap' (shared memory) or 'bytearray' (inline)."""
    return owner_of(array)


def owner_of(array: np.ndarray) -> str:
    base: Any = array
    while isinstance(base, np.ndarray) and base.base is not None:
        base = base.base
    if isinstance(base, memoryview):
        base = base.obj
    return type(base).__name__


def load_with_thread(name: str) -> dict[str, Any]:
    """A load that leaves a thread running in the zygote (the pool warns about it)."""
    import threading

    threading.Thread(target=threading.Event().wait, daemon=True).start()
    return load_counter(name)


def threads_seen(model: dict[str, Any]) -> dict[str, Any]:
    """The thread variables a worker runs with, and what numpy's BLAS reports."""
    from threadpoolctl import threadpool_info

    blas = [i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"]
    names = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
    return {"env": {n: os.environ.get(n) for n in names}, "blas": blas}


def load_thread_pool(name: str) -> dict[str, Any]:
    """A thread pool started in load, and one prediction through it (a warm-up).

    Forked workers inherit the queue but not the thread: their first call
    through it waits forever, as libgomp's do after a fork.
    """
    import queue
    import threading

    jobs: queue.Queue[tuple[float, queue.Queue[float]]] = queue.Queue()

    def serve() -> None:
        while True:
            value, done = jobs.get()
            done.put(value * 2)

    threading.Thread(target=serve, daemon=True).start()
    model = {"name": name, "jobs": jobs}
    via_thread(model, 1.0)
    return model


def via_thread(model: dict[str, Any], value: float) -> float:
    import queue

    done: queue.Queue[float] = queue.Queue()
    model["jobs"].put((value, done))
    return done.get()


def c_sleep(model: dict[str, Any], seconds: int) -> None:
    """Blocks in C with the GIL released (the heartbeat thread keeps beating)."""
    import ctypes

    ctypes.CDLL(None).sleep(seconds)


def load_module_names() -> list[str]:
    """A model that is the zygote's ``sys.modules`` when it loaded it."""
    import sys

    return sorted(sys.modules)


def module_names(model: list[str]) -> tuple[list[str], list[str]]:
    """The zygote's modules (the model) and this worker's."""
    import sys

    return model, sorted(sys.modules)


def stacked(model: dict[str, Any], x: np.ndarray, names: np.ndarray) -> dict[str, np.ndarray]:
    """A batching model's score: stacked rows in, as many rows out; each row
    says how many rows its batch had."""
    if x.dtype != np.float32:
        raise TypeError(f"x must be float32, got {x.dtype}")
    return {
        "double": x * 2,
        "names": np.array([n.upper() for n in names], dtype=object),
        "batch": np.full(len(x), len(x)),
    }


def stacked_short(model: dict[str, Any], x: np.ndarray, names: np.ndarray) -> np.ndarray:
    return x[1:]  # one row too few
