"""The router fleet (issue 31): echo c16 with ``routers: 2`` beside ``routers: 1``,
and what more cores would carry.

Three servers, each with only echo (FP32 [1,16]), measured at concurrency 16
over gRPC with the servers interleaved innermost per round: poolserve with one
router, poolserve with two routers (both 2 workers), and KServe's single
process. The bench already reads every process's CPU before and after a cell
(run.py ``cpu_record``); from it comes the CPU per request of each poolserve
process role (router, pool, worker, supervisor, zygote), summed over the
processes of that role.

The capacity table turns those into requests/s on 4, 8, 16 and 32 cores,
one model in one pool. The model: each process runs on at most one core, so a
role of ``n`` processes carries at most ``n / cpu`` requests/s (``cpu`` its
CPU seconds per request), and all of them together at most
``cores / total``. Routers are what ``routers: auto`` starts (one per 4
cores; settings.router_count); the pool and its workers share the other cores
in proportion to their CPU per request (a pool is one process per gid: one
model has one, so the table also says what a single pool caps). The
smallest of these is the figure, and its role is named as the bound. KServe
is one process: at most one core, whatever the machine (``1 / its CPU per
request``). It is a model from measured CPU, not a measurement on such
machines: the cores the measuring box lacks are the assumption.

Only the standard library at import time: run.py registers this module's
section in report.py, and tests load it by path.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

TITLE = "Router fleet (routers: 2)"
ONE, TWO, KSERVE = "poolserve", "poolserve-routers2", "kserve"
SERVERS = (ONE, TWO, KSERVE)
ECHO = "echo"
C = 16
CORES = (4, 8, 16, 32)
ROUTER_CORES = 4  # settings.ROUTER_CORES: routers "auto" is one per this many cores
# /proc/PID/comm of each poolserve process -> its role
ROLES = {
    "poolserve-rtr": "router",
    "poolserve-pool": "pool",
    "poolserve-wrk": "worker",
    "poolserve-zyg": "zygote",
    "poolserve": "supervisor",
}

Start = Callable[[str], Any]
Measure = Callable[..., dict[str, Any]]


def rounds_for(runs: int) -> int:
    """5 rounds where the bench's other parts measure 3 (one where they measure
    one): the row is a median of paired ratios, and a pair moves with the host."""
    return max(1, 2 * runs - 1)


def phase(
    start: Start,
    stop: Callable[[Any], None],
    measure: Measure,
    run_dir: Path,
    runs: int,
    log: Callable[[str], None],
    available: Callable[[str], str],
) -> dict[str, Any]:
    """Starts the three servers (``start(key)``: echo only, gRPC-ready), measures
    echo c16 on each in ``rounds_for(runs)`` rounds, and stops them. In each
    round the two poolserve cells are next to each other, the first of them
    alternating (routers: 1 then 2, then 2 then 1): their ratio is what the
    row judges, and on a host whose speed drifts within minutes cells apart
    differ more than the two layouts do."""
    folder = run_dir / "fleet"
    folder.mkdir(parents=True, exist_ok=True)
    skipped: dict[str, str] = {}
    running: dict[str, Any] = {}
    records: list[dict[str, Any]] = []
    for key in SERVERS:
        why = available(key)
        if not why:
            try:
                running[key] = start(key)
                continue
            except Exception as exc:  # a peer that does not start: say so, go on
                why = f"did not start: {str(exc)[:300]}"
        skipped[key] = why
        log(f"fleet: skipping {key}: {why}")
    rounds = rounds_for(runs)
    try:
        for r in range(rounds):
            keys = [key for key in SERVERS if key in running]
            order = keys if r % 2 == 0 else keys[::-1]
            for key in order:
                csv_path = folder / f"r{r}-{key}-echo-c{C}.csv"
                out = measure(running[key], list(running.values()), ECHO, C, csv_path=csv_path)
                records.append({"round": r, "server": key, "model": ECHO, "concurrency": C, **out})
                log(f"[{len(records)}/{rounds * len(running)}] fleet {key:<20} {out['shown']}")
                del records[-1]["shown"]
                (run_dir / "fleet.json").write_text(json.dumps(records, indent=1))
    finally:
        for server in running.values():
            stop(server)
    found: dict[str, Any] = {"runs": records, "rounds": rounds, "skipped": skipped}
    found["cells"] = cells(found)
    return found


def _requests(run: Mapping[str, Any]) -> float:
    return float(run["result"]["throughput"]) * float(run["cpu"]["wall_s"])


def cells(fleet: Mapping[str, Any]) -> dict[str, Any]:
    """server -> median throughput, p99 and CPU ms per request by role (and total)."""
    grouped: dict[str, list[Mapping[str, Any]]] = {}
    for run in fleet.get("runs", []):
        if run.get("result") and run.get("cpu") and _requests(run) > 0:
            grouped.setdefault(run["server"], []).append(run)
    out: dict[str, Any] = {}
    for server, runs in grouped.items():
        per_role: dict[str, list[float]] = {}
        for run in runs:
            roles: dict[str, float] = {"total": float(run["cpu"]["cpu_s"])}
            for name, seconds in run["cpu"].get("cpu_by_process", {}).items():
                role = ROLES.get(name, name)
                roles[role] = roles.get(role, 0.0) + float(seconds)
            for role, seconds in roles.items():
                per_role.setdefault(role, []).append(1000 * seconds / _requests(run))
        out[server] = {
            "throughput": statistics.median(float(r["result"]["throughput"]) for r in runs),
            "p99_ms": statistics.median(float(r["result"]["p99_us"]) / 1000 for r in runs),
            "cpu_ms": {role: statistics.median(v) for role, v in sorted(per_role.items())},
        }
    return out


def auto_routers(cores: int) -> int:
    return max(1, cores // ROUTER_CORES)


def capacity(cpu_ms: Mapping[str, float], cores: int) -> dict[str, Any]:
    """Requests/s ``cores`` would carry with the fleet, and the role that bounds it."""
    router, pool, worker = (max(cpu_ms.get(k, 0.0), 1e-6) for k in ("router", "pool", "worker"))
    total = max(cpu_ms.get("total", router + pool + worker), router + pool + worker)
    routers = auto_routers(cores)
    rest = max(2, cores - routers)
    pool_cores = rest * pool / (pool + worker)
    workers = max(1, round(rest - min(pool_cores, 1.0)))
    limits = {
        "cores": cores * 1000 / total,
        f"routers ({routers})": routers * 1000 / router,
        "pool (1 per gid)": 1000 / pool,
        f"workers ({workers})": workers * 1000 / worker,
    }
    bound = min(limits, key=lambda k: limits[k])
    return {"cores": cores, "routers": routers, "workers": workers, "limits": limits,
            "throughput": limits[bound], "bound": bound}  # fmt: skip


def _fmt(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def measured_table(fleet: Mapping[str, Any]) -> str:
    found = fleet.get("cells", {})
    rows = []
    for key, label in ((ONE, "poolserve, routers: 1"), (TWO, "poolserve, routers: 2"),
                       (KSERVE, "KServe (1 process)")):  # fmt: skip
        cell = found.get(key)
        if cell is None:
            why = fleet.get("skipped", {}).get(key, "not measured")
            rows.append([label, "-", "-", "-", "-", "-", "-", why])
            continue
        cpu = cell["cpu_ms"]
        rows.append([label, _fmt(cell["throughput"], 1), _fmt(cell["p99_ms"], 1),
                     *(_fmt(cpu.get(role), 3) for role in ("router", "pool", "worker")),
                     _fmt(cpu.get("total"), 3), ""])  # fmt: skip
    header = ["echo c16 (gRPC)", "infer/s", "p99 ms", "router CPU ms/req", "pool CPU ms/req",
              "worker CPU ms/req", "total CPU ms/req", "note"]  # fmt: skip
    return _table(header, rows)


def capacity_table(fleet: Mapping[str, Any]) -> str:
    found = fleet.get("cells", {})
    source = TWO if TWO in found else ONE
    if source not in found:
        return ""
    cpu = found[source]["cpu_ms"]
    kserve = found.get(KSERVE, {}).get("cpu_ms", {}).get("total")
    kserve_rate = 1000 / kserve if kserve else None
    rows = []
    for cores in CORES:
        got = capacity(cpu, cores)
        ratio = got["throughput"] / kserve_rate if kserve_rate else None
        rows.append([str(cores), str(got["routers"]), str(got["workers"]),
                     _fmt(got["throughput"]), got["bound"], _fmt(kserve_rate),
                     "-" if ratio is None else f"{ratio:.1f}x"])  # fmt: skip
    header = ["cores", "routers (auto)", "workers", "poolserve infer/s", "bound by",
              "KServe infer/s (1 process)", "poolserve / KServe"]  # fmt: skip
    return (
        _table(header, rows)
        + f"\n\nFrom the CPU per request of `{source}` above (echo c16); KServe at one core: "
        "1 / its CPU per request."
    )


def section(results: Mapping[str, Any]) -> str:
    fleet = results.get("fleet")
    if not fleet:
        return ""
    return (
        f"{measured_table(fleet)}\n\nWhat more cores would carry (one model, one pool; "
        f"bench/fleet.py says how):\n\n{capacity_table(fleet)}"
    )


# routers: 2 may not be slower than routers: 1 beyond the noise: on this shared host two
# cells of one server a minute apart differ by 5 % and more (bench/profile_path.py).
NOT_SLOWER = 0.95


def targets(results: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Issue 31's fleet row: routers: 2 over routers: 1 in each round (the
    same minute), the median of those ratios."""
    fleet = results.get("fleet")
    if not fleet:
        return []
    rounds: dict[int, dict[str, float]] = {}
    for run in fleet.get("runs", []):
        if run.get("result"):
            rounds.setdefault(int(run["round"]), {})[run["server"]] = float(
                run["result"]["throughput"]
            )
    ratios = [r[TWO] / r[ONE] for _, r in sorted(rounds.items()) if r.get(ONE) and r.get(TWO)]
    if not ratios:
        return []
    value = statistics.median(ratios)
    ones = [r[ONE] for r in rounds.values() if r.get(ONE)]
    spread = (max(ones) - min(ones)) / statistics.median(ones)
    detail = (
        "rounds " + ", ".join(f"{x:.2f}" for x in ratios)
        + f"; routers: 1's own rounds spread {100 * spread:.0f} %"
    )  # fmt: skip
    return [{"key": "fleet_routers2_vs_1",
             "label": "routers: 2 vs routers: 1, echo c16 throughput (median of rounds' ratios)",
             "value": value, "op": ">=", "threshold": NOT_SLOWER, "detail": detail,
             "issue": "31", "passed": value >= NOT_SLOWER}]  # fmt: skip


def console(found: Mapping[str, Any]) -> str:
    return section({"fleet": found}) + "\n"
