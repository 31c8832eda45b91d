"""`make bench`: poolserve against MLServer, KServe and a bare grpc.aio server, side by side.

  python bench/run.py --mode full    # make bench: 3 runs per cell (37 min on 2 cores, Dec 1,
                                     # before the REST part, which adds about 9 min)
  python bench/run.py --mode quick   # make bench-quick: 1 run per cell, shorter
  python bench/run.py --render       # rewrite latest.md, latest.png, docs/performance.md
  python bench/run.py --only overload --servers poolserve --repeat 3
                                     # the overload part alone (mode's duration), never published
  python bench/run.py --only batching  # the batching part alone (bench/batching.py)
  python bench/run.py --only large --repeat 3
                                     # the large-tensor echo alone (issue 20), never published
  python bench/run.py --only ensemble [--repeat 3]
                                     # ensembles alone (issue 44, bench/ensemble.py); unpublished
  python bench/run.py --only cache   # the response-cache part alone (issue 44), never published
  python bench/run.py --mode quick --only rest [--publish]
                                     # the REST part alone (issue 29; bench/rest.py); --publish
                                     # puts it into latest.json/md and docs/performance.md

Phases: install the peers (once, under bench/.peers); calibrate ``burn``;
start every server with the same models; perf_analyzer rounds with the
servers interleaved; overload; large tensors (full mode); REST (bench/rest.py:
perf_analyzer -i http on every server's REST port); memory; then results in bench/results
(JSON, Markdown, PNG) and, for a full run, the generated section of
docs/performance.md. Every process
it starts is stopped by PID, whatever happens.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import platform
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from importlib import metadata
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH / "peers"))

import batching  # noqa: E402
import cache as cache_part  # noqa: E402
import decoupled  # noqa: E402
import ensemble as ensemble_part  # noqa: E402
import fleet as fleet_part  # noqa: E402
import install  # noqa: E402
import large_tensors  # noqa: E402
import mlserver_dropin  # noqa: E402
import perf  # noqa: E402
import report  # noqa: E402
import rest  # noqa: E402
import servers  # noqa: E402
import workload  # noqa: E402

report.PARTS.append(large_tensors)  # its targets and its section in the report
report.PARTS.append(rest)  # the REST part (issue 29)
report.PARTS.append(fleet_part)  # the router fleet (issue 31)
report.PARTS.append(ensemble_part)  # ensembles (issue 44)
report.PARTS.append(cache_part)  # the response cache (issue 44)

ROOT = BENCH.parent
RESULTS = BENCH / "results"
WORK = install.PEERS / "work"
CLIENT = BENCH / "client.py"
DEADLINE_S = 0.2
OVERLOAD_FACTOR = 2.0
CAPACITY_PROBE_S = 8.0  # closed loop, c16, the bench's client: measured over the second half
OVERLOAD_RETRIES = 2  # an overload measured again when other processes loaded the machine
OVERLOAD_SEGMENTS = 4  # overload in segments between capacity probes: the host drifts


@dataclass(frozen=True)
class Mode:
    name: str
    runs: int
    window_ms: int
    overload_s: float
    overload_servers: tuple[str, ...]
    memory_c_peer: bool  # also MLServer with the 400 MiB model (information, no target)
    publish: bool  # write latest.* and docs/performance.md's section
    quiet_wait_s: float  # how long to wait for the machine to calm down before measuring
    retries: int  # cells re-measured because other processes loaded the machine (whole run)
    large: bool = False  # the large-tensor echo (issue 20; bench/large_tensors.py)


MODES = {
    "full": Mode(
        "full", 3, 1500, 20.0, tuple(s.key for s in servers.SERVERS), True, True, 30, 10, large=True
    ),
    "quick": Mode("quick", 1, 1000, 8.0, (servers.SUBJECT,), False, False, 10, 2),
}
NOISY_CORES = 0.35  # a cell during which other processes used more than this is measured again
QUIET_CORES = 0.25


def log(message: str) -> None:
    print(f"bench: {message}", file=sys.stderr, flush=True)


class Stopped(Exception):
    """SIGTERM or SIGHUP: unwind so that every server is stopped."""


def _raise_stopped(signum: int, _: Any) -> None:
    raise Stopped(f"signal {signum}")


# -- servers ----------------------------------------------------------------------


class Fleet:
    """Every server this run started, so that each is stopped whatever happens."""

    def __init__(self, run_dir: Path, venvs: dict[str, Path], load: servers.Workload) -> None:
        self.run_dir = run_dir
        self.venvs = venvs
        self.workload = load
        self.running: list[servers.Running] = []

    def missing(self, key: str) -> str:
        """Why server ``key`` cannot run here ("" if it can)."""
        venv = servers.spec(key).venv
        return f"its peer ({venv}) is not installed here" if venv and venv not in self.venvs else ""

    def start(self, spec: servers.ServerSpec, layout: servers.Layout, tag: str) -> servers.Running:
        workdir = self.run_dir / f"{tag}-{spec.key}"
        load = replace(self.workload, counter=workdir / "burn.count")
        ctx = servers.Context(workdir, servers.free_port(), load, layout, self.venvs,
                              servers.free_port())  # fmt: skip
        server = servers.start(spec, ctx)
        self.running.append(server)
        return server

    def wait_ready(self, server: servers.Running, warm: int = 3) -> None:
        servers.wait_line(server, timeout=120)
        done = client("ready", server.address, "--models", ",".join(server.layout.models),
                      "--timeout", "120", "--warm", str(warm), timeout=300)  # fmt: skip
        if not done.get("ready"):
            tail = server.log.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"{server.spec.key} never became ready: {done}\n{tail}")
        server.tree()

    def stop(self, server: servers.Running) -> None:
        servers.stop(server)
        if server in self.running:
            self.running.remove(server)

    def stop_all(self) -> None:
        for server in list(self.running):
            try:
                self.stop(server)
            except Exception as exc:  # keep stopping the others
                log(f"stopping {server.spec.key}: {exc}")


def client(*args: str, timeout: float) -> dict[str, Any]:
    argv = [sys.executable, str(CLIENT), *args]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    lines = done.stdout.strip().splitlines()
    if not lines:
        raise RuntimeError(f"client {args[0]} failed: {done.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(lines[-1])
    return result


@contextmanager
def phase(name: str, timings: dict[str, float]) -> Iterator[None]:
    began = time.monotonic()
    log(f"{name} ...")
    try:
        yield
    finally:
        timings[name] = round(time.monotonic() - began, 1)
        log(f"{name}: {timings[name]} s")


# -- the machine's own load ------------------------------------------------------------


def outside_load(seconds: float, fleet: Sequence[servers.Running] = ()) -> float:
    """Cores used by processes other than the bench and its servers over ``seconds``."""
    busy, own, ours = servers.machine_busy_seconds(), own_cpu_seconds(), sum(s.cpu() for s in fleet)
    time.sleep(seconds)
    spent = (own_cpu_seconds() - own) + (sum(s.cpu() for s in fleet) - ours)
    return max(0.0, servers.machine_busy_seconds() - busy - spent) / seconds


def wait_for_quiet(limit_s: float) -> float:
    """Waits (up to ``limit_s``) until other processes leave the cores alone; returns their load."""
    end = time.monotonic() + limit_s
    load = outside_load(2.0)
    while load > QUIET_CORES and time.monotonic() < end:
        log(f"other processes use {load:.2f} cores: waiting for a quieter machine")
        load = outside_load(2.0)
    if load > QUIET_CORES:
        log(f"WARNING: measuring while other processes use {load:.2f} cores")
    return load


# -- calibration -------------------------------------------------------------------------


def train_xgb(path: Path) -> Path:
    """The run's XGBoost model file, trained in a process of its own (the project's venv)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    code = f"import workload; workload.train_xgb({str(path)!r})"
    env = {**os.environ, "PYTHONPATH": str(BENCH / "peers")}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=600)
    return path


