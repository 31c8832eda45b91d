"""The batching part of `make bench` (issue 16): a vectorized scikit-learn model,
with and without adaptive batching, poolserve against MLServer.

Model: examples/models/boosted (a HistGradientBoostingClassifier on 20
synthetic features), trained once per run by its own train.py; FP32 [1, 20]
per request. Servers, 2 workers each: poolserve without batching; poolserve
with ``max_batch_size`` 32 and ``max_batch_time`` 0.002; MLServer 1.7.1 with
its own scikit-learn runtime (mlserver-sklearn) with the same batching
settings, and without (OMP_NUM_THREADS=1 and the like, as poolserve's workers
have by default). perf_analyzer at concurrency 1, 16 and 64, the servers
interleaved per cell. perf_analyzer checks no values, so each server then
gets a correctness pass: 64 concurrent callers, distinct random rows, every
reply's ``predict`` compared with the model scored locally. The model's own
cost (1 row against 32, in one process) is measured beside.

    .venv/bin/python bench/run.py --only batching [--mode quick]
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported where used: report.py loads this module by path, alone
    import install
    import servers

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
TRAIN = ROOT / "examples" / "models" / "boosted" / "train.py"
MODEL = "boosted"
CONCURRENCIES = (1, 16, 64)
BATCH = {"max_batch_size": 32, "max_batch_time": 0.002}
FEATURES = 20
CHECK_CALLS = 512  # per server, in the correctness pass
ONE_THREAD = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}

TARGETS = (
    # (what, numerator server, denominator server, concurrency, measure, bound, higher is better)
    ("c64 throughput, batched vs unbatched", "poolserve-batched", "poolserve", 64, "thr", 3.0,
     True),
    ("c64 throughput, batched vs MLServer batched", "poolserve-batched", "mlserver-batched", 64,
     "thr", 1.5, True),
    ("c1 p99, batched vs unbatched", "poolserve-batched", "poolserve", 1, "p99", 1.2, False),
)  # fmt: skip


def _settings(
    model_file: Path, implementation: str, batched: bool, shape: list[int]
) -> dict[str, Any]:
    return {
        "name": MODEL,
        "implementation": implementation,
        "parameters": {"uri": str(model_file)},
        "inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": shape}],
        "outputs": [{"name": "predict", "datatype": "INT64", "shape": [shape[0]]}],
        **(BATCH if batched else {}),
    }


def build_poolserve(model_file: Path, batched: bool, spec: servers.ServerSpec,
                    ctx: servers.Context) -> servers.Launch:  # fmt: skip
    """A batched model declares [-1, 20]: its ModelConfig (max_batch_size 32) has dims [20]."""
    import servers

    folder = ctx.workdir / "repo" / MODEL
    folder.mkdir(parents=True)
    shape = [-1, FEATURES] if batched else [1, FEATURES]
    implementation = "poolserve.service.runtimes.SKLearnModel"
    servers.write_json(folder / "model-settings.json",
                       _settings(model_file, implementation, batched, shape))  # fmt: skip
    run_dir = Path(os.environ.get("XDG_RUNTIME_DIR") or "/tmp") / f"psb-{os.getpid()}-{ctx.port}"
    argv = [str(servers.POOLSERVE), "serve", str(ctx.workdir / "repo")]
    argv += ["--grpc-port", str(ctx.port), "--run-dir", str(run_dir), "--workers", "2"]
    argv += ["--metrics-port", "0"]  # a free port: two poolserve servers run side by side
    argv += ["--http-port", str(ctx.http_port)]  # the same for the REST port (0: any free one)
    return servers.Launch(argv, ready_line="poolserve: ready", cleanup=(run_dir,))


def build_mlserver(model_file: Path, batched: bool, spec: servers.ServerSpec,
                   ctx: servers.Context) -> servers.Launch:  # fmt: skip
    import servers

    repo = ctx.workdir / "repo"
    (repo / MODEL).mkdir(parents=True)
    servers.write_json(repo / "settings.json", {
        "parallel_workers": 2, "host": "127.0.0.1", "grpc_port": ctx.port,
        "http_port": servers.free_port(), "metrics_port": servers.free_port(),
    })  # fmt: skip
    settings = _settings(model_file, "mlserver_sklearn.SKLearnModel", batched, [1, FEATURES])
    servers.write_json(repo / MODEL / "model-settings.json", settings)
    python = ctx.venvs[spec.venv]
    argv = [str(python), str(servers.PEER_CODE / "mlserver_addon.py"), "start", str(repo)]
    # one native thread per worker, as poolserve's workers have (threads_per_worker 1): the
    # model's OpenMP pool would otherwise start a thread per core in each worker
    env = {"PYTHONPATH": str(servers.PEER_CODE), **ONE_THREAD}
    return servers.Launch(argv, env=env)


def specs(model_file: Path) -> list[servers.ServerSpec]:
    import servers

    def spec(key: str, label: str, build: Callable[..., servers.Launch], batched: bool,
             venv: str = "") -> servers.ServerSpec:  # fmt: skip
        return servers.ServerSpec(key, label, 2, functools.partial(build, model_file, batched),
                                  venv, models=(MODEL,))  # fmt: skip

    return [
        spec("poolserve", "poolserve (2 workers)", build_poolserve, False),
        spec("poolserve-batched", "poolserve batched 32 / 2 ms", build_poolserve, True),
        spec("mlserver", "MLServer 1.7.1 sklearn (2 workers)", build_mlserver, False, "mlserver"),
        spec("mlserver-batched", "MLServer 1.7.1 sklearn batched 32 / 2 ms", build_mlserver,
             True, "mlserver"),
    ]  # fmt: skip


def train(run_dir: Path) -> Path:
    path = run_dir / MODEL / "model.joblib"
    path.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, str(TRAIN), str(path)], check=True, timeout=600,
                   capture_output=True)  # fmt: skip
    return path


def perf_cell(pa: install.PerfAnalyzer, address: str, concurrency: int, window_ms: int,
              csv_path: Path) -> dict[str, Any]:  # fmt: skip
    """One perf_analyzer cell; the shape comes from the model's config (no --shape)."""
    import perf

    argv = perf.command(pa.binary, address, MODEL, concurrency, window_ms, csv_path)
    at = argv.index("--shape")
    del argv[at : at + 2]
    csv_path.unlink(missing_ok=True)
    try:
        env = {**os.environ, **pa.env}
        limit = 10 * window_ms / 1000 + 60
        done = subprocess.run(argv, capture_output=True, text=True, timeout=limit, env=env)
    except subprocess.TimeoutExpired:
        return {"error": "perf_analyzer timed out"}
    out = done.stdout + done.stderr
    csv_path.with_suffix(".out").write_text(out)
    if done.returncode != 0 or not csv_path.exists():
        return {"error": f"perf_analyzer exit {done.returncode}: {perf.first_error(out)}"}
    return {"result": perf.parse(csv_path.read_text(), out).to_json()}


