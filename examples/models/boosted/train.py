"""Trains the ``boosted`` example: a HistGradientBoostingClassifier on a
synthetic data set of 20 features (scikit-learn's make_classification, fixed
seed), the vectorized model that adaptive batching is for.

Run at first use (``make run``, the batching bench and its tests) when
``model.joblib`` is missing: python train.py [OUT]
"""

from __future__ import annotations

import sys
from pathlib import Path

FEATURES = 20


def train(out: Path) -> Path:
    import joblib
    from sklearn.datasets import make_classification
    from sklearn.ensemble import HistGradientBoostingClassifier

    x, y = make_classification(
        n_samples=4000, n_features=FEATURES, n_informative=12, random_state=16
    )
    model = HistGradientBoostingClassifier(max_iter=100, random_state=16).fit(x, y)
    tmp = out.with_suffix(".tmp")
    joblib.dump(model, tmp)
    tmp.replace(out)  # a concurrent reader never sees half a file
    return out


def ensure(folder: Path) -> Path:
    """The folder's model file, trained now if it is missing."""
    path = folder / "model.joblib"
    return path if path.is_file() else train(path)


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).with_name("model.joblib")
    print(f"trained {train(target)}")
