"""REST (issue 29): perf_analyzer ``-i http`` against every server's HTTP/REST port.

poolserve's REST door (the router's ``http_port``), KServe's REST server (its
FastAPI app on uvicorn, v2 at /v2/models/{m}/infer), MLServer's REST server
(its ``http_port``, parallel_workers 2 and 0) and the bench's own uvicorn
echo (peers/rest_floor.py: one process, a bare ASGI app that decodes the body
into an array and answers it) as the floor. The same models as the gRPC part:
echo FP32 [1,16] at concurrency 1 and 16, the XGBoost model at 16 (the
servers whose gRPC part serves it), each with Triton's binary tensor
extension (perf_analyzer's default, ``--input-tensor-format=binary
--output-tensor-format=binary``) and with JSON tensors (``=json``); then the
9.2 MiB echo (FP32 [16,3,224,224]) at concurrency 8 with binary tensors, in
MB/s. poolserve's echo c16 is measured over gRPC too in the same rounds, so
that the router's CPU per request through each door comes from one run.

Every server is started with the same models, the servers interleaved
innermost per round (the same drift for all). A peer that cannot be installed
or started is skipped with its reason in the section, and a format a server
does not take is shown as "not supported" (a 4xx answer naming it), not as a
failure of the bench.

Only the standard library at import time: run.py registers this module's
targets and section in report.py, and tests load it by path.
"""

from __future__ import annotations

import json
import os
import statistics
import time
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

TITLE = "REST (perf_analyzer -i http)"
SUBJECT, KSERVE, MLSERVER, MLSERVER_0, FLOOR = (
    "poolserve", "kserve", "mlserver-2", "mlserver-0", "rest-floor",
)  # fmt: skip
SERVERS = (SUBJECT, KSERVE, MLSERVER, MLSERVER_0, FLOOR)
LABELS = {
    SUBJECT: "poolserve (2 workers), REST door",
    KSERVE: "KServe 0.21.0 REST (1 process)",
    MLSERVER: "MLServer 1.7.1 REST (parallel_workers 2)",
    MLSERVER_0: "MLServer 1.7.1 REST (parallel_workers 0)",
    FLOOR: "bare uvicorn echo (1 process)",
}
FORMATS = ("binary", "json")
GRPC = "grpc"  # poolserve's echo c16 over gRPC, in the same rounds (router CPU per door)
ECHO, XGB = "echo", "xgb"
SMALL_CELLS: tuple[tuple[str, int], ...] = ((ECHO, 1), (ECHO, 16), (XGB, 16))
SHAPES = {ECHO: (1, 16), XGB: (1, 20)}
LARGE = "9.2 MiB"
LARGE_SHAPE = (16, 3, 224, 224)
LARGE_DIMS = (-1, 3, 224, 224)  # the large echo's declared shape on every server
LARGE_C = 8
LARGE_SERVERS = (SUBJECT, KSERVE, MLSERVER, FLOOR)
LARGE_WINDOW_MS = 3000
ROUTER = "poolserve-rtr"  # the router process's name (/proc/PID/comm)
# What perf_analyzer says when a server does not take a tensor format (MLServer parses every
# body as JSON: no binary extension), or when its HTTP client (tritonclient 2.51) cannot read
# the reply: it wants binary_data_size in every output that has "parameters" (KServe writes
# "parameters": null, MLServer's own runtimes {"content_type": ...}). Such a cell is shown as
# "not supported" with these words, not as a failure of the bench.
UNSUPPORTED = (
    "not supported", "Unsupported", "parse the request JSON", "Inference-Header",
    "'binary_data_size'",
)  # fmt: skip
ISSUE = "29"

Measure = Callable[..., dict[str, Any]]
Start = Callable[[str, tuple[str, ...], "tuple[int, ...] | None"], Any]


# -- measuring ---------------------------------------------------------------------------------


def wait_rest_ready(address: str, models: Sequence[str], timeout: float = 120.0) -> None:
    """Polls GET /v2/models/{m}/ready on the REST port until every model answers 200."""
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        try:
            for model in models:
                url = f"http://{address}/v2/models/{model}/ready"
                with urllib.request.urlopen(url, timeout=2) as reply:
                    if reply.status != 200:
                        raise OSError(f"{model}: HTTP {reply.status}")
            return
        except OSError as exc:
            last = str(exc)
            time.sleep(0.2)
    raise RuntimeError(f"REST port {address} not ready after {timeout:.0f} s: {last}")


