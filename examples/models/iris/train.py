"""Trains the iris classifier from the data that ships inside scikit-learn.

Run by ``make run`` when ``model.joblib`` is missing: python train.py [OUT]
"""

from __future__ import annotations

import sys
from pathlib import Path

import joblib
from sklearn.datasets import load_iris
from sklearn.linear_model import LogisticRegression


def train(out: Path) -> Path:
    data = load_iris()
    model = LogisticRegression(max_iter=500).fit(data.data, data.target)
    joblib.dump(model, out)
    return out


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).with_name("model.joblib")
    print(f"trained {train(target)}")
