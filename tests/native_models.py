"""Models on real native runtimes, for the fork-safety tests (tests/test_native_runtimes.py).

Run as a script, it trains or builds each model and writes, per model, the
model file, test inputs and the model's local predictions (computed here, in
a process that never forks), so that the tests compare a served reply with
what the same library answers outside poolserve. ``MODEL_CODE`` is the
``model.py`` every model folder gets: each class loads its file and runs one
warm-up prediction in ``load()`` (so in the pool's zygote, before the fork),
as people do to have the first request fast.

    python tests/native_models.py OUT_DIR KIND...
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np

FEATURES = 20
ROWS = 8  # rows per request
CALLS = 40  # concurrent calls per model, each with its own rows

KINDS = ("xgboost", "lightgbm", "onnxruntime", "sklearn", "blas", "torch")
MODULES = {
    "xgboost": ("xgboost",),
    "lightgbm": ("lightgbm",),
    "onnxruntime": ("onnxruntime", "skl2onnx"),
    "sklearn": ("sklearn",),
    "blas": (),
    "torch": ("torch",),
}
CLASSES = {
    "xgboost": "XGBoostModel",
    "lightgbm": "LightGBMModel",
    "onnxruntime": "OnnxModel",
    "sklearn": "ForestModel",
    "blas": "MatmulModel",
    "torch": "TorchModel",
}

MODEL_CODE = """
import os

import numpy as np

from poolserve.service import Model

FEATURES = 20


class Native(Model):
    def path(self, name):
        return os.path.join(str(self.settings.folder), name)

    def load(self):
        self.build()
        self.run(np.zeros((4, FEATURES), np.float32))  # warm-up, in the zygote

    def predict(self, inputs, parameters):
        return {"OUTPUT0": self.run(inputs["INPUT0"])}


class XGBoostModel(Native):
    def build(self):
        import xgboost

        self.model = xgboost.XGBClassifier()
        self.model.load_model(self.path("model.json"))

    def run(self, x):
        return self.model.predict_proba(x).astype(np.float32)


class LightGBMModel(Native):
    def build(self):
        import lightgbm

        self.model = lightgbm.Booster(model_file=self.path("model.txt"))

    def run(self, x):
        return self.model.predict(x)


class OnnxModel(Native):
    def build(self):
        import onnxruntime

        self.session = onnxruntime.InferenceSession(
            self.path("model.onnx"), providers=["CPUExecutionProvider"]
        )

    def run(self, x):
        return self.session.run(["probabilities"], {"input": x})[0]


class ForestModel(Native):
    def build(self):
        import joblib

        self.model = joblib.load(self.path("model.joblib"))  # n_jobs=-1

    def run(self, x):
        return self.model.predict_proba(x)


class MatmulModel(Native):
    def build(self):
        self.w1 = np.load(self.path("w1.npy"))
        self.w2 = np.load(self.path("w2.npy"))

    def run(self, x):
        return np.tanh(x.astype(np.float64) @ self.w1) @ self.w2


class TorchModel(Native):
    def build(self):
        import torch

        self.torch = torch
        self.net = torch.nn.Sequential(
            torch.nn.Linear(FEATURES, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024)
        )
        self.net.load_state_dict(torch.load(self.path("model.pt"), weights_only=True))
        self.net.eval()

    def run(self, x):
        with self.torch.no_grad():
            return self.net(self.torch.from_numpy(np.ascontiguousarray(x))).numpy()
"""


def available(kind: str) -> bool:
    return all(importlib.util.find_spec(m) is not None for m in MODULES[kind])


def _data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(7)
    x = rng.standard_normal((400, FEATURES)).astype(np.float32)
    y = (x[:, 0] + 0.5 * x[:, 1] * x[:, 2] - x[:, 3] > 0).astype(np.int64)
    return x, y


def build(kind: str, folder: Path) -> None:
    x, y = _data()
    if kind == "xgboost":
        import xgboost

        model = xgboost.XGBClassifier(n_estimators=50, max_depth=4)
        model.fit(x, y)
        model.save_model(folder / "model.json")
    elif kind == "lightgbm":
        import lightgbm

        data = lightgbm.Dataset(x, label=y)
        lightgbm.train({"objective": "binary", "verbose": -1}, data, 50).save_model(
            folder / "model.txt"
        )
    elif kind == "onnxruntime":
        from skl2onnx import convert_sklearn
        from skl2onnx.common.data_types import FloatTensorType
        from sklearn.ensemble import RandomForestClassifier

        forest = RandomForestClassifier(n_estimators=30, max_depth=6, random_state=0).fit(x, y)
        onnx = convert_sklearn(
            forest,
            initial_types=[("input", FloatTensorType([None, FEATURES]))],
            options={id(forest): {"zipmap": False}},
        )
        (folder / "model.onnx").write_bytes(onnx.SerializeToString())
    elif kind == "sklearn":
        import joblib
        from sklearn.ensemble import RandomForestClassifier

        forest = RandomForestClassifier(n_estimators=30, max_depth=6, n_jobs=-1, random_state=0)
        joblib.dump(forest.fit(x, y), folder / "model.joblib")
    elif kind == "blas":
        rng = np.random.default_rng(3)
        np.save(folder / "w1.npy", rng.standard_normal((FEATURES, 512)) / 4)
        np.save(folder / "w2.npy", rng.standard_normal((512, 512)) / 16)
    elif kind == "torch":
        import torch

        torch.manual_seed(0)
        net = torch.nn.Sequential(
            torch.nn.Linear(FEATURES, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024)
        )
        torch.save(net.state_dict(), folder / "model.pt")


def local_predictions(kind: str, folder: Path, inputs: np.ndarray) -> np.ndarray:
    """What the model's own class answers here, loaded outside poolserve."""
    namespace: dict[str, object] = {}
    exec(compile(MODEL_CODE, "model.py", "exec"), namespace)
    from poolserve.service.contract.repository import ModelSettings

    cls = namespace[CLASSES[kind]]
    settings = ModelSettings(kind, f"model.{CLASSES[kind]}", folder, folder / "x")
    model = cls(settings)  # type: ignore[operator]
    model.load()
    return np.stack([model.run(batch) for batch in inputs])


def main(out: Path, kinds: list[str]) -> None:
    rng = np.random.default_rng(11)
    for kind in kinds:
        folder = out / kind
        folder.mkdir(parents=True, exist_ok=True)
        build(kind, folder)
        inputs = rng.standard_normal((CALLS, ROWS, FEATURES)).astype(np.float32)
        np.save(folder / "inputs.npy", inputs)
        np.save(folder / "expected.npy", local_predictions(kind, folder, inputs))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
