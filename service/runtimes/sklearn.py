"""scikit-learn estimators saved with joblib (extra ``poolserve[sklearn]``).

``parameters.uri`` names the joblib file. The first input is the feature
matrix; outputs are ``predict`` and, when requested and supported,
``predict_proba``. A transformer (an estimator with ``transform`` and no
``predict``: StandardScaler, PCA, ...) answers ``transform``, so that it can
be a preprocessing step of an ensemble.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from poolserve.service.contract.errors import InvalidInput
from poolserve.service.inference.model import Array, Model
from poolserve.service.runtimes.artifact import model_file


class SKLearnModel(Model):
    estimator: Any

    def load(self) -> None:
        import joblib  # optional dependency: imported only by models that use it

        self.estimator = joblib.load(model_file(self.settings, "a joblib file"))

    def predict(self, inputs: dict[str, Array], parameters: dict[str, object]) -> dict[str, Array]:
        if len(inputs) != 1:
            raise InvalidInput(f"model '{self.settings.name}' expects exactly one input")
        features = next(iter(inputs.values()))
        if features.ndim != 2:
            raise InvalidInput(f"input must be 2-D [rows, features], got shape {features.shape}")
        try:
            if not hasattr(self.estimator, "predict") and hasattr(self.estimator, "transform"):
                return {"transform": np.asarray(self.estimator.transform(features))}
            outputs = {"predict": np.asarray(self.estimator.predict(features))}
            if hasattr(self.estimator, "predict_proba"):
                outputs["predict_proba"] = np.asarray(self.estimator.predict_proba(features))
        except ValueError as exc:
            raise InvalidInput(f"model '{self.settings.name}' rejected the input: {exc}") from exc
        return outputs
