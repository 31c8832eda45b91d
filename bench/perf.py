"""Runs Triton's perf_analyzer for one cell and reads what it reported.

One cell is (server, model, concurrency). perf_analyzer measures fixed time
windows and reports the last three merged; the bench sets the stability
threshold out of reach (``-s 1000``) so that every cell takes exactly three
windows on every server, instead of "until stable", which on a noisy
machine has no bound. Its CSV (``-f``) holds throughput and the p50 to p99
latencies in microseconds; the average latency is read from its stdout.
"""

from __future__ import annotations

import csv
import io
import re
import subprocess
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

SHAPE = "INPUT0:1,16"
SHAPES = {"xgb": "INPUT0:1,20"}  # the XGBoost model's 20 features


@dataclass(frozen=True)
class PerfResult:
    throughput: float  # inferences per second
    p50_us: float
    p90_us: float
    p95_us: float
    p99_us: float
    avg_us: float | None = None

    def to_json(self) -> dict[str, float | None]:
        return asdict(self)


def command(
    binary: Path,
    address: str,
    model: str,
    concurrency: int,
    window_ms: int,
    csv_path: Path,
    shape: str | None = None,
    extra: Sequence[str] = (),
    protocol: str = "grpc",
) -> list[str]:
    """``shape`` replaces the model's default --shape; ``extra`` flags go last; ``protocol``
    is perf_analyzer's -i (grpc or http: ``address`` is then the REST port's)."""
    return [
        str(binary),
        "-m",
        model,
        "-i",
        protocol,
        "-u",
        address,
        "--shape",
        shape or SHAPES.get(model, SHAPE),
        "--concurrency-range",
        str(concurrency),
        "--measurement-interval",
        str(window_ms),
        "--stability-percentage",
        "1000",
        "-f",
        str(csv_path),
        *extra,
    ]


def parse_csv(text: str) -> PerfResult:
    """The single row perf_analyzer writes for one concurrency level."""
    rows = list(csv.DictReader(io.StringIO(text)))
    if not rows:
        raise ValueError("perf_analyzer CSV has no data row")
    row = {k.strip(): v.strip() for k, v in rows[0].items() if k is not None}
    try:
        return PerfResult(
            throughput=float(row["Inferences/Second"]),
            p50_us=float(row["p50 latency"]),
            p90_us=float(row["p90 latency"]),
            p95_us=float(row["p95 latency"]),
            p99_us=float(row["p99 latency"]),
        )
    except KeyError as exc:
        raise ValueError(f"perf_analyzer CSV lacks column {exc}") from None


AVG = re.compile(r"^\s*Avg latency:\s*([0-9.]+)\s*usec", re.MULTILINE)
ERROR = re.compile(r"^(?:error|Failed|Thread \[\d+\] had error).*$", re.MULTILINE | re.IGNORECASE)


def parse_stdout_avg(text: str) -> float | None:
    found = AVG.findall(text)
    return float(found[-1]) if found else None


THREAD_ERROR = re.compile(r"^Thread \[\d+\] had error.*$", re.MULTILINE)


def first_error(text: str) -> str:
    """The most telling error line: a worker thread's own words (what the server or the client
    library said), else the first error line, else the last line."""
    found = THREAD_ERROR.search(text) or ERROR.search(text)
    if found:
        return found.group(0).strip()
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "no output"


def parse(csv_text: str, stdout: str) -> PerfResult:
    result = parse_csv(csv_text)
    return PerfResult(**{**asdict(result), "avg_us": parse_stdout_avg(stdout)})


def run(
    binary: Path,
    env: dict[str, str],
    address: str,
    model: str,
    concurrency: int,
    window_ms: int,
    csv_path: Path,
    timeout: float,
    shape: str | None = None,
    extra: Sequence[str] = (),
    protocol: str = "grpc",
) -> PerfResult:
    """Runs one cell; raises RuntimeError with perf_analyzer's own words on failure."""
    csv_path.unlink(missing_ok=True)
    argv = command(binary, address, model, concurrency, window_ms, csv_path, shape, extra, protocol)
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"perf_analyzer took more than {timeout:.0f} s") from None
    stdout = done.stdout + done.stderr
    csv_path.with_suffix(".out").write_text(stdout)
    if done.returncode != 0 or not csv_path.exists():
        raise RuntimeError(f"perf_analyzer exit {done.returncode}: {first_error(stdout)}")
    return parse(csv_path.read_text(), stdout)
