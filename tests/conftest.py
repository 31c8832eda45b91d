"""The reliability suite's helpers (reliability/harness.py) are the tests' too.

Every server a test starts inherits POOLSERVE_METRICS_PORT=0: its router's
/metrics takes a free port (written to ``<run_dir>/metrics.addr``) instead of
the default 8082, which two trees (or two engineers' suites) would share;
POOLSERVE_HTTP_PORT=0 does the same for the HTTP door (``<run_dir>/http.addr``).

Property tests (hypothesis) run without its per-example deadline (200 ms by
default): on a loaded 2-core CI host one slow example is the host, not the
code, and a speed is never a test's assertion.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from hypothesis import settings

settings.register_profile("poolserve", deadline=None)
settings.load_profile("poolserve")

os.environ.setdefault("POOLSERVE_METRICS_PORT", "0")
os.environ.setdefault("POOLSERVE_HTTP_PORT", "0")  # the same for the HTTP door (http.addr)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "reliability"))
