"""Fits the pipeline's preprocessor: a StandardScaler on the iris features.

python train.py [OUT]   (writes model.joblib beside this file by default)
"""

from __future__ import annotations

import sys
from pathlib import Path

import joblib
from sklearn.datasets import load_iris
from sklearn.preprocessing import StandardScaler


def train(out: Path) -> Path:
    joblib.dump(StandardScaler().fit(load_iris().data), out)
    return out


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).with_name("model.joblib")
    print(f"trained {train(target)}")
