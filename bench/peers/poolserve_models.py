"""The bench's models as poolserve runtimes (copied into a temporary repository as model.py).

The loop and the counter come from ``workload.py``, copied beside this file,
so poolserve runs exactly the code that the other servers run.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
import workload

from poolserve.service import Model

Array = npt.NDArray[Any]


class EchoModel(Model):
    def predict(self, inputs: dict[str, Array], parameters: dict[str, object]) -> dict[str, Array]:
        return {"OUTPUT0": inputs["INPUT0"]}


class BurnModel(Model):
    def load(self) -> None:
        self.iterations = int(self.settings.extra["iterations"])
        self.counter = workload.ExecutionCounter(str(self.settings.extra.get("counter", "")))

    def predict(self, inputs: dict[str, Array], parameters: dict[str, object]) -> dict[str, Array]:
        workload.burn(self.iterations, self.counter)
        return {"OUTPUT0": inputs["INPUT0"]}


class BigModel(Model):
    """Holds ``extra.array_mib`` MiB of float64 (written, so resident) and reads it per request."""

    def load(self) -> None:
        count = int(self.settings.extra["array_mib"]) * 1024 * 1024 // 8
        self.table = np.ones(count, dtype=np.float64)

    def predict(self, inputs: dict[str, Array], parameters: dict[str, object]) -> dict[str, Array]:
        x = inputs["INPUT0"]
        return {"OUTPUT0": x + np.float32(self.table[x.size])}


class XGBoostModel(Model):
    """Written the way XGBoost's docs advise for one row at a time: a Booster and
    inplace_predict (no DMatrix per request); one warm-up prediction in load()."""

    def load(self) -> None:
        import xgboost

        self.booster = xgboost.Booster(model_file=str(self.settings.extra["model_file"]))
        self.booster.inplace_predict(np.zeros((1, workload.XGB_FEATURES), np.float32))

    def predict(self, inputs: dict[str, Array], parameters: dict[str, object]) -> dict[str, Array]:
        y = self.booster.inplace_predict(inputs["INPUT0"])
        return {workload.XGB_OUTPUT: np.asarray(y, np.float32)}
