"""Large tensors (issue 20): echo of FP32 [1,3,224,224] (588 KiB) and [16,3,224,224] (9.2 MiB).

perf_analyzer at concurrency 1 and 8 against poolserve, KServe, MLServer (2
workers) and the bare grpc.aio server over gRPC, and against poolserve again
with ``--shared-memory=system`` (the tensors in POSIX shared memory, the
request carrying names only). Every server serves the same echo model with
the tensor shape [-1,3,224,224] and the same 64 MiB message limit
(servers.MESSAGE_LIMIT). perf_analyzer reads normal floats from a JSON input
data file (its default random bytes include NaN patterns on which MLServer
with workers fails). A server that answers the shared-memory calls
UNIMPLEMENTED gets "not supported" in its cells instead of failing the bench.

The figure is MB/s moved: (input + output bytes) x inferences per second /
1e6. Beside it, the copies poolserve makes of a request's tensor bytes on
their way, as counted in its code (docs/performance.md, "Large tensors: slabs and copies").

Only the standard library at import time: run.py registers this module's
targets and section in report.py, and tests load it by path.
"""

from __future__ import annotations

import json
import os
import statistics
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

TITLE = "Large tensors (echo)"
SIZES: tuple[tuple[str, tuple[int, ...]], ...] = (
    ("588 KiB", (1, 3, 224, 224)),
    ("9.2 MiB", (16, 3, 224, 224)),
)
LARGE = "9.2 MiB"  # the size the targets are about
CONCURRENCIES = (1, 8)
DIMS = (-1, 3, 224, 224)  # the echo model's declared shape on every server
SERVERS = ("poolserve", "kserve", "mlserver-2", "bare")  # over gRPC
SUBJECT, KSERVE, MLSERVER = "poolserve", "kserve", "mlserver-2"
SHM = "poolserve-shm"  # poolserve again, perf_analyzer with --shared-memory=system
WINDOW_MS = 3000  # MLServer moves a 9.2 MiB echo a few times a second: windows long enough
# gRPC answers an unknown method UNIMPLEMENTED, "Method not found!"
UNSUPPORTED = ("UNIMPLEMENTED", "Unimplemented", "Method not found", "not supported")
# Copies of a request's tensor bytes in poolserve's code and in the kernel's
# socket hops, request and reply ways together, counted in the code path
# (docs/performance.md, "Large tensors: slabs and copies", has the table; the
# router's HTTP/2: docs/request-path.md, "Large tensors through the router's HTTP/2").
COPIES = {
    SUBJECT: "2, no socket hop (the router's slabs; the reply sent from its slab)",
    SHM: "0 in transit (the worker maps the regions)",
}

Measure = Callable[..., dict[str, Any]]


def tensor_bytes(shape: Sequence[int]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return 4 * count


def data_file(folder: Path, label: str, shape: Sequence[int]) -> Path:
    """perf_analyzer's input data: normal floats (seeded), written once per run."""
    import numpy as np

    path = folder / f"input-{'x'.join(map(str, shape))}.json"
    if not path.exists():
        values = np.random.default_rng(20).standard_normal(tensor_bytes(shape) // 4)
        content = np.round(values, 3).astype(np.float32).tolist()
        entry = {"INPUT0": {"content": content, "shape": list(shape)}}
        folder.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"data": [entry]}))
    return path


def unsupported(error: str) -> bool:
    return any(word in error for word in UNSUPPORTED)


