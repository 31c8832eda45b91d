"""The model code every server in the bench runs: one source, so one cost.

``spin`` is the loop of ``burn`` (the same loop as examples/models/burn);
each server's thin model class calls :func:`burn` with the iteration count
the bench calibrated once. :class:`ExecutionCounter` appends one 8-byte
record per finished ``burn`` to a file: the CPU the loop took in that
process, from whichever process ran it. So the bench counts executions, and
measures the model's own CPU under the run's real conditions, the same way
in every server (a forked or spawned worker opens its own descriptor; small
O_APPEND writes to a regular file do not interleave).
"""

from __future__ import annotations

import os
import statistics
import struct
import time
from pathlib import Path

RECORD = struct.Struct("<Q")  # CPU nanoseconds of one execution


def spin(iterations: int) -> int:
    total = 0
    for i in range(iterations):
        total += i & 7
    return total


class ExecutionCounter:
    def __init__(self, path: str) -> None:
        self.path = path
        self._pid = 0
        self._fd = -1

    def count(self, cpu_ns: int) -> None:
        if not self.path:
            return
        if self._pid != os.getpid():  # first use in this process (after a fork or a spawn)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            self._pid = os.getpid()
        os.write(self._fd, RECORD.pack(cpu_ns))


def burn(iterations: int, counter: ExecutionCounter) -> None:
    """The body of every server's ``burn`` model: the loop, then one record of its CPU."""
    began = time.thread_time_ns()
    spin(iterations)
    counter.count(time.thread_time_ns() - began)


def counter_offset(path: Path) -> int:
    """Where the next record will go: compare two offsets to find a window's executions."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return 0
    return size - size % RECORD.size


def read_records(path: Path, start: int, end: int) -> list[int]:
    """The CPU nanoseconds of each execution recorded between two offsets."""
    if end <= start:
        return []
    with open(path, "rb") as f:
        f.seek(start)
        data = f.read(end - start)
    return [v for (v,) in RECORD.iter_unpack(data[: len(data) - len(data) % RECORD.size])]


def cpu_seconds(iterations: int) -> float:
    start = time.process_time()
    spin(iterations)
    return time.process_time() - start


def calibrate(target_s: float = 0.020, probe: int = 200_000, repeat: int = 5) -> int:
    """Iterations of ``spin`` that take ``target_s`` of CPU here (rounded to 1000)."""
    spin(probe)  # warm the interpreter's caches
    per_iteration = min(cpu_seconds(probe) for _ in range(repeat)) / probe
    return max(1000, round(target_s / per_iteration / 1000) * 1000)


def measure(iterations: int, repeat: int = 7) -> float:
    """Median CPU seconds of one ``spin(iterations)``."""
    return statistics.median(cpu_seconds(iterations) for _ in range(repeat))


# -- the XGBoost model (issue 22): one file, trained once per run, loaded by every server --

XGB_FEATURES = 20
XGB_TREES = 200
XGB_OUTPUT = "predict"  # MLServer's XGBoost runtime names its output after the method


def train_xgb(path: str) -> None:
    """A regressor of ``XGB_TREES`` trees over ``XGB_FEATURES`` features, saved as JSON."""
    import numpy as np
    import xgboost

    rng = np.random.default_rng(22)
    x = rng.standard_normal((5000, XGB_FEATURES)).astype(np.float32)
    y = x[:, 0] * x[:, 1] + np.sin(x[:, 2]) + 0.1 * rng.standard_normal(5000)
    model = xgboost.XGBRegressor(n_estimators=XGB_TREES, max_depth=6, random_state=22)
    model.fit(x, y)
    model.save_model(path)
