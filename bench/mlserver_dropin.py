"""The MLServer drop-in row (issue 18): MLServer models served by poolserve, unchanged.

The bench's echo and burn written as ``mlserver.MLModel`` runtimes
(peers/mlserver_models.py: the very classes MLServer serves in the bench) are
served by poolserve with 2 workers (service/runtimes/mlmodel.py adapts them)
and by MLServer 1.7.1 with 2 workers, in the same run, interleaved: echo and
burn at concurrency 16 (perf_analyzer), then the PSS of each process tree.
Targets: echo c16 >= 2 x MLServer, burn c16 >= 1.0 x MLServer, PSS <= 0.7 x
(the PSS of each whole process tree, from /proc/PID/smaps_rollup).

Registered in run.py (a phase of ``make bench``, or alone with
``python bench/run.py --only mlserver-dropin``); report.py shows the table
this module renders into the results (``results["mlserver_dropin"]["table"]``).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import servers

KEY = "poolserve-mlmodel"
CONCURRENCY = 16
TARGETS = {"echo": 2.0, "burn": 1.0}  # throughput x MLServer at c16, at least
PSS_TARGET = 0.7  # x MLServer, at most (issue 30: 0.5x needs fewer Python processes)
ROUNDS = 5  # in full mode: pairs of fresh servers (see measure)


def build(spec: servers.ServerSpec, ctx: servers.Context) -> servers.Launch:
    """MLServer's repository (the model-settings.json MLServer gets) under ``poolserve serve``."""
    repo = ctx.workdir / "repo"
    for model in ctx.layout.models:
        implementation = f"mlserver_models.{servers.MLSERVER_CLASSES[model]}"
        servers.write_model_settings(repo / model, model, implementation, ctx)
    run_dir = Path(os.environ.get("XDG_RUNTIME_DIR") or "/tmp") / f"psm-{os.getpid()}-{ctx.port}"
    argv = [str(servers.POOLSERVE), "serve", str(repo), "--grpc-port", str(ctx.port)]
    argv += ["--metrics-port", "0"]  # a free port: never the one another server holds
    argv += ["--http-port", str(ctx.http_port)]  # the same for the REST port (0: any free one)
    argv += ["--run-dir", str(run_dir), "--workers", str(spec.workers_for(ctx.layout))]
    return servers.Launch(
        argv,
        env={"PYTHONPATH": str(servers.PEER_CODE)},
        ready_line="poolserve: ready",
        cleanup=(run_dir,),
    )


SPEC = servers.ServerSpec(
    KEY,
    "poolserve (2 workers) serving MLServer runtimes",
    2,
    build,
    note="peers/mlserver_models.py (mlserver.MLModel subclasses) as they are, adapted by "
    "service/runtimes/mlmodel.py",
)

# run.measure_cell(server, running, model, concurrency, mode, pa, env, csv_path, timeout)
MeasureCell = Callable[..., dict[str, Any]]


def measure(
    fleet: Any, mode: Any, pa: Any, run_dir: Path, measure_cell: MeasureCell
) -> dict[str, Any]:
    """:data:`ROUNDS` rounds (one in quick mode); each starts both servers afresh, measures them
    interleaved, reads each process's PSS, and stops them.

    Fresh processes every round: how fast one process runs the same Python
    loop differs from process to process by a few percent (where its objects
    landed in memory; measured here: 14.4 to 15.7 ms for one loop, alternating
    requests between live servers), and a process keeps its speed for its life.
    With one pair of servers for all rounds, that draw would decide the burn
    ratio; new processes each round make the median a median over draws.
    """
    specs = [SPEC, servers.spec(servers.REFERENCE)]
    layout = servers.Layout(servers.BOTH)
    env = {**os.environ, **pa.env}
    timeout = 10 * mode.window_ms / 1000 + 30
    cells: list[dict[str, Any]] = []
    rounds: list[dict[str, list[tuple[str, int]]]] = []
    for r in range(max(mode.runs, ROUNDS) if mode.runs > 1 else mode.runs):
        running = [fleet.start(s, layout, f"dropin{r}") for s in specs]
        try:
            for server in running:
                fleet.wait_ready(server, warm=10)
            order = running if r % 2 == 0 else running[::-1]
            for model in servers.BOTH:
                for server in order:
                    csv_path = run_dir / "dropin" / f"r{r}-{server.spec.key}-{model}.csv"
                    csv_path.parent.mkdir(parents=True, exist_ok=True)
                    cell = measure_cell(server, running, model, CONCURRENCY, mode, pa, env,
                                        csv_path, timeout)  # fmt: skip
                    shown = f"{server.spec.key:<18} {cell['shown']}{_loop(cell)}"
                    print(f"  drop-in round {r + 1} {model} c{CONCURRENCY} {shown}", flush=True)
                    del cell["shown"]
                    cells.append({"round": r, "server": server.spec.key, "model": model, **cell})
            time.sleep(1.0)  # start-up garbage settles before smaps is read
            by_process = {
                s.spec.key: [(role(p), servers.pss_bytes(p)) for p in s.tree()] for s in running
            }
        finally:
            for server in running:
                fleet.stop(server)
        rounds.append(by_process)
        for key, rows in by_process.items():  # what each process of the tree holds
            shown = ", ".join(f"{name} {b / 2**20:.1f}" for name, b in rows)
            print(f"  drop-in round {r + 1} PSS MiB {key:<18} {shown}", flush=True)
    pss = {key: statistics.median(sum(b for _, b in rnd[key]) for rnd in rounds)
           for key in rounds[0]}  # fmt: skip
    processes = {key: len(rows) for key, rows in rounds[-1].items()}
    return summarize({"cells": cells, "pss_bytes": pss, "processes": processes,
                      "pss_by_process": rounds[-1], "pss_rounds": rounds})  # fmt: skip