def data_file(folder: Path, shape: Sequence[int]) -> Path:
    """perf_analyzer's input data: normal floats (seeded) in a JSON file, written once per run
    (JSON tensors need finite numbers; the random bytes it makes by default include NaN)."""
    import numpy as np

    path = folder / f"input-{'x'.join(map(str, shape))}.json"
    if not path.exists():
        count = 1
        for dim in shape:
            count *= dim
        values = np.random.default_rng(29).standard_normal(count)
        content = np.round(values, 3).astype(np.float32).tolist()
        folder.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"data": [{"INPUT0": {"content": content,
                                                         "shape": list(shape)}}]}))  # fmt: skip
    return path


def format_flags(fmt: str) -> list[str]:
    if fmt == GRPC:
        return []
    return [f"--input-tensor-format={fmt}", f"--output-tensor-format={fmt}"]


def unsupported(error: str) -> bool:
    return any(word in error for word in UNSUPPORTED)


def _cell(
    measure: Measure,
    server: Any,
    running: Sequence[Any],
    model: str,
    c: int,
    fmt: str,
    data: Path,
    csv_path: Path,
    shape: Sequence[int],
    window_ms: int | None = None,
) -> dict[str, Any]:
    out = measure(server, running, model, c, csv_path=csv_path, window_ms=window_ms,
                  shape="INPUT0:" + ",".join(map(str, shape)),
                  extra=["--input-data", str(data), *format_flags(fmt)],
                  protocol="grpc" if fmt == GRPC else "http")  # fmt: skip
    refused = "error" in out and unsupported(out["error"])
    if refused and fmt != GRPC and server.spec.key != SUBJECT:
        out["unsupported"] = out.pop("error")
    return out


def phase(
    start: Start,
    stop: Callable[[Any], None],
    measure: Measure,
    run_dir: Path,
    runs: int,
    log: Callable[[str], None],
    available: Callable[[str], str],
    large: bool = True,
) -> dict[str, Any]:
    """Starts the servers (``start(key, models, shape)`` -> a running server, REST-ready),
    measures every cell ``runs`` times with the servers interleaved innermost, stops them,
    then the 9.2 MiB echo on servers of its own. ``available(key)`` is "" or why the
    server cannot run here (its peer not installed)."""
    folder = run_dir / "rest"
    folder.mkdir(parents=True, exist_ok=True)
    skipped: dict[str, str] = {}
    records: list[dict[str, Any]] = []

    def start_all(keys: Sequence[str], models: Callable[[str], tuple[str, ...]],
                  shape: tuple[int, ...] | None) -> dict[str, Any]:  # fmt: skip
        running: dict[str, Any] = {}
        for key in keys:
            why = available(key)
            if not why:
                try:
                    running[key] = start(key, models(key), shape)
                    continue
                except Exception as exc:  # a peer that does not start: say so, go on
                    why = f"did not start: {str(exc)[:300]}"
            skipped.setdefault(key, why)
            log(f"REST: skipping {key}: {why}")
        return running

    def served(key: str) -> tuple[str, ...]:
        return (ECHO, XGB) if key in (SUBJECT, KSERVE, MLSERVER) else (ECHO,)

    data = {model: data_file(folder, shape) for model, shape in SHAPES.items()}
    running = start_all(SERVERS, served, None)
    try:
        configs = [(k, f) for f in FORMATS for k in running] + [(SUBJECT, GRPC)] * (
            SUBJECT in running
        )
        total = runs * sum(
            1
            for model, c in SMALL_CELLS
            for k, f in configs
            if model in served(k) and (f != GRPC or (model, c) == (ECHO, 16))
        )
        for r in range(runs):
            keys = list(running)
            order = keys[r % max(1, len(keys)) :] + keys[: r % max(1, len(keys))]
            for model, c in SMALL_CELLS:
                for fmt in (*FORMATS, GRPC):
                    for key in order:  # innermost: the servers meet the same drift
                        if model not in served(key) or (fmt == GRPC and (
                                key != SUBJECT or (model, c) != (ECHO, 16))):  # fmt: skip
                            continue
                        csv_path = folder / f"r{r}-{key}-{model}-c{c}-{fmt}.csv"
                        out = _cell(measure, running[key], list(running.values()), model, c,
                                    fmt, data[model], csv_path, SHAPES[model])  # fmt: skip
                        records.append({"round": r, "server": key, "model": model,
                                        "concurrency": c, "format": fmt, **out})  # fmt: skip
                        _log(log, records, total, out)
                        (run_dir / "rest.json").write_text(json.dumps(records, indent=1))
    finally:
        for server in running.values():
            stop(server)
    if large:
        big = data_file(folder, LARGE_SHAPE)
        running = start_all(LARGE_SERVERS, lambda _: (ECHO,), LARGE_DIMS)
        try:
            total = runs * len(running)
            done = 0
            for r in range(runs):
                keys = list(running)
                order = keys[r % max(1, len(keys)) :] + keys[: r % max(1, len(keys))]
                for key in order:
                    csv_path = folder / f"r{r}-{key}-large-c{LARGE_C}.csv"
                    out = _cell(measure, running[key], list(running.values()), ECHO, LARGE_C,
                                "binary", big, csv_path, LARGE_SHAPE, LARGE_WINDOW_MS)  # fmt: skip
                    records.append({"round": r, "server": key, "model": LARGE,
                                    "concurrency": LARGE_C, "format": "binary",
                                    "bytes": tensor_bytes(LARGE_SHAPE), **out})  # fmt: skip
                    done += 1
                    _log(log, records, total, out, f"[{done}/{total}] REST {LARGE}")
                    (run_dir / "rest.json").write_text(json.dumps(records, indent=1))
        finally:
            for server in running.values():
                stop(server)
    found: dict[str, Any] = {"runs": records, "rounds": runs, "skipped": skipped,
                             "large_window_ms": LARGE_WINDOW_MS}  # fmt: skip
    found["cells"] = cells(found)
    return found


