"""The reliability suite's helpers (reliability/harness.py) are the tests' too."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "reliability"))