def check(address: str, model_file: Path) -> dict[str, Any]:
    """The correctness pass, in a process of its own (scikit-learn stays out of the bench)."""
    argv = [sys.executable, __file__, "check", address, str(model_file), str(CHECK_CALLS)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        return {"ok": 0, "wrong": 0, "errors": CHECK_CALLS, "why": done.stderr[-1000:]}
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def model_cost(model_file: Path) -> dict[str, float]:
    argv = [sys.executable, __file__, "cost", str(model_file)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    cost: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return cost


def run_phase(
    fleet: Any, pa: install.PerfAnalyzer, runs: int, window_ms: int, run_dir: Path,
    log: Callable[[str], None],
) -> dict[str, Any]:  # fmt: skip
    """Everything of the batching part; ``fleet`` is run.py's Fleet (start, wait_ready, stop)."""
    import servers

    model_file = train(run_dir)
    cost = model_cost(model_file)
    log(f"batching: model {MODEL}: 1 row {cost['one_ms']:.3f} ms, 32 rows {cost['batch_ms']:.3f} "
        f"ms ({cost['ratio']:.2f}x)")  # fmt: skip
    chosen = specs(model_file)
    cells: list[dict[str, Any]] = []
    checks: dict[str, Any] = {}
    stats: dict[str, Any] = {}
    running = []
    try:
        for spec in chosen:
            server = fleet.start(spec, servers.Layout((MODEL,)), "batching")
            running.append(server)
            fleet.wait_ready(server)
        for r in range(runs):
            for c in CONCURRENCIES:
                for server in running[r % len(running) :] + running[: r % len(running)]:
                    csv_path = run_dir / "batching" / f"r{r}-{server.spec.key}-c{c}.csv"
                    csv_path.parent.mkdir(parents=True, exist_ok=True)
                    cell = perf_cell(pa, server.address, c, window_ms, csv_path)
                    cells.append({"round": r, "server": server.spec.key, "concurrency": c, **cell})
                    shown = cell.get("error") or (
                        f"{cell['result']['throughput']:8.1f}/s "
                        f"p99 {cell['result']['p99_us'] / 1000:6.1f} ms"
                    )
                    log(f"batching round {r + 1} c{c} {server.spec.key:<18} {shown}")
        for server in running:
            checks[server.spec.key] = check(server.address, model_file)
            log(f"batching: correctness {server.spec.key}: {checks[server.spec.key]}")
        for server in running:
            if server.spec.key.startswith("poolserve"):
                stats[server.spec.key] = batch_stats(server.address)
    finally:
        for server in running:
            fleet.stop(server)
    return {
        "model_cost": cost,
        "servers": [{"key": s.key, "label": s.label} for s in chosen],
        "cells": cells,
        "checks": checks,
        "batch_stats": stats,
        "settings": BATCH,
    }


def batch_stats(address: str) -> dict[str, int]:
    argv = [sys.executable, __file__, "stats", address]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    lines = done.stdout.strip().splitlines()
    return {str(k): int(v) for k, v in json.loads(lines[-1]).items()} if lines else {}


# -- the summary ------------------------------------------------------------------------


def median(b: dict[str, Any], server: str, c: int, what: str) -> float | None:
    key = {"thr": "throughput", "p99": "p99_us"}[what]
    values = [
        float(cell["result"][key])
        for cell in b.get("cells", [])
        if cell["server"] == server and cell["concurrency"] == c and "result" in cell
    ]
    return statistics.median(values) if values else None


def targets(b: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for what, num, den, c, measure, bound, higher in TARGETS:
        a, z = median(b, num, c, measure), median(b, den, c, measure)
        value = a / z if a is not None and z else None
        met = value is not None and (value >= bound if higher else value <= bound)
        out.append({"what": what, "value": value, "bound": bound, "higher": higher, "met": met})
    checks = b.get("checks", {})
    correct = bool(checks) and all(
        v.get("ok") == CHECK_CALLS and not v.get("wrong") for v in checks.values()
    )
    out.append({"what": "every reply correct (all servers)", "value": None, "bound": None,
                "higher": True, "met": correct})  # fmt: skip
    cost = b.get("model_cost", {})
    out.append({"what": "model: 32 rows cost < 3x one row", "value": cost.get("ratio"),
                "bound": 3.0, "higher": False, "met": cost.get("ratio", 99) < 3.0})  # fmt: skip
    return out


def _fmt(value: float | None, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:,.{digits}f}"


def markdown(b: dict[str, Any]) -> str:
    """The batching tables (throughput and p99 per concurrency; targets; checks)."""
    if not b or not b.get("cells"):
        return ""
    labels = {s["key"]: s["label"] for s in b["servers"]}
    rows = []
    for key, label in labels.items():
        row = [label]
        for c in CONCURRENCIES:
            p99 = median(b, key, c, "p99")
            row.append(f"{_fmt(median(b, key, c, 'thr'))}/s, p99 "
                       f"{_fmt(None if p99 is None else p99 / 1000, 2)} ms")  # fmt: skip
        check_ = b["checks"].get(key, {})
        row.append(f"{check_.get('ok', 0)}/{CHECK_CALLS} correct")
        rows.append(row)
    lines = ["| server | c1 | c16 | c64 | values |", "|---|---|---|---|---|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    lines += ["", "| target | measured | bound | met |", "|---|---|---|---|"]
    for t in targets(b):
        sign = "&ge; " if t["higher"] else "&le; "
        bound = "" if t["bound"] is None else f"{sign}{t['bound']:g}"
        lines.append(f"| {t['what']} | {_fmt(t['value'], 2)} | {bound} | "
                     f"{'yes' if t['met'] else 'NO'} |")  # fmt: skip
    cost = b.get("model_cost", {})
    sizes = b.get("batch_stats", {}).get("poolserve-batched", {})
    lines += [
        "",
        f"Model `{MODEL}` (examples/models/boosted, HistGradientBoostingClassifier, 20 "
        f"features), one process, one thread: 1 row {_fmt(cost.get('one_ms'), 3)} ms, 32 rows "
        f"{_fmt(cost.get('batch_ms'), 3)} ms. FP32 [1, 20] per request, perf_analyzer, median "
        f"of the runs; settings max_batch_size 32, max_batch_time 0.002 s, 2 workers each. "
        f"poolserve's batch sizes (batch_stats, executions per size): "
        + (", ".join(f"{k}: {v}" for k, v in sorted(sizes.items(), key=lambda kv: int(kv[0])))
           or "n/a")
        + ".",
    ]  # fmt: skip
    return "\n".join(lines)


# -- the helper processes (check, cost, stats) --------------------------------------------


async def _check(address: str, model_file: str, calls: int) -> dict[str, Any]:
    import grpc
    import joblib
    import numpy as np

    from poolserve.protos import inference_pb2 as pb
    from poolserve.service.inference.codec import decode_outputs, encode_inputs

    model = joblib.load(model_file)
    rng = np.random.default_rng(16)
    rows = rng.normal(size=(calls, FEATURES)).astype(np.float32)
    expected = model.predict(rows)
    ok = wrong = errors = 0
    gate = asyncio.Semaphore(64)
    async with grpc.aio.insecure_channel(address) as channel:
        call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")

        async def one(i: int) -> None:
            nonlocal ok, wrong, errors
            req = pb.ModelInferRequest(model_name=MODEL, id=f"check-{i}")
            encode_inputs({"INPUT0": rows[i : i + 1]}, req, raw=True)
            req.outputs.add(name="predict")
            async with gate:
                try:
                    reply = await call(req.SerializeToString(), timeout=60)
                except grpc.aio.AioRpcError:
                    errors += 1
                    return
            got = decode_outputs(pb.ModelInferResponse.FromString(reply))["predict"]
            if got.size == 1 and int(got.ravel()[0]) == int(expected[i]):
                ok += 1
            else:
                wrong += 1

        await asyncio.gather(*(one(i) for i in range(calls)))
    return {"ok": ok, "wrong": wrong, "errors": errors}


def _cost(model_file: str) -> dict[str, float]:
    import joblib
    import numpy as np

    model = joblib.load(model_file)
    x = np.random.default_rng(0).normal(size=(32, FEATURES)).astype(np.float32)

    def timed(n: int) -> float:
        for _ in range(20):
            model.predict(x[:n])
        began = time.perf_counter()
        for _ in range(200):
            model.predict(x[:n])
        return (time.perf_counter() - began) / 200 * 1000

    one, batch = timed(1), timed(32)
    return {"one_ms": one, "batch_ms": batch, "ratio": batch / one}


async def _stats(address: str) -> dict[str, int]:
    import grpc

    from poolserve.protos import inference_pb2 as pb
    from poolserve.protos import inference_pb2_grpc as pbg

    async with grpc.aio.insecure_channel(address) as channel:
        stub = pbg.GRPCInferenceServiceStub(channel)
        got = await stub.ModelStatistics(pb.ModelStatisticsRequest(name=MODEL), timeout=30)
    return {str(b.batch_size): b.compute_infer.count for b in got.model_stats[0].batch_stats}


def main(argv: Sequence[str]) -> int:
    if argv[:1] == ["check"]:
        print(json.dumps(asyncio.run(_check(argv[1], argv[2], int(argv[3])))))
    elif argv[:1] == ["cost"]:
        print(json.dumps(_cost(argv[1])))
    elif argv[:1] == ["stats"]:
        print(json.dumps(asyncio.run(_stats(argv[1]))))
    else:
        sys.exit(__doc__)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