def _log(log: Callable[[str], None], records: Sequence[Mapping[str, Any]], total: int,
         out: Mapping[str, Any], prefix: str = "") -> None:  # fmt: skip
    last = records[-1]
    shown = out.get("shown", "")
    if "unsupported" in out:
        shown = "not supported: " + str(out["unsupported"])[:160]
    elif "result" in out and last.get("bytes"):
        shown = f"{mb_per_s(out['result']['throughput'], last['bytes']):8.1f} MB/s"
    load = out.get("cpu", {}).get("foreign_cores", 0.0)
    head = prefix or (f"[{len(records)}/{total}] REST {last['model']} c{last['concurrency']} "
                      f"{last['format']:<6}")  # fmt: skip
    log(f"{head} {last['server']:<12} {shown}  (other load {load:.2f} cores)")


def tensor_bytes(shape: Sequence[int]) -> int:
    count = 4
    for dim in shape:
        count *= dim
    return count


def mb_per_s(throughput: float, size: int) -> float:
    """Input and output bytes moved per second, in MB (1e6 bytes)."""
    return throughput * 2 * size / 1e6


# -- pure: from the records to cells, targets and tables ---------------------------------------


def _requests(run: Mapping[str, Any]) -> float:
    return float(run["result"]["throughput"]) * float(run["cpu"]["wall_s"])


def cells(rest: Mapping[str, Any]) -> dict[str, Any]:
    """server -> format -> model -> concurrency -> medians (throughput, p99, MB/s, CPU ms per
    request of the whole tree and of the router) or why there are none."""
    out: dict[str, Any] = {}
    for run in rest.get("runs", []):
        fmt = out.setdefault(run["server"], {}).setdefault(run["format"], {})
        found = fmt.setdefault(run["model"], {}).setdefault(
            str(run["concurrency"]),
            {"throughput_runs": [], "p99_ms_runs": [], "cpu_ms_runs": [], "router_ms_runs": []},
        )
        if run.get("result"):
            found["throughput_runs"].append(float(run["result"]["throughput"]))
            found["p99_ms_runs"].append(float(run["result"]["p99_us"]) / 1000)
            cpu = run.get("cpu") or {}
            requests = _requests(run) if cpu.get("wall_s") else 0.0
            if requests > 0:
                found["cpu_ms_runs"].append(1000 * float(cpu.get("cpu_s", 0.0)) / requests)
                router = cpu.get("cpu_by_process", {}).get(ROUTER)
                if router is not None:
                    found["router_ms_runs"].append(1000 * float(router) / requests)
            if run.get("bytes"):
                found.setdefault("bytes", int(run["bytes"]))
        elif run.get("unsupported"):
            found["unsupported"] = str(run["unsupported"])
        else:
            found.setdefault("errors", []).append(str(run.get("error", "")))
    for formats in out.values():
        for models in formats.values():
            for per_c in models.values():
                for found in per_c.values():
                    for name in ("throughput", "p99_ms", "cpu_ms", "router_ms"):
                        values = found[f"{name}_runs"]
                        found[name] = statistics.median(values) if values else None
                    size, tput = found.get("bytes"), found["throughput"]
                    found["mb_s"] = mb_per_s(tput, size) if size and tput is not None else None
    return out


