"""Trains the pipeline's classifier on standardized iris features (the
scaler's outputs: a StandardScaler fitted on the same data, as
../iris_scaler/train.py fits it).

python train.py [OUT]   (writes model.joblib beside this file by default)
"""

from __future__ import annotations

import sys
from pathlib import Path

import joblib
from sklearn.datasets import load_iris
from sklearn.linear_model import LogisticRegression
from sklearn.preprocessing import StandardScaler


def train(out: Path) -> Path:
    data = load_iris()
    scaled = StandardScaler().fit_transform(data.data)
    joblib.dump(LogisticRegression(max_iter=500).fit(scaled, data.target), out)
    return out


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).with_name("model.joblib")
    print(f"trained {train(target)}")