def _loop(cell: Mapping[str, Any]) -> str:
    """The model's own CPU per burn execution, as the model measured it."""
    ms = cell.get("cpu", {}).get("model_cpu_ms")
    return f", loop {ms:.2f} ms CPU" if ms else ""


def role(pid: int) -> str:
    """A process's part in its tree, from its command line: poolserve's
    supervisor (serve), pool server, zygote, worker, router; MLServer's main
    process and its workers (multiprocessing)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
        parent = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        parent_argv = Path(f"/proc/{parent}/cmdline").read_bytes().split(b"\0")
        grandparent = int(Path(f"/proc/{parent}/stat").read_text().rsplit(")", 1)[1].split()[1])
        grand_argv = Path(f"/proc/{grandparent}/cmdline").read_bytes().split(b"\0")
    except (OSError, ValueError, IndexError):
        return "?"
    if "poolserve.supervisor.cli" in argv:
        kind = argv[argv.index("poolserve.supervisor.cli") + 1]
        if kind == "pool" and b"pool" in grand_argv:
            return "worker"
        if kind == "pool" and b"pool" in parent_argv:
            return "zygote"
        return kind
    if "serve" in argv:
        return "serve"
    if any("multiprocessing" in a for a in argv):
        return "worker"
    return Path(argv[1] if len(argv) > 1 else argv[0]).name or "?"


def _median(cells: Sequence[Mapping[str, Any]], server: str, model: str) -> float | None:
    values = [
        float(c["result"]["throughput"])
        for c in cells
        if c["server"] == server and c["model"] == model and "result" in c
    ]
    return statistics.median(values) if values else None


def _median_loop(cells: Sequence[Mapping[str, Any]], server: str) -> float | None:
    values = [
        float(c["cpu"]["model_cpu_ms"])
        for c in cells
        if c["server"] == server and c["model"] == "burn" and c.get("cpu", {}).get("model_cpu_ms")
    ]
    return statistics.median(values) if values else None


def summarize(data: dict[str, Any]) -> dict[str, Any]:
    """Medians, ratios to MLServer and the targets' verdicts, added to ``data``."""
    ref = servers.REFERENCE
    rows: list[dict[str, Any]] = []
    for model, target in TARGETS.items():
        ours, theirs = _median(data["cells"], KEY, model), _median(data["cells"], ref, model)
        x = ours / theirs if ours and theirs else None
        rows.append({"what": f"{model} c{CONCURRENCY} throughput", "poolserve": ours,
                     "mlserver": theirs, "ratio": x, "target": f">= {target:g}x",
                     "met": x is not None and x >= target})  # fmt: skip
    ours, theirs = _median_loop(data["cells"], KEY), _median_loop(data["cells"], ref)
    rows.append({"what": "burn: the model's CPU per execution (ms)", "poolserve": ours,
                 "mlserver": theirs, "ratio": ours / theirs if ours and theirs else None,
                 "target": "not a target: the same loop, timed inside each server",
                 "met": None})  # fmt: skip
    ours_pss, theirs_pss = data["pss_bytes"].get(KEY), data["pss_bytes"].get(ref)
    x = ours_pss / theirs_pss if ours_pss and theirs_pss else None
    met = x is not None and x <= PSS_TARGET
    rows.append({"what": "PSS (MiB)", "poolserve": ours_pss and ours_pss / 2**20,
                 "mlserver": theirs_pss and theirs_pss / 2**20, "ratio": x,
                 "target": f"<= {PSS_TARGET:g}x", "met": met})  # fmt: skip
    data["summary"] = rows
    data["table"] = table(data)  # report.py shows it as it is
    return data


def table(data: Mapping[str, Any] | None) -> str:
    """The drop-in table (Markdown), or "" when the run had no drop-in phase."""
    if not data:
        return ""

    def f(value: float | None) -> str:
        return "-" if value is None else f"{value:,.1f}"

    lines = [
        "| MLServer runtimes | poolserve (2 workers) | MLServer 1.7.1 (2 workers) | x | target |",
        "|---|---:|---:|---:|---|",
    ]
    for row in data["summary"]:
        verdict = {True: " met", False: " MISSED", None: ""}[row["met"]]
        ratio = "-" if row["ratio"] is None else f"{row['ratio']:.2f}"
        lines.append(f"| {row['what']} | {f(row['poolserve'])} | {f(row['mlserver'])} | "
                     f"{ratio} | {row['target']}{verdict} |")  # fmt: skip
    return "\n".join(lines)