def _found(results: Mapping[str, Any], server: str, fmt: str, model: str, c: int) -> dict[str, Any]:
    rest = results.get("rest") or {}
    got = rest.get("cells", {}).get(server, {}).get(fmt, {}).get(model, {}).get(str(c))
    return dict(got) if got else {}


def figure(
    results: Mapping[str, Any], server: str, fmt: str, model: str, c: int, what: str
) -> float | None:
    value = _found(results, server, fmt, model, c).get(what)
    return float(value) if value is not None else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _fmt(value: float | None, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:,.{digits}f}"


TARGETS: tuple[tuple[str, str, str, int, str, str, str, float, tuple[str, ...]], ...] = (
    # key, label, model, c, what, peer, op, threshold, formats
    ("rest_echo_c16_vs_kserve", "echo c16 REST throughput vs KServe REST", ECHO, 16,
     "throughput", KSERVE, ">=", 1.5, FORMATS),
    ("rest_echo_c16_vs_mlserver", "echo c16 REST throughput vs MLServer REST (2 workers)",
     ECHO, 16, "throughput", MLSERVER, ">=", 3.0, FORMATS),
    ("rest_xgb_c16_vs_kserve", "XGBoost c16 REST throughput vs KServe REST", XGB, 16,
     "throughput", KSERVE, ">=", 2.0, FORMATS),
    ("rest_large_c8_vs_kserve", "9.2 MiB binary echo c8 REST MB/s vs KServe REST", LARGE,
     LARGE_C, "mb_s", KSERVE, ">=", 1.0, ("binary",)),
    ("rest_echo_c16_p99_vs_kserve", "echo c16 REST p99 vs KServe REST", ECHO, 16, "p99_ms",
     KSERVE, "<=", 1.0, FORMATS),
)  # fmt: skip
UNITS = {"throughput": "infer/s", "mb_s": "MB/s", "p99_ms": "ms"}


