"""The response cache (issue 44, item 3): a cache hit's throughput against a
computed echo's, at concurrency 16 over gRPC.

One poolserve tree (2 workers) serves two copies of the bench's echo (FP32
[1,16]) in its default pool: ``echo``, computed by a worker on every call,
and ``echo_cached``, the same model with ``parameters.extra.response_cache:
true``. perf_analyzer sends the same tensor on every call (its random data is
made once), so after its first call every ``echo_cached`` request is a hit,
answered by the pool server without a worker. Both are measured in each
round, next to each other, the first alternating; the row is the median of
the rounds' ratios (``echo_cached`` over ``echo``), target at least 3x.

Only the standard library at import time: run.py registers this module's
section in report.py, and tests load it by path.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

TITLE = "Response cache (echo c16)"
SERVER = "poolserve-cache"
COMPUTED, CACHED = "echo", "echo_cached"
MODELS = (COMPUTED, CACHED)
C = 16
TARGET = 3.0  # a hit at least 3x a computed echo's throughput (issue 44)

Measure = Callable[..., dict[str, Any]]


def rounds_for(runs: int) -> int:
    """5 rounds where the bench's other parts measure 3, one where they measure one."""
    return max(1, 2 * runs - 1)


def phase(
    start: Callable[[str], Any],
    stop: Callable[[Any], None],
    measure: Measure,
    run_dir: Path,
    runs: int,
    log: Callable[[str], None],
) -> dict[str, Any]:
    """Starts the tree (``start(key)``), measures both models at c16 in
    ``rounds_for(runs)`` rounds, stops it."""
    folder = run_dir / "cache"
    folder.mkdir(parents=True, exist_ok=True)
    records: list[dict[str, Any]] = []
    rounds = rounds_for(runs)
    server = start(SERVER)
    try:
        for r in range(rounds):
            order = MODELS if r % 2 == 0 else MODELS[::-1]
            for model in order:
                csv_path = folder / f"r{r}-{model}-c{C}.csv"
                out = measure(server, [server], model, C, csv_path=csv_path)
                records.append({"round": r, "server": SERVER, "model": model, "concurrency": C,
                                **out})  # fmt: skip
                log(f"[{len(records)}/{rounds * len(MODELS)}] cache {model:<12} {out['shown']}")
                del records[-1]["shown"]
                (run_dir / "cache.json").write_text(json.dumps(records, indent=1))
    finally:
        stop(server)
    found: dict[str, Any] = {"runs": records, "rounds": rounds}
    found["cells"] = cells(found)
    return found


def _requests(run: Mapping[str, Any]) -> float:
    return float(run["result"]["throughput"]) * float(run["cpu"]["wall_s"])


def cells(cache: Mapping[str, Any]) -> dict[str, Any]:
    """model -> median throughput, p99 and whole-tree CPU ms per request."""
    grouped: dict[str, list[Mapping[str, Any]]] = {}
    for run in cache.get("runs", []):
        if run.get("result"):
            grouped.setdefault(run["model"], []).append(run)
    out: dict[str, Any] = {}
    for model, found in grouped.items():
        cpu = [1000 * float(r["cpu"]["cpu_s"]) / _requests(r) for r in found
               if r.get("cpu") and _requests(r) > 0]  # fmt: skip
        out[model] = {
            "throughput": statistics.median(float(r["result"]["throughput"]) for r in found),
            "p99_ms": statistics.median(float(r["result"]["p99_us"]) / 1000 for r in found),
            "cpu_ms": statistics.median(cpu) if cpu else None,
        }
    return out


def ratios(cache: Mapping[str, Any]) -> list[float]:
    """Each round's echo_cached throughput over its echo's."""
    rounds: dict[int, dict[str, float]] = {}
    for run in cache.get("runs", []):
        if run.get("result"):
            rounds.setdefault(int(run["round"]), {})[run["model"]] = float(
                run["result"]["throughput"]
            )
    return [r[CACHED] / r[COMPUTED] for _, r in sorted(rounds.items())
            if r.get(CACHED) and r.get(COMPUTED)]  # fmt: skip


def _fmt(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def section(results: Mapping[str, Any]) -> str:
    cache = results.get("cache")
    if not cache:
        return ""
    found = cache.get("cells", {})
    rows = ["| model | infer/s | p99 ms | CPU ms per request (whole tree) |",
            "|---|---:|---:|---:|"]  # fmt: skip
    for model, label in ((COMPUTED, "echo (computed)"), (CACHED, "echo_cached (hits)")):
        cell = found.get(model, {})
        rows.append(f"| {label} | {_fmt(cell.get('throughput'))} | "
                    f"{_fmt(cell.get('p99_ms'), 2)} | {_fmt(cell.get('cpu_ms'), 3)} |")  # fmt: skip
    each = ratios(cache)
    median = statistics.median(each) if each else None
    return (
        "\n".join(rows)
        + f"\n\nHits over computed, median of {len(each)} rounds' ratios: {_fmt(median, 2)}x"
        + (" (" + ", ".join(f"{x:.2f}" for x in each) + ")" if each else "")
        + "; a hit costs the router and the pool server, no worker. perf_analyzer (the "
        "client) runs on the same cores, so the CPU per request says what the throughput "
        "on a host of two cores cannot"
    )


def targets(results: Mapping[str, Any]) -> list[dict[str, Any]]:
    cache = results.get("cache")
    each = ratios(cache) if cache else []
    if not each:
        return []
    value = statistics.median(each)
    detail = "rounds " + ", ".join(f"{x:.2f}" for x in each)
    found = cells(cache)
    cpu = [found.get(model, {}).get("cpu_ms") for model in (COMPUTED, CACHED)]
    if cpu[0] and cpu[1]:
        detail += (f"; the tree's CPU per request {cpu[1]:.3f} ms from the cache, "
                   f"{cpu[0]:.3f} ms computed ({cpu[0] / cpu[1]:.1f}x less)")  # fmt: skip
    return [{"key": "cache_hit_vs_echo",
             "label": "response cache hit vs computed echo, c16 throughput (median of rounds)",
             "value": value, "op": ">=", "threshold": TARGET, "detail": detail,
             "issue": "44", "passed": value >= TARGET}]  # fmt: skip


def console(found: Mapping[str, Any]) -> str:
    return section({"cache": found}) + "\n"
