"""The models of tests/test_batching.py: batched models that log what they ran.

``ROWS_MODEL`` logs each predict (its pid and the first column of every row)
to ``parameters.extra.log``, so a test can tell which rows ever ran and in
which batches; the ``hold_ms`` parameter keeps a worker busy. ``SHORT`` is
the same with one row too few in its outputs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from support import write_model

ROWS_MODEL = """
import json, os, time
import numpy as np
from poolserve.service import InvalidInput, Model


class RowsModel(Model):
    def predict(self, inputs, parameters):
        x = inputs["INPUT0"]
        if x.dtype != np.float32:
            raise InvalidInput(f"INPUT0 must be FP32, got {x.dtype}")
        if x.ndim != 2:
            raise InvalidInput(f"INPUT0 must be 2-D, got {x.shape}")
        log = self.settings.extra.get("log")
        if log:
            with open(log, "a") as f:
                line = {"pid": os.getpid(), "rows": x[:, 0].tolist()}
                f.write(json.dumps(line) + "\\n")
        hold = parameters.get("hold_ms")
        if hold:
            time.sleep(int(hold) / 1000)
        n = x.shape[0] - int(self.settings.extra.get("short", 0))
        return {
            "DOUBLE": (x * 2)[:n],
            "ROWSUM": x.sum(axis=1)[:n],
            "BATCH": np.full(n, x.shape[0], np.int64),
            "NAME": np.array([f"row {v:g}".encode() for v in x[:n, 0]], dtype=object),
        }
"""


def rows_model(repo: Path, name: str, log: Path, *, max_batch_size: int = 16, **extra: Any) -> Path:
    settings = {
        "name": name,
        "implementation": "model.RowsModel",
        "max_batch_size": max_batch_size,
        "max_batch_time": 0.002,
        "parameters": {"extra": {"log": str(log), **extra}},
    }
    return write_model(repo, name, settings, ROWS_MODEL)