def targets(results: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Issue 29's targets, as report.Target.to_json dicts: poolserve / peer, same run, same
    tensor format. A format the peer does not take (or a peer skipped) gives no row."""
    rest = results.get("rest")
    if not rest:
        return []
    found = []
    skipped = rest.get("skipped", {})
    for key, label, model, c, what, peer, op, threshold, formats in TARGETS:
        for fmt in formats:
            peer_cell = _found(results, peer, fmt, model, c)
            if peer in skipped or peer_cell.get("unsupported"):
                continue
            a = figure(results, SUBJECT, fmt, model, c, what)
            b = figure(results, peer, fmt, model, c, what)
            value = _ratio(a, b)
            if value is None:
                passed = False
            elif op == ">=":
                passed = value >= threshold
            else:
                passed = value <= threshold
            found.append({"key": f"{key}_{fmt}", "label": f"{label}, {fmt} tensors",
                          "value": value, "op": op, "threshold": threshold,
                          "detail": f"{_fmt(a, 2 if what == 'p99_ms' else 1)} vs "
                                    f"{_fmt(b, 2 if what == 'p99_ms' else 1)} {UNITS[what]}",
                          "issue": ISSUE, "passed": passed})  # fmt: skip
    return found


def _shown(found: Mapping[str, Any], what: str, digits: int = 1) -> str:
    if not found:
        return "-"
    if found.get(what) is not None:
        return _fmt(found[what], digits)
    if found.get("unsupported"):
        return "not supported"
    return "error"


def _versus(results: Mapping[str, Any], fmt: str, model: str, c: int, what: str,
            peer: str) -> str:  # fmt: skip
    value = _ratio(figure(results, SUBJECT, fmt, model, c, what),
                   figure(results, peer, fmt, model, c, what))  # fmt: skip
    return "-" if value is None else f"{value:.2f}x"


def tables(results: Mapping[str, Any]) -> str:
    """One table per tensor format: throughput, p99 at c16, and poolserve's ratios."""
    rest = results.get("rest") or {}
    out = []
    for fmt in FORMATS:
        header = ["server", "echo c1 infer/s", "echo c16 infer/s", "echo c16 p99 ms",
                  "XGBoost c16 infer/s", "XGBoost c16 p99 ms"]  # fmt: skip
        rows = []
        for key in SERVERS:
            if key in rest.get("skipped", {}):
                rows.append([LABELS[key], *(["skipped"] * (len(header) - 1))])
                continue
            row = [LABELS[key]]
            row.append(_shown(_found(results, key, fmt, ECHO, 1), "throughput"))
            row.append(_shown(_found(results, key, fmt, ECHO, 16), "throughput"))
            row.append(_shown(_found(results, key, fmt, ECHO, 16), "p99_ms", 2))
            row.append(_shown(_found(results, key, fmt, XGB, 16), "throughput"))
            row.append(_shown(_found(results, key, fmt, XGB, 16), "p99_ms", 2))
            rows.append(row)
        ratios = ["poolserve / KServe REST",
                  _versus(results, fmt, ECHO, 1, "throughput", KSERVE),
                  _versus(results, fmt, ECHO, 16, "throughput", KSERVE),
                  _versus(results, fmt, ECHO, 16, "p99_ms", KSERVE),
                  _versus(results, fmt, XGB, 16, "throughput", KSERVE),
                  _versus(results, fmt, XGB, 16, "p99_ms", KSERVE)]  # fmt: skip
        ml = ["poolserve / MLServer REST (2 workers)",
              _versus(results, fmt, ECHO, 1, "throughput", MLSERVER),
              _versus(results, fmt, ECHO, 16, "throughput", MLSERVER),
              _versus(results, fmt, ECHO, 16, "p99_ms", MLSERVER),
              _versus(results, fmt, XGB, 16, "throughput", MLSERVER),
              _versus(results, fmt, XGB, 16, "p99_ms", MLSERVER)]  # fmt: skip
        rows += [ratios, ml]
        title = {"binary": "Binary tensors (Triton's binary tensor data extension, "
                           "perf_analyzer's default)",
                 "json": "JSON tensors (`--input-tensor-format=json "
                         "--output-tensor-format=json`)"}[fmt]  # fmt: skip
        out.append(f"{title}:\n\n" + _table(header, rows))
    return "\n\n".join(out)


def large_table(results: Mapping[str, Any]) -> str:
    rest = results.get("rest") or {}
    if not any(r.get("model") == LARGE for r in rest.get("runs", [])):
        return ""
    rows = []
    for key in LARGE_SERVERS:
        found = _found(results, key, "binary", LARGE, LARGE_C)
        if key in rest.get("skipped", {}):
            rows.append([LABELS[key], "skipped", "skipped", "-"])
            continue
        rows.append([LABELS[key], _shown(found, "mb_s"), _shown(found, "p99_ms"),
                     "-" if key == SUBJECT else
                     _versus(results, "binary", LARGE, LARGE_C, "mb_s", key)])  # fmt: skip
    header = [
        "server",
        f"{LARGE} echo c{LARGE_C} MB/s",
        "p99 ms",
        "poolserve / this server",
    ]
    return _table(header, rows)


def cpu_table(results: Mapping[str, Any]) -> str:
    """CPU ms per request at echo c16: the router beside the gRPC figure, and each tree."""
    grpc_router = figure(results, SUBJECT, GRPC, ECHO, 16, "router_ms")
    grpc_total = figure(results, SUBJECT, GRPC, ECHO, 16, "cpu_ms")
    rows = [
        [
            "poolserve router (poolserve-rtr)",
            _fmt(grpc_router, 3),
            *(_fmt(figure(results, SUBJECT, f, ECHO, 16, "router_ms"), 3) for f in FORMATS),
        ]
    ]
    rows.append(
        [
            "poolserve, whole tree",
            _fmt(grpc_total, 3),
            *(_fmt(figure(results, SUBJECT, f, ECHO, 16, "cpu_ms"), 3) for f in FORMATS),
        ]
    )
    for key in SERVERS[1:]:
        rows.append(
            [
                f"{LABELS[key]}, whole tree",
                "-",
                *(_fmt(figure(results, key, f, ECHO, 16, "cpu_ms"), 3) for f in FORMATS),
            ]
        )
    return _table(["echo c16: CPU ms per request", "gRPC", "REST binary", "REST JSON"], rows)


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def notes(results: Mapping[str, Any]) -> str:
    rest = results.get("rest") or {}
    meta = results.get("meta", {})
    parts = [
        f"{rest.get('when', meta.get('date', '?'))}, "
        f"{rest.get('mode', meta.get('mode', '?'))} mode: perf_analyzer `-i http` on each "
        "server's REST port, input data normal floats from a JSON file, "
        f"{rest.get('window_ms', meta.get('window_ms', '?'))} ms windows x 3 per cell "
        f"({rest.get('large_window_ms', LARGE_WINDOW_MS)} ms for the {LARGE} echo), servers "
        f"interleaved per round, median of {rest.get('rounds', '?')} rounds. Same models as "
        "the gRPC part (echo FP32 [1,16]; XGBoost FP32 [1,20], 200 trees, on poolserve, KServe "
        "and MLServer 2 workers); the same peers and settings, reached on their REST ports "
        "(KServe's FastAPI server on uvicorn, one process; MLServer's `http_port`). "
        "KServe and MLServer lack Triton's GET .../config and .../stats, which perf_analyzer "
        "asks for: the bench added those two routes to the FastAPI app each builds (the same "
        "answers as its gRPC handlers). Over REST, KServe's bench models pass the request's "
        "binary-output choice to InferResponse (`use_binary_outputs`, `requested_outputs`), and "
        "MLServer's echo runtime drops the `content_type` parameter NumpyCodec puts on its "
        "output: perf_analyzer's HTTP client (tritonclient 2.51) cannot read an output whose "
        "`parameters` lack `binary_data_size` (the cells it still cannot read, and MLServer's "
        "refusal of binary bodies, are listed below as not supported and give no target "
        "row). The floor is the bench's own ASGI app on uvicorn "
        "(httptools, asyncio loop, one process: bench/peers/rest_floor.py), which decodes the "
        f"JSON or binary body into an array and answers it. {LARGE}: FP32 [16,3,224,224], "
        "binary tensors, MB/s = (input + output bytes) x inferences/s / 1e6. CPU per request: "
        "CPU of the process (tree) during the cell over the requests served (throughput x "
        "duration of the perf_analyzer run), median of the rounds; poolserve's echo c16 over "
        "gRPC is measured in the same rounds for the router's figure beside it.",
    ]
    if rest.get("skipped"):
        skipped = sorted(rest["skipped"].items())
        parts.append("Skipped: " + "; ".join(f"{LABELS.get(k, k)}: {why}" for k, why in skipped))
    unsupported_cells = sorted({f"{LABELS.get(s, s)} {m} ({fmt}): {f['unsupported'][:160]}"
                                for s, formats in rest.get("cells", {}).items()
                                for fmt, models in formats.items()
                                for m, per_c in models.items() for f in per_c.values()
                                if f.get("unsupported")})  # fmt: skip
    if unsupported_cells:
        parts.append("Not supported: " + "; ".join(unsupported_cells))
    errors = sorted({f"{LABELS.get(s, s)} {m} ({fmt}): {e[:200]}"
                     for s, formats in rest.get("cells", {}).items()
                     for fmt, models in formats.items()
                     for m, per_c in models.items() for f in per_c.values()
                     for e in f.get("errors", [])})  # fmt: skip
    if errors:
        parts.append("Errors: " + "; ".join(errors))
    return "\n\n".join(parts)


def section(results: Mapping[str, Any]) -> str:
    """The Markdown section: the two format tables, the large echo, CPU, the targets."""
    if not results.get("rest"):
        return ""
    rows = [
        f"| {t['label']} ({t['detail']}) | {_fmt(t['value'], 2)} | {t['op']} {t['threshold']} "
        f"| {'PASS' if t['passed'] else 'MISS'} |"
        for t in targets(results)
    ]
    target_table = "\n".join(
        ["| target (poolserve, same run) | measured | target | result |", "|---|---|---|---|",
         *rows]
    )  # fmt: skip
    large = large_table(results)
    return "\n\n".join(
        part
        for part in (
            notes(results),
            target_table,
            tables(results),
            f"{LARGE} echo, binary tensors, concurrency {LARGE_C}:\n\n{large}" if large else "",
            "CPU per request at echo c16 (ms):\n\n" + cpu_table(results),
        )
        if part
    )


def console(results: Mapping[str, Any]) -> str:
    """What `bench/run.py --only rest` prints: the section and the other processes' load."""
    load = [float(r["cpu"]["foreign_cores"]) for r in (results.get("rest") or {}).get("runs", [])
            if r.get("cpu")]  # fmt: skip
    noise = (
        f"Other processes used a median {statistics.median(load):.2f} cores (max "
        f"{max(load):.2f}) of {os.cpu_count()} during the cells."
        if load
        else ""
    )
    return "\n\n".join(part for part in (section(results), noise) if part)