def calibrate() -> dict[str, float]:
    """Iterations for ~20 ms of CPU, and the CPU of one burn alone and with every core busy."""
    iterations = workload.calibrate()
    solo = workload.measure(iterations)
    cores = os.cpu_count() or 1
    code = f"import workload; print(workload.measure({iterations}))"
    env = {**os.environ, "PYTHONPATH": str(BENCH / "peers")}
    procs = [
        subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
        for _ in range(cores)
    ]
    try:
        busy = [float(p.communicate(timeout=120)[0]) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    per_request = max(solo, sum(busy) / len(busy))
    return {
        "iterations": iterations,
        "burn_cpu_solo_ms": solo * 1000,
        "burn_cpu_ms": per_request * 1000,
        "physical_limit": cores / per_request,
    }


# -- perf_analyzer rounds ---------------------------------------------------------------------


def own_cpu_seconds() -> float:
    """CPU of this process and of its reaped children (perf_analyzer, client.py)."""
    me, kids = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


@dataclass(frozen=True)
class CpuSnapshot:
    """Where the machine's CPU went, read before and after one cell."""

    at: float
    busy: float
    own: float
    fleet: float
    measured: dict[int, tuple[str, float]]

    @staticmethod
    def take(fleet: Sequence[servers.Running], measured: servers.Running) -> CpuSnapshot:
        return CpuSnapshot(
            time.monotonic(),
            servers.machine_busy_seconds(),
            own_cpu_seconds(),
            sum(s.cpu() for s in fleet),
            measured.cpu_by_process(),
        )


def cpu_record(before: CpuSnapshot, after: CpuSnapshot) -> dict[str, Any]:
    """The measured server's CPU by process name, and the load from outside the bench."""
    wall = after.at - before.at
    by_name: dict[str, float] = {}
    for pid, (name, cpu) in after.measured.items():
        spent = cpu - before.measured.get(pid, (name, 0.0))[1]
        by_name[name] = by_name.get(name, 0.0) + spent
    bench = (after.own - before.own) + (after.fleet - before.fleet)
    return {
        "wall_s": round(wall, 3),
        "cpu_s": round(sum(by_name.values()), 3),
        "cpu_by_process": {k: round(v, 3) for k, v in sorted(by_name.items())},
        "foreign_cores": round(max(0.0, (after.busy - before.busy) - bench) / wall, 3),
    }


def measure_cell(
    server: servers.Running,
    running: Sequence[servers.Running],
    model: str,
    concurrency: int,
    mode: Mode,
    pa: install.PerfAnalyzer,
    env: dict[str, str],
    csv_path: Path,
    timeout: float,
    window_ms: int | None = None,
    shape: str | None = None,
    extra: Sequence[str] = (),
    protocol: str = "grpc",
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    address = server.http_address if protocol == "http" else server.address
    counter = server.workdir / "burn.count"
    offset = workload.counter_offset(counter)
    before = CpuSnapshot.take(running, server)
    try:
        if server.process.poll() is not None:
            raise RuntimeError("server exited")
        result = perf.run(pa.binary, env, address, model, concurrency,
                          window_ms or mode.window_ms, csv_path, timeout, shape, extra,
                          protocol)  # fmt: skip
        out["result"] = result.to_json()
        out["shown"] = f"{result.throughput:8.1f}/s p99 {result.p99_us / 1000:7.1f} ms"
    except RuntimeError as exc:
        out["error"] = str(exc)
        out["shown"] = f"ERROR {exc}"
    out["cpu"] = cpu_record(before, CpuSnapshot.take(running, server))
    if model == "burn":  # perf_analyzer waits for every reply: the records are complete
        records = workload.read_records(counter, offset, workload.counter_offset(counter))
        out["cpu"]["executions"] = len(records)
        if records:
            out["cpu"]["model_cpu_ms"] = round(statistics.median(records) / 1e6, 3)
    return out


def perf_rounds(
    mode: Mode, running: Sequence[servers.Running], pa: install.PerfAnalyzer, run_dir: Path
) -> list[dict[str, Any]]:
    runs: list[dict[str, Any]] = []
    env = {**os.environ, **pa.env}
    timeout = 10 * mode.window_ms / 1000 + 30
    served = sum(1 for s in running for m in report.ROUND_MODELS if m in s.layout.models)
    total = mode.runs * len(report.CONCURRENCIES) * served
    retries_left = mode.retries
    for r in range(mode.runs):
        order = list(running[r % len(running) :]) + list(running[: r % len(running)])
        for model in report.ROUND_MODELS:
            for c in report.CONCURRENCIES:
                for server in order:  # innermost: the servers meet the same drift
                    if model not in server.layout.models:
                        continue
                    record: dict[str, Any] = {"round": r, "server": server.spec.key,
                                              "model": model, "concurrency": c}  # fmt: skip
                    csv_path = run_dir / "perf" / f"r{r}-{server.spec.key}-{model}-c{c}.csv"
                    csv_path.parent.mkdir(exist_ok=True)
                    attempts: list[dict[str, Any]] = []
                    while True:
                        attempts.append(measure_cell(server, running, model, c, mode, pa, env,
                                                     csv_path, timeout))  # fmt: skip
                        noisy = attempts[-1]["cpu"]["foreign_cores"] > NOISY_CORES
                        if not noisy or retries_left <= 0 or "error" in attempts[-1]:
                            break
                        retries_left -= 1
                        log(f"  other processes used {attempts[-1]['cpu']['foreign_cores']:.2f} "
                            "cores: measuring this cell again")  # fmt: skip
                    best = min(attempts, key=lambda a: float(a["cpu"]["foreign_cores"]))
                    record.update(best, attempts=len(attempts))
                    runs.append(record)
                    log(f"[{len(runs)}/{total}] round {r + 1} {model} c{c} "
                        f"{server.spec.key:<16} {best['shown']}  "
                        f"(other load {record['cpu']['foreign_cores']:.2f} cores)")  # fmt: skip
                    del record["shown"]
                    (run_dir / "runs.json").write_text(json.dumps(runs, indent=1))
    return runs


# -- overload -----------------------------------------------------------------------------


def settle(path: Path, quiet_s: float = 1.0, limit_s: float = 25.0) -> int:
    """The counter's offset once it has not moved for ``quiet_s`` (late executions included)."""
    end = time.monotonic() + limit_s
    last, since = workload.counter_offset(path), time.monotonic()
    while time.monotonic() < end:
        time.sleep(0.25)
        now = workload.counter_offset(path)
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            break
    return last


def closed_capacity(server: servers.Running) -> float:
    """Burn throughput at concurrency 16 from the bench's own client, right now."""
    done = client("closed", server.address, "--model", "burn", "--concurrency", "16",
                  "--duration", str(CAPACITY_PROBE_S), timeout=CAPACITY_PROBE_S + 120)  # fmt: skip
    return float(done["throughput"])


def overload(
    server: servers.Running,
    seconds: float,
    calibration: dict[str, float],
    reference: float | None = None,
    retries: int = 0,
) -> dict[str, Any]:
    """2x overload, measured again (up to ``retries`` times) when other processes loaded
    the machine meanwhile; the attempt with the least outside load is kept."""
    attempts = [overload_once(server, seconds, calibration, reference)]
    while attempts[-1]["foreign_cores"] > NOISY_CORES and len(attempts) <= retries:
        log(f"  other processes used {attempts[-1]['foreign_cores']:.2f} cores during the "
            "overload: measuring it again")  # fmt: skip
        attempts.append(overload_once(server, seconds, calibration, reference))
    best = min(attempts, key=lambda a: float(a["foreign_cores"]))
    return {**best, "attempts": len(attempts)}


def overload_once(
    server: servers.Running,
    seconds: float,
    calibration: dict[str, float],
    reference: float | None,
) -> dict[str, Any]:
    """Open-loop burn at 2x capacity with a 200 ms deadline, in segments.

    Capacity is the burn throughput of the same client, closed loop at
    concurrency 16, measured before, between and after the overload's
    segments (their mean): on a shared host the cores left to the server
    drift within seconds, so a capacity from another moment (or from another
    client) measures the drift, not the server. Goodput is over the sending
    time plus one deadline per segment (replies still come then), and counts
    OK statuses:
    gRPC ends a call at its deadline, so an OK arrived in time; the client's
    own clock, which also counts its event loop's lag, is kept beside it
    (ok_in_deadline).
    """
    counter = server.workdir / "burn.count"
    probes = [closed_capacity(server)]
    busy, own, began = servers.machine_busy_seconds(), own_cpu_seconds(), time.monotonic()
    server_began = server.cpu()
    stats_before = client("stats", server.address, "--model", "burn", timeout=30)
    segments: list[dict[str, Any]] = []
    records: list[int] = []
    cpu = 0.0
    for _ in range(OVERLOAD_SEGMENTS):
        rate = OVERLOAD_FACTOR * probes[-1]
        before, cpu_before = settle(counter), server.cpu()
        segments.append(
            client(
                "overload",
                server.address,
                "--model",
                "burn",
                "--rate",
                f"{rate:.3f}",
                "--duration",
                str(seconds / OVERLOAD_SEGMENTS),
                "--deadline",
                str(DEADLINE_S),
                timeout=seconds + 120,
            )
        )
        records += workload.read_records(counter, before, settle(counter))
        cpu += server.cpu() - cpu_before
        probes.append(closed_capacity(server))
    stats_after = client("stats", server.address, "--model", "burn", timeout=30)
    wall = time.monotonic() - began
    spent = (own_cpu_seconds() - own) + (server.cpu() - server_began)
    foreign = max(0.0, servers.machine_busy_seconds() - busy - spent) / wall
    capacity = statistics.mean(probes)
    codes: dict[str, int] = {}
    for segment in segments:
        for code, n in segment["codes"].items():
            codes[code] = codes.get(code, 0) + n
    ok = codes.get("OK", 0)
    ok_clock = sum(int(segment["ok_in_deadline"]) for segment in segments)
    sending = sum(float(segment["send_s"]) for segment in segments) or seconds
    offered = sum(int(segment["sent"]) for segment in segments) / sending
    # a segment's replies keep coming for one deadline after its last send: count that time
    duration = sending + len(segments) * DEADLINE_S
    executions = len(records)
    abandoned = max(0, executions - ok)
    success = [
        a["success_count"] - b["success_count"]
        for a, b in zip(stats_after["stats"], stats_before["stats"], strict=False)
    ]
    return {
        "sent": sum(int(segment["sent"]) for segment in segments),
        "codes": codes,
        "ok": ok,
        "ok_in_deadline": ok_clock,
        "ok_p99_ms": max(float(segment["ok_p99_ms"]) for segment in segments),
        "max_send_lag_s": max(float(segment["max_send_lag_s"]) for segment in segments),
        "segments": len(segments),
        "capacity": capacity,
        "capacity_probes": probes,
        "capacity_before": probes[0],
        "capacity_after": probes[-1],
        "capacity_perf_analyzer": reference,
        "offered_rate": offered,
        "duration_s": duration,
        "send_s": sending,
        "deadline_s": DEADLINE_S,
        "goodput_per_s": ok / duration,
        "goodput_ratio": ok / duration / capacity,
        "goodput_ratio_client_clock": ok_clock / duration / capacity,
        "executions": executions,
        "abandoned_executions": abandoned,
        "abandoned_fraction": abandoned / executions if executions else None,
        "foreign_cores": round(foreign, 3),
        "burn_cpu_ms": calibration["burn_cpu_ms"],
        "physical_limit": calibration["physical_limit"],
        "server_cpu_s": cpu,
        "model_cpu_s": sum(records) / 1e9,
        "model_cpu_ms": statistics.median(records) / 1e6 if records else None,
        "server_stats_success": success[0] if success else None,
    }


def overload_phase(
    mode: Mode,
    results: dict[str, Any],
    running: Sequence[servers.Running],
    calibration: dict[str, float],
    repeat: int = 1,
) -> dict[str, Any]:
    """The overload of every server of the mode that serves burn; with ``repeat`` > 1
    (overload only), each server's runs are kept under ``repeats``."""
    overloads: dict[str, Any] = {}
    for server in running:
        if server.spec.key not in mode.overload_servers or "burn" not in server.layout.models:
            continue
        reference = report.capacity(results, server.spec.key)
        runs = []
        for _ in range(repeat):
            wait_for_quiet(mode.quiet_wait_s)
            o = overload(server, mode.overload_s, calibration, reference,
                         min(mode.retries, OVERLOAD_RETRIES))  # fmt: skip
            runs.append(o)
            log(f"overload {server.spec.key}: goodput {o['goodput_ratio']:.2f} x capacity "
                f"({o['capacity']:.1f}/s), {o['abandoned_executions']}/{o['executions']} "
                f"executions for callers gone; burn {calibration['burn_cpu_ms']:.1f} ms CPU on "
                f"this host, other processes {o['foreign_cores']:.2f} cores")  # fmt: skip
        overloads[server.spec.key] = {**runs[-1], "repeats": runs} if repeat > 1 else runs[0]
    return overloads


def overload_only(mode: Mode, only: Sequence[str], repeat: int) -> dict[str, Any]:
    """Calibration, the servers, and their overload runs: no perf_analyzer, no memory."""
    chosen = [s for s in servers.SERVERS if (not only or s.key in only) and "burn" in s.models]
    venvs = {
        name: install.ensure_venv(install.PEER_VENVS[name]())
        for name in sorted({s.venv for s in chosen if s.venv})
    }
    run_dir = WORK / datetime.datetime.now().strftime("overload-%Y%m%d-%H%M%S")
    run_dir.mkdir(parents=True)
    wait_for_quiet(mode.quiet_wait_s)
    calibration = calibrate()
    log(f"burn: {calibration['iterations']:.0f} iterations, {calibration['burn_cpu_ms']:.2f} ms "
        f"CPU on this host; physical limit {calibration['physical_limit']:.1f}/s")  # fmt: skip
    load = servers.Workload(int(calibration["iterations"]), run_dir / "burn.count")
    fleet = Fleet(run_dir, venvs, load)
    results: dict[str, Any] = {
        "meta": {
            "mode": f"{mode.name}, overload only",
            "cores": os.cpu_count(),
            "cpu": cpu_model(),
            **calibration,
            "overload_s": mode.overload_s,
            "work_dir": str(run_dir),
        },
        "servers": [{"key": s.key, "label": s.label} for s in chosen],
    }
    overload_mode = replace(mode, overload_servers=tuple(s.key for s in chosen))
    try:
        running = [fleet.start(s, servers.Layout(s.models), "overload") for s in chosen]
        for server in running:
            fleet.wait_ready(server)
        results["overload"] = overload_phase(overload_mode, results, running, calibration, repeat)
    finally:
        fleet.stop_all()
    (run_dir / "overload.json").write_text(json.dumps(results, indent=1) + "\n")
    log(f"wrote {run_dir / 'overload.json'}")
    return results


def dropin_only(mode: Mode) -> dict[str, Any]:
    """Calibration and bench/mlserver_dropin.py's phase alone (never published)."""
    installed = install.ensure_all([install.PEER_VENVS["mlserver"]()])
    run_dir = WORK / datetime.datetime.now().strftime("dropin-%Y%m%d-%H%M%S")
    run_dir.mkdir(parents=True)
    wait_for_quiet(mode.quiet_wait_s)
    calibration = calibrate()
    load = servers.Workload(int(calibration["iterations"]), run_dir / "burn.count")
    fleet = Fleet(run_dir, installed.venvs, load)
    try:
        data = mlserver_dropin.measure(fleet, mode, installed.perf_analyzer, run_dir, measure_cell)
    finally:
        fleet.stop_all()
    (run_dir / "dropin.json").write_text(json.dumps({**calibration, **data}, indent=1) + "\n")
    log(f"wrote {run_dir / 'dropin.json'}")
    return data


def batching_only(mode: Mode) -> str:
    """The batching part alone: its four servers, perf_analyzer, the checks; markdown."""
    installed = install.ensure_all([install.PEER_VENVS["mlserver"]()])
    run_dir = WORK / datetime.datetime.now().strftime("batching-%Y%m%d-%H%M%S")
    run_dir.mkdir(parents=True)
    wait_for_quiet(mode.quiet_wait_s)
    fleet = Fleet(run_dir, installed.venvs, servers.Workload(0, run_dir / "burn.count"))
    try:
        found = batching.run_phase(fleet, installed.perf_analyzer, mode.runs, mode.window_ms,
                                   run_dir, log)  # fmt: skip
    finally:
        fleet.stop_all()
    (run_dir / "batching.json").write_text(json.dumps(found, indent=1) + "\n")
    log(f"wrote {run_dir / 'batching.json'}")
    return batching.markdown(found)


# -- large tensors -----------------------------------------------------------------------------


def large_phase(
    fleet: Fleet, mode: Mode, pa: install.PerfAnalyzer, run_dir: Path, runs: int
) -> dict[str, Any]:
    """bench/large_tensors.py's echo on servers of its own (tensor shape [-1,3,224,224])."""
    layout = servers.Layout(("echo",), shape=large_tensors.DIMS)
    started: list[servers.Running] = []

    def start(key: str) -> servers.Running:
        server = fleet.start(servers.spec(key), layout, "large")
        started.append(server)
        fleet.wait_ready(server, warm=0)  # client.py's warm-up tensor does not fit the shape
        return server

    env = {**os.environ, **pa.env}
    timeout = 10 * large_tensors.WINDOW_MS / 1000 + 60
    measure = functools.partial(measure_cell, mode=mode, pa=pa, env=env, timeout=timeout)
    try:
        large = large_tensors.phase(start, measure, run_dir, runs, log)
    finally:
        for server in started:
            fleet.stop(server)
    large["cells"] = large_tensors.cells(large)
    return large


def large_only(mode: Mode, runs: int) -> dict[str, Any]:
    """The large-tensor echo alone (`--only large`): never published."""
    keys = set(large_tensors.SERVERS)
    needed = sorted({s.venv for s in servers.SERVERS if s.key in keys and s.venv})
    installed = install.ensure_all([install.PEER_VENVS[name]() for name in needed])
    run_dir = WORK / datetime.datetime.now().strftime("large-%Y%m%d-%H%M%S")
    run_dir.mkdir(parents=True)
    quiet = wait_for_quiet(mode.quiet_wait_s)
    fleet = Fleet(run_dir, installed.venvs, servers.Workload(1, run_dir / "burn.count"))
    try:
        large = large_phase(fleet, mode, installed.perf_analyzer, run_dir, runs)
    finally:
        fleet.stop_all()
    results = {"meta": {"outside_load_at_start_cores": quiet, "work_dir": str(run_dir)},
               "large": large}  # fmt: skip
    (run_dir / "large-results.json").write_text(json.dumps(results, indent=1) + "\n")
    log(f"wrote {run_dir / 'large-results.json'}")
    return results


# -- REST -------------------------------------------------------------------------------------


def rest_phase(
    fleet: Fleet, mode: Mode, installed: install.Installed, run_dir: Path, runs: int
) -> dict[str, Any]:
    """bench/rest.py's part: perf_analyzer -i http on each server's REST port."""
    pa = installed.perf_analyzer

    def start(key: str, models: tuple[str, ...], shape: tuple[int, ...] | None) -> Any:
        spec = servers.spec(key)
        tag = "rest-large" if shape else "rest"
        server = fleet.start(spec, servers.Layout(models, shape=shape), tag)
        try:
            if key == rest.FLOOR:  # REST only: no gRPC port to ask
                servers.wait_line(server, timeout=60)
            else:  # the large echo's [-1,3,224,224] refuses client.py's warm-up tensor
                fleet.wait_ready(server, warm=0 if shape else 3)
            rest.wait_rest_ready(server.http_address, models)
        except Exception:
            fleet.stop(server)
            raise
        return server

    env = {**os.environ, **pa.env}
    timeout = 10 * max(mode.window_ms, rest.LARGE_WINDOW_MS) / 1000 + 60
    measure = functools.partial(measure_cell, mode=mode, pa=pa, env=env, timeout=timeout)
    found = rest.phase(start, fleet.stop, measure, run_dir, runs, log, fleet.missing)
    found.update(
        when=datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        mode=mode.name,
        window_ms=mode.window_ms,
    )
    return found


def _starter(fleet: Fleet, models: tuple[str, ...], tag: str) -> Any:
    """``start(key)`` for a part's servers: started with ``models``, stopped if not ready."""

    def start(key: str) -> Any:
        server = fleet.start(servers.spec(key), servers.Layout(models), tag)
        try:
            fleet.wait_ready(server)
        except Exception:
            fleet.stop(server)
            raise
        return server

    return start


def _measurer(mode: Mode, installed: install.Installed) -> Any:
    """``measure_cell`` with the mode's perf_analyzer settings, for a part's cells."""
    pa = installed.perf_analyzer
    env = {**os.environ, **pa.env}
    timeout = 10 * mode.window_ms / 1000 + 30
    return functools.partial(measure_cell, mode=mode, pa=pa, env=env, timeout=timeout)


def _stamped(found: dict[str, Any], mode: Mode) -> dict[str, Any]:
    found.update(
        when=datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        mode=mode.name,
        window_ms=mode.window_ms,
    )
    return found


def fleet_phase(fleet: Fleet, mode: Mode, installed: install.Installed, run_dir: Path,
                runs: int) -> dict[str, Any]:  # fmt: skip
    """bench/fleet.py's part: echo c16 with routers 1 and 2, and KServe's one process."""
    start, measure = _starter(fleet, ("echo",), "fleet"), _measurer(mode, installed)
    found = fleet_part.phase(start, fleet.stop, measure, run_dir, runs, log, fleet.missing)
    return _stamped(found, mode)


def cache_phase(fleet: Fleet, mode: Mode, installed: install.Installed, run_dir: Path,
                runs: int) -> dict[str, Any]:  # fmt: skip
    """bench/cache.py's part: echo c16 computed, and from the response cache."""
    start, measure = _starter(fleet, cache_part.MODELS, "cache"), _measurer(mode, installed)
    return _stamped(cache_part.phase(start, fleet.stop, measure, run_dir, runs, log), mode)


def part_alone(name: str, keys: Sequence[str], phase_of: Any, mode: Mode,
               runs: int) -> dict[str, Any]:  # fmt: skip
    """One part alone (`--only fleet`, `--only cache`), in a run folder of its own;
    never published."""
    installed = installed_peers(keys)
    run_dir = WORK / datetime.datetime.now().strftime(f"{name}-%Y%m%d-%H%M%S")
    run_dir.mkdir(parents=True)
    quiet = wait_for_quiet(mode.quiet_wait_s)
    load = servers.Workload(1, run_dir / "burn.count")
    fleet = Fleet(run_dir, installed.venvs, load)
    try:
        found: dict[str, Any] = phase_of(fleet, mode, installed, run_dir, runs)
    finally:
        fleet.stop_all()
    found["outside_load_at_start_cores"] = round(quiet, 3)
    (run_dir / f"{name}-results.json").write_text(json.dumps(found, indent=1) + "\n")
    log(f"wrote {run_dir / f'{name}-results.json'}")
    return found


def installed_peers(keys: Sequence[str]) -> install.Installed:
    """The peers' environments these servers need; one that fails to install is left out
    (its servers are then skipped with the reason), not a failure of the run."""
    needed = sorted({s.venv for s in servers.SERVERS if s.key in keys and s.venv})
    specs = []
    for name in needed:
        try:
            install.ensure_all([install.PEER_VENVS[name]()])
            specs.append(install.PEER_VENVS[name]())
        except Exception as exc:
            log(f"peer {name} could not be installed: {exc}")
    return install.ensure_all(specs)


def rest_only(mode: Mode, runs: int, publish_results: bool) -> dict[str, Any]:
    """The REST part alone (`--only rest`); with --publish its section replaces the REST part
    of bench/results/latest.json, and latest.md and docs/performance.md are rendered again."""
    installed = installed_peers(rest.SERVERS)
    run_dir = WORK / datetime.datetime.now().strftime("rest-%Y%m%d-%H%M%S")
    run_dir.mkdir(parents=True)
    quiet = wait_for_quiet(mode.quiet_wait_s)
    xgb_model = train_xgb(run_dir / "xgb" / "model.json")
    load = servers.Workload(1, run_dir / "burn.count", xgb_model=xgb_model)
    fleet = Fleet(run_dir, installed.venvs, load)
    try:
        found = rest_phase(fleet, mode, installed, run_dir, runs)
    finally:
        fleet.stop_all()
    found["outside_load_at_start_cores"] = round(quiet, 3)
    results: dict[str, Any] = {"meta": {"work_dir": str(run_dir), "mode": mode.name},
                               "rest": found}  # fmt: skip
    (run_dir / "rest-results.json").write_text(json.dumps(results, indent=1) + "\n")
    log(f"wrote {run_dir / 'rest-results.json'}")
    if publish_results and (RESULTS / "latest.json").exists():
        merged = json.loads((RESULTS / "latest.json").read_text())
        merged["rest"] = found
        merged["meta"].setdefault("versions", {}).update(
            versions(installed.venvs, installed.perf_analyzer)
        )
        publish(report.summarize(merged), installed.tools_python, RESULTS, docs=True)
    return results


# -- memory ---------------------------------------------------------------------------------


def memory_configs(mode: Mode, chosen: Sequence[str]) -> list[tuple[str, str, servers.Layout]]:
    """KServe in (a) only: one process holds every model, with no pools, gids or workers, so
    (b) and (c) would measure the same process again."""
    both = servers.BOTH
    xgb = servers.Layout((report.XGB,))
    configs = [
        ("a", servers.SUBJECT, servers.Layout(both)),
        ("a", servers.REFERENCE, servers.Layout(both)),
        ("a", servers.KSERVE, servers.Layout(both)),
        ("b", servers.SUBJECT, servers.Layout(both, separate_gids=True)),
        ("b", servers.REFERENCE, servers.Layout(both, separate_gids=True)),
        ("c", servers.SUBJECT, servers.Layout(("big",), workers=4)),
        ("x", servers.SUBJECT, xgb),
        ("x", servers.REFERENCE, xgb),
    ]
    if mode.memory_c_peer:
        configs.append(("c", servers.REFERENCE, servers.Layout(("big",), workers=4)))
    return [c for c in configs if c[1] in chosen]


def measure_memory(fleet: Fleet, mode: Mode, chosen: Sequence[str]) -> dict[str, Any]:
    memory: dict[str, Any] = {"c": {"array_bytes": fleet.workload.array_mib * report.MIB}}
    for config, key, layout in memory_configs(mode, chosen):
        server = fleet.start(servers.spec(key), layout, f"mem-{config}")
        try:
            fleet.wait_ready(server, warm=10)
            time.sleep(1.0)  # let start-up garbage settle before reading smaps
            parts = server.pss_by_process()
            pss = sum(b for _, b in parts)
            memory.setdefault(config, {})[key] = {
                "pss_bytes": pss,
                "processes": len(parts),
                "by_process": [[name, b] for name, b in parts],
            }
            pids = parts
            log(f"memory ({config}) {key}: {pss / report.MIB:,.0f} MiB in {len(pids)} processes")
        finally:
            fleet.stop(server)
    return memory


# -- the run ----------------------------------------------------------------------------------


def versions(venvs: dict[str, Path], pa: install.PerfAnalyzer) -> dict[str, str]:
    found = {
        "python": platform.python_version(),
        "poolserve": metadata.version("poolserve"),
        "grpcio": metadata.version("grpcio"),
        "protobuf": metadata.version("protobuf"),
        "perf_analyzer": f"tritonclient {pa.version}",
    }
    if "mlserver" in venvs:
        found["MLServer"] = install.package_version(venvs["mlserver"], "mlserver")
        found["grpcio (MLServer venv)"] = install.package_version(venvs["mlserver"], "grpcio")
    if "kserve" in venvs:
        found["KServe"] = install.package_version(venvs["kserve"], "kserve")
        found["grpcio (KServe venv)"] = install.package_version(venvs["kserve"], "grpcio")
    return found


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "?"


def publish(results: dict[str, Any], tools_python: Path, out: Path, docs: bool) -> None:
    """latest.json, latest.md and latest.png in ``out``; docs/performance.md's section if asked."""
    out.mkdir(parents=True, exist_ok=True)
    json_path = out / "latest.json"
    json_path.write_text(json.dumps(results, indent=1) + "\n")
    (out / "latest.md").write_text(report.markdown(results))
    chart = subprocess.run(
        [str(tools_python), str(BENCH / "chart.py"), str(json_path), str(out / "latest.png")],
        capture_output=True,
        text=True,
    )
    if chart.returncode != 0:
        log(f"chart failed: {chart.stderr[-1500:]}")
    if docs:
        path = ROOT / report.DOCS_PAGE
        section = report.docs_section(results)
        path.write_text(report.update_section(path.read_text(), section))
    log(f"wrote {json_path.with_suffix('.*')}" + (f" and {report.DOCS_PAGE}" if docs else ""))


def run(mode: Mode, only: Sequence[str], publish_results: bool) -> dict[str, Any]:
    timings: dict[str, float] = {}
    began = time.monotonic()
    chosen = [s for s in servers.SERVERS if not only or s.key in only]
    with phase("install peers", timings):
        needed = sorted({s.venv for s in chosen if s.venv})
        installed = install.ensure_all([install.PEER_VENVS[name]() for name in needed])
    shutil.rmtree(WORK, ignore_errors=True)  # the previous run's logs and repositories
    run_dir = WORK / datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    run_dir.mkdir(parents=True)
    with phase("wait for a quiet machine", timings):
        quiet = wait_for_quiet(mode.quiet_wait_s)
    with phase("calibrate burn", timings):
        calibration = calibrate()
    log(f"burn: {calibration['iterations']:.0f} iterations, "
        f"{calibration['burn_cpu_ms']:.2f} ms CPU; physical limit "
        f"{calibration['physical_limit']:.1f}/s")  # fmt: skip
    with phase("train the XGBoost model", timings):
        xgb_model = train_xgb(run_dir / "xgb" / "model.json")
    load = servers.Workload(
        int(calibration["iterations"]), run_dir / "burn.count", xgb_model=xgb_model
    )
    fleet = Fleet(run_dir, installed.venvs, load)
    results: dict[str, Any] = {
        "meta": {
            "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "mode": mode.name,
            "command": "make bench" if mode.name == "full" else "make bench-quick",
            "cores": os.cpu_count(),
            "cpu": cpu_model(),
            "kernel": platform.release(),
            "versions": versions(installed.venvs, installed.perf_analyzer),
            **calibration,
            "runs": mode.runs,
            "window_ms": mode.window_ms,
            "overload_s": mode.overload_s,
            "outside_load_at_start_cores": round(quiet, 3),
            "timings_s": timings,
            "work_dir": str(run_dir),
        },
        "servers": [
            {
                "key": s.key,
                "label": s.label,
                "workers": s.workers,
                "models": list(s.models),
                "note": s.note,
            }
            for s in chosen
        ],
    }
    try:
        with phase("start servers", timings):
            running = [fleet.start(s, servers.Layout(s.models), "perf") for s in chosen]
            for server in running:
                fleet.wait_ready(server)
        with phase("perf_analyzer rounds", timings):
            results["runs"] = perf_rounds(mode, running, installed.perf_analyzer, run_dir)
        report.summarize(results)
        with phase("overload", timings):
            results["overload"] = overload_phase(mode, results, running, calibration)
        fleet.stop_all()
        if mode.large:
            with phase("large tensors", timings):
                results["large"] = large_phase(fleet, mode, installed.perf_analyzer, run_dir,
                                               mode.runs)  # fmt: skip
        with phase("rest", timings):
            results["rest"] = rest_phase(fleet, mode, installed, run_dir, mode.runs)
        with phase("router fleet", timings):
            results["fleet"] = fleet_phase(fleet, mode, installed, run_dir, mode.runs)
        with phase("response cache", timings):
            results["cache"] = cache_phase(fleet, mode, installed, run_dir, mode.runs)
        with phase("memory", timings):
            results["memory"] = measure_memory(fleet, mode, [s.key for s in chosen])
        if servers.REFERENCE in [s.key for s in chosen]:
            with phase("mlserver drop-in", timings):
                results["mlserver_dropin"] = mlserver_dropin.measure(
                    fleet, mode, installed.perf_analyzer, run_dir, measure_cell)  # fmt: skip
        if "mlserver" in installed.venvs:
            with phase("batching", timings):
                pa = installed.perf_analyzer
                results["batching"] = batching.run_phase(
                    fleet, pa, mode.runs, mode.window_ms, run_dir, log
                )
        with phase("decoupled", timings):
            results["decoupled"] = decoupled.measure()
        with phase("ensembles", timings):
            results["ensemble"] = ensemble_part.measure(rounds=mode.runs)
    finally:
        fleet.stop_all()
    timings["total"] = round(time.monotonic() - began, 1)
    report.summarize(results)
    out = RESULTS if publish_results else run_dir
    publish(results, installed.tools_python, out, docs=publish_results)
    return results


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--mode", choices=sorted(MODES), default="full")
    parser.add_argument("--servers", default="", help="comma-separated subset (debugging)")
    parser.add_argument(
        "--render", action="store_true", help="only re-render bench/results from latest.json"
    )
    parser.add_argument(
        "--only",
        choices=[
            "overload",
            "mlserver-dropin",
            "batching",
            "decoupled",
            "large",
            "rest",
            "fleet",
            "ensemble",
            "cache",
        ],
        help="run one part alone: overload (calibration, servers, overload), "
        "mlserver-dropin (bench/mlserver_dropin.py), batching (bench/batching.py), "
        "decoupled (bench/decoupled.py), large (the large-tensor echo, bench/large_tensors.py) "
        "rest (perf_analyzer -i http, bench/rest.py) or fleet (routers 1 and 2, echo c16, and "
        "the capacity table, bench/fleet.py), cache (echo c16 computed and from the "
        "response cache, bench/cache.py) or ensemble (two light steps against one call "
        "and against a client's own two calls, bench/ensemble.py); never published, except "
        "rest with "
        "--publish (its section replaces latest.json's REST part)",
    )
    parser.add_argument(
        "--repeat", type=int, default=None, help="with --only: runs each (rest: the mode's)"
    )
    parser.add_argument(
        "--publish",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="write bench/results/latest.* and docs/performance.md's section "
        "(default: full mode only)",
    )
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, _raise_stopped)
    signal.signal(signal.SIGHUP, _raise_stopped)
    only = [s for s in args.servers.split(",") if s]
    if args.render:
        results = report.summarize(json.loads((RESULTS / "latest.json").read_text()))
        publish(results, install.tools_venv().python, RESULTS, docs=True)
        print(report.console(results))
        return 0
    mode = MODES[args.mode]
    if args.only == "mlserver-dropin":
        print(dropin_only(mode)["table"])
        return 0
    if args.only == "overload":
        print(report.overload_console(overload_only(mode, only, max(1, args.repeat or 1))))
        return 0
    if args.only == "batching":
        print(batching_only(mode))
        return 0
    if args.only == "decoupled":
        print(decoupled.markdown(decoupled.measure()))
        return 0
    if args.only == "rest":
        print(rest.console(rest_only(mode, max(1, args.repeat or mode.runs), bool(args.publish))))
        return 0
    if args.only == "fleet":
        found = part_alone("fleet", fleet_part.SERVERS, fleet_phase, mode,
                           max(1, args.repeat or mode.runs))  # fmt: skip
        print(fleet_part.console(found))
        return 0
    if args.only == "cache":
        found = part_alone("cache", (), cache_phase, mode, max(1, args.repeat or mode.runs))
        print(cache_part.console(found))
        return 0
    if args.only == "ensemble":
        print(ensemble_part.section({"ensemble": ensemble_part.measure(rounds=args.repeat or 3)}))
        return 0
    if args.only == "large":
        print(large_tensors.console(large_only(mode, max(1, args.repeat or 1))))
        return 0
    publish_results = mode.publish if args.publish is None else args.publish
    results = run(mode, only, publish_results and not only)
    print(report.console(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