def phase(
    start: Callable[[str], Any],
    measure: Measure,
    run_dir: Path,
    runs: int,
    log: Callable[[str], None],
) -> dict[str, Any]:
    """Starts the servers (``start(key)`` -> a running server), measures every cell
    ``runs`` times with the servers interleaved, innermost, and returns the records."""
    data = {label: data_file(run_dir / "large", label, shape) for label, shape in SIZES}
    running = {key: start(key) for key in SERVERS}
    configs = [(key, key) for key in SERVERS] + [(SHM, SUBJECT)]
    records: list[dict[str, Any]] = []
    total = runs * len(SIZES) * len(CONCURRENCIES) * len(configs)
    for r in range(runs):
        order = configs[r % len(configs) :] + configs[: r % len(configs)]
        for label, shape in SIZES:
            size = tensor_bytes(shape)
            for c in CONCURRENCIES:
                for config, key in order:
                    extra = ["--input-data", str(data[label])]
                    if config == SHM:
                        extra += ["--shared-memory=system", f"--output-shared-memory-size={size}"]
                    csv_path = run_dir / "large" / f"r{r}-{config}-{size}-c{c}.csv"
                    dims = "INPUT0:" + ",".join(map(str, shape))
                    out = measure(running[key], list(running.values()), "echo", c,
                                  csv_path=csv_path, window_ms=WINDOW_MS, shape=dims,
                                  extra=extra)  # fmt: skip
                    if "error" in out and config == SHM and unsupported(out["error"]):
                        out["unsupported"] = out.pop("error")
                    record = {"round": r, "config": config, "size": label, "bytes": size,
                              "concurrency": c, **out}  # fmt: skip
                    records.append(record)
                    shown = out.get("shown", "")
                    if "unsupported" in out:
                        shown = "not supported: " + out["unsupported"][:120]
                    elif "result" in out:
                        shown = f"{mb_per_s(out['result']['throughput'], size):8.1f} MB/s"
                    load = out.get("cpu", {}).get("foreign_cores", 0.0)
                    log(f"[{len(records)}/{total}] large {label} c{c} {config:<14} {shown}  "
                        f"(other load {load:.2f} cores)")  # fmt: skip
                    (run_dir / "large.json").write_text(json.dumps(records, indent=1))
    return {"runs": records, "window_ms": WINDOW_MS, "rounds": runs}


def mb_per_s(throughput: float, size: int) -> float:
    """Input and output bytes moved per second, in MB (1e6 bytes)."""
    return throughput * 2 * size / 1e6


# -- pure: from the records to cells, targets and tables ----------------------------------


def cells(large: Mapping[str, Any]) -> dict[str, dict[str, dict[str, dict[str, Any]]]]:
    """config -> size -> concurrency -> median MB/s, p99 and the runs (or why none)."""
    out: dict[str, dict[str, dict[str, dict[str, Any]]]] = {}
    for run in large.get("runs", []):
        cell = out.setdefault(run["config"], {}).setdefault(run["size"], {})
        found = cell.setdefault(str(run["concurrency"]), {"mb_s_runs": [], "p99_ms_runs": []})
        if run.get("result"):
            found["mb_s_runs"].append(mb_per_s(run["result"]["throughput"], run["bytes"]))
            found["p99_ms_runs"].append(run["result"]["p99_us"] / 1000)
        elif run.get("unsupported"):
            found["unsupported"] = run["unsupported"]
        else:
            found.setdefault("errors", []).append(str(run.get("error", "")))
    for sizes in out.values():
        for per_c in sizes.values():
            for found in per_c.values():
                mb, p99 = found["mb_s_runs"], found["p99_ms_runs"]
                found["mb_s"] = statistics.median(mb) if mb else None
                found["p99_ms"] = statistics.median(p99) if p99 else None
    return out


def figure(results: Mapping[str, Any], config: str, size: str, c: int) -> float | None:
    found = results.get("large", {}).get("cells", {}).get(config, {}).get(size, {}).get(str(c))
    value = found.get("mb_s") if found else None
    return float(value) if value is not None else None


