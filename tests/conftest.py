"""The reliability suite's helpers (reliability/harness.py) are the tests' too.

Every server a test starts inherits POOLSERVE_METRICS_PORT=0: its router's
/metrics takes a free port (written to ``<run_dir>/metrics.addr``) instead of
the default 8082, which two trees (or two engineers' suites) would share.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("POOLSERVE_METRICS_PORT", "0")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "reliability"))