def targets(results: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Issue 20's targets, as report.Target.to_json dicts (same run, ratios, at c8)."""
    if not results.get("large"):
        return []
    subject = figure(results, SUBJECT, LARGE, 8)
    found = []
    for key, label, a, b, threshold in (
        ("large_c8_vs_kserve", "9.2 MiB echo c8 MB/s vs KServe (1 process), gRPC",
         subject, figure(results, KSERVE, LARGE, 8), 1.0),
        ("large_c8_vs_mlserver", "9.2 MiB echo c8 MB/s vs MLServer (2 workers), gRPC",
         subject, figure(results, MLSERVER, LARGE, 8), 2.0),
        ("large_shm_c8_vs_kserve",
         "9.2 MiB echo c8 MB/s, system shared memory, vs KServe's gRPC figure",
         figure(results, SHM, LARGE, 8), figure(results, KSERVE, LARGE, 8), 3.0),
    ):  # fmt: skip
        value = a / b if a is not None and b else None
        detail = f"{_fmt(a)} vs {_fmt(b)} MB/s"
        passed = value is not None and value >= threshold
        found.append({"key": key, "label": label, "value": value, "op": ">=",
                      "threshold": threshold, "detail": detail, "issue": "20",
                      "passed": passed})  # fmt: skip
    return found


LABELS = {
    SUBJECT: "poolserve (2 workers), gRPC",
    SHM: "poolserve (2 workers), system shared memory",
    KSERVE: "KServe 0.21.0 (1 process)",
    MLSERVER: "MLServer 1.7.1 (parallel_workers 2)",
    "bare": "bare grpc.aio (1 process)",
}


def _fmt(value: float | None, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:,.{digits}f}"


def _shown(found: Mapping[str, Any] | None) -> str:
    if not found:
        return "n/a"
    if found.get("mb_s") is not None:
        return f"{_fmt(found['mb_s'])} ({_fmt(found['p99_ms'])} ms)"
    if found.get("unsupported"):
        return "not supported"
    return "error"


def section(results: Mapping[str, Any]) -> str:
    """The Markdown section: MB/s and p99 per cell, the copy counts, the settings."""
    large = results.get("large")
    if not large:
        return ""
    header = ["server"] + [f"{label} c{c}" for label, _ in SIZES for c in CONCURRENCIES]
    header.append("tensor copies in the server")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for config in (*SERVERS, SHM):
        sizes = large.get("cells", {}).get(config, {})
        row = [LABELS.get(config, config)]
        for label, _ in SIZES:
            row += [_shown(sizes.get(label, {}).get(str(c))) for c in CONCURRENCIES]
        row.append(COPIES.get(config, "not counted"))
        lines.append("| " + " | ".join(row) + " |")
    errors = sorted({e[:200] for sizes in large.get("cells", {}).values()
                     for per_c in sizes.values() for f in per_c.values()
                     for e in f.get("errors", [])})  # fmt: skip
    notes = [
        f"Echo of FP32 tensors, perf_analyzer over gRPC (input data: normal floats from a JSON "
        f"file), concurrency {' and '.join(map(str, CONCURRENCIES))}, {large.get('window_ms')} ms "
        f"windows x 3, servers interleaved per round, median of {large.get('rounds')} rounds. "
        "MB/s = (input + output bytes) x inferences/s / 1e6; p99 latency in parentheses. Every "
        "server has a 64 MiB gRPC message limit (poolserve's default `max_message_size`; "
        "MLServer `grpc_max_message_length`; KServe `--grpc_max_send_message_length` and "
        "`--grpc_max_receive_message_length`; the bare server's channel options); poolserve's "
        "other settings are its defaults (the unread-reply budget, 32 MiB per connection, "
        "lets 8 concurrent 9.2 MiB replies wait while the client reads). MLServer "
        "runs with `debug: false` (its default true logs every call); KServe with "
        "KSERVE_LOGLEVEL=WARNING (at INFO it logs every call). Shared memory: perf_analyzer "
        "`--shared-memory=system --output-shared-memory-size` = the tensor's bytes; "
        '"not supported" = the server answered the shared-memory calls UNIMPLEMENTED.',
    ]
    if errors:
        notes.append("Errors: " + "; ".join(errors))
    return "\n\n".join(["\n".join(lines), *notes])


def console(results: Mapping[str, Any]) -> str:
    """What `bench/run.py --only large` prints: the section and the targets."""
    rows = [
        f"- {t['label']} ({t['detail']}): {_fmt(t['value'], 2)} {t['op']} {t['threshold']}: "
        + ("PASS" if t["passed"] else "MISS")
        for t in targets(results)
    ]
    load = [float(r["cpu"]["foreign_cores"]) for r in results.get("large", {}).get("runs", [])
            if r.get("cpu")]  # fmt: skip
    noise = (
        f"Other processes used a median {statistics.median(load):.2f} cores (max "
        f"{max(load):.2f}) of {os.cpu_count()} during the cells."
        if load
        else ""
    )
    return "\n\n".join(part for part in (section(results), "\n".join(rows), noise) if part)
