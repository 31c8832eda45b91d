"""From the raw measurements of a run to medians, target ratios, Markdown and docs/performance.md.

Pure functions over the JSON-able ``results`` dict that run.py fills in, so
that tests/test_bench_report.py can check them on a recorded sample.
"""

from __future__ import annotations

import importlib.util
import statistics
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from types import ModuleType
from typing import Any


def _sibling(name: str) -> ModuleType:
    """A bench module beside this one, loaded by path (the tests load report.py so too)."""
    key = f"_bench_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, Path(__file__).with_name(f"{name}.py"))
        assert spec is not None and spec.loader is not None
        sys.modules[key] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[key])
    return sys.modules[key]


batching = _sibling("batching")
decoupled = _sibling("decoupled")

# The generated section of docs/performance.md lies between these markers.
DOCS_PAGE = "docs/performance.md"
SECTION_START = "<!-- bench:start -->"
SECTION_END = "<!-- bench:end -->"
MODELS = ("echo", "burn")
XGB = "xgb"  # the XGBoost model (FP32 [1,20], 200 trees), issue 22
ROUND_MODELS = (*MODELS, XGB)  # what the perf_analyzer rounds measure
CONCURRENCIES = (1, 4, 16)
MIB = 1024 * 1024

Results = dict[str, Any]
# Parts of the bench in modules of their own (run.py registers bench/large_tensors.py):
# each has a TITLE, targets(results) -> Target.to_json dicts, section(results) -> Markdown.
PARTS: list[Any] = []


# -- medians per cell ------------------------------------------------------------


def cells(runs: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, dict[str, dict[str, Any]]]]:
    """server -> model -> concurrency (as a string key) -> medians of the successful runs."""
    grouped: dict[tuple[str, str, int], list[Mapping[str, Any]]] = {}
    errors: dict[tuple[str, str, int], list[str]] = {}
    for run in runs:
        key = (run["server"], run["model"], int(run["concurrency"]))
        if run.get("result"):
            grouped.setdefault(key, []).append(run["result"])
        else:
            errors.setdefault(key, []).append(str(run.get("error", "")))
    out: dict[str, dict[str, dict[str, dict[str, Any]]]] = {}
    for key in sorted(set(grouped) | set(errors)):
        server, model, concurrency = key
        results = grouped.get(key, [])
        throughput = [float(r["throughput"]) for r in results]
        p99 = [float(r["p99_us"]) / 1000 for r in results]
        out.setdefault(server, {}).setdefault(model, {})[str(concurrency)] = {
            "throughput": statistics.median(throughput) if throughput else None,
            "p99_ms": statistics.median(p99) if p99 else None,
            "n": len(results),
            "throughput_runs": throughput,
            "p99_ms_runs": p99,
            "errors": errors.get(key, []),
        }
    return out


def cell(results: Results, server: str, model: str, concurrency: int, what: str) -> float | None:
    found = results.get("cells", {}).get(server, {}).get(model, {}).get(str(concurrency), {})
    value = found.get(what)
    return float(value) if value is not None else None


def capacity(results: Results, server: str) -> float | None:
    """A server's burn capacity: its best median throughput over the concurrency levels."""
    found = [cell(results, server, "burn", c, "throughput") for c in CONCURRENCIES]
    values = [v for v in found if v is not None]
    return max(values) if values else None


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


# -- targets ------------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    key: str
    label: str
    value: float | None
    op: str  # ">=", "<=" or "<"
    threshold: float
    detail: str = ""
    issue: str = ""  # the tracker issue(s) that set this target

    @property
    def passed(self) -> bool:
        if self.value is None:
            return False
        if self.op == ">=":
            return self.value >= self.threshold
        if self.op == "<=":
            return self.value <= self.threshold
        return self.value < self.threshold

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "passed": self.passed}


def _mem(results: Results, config: str, server: str) -> float | None:
    found = results.get("memory", {}).get(config, {}).get(server)
    return float(found["pss_bytes"]) if found and found.get("pss_bytes") else None


def _versus(
    key: str,
    label: str,
    a: float | None,
    b: float | None,
    op: str,
    threshold: float,
    unit: str,
    issue: str = "8",
) -> Target:
    """A target on a / b, with both figures in its detail."""
    detail = f"{fmt(a)} vs {fmt(b)} {unit}" if a is not None or b is not None else ""
    return Target(key, label, ratio(a, b), op, threshold, detail.strip(), issue)


def targets(
    results: Results,
    subject: str = "poolserve",
    peer: str = "mlserver-2",
    kserve: str = "kserve",
    inline: str = "poolserve-inline",
) -> list[Target]:
    """Issue 8 (make bench) against MLServer (2 workers) and the machine; issue 10 (light
    models) against KServe's single process, with echo also served inline by poolserve."""

    def c16(server: str, model: str, what: str) -> float | None:
        return cell(results, server, model, 16, what)

    def mib(config: str, server: str) -> float | None:
        found = _mem(results, config, server)
        return found / MIB if found is not None else None

    limit = results.get("physical_limit") or results.get("meta", {}).get("physical_limit")
    overload = results.get("overload", {}).get(subject, {})
    array = results.get("memory", {}).get("c", {}).get("array_bytes")
    share = overload.get("abandoned_fraction")
    gone = (
        f"{overload.get('abandoned_executions')} of {overload.get('executions')} executions"
        if overload
        else ""
    )
    peer_label = "MLServer (2 workers)"
    ks_label = "KServe (1 process)"
    return [
        _versus("echo_c16_throughput", f"echo c16 throughput vs {peer_label}",
                c16(subject, "echo", "throughput"), c16(peer, "echo", "throughput"),
                ">=", 1.5, "infer/s"),
        _versus("echo_c16_p99", f"echo c16 p99 vs {peer_label}",
                c16(subject, "echo", "p99_ms"), c16(peer, "echo", "p99_ms"), "<=", 0.67, "ms"),
        _versus("burn_c16_vs_limit", "burn c16 throughput vs physical limit",
                c16(subject, "burn", "throughput"), float(limit) if limit else None,
                ">=", 0.97, "infer/s"),
        _versus("burn_c16_throughput", f"burn c16 throughput vs {peer_label}",
                c16(subject, "burn", "throughput"), c16(peer, "burn", "throughput"),
                ">=", 1.0, "infer/s", "8, 10"),
        _versus("burn_c16_p99", f"burn c16 p99 vs {peer_label}",
                c16(subject, "burn", "p99_ms"), c16(peer, "burn", "p99_ms"), "<=", 1.0, "ms"),
        _versus("memory_a", "memory (a) one pool, 2 workers: PSS vs MLServer",
                mib("a", subject), mib("a", peer), "<=", 0.5, "MiB"),
        _versus("memory_b", "memory (b) one gid per model: PSS vs MLServer",
                mib("b", subject), mib("b", peer), "<=", 0.5, "MiB"),
        _versus("memory_c", "memory (c) 400 MiB array, 4 workers: PSS vs array",
                mib("c", subject), float(array) / MIB if array else None, "<=", 1.3, "MiB"),
        _versus("overload_goodput",
                "overload (2x capacity, 200 ms deadline): goodput vs capacity"
                + host_calibration(overload),
                overload.get("goodput_per_s"), overload.get("capacity"), ">=", 0.9, "/s"),
        Target("overload_abandoned_cpu", "overload: share of burn CPU spent for callers gone",
               share, "<", 0.05, gone, "8"),
        _versus("echo_c16_vs_kserve", f"echo c16 throughput vs {ks_label}",
                c16(subject, "echo", "throughput"), c16(kserve, "echo", "throughput"),
                ">=", 0.75, "infer/s", "10"),
        _versus("echo_c16_vs_mlserver_x2", f"echo c16 throughput vs {peer_label}",
                c16(subject, "echo", "throughput"), c16(peer, "echo", "throughput"),
                ">=", 2.0, "infer/s", "10"),
        _versus("echo_c16_p99_vs_kserve", f"echo c16 p99 vs {ks_label}",
                c16(subject, "echo", "p99_ms"), c16(kserve, "echo", "p99_ms"),
                "<=", 1.3, "ms", "10"),
        _versus("echo_inline_c16_vs_kserve", f"echo inline (fast) c16 throughput vs {ks_label}",
                c16(inline, "echo", "throughput"), c16(kserve, "echo", "throughput"),
                ">=", 0.9, "infer/s", "10"),
        _versus("burn_c16_vs_kserve", f"burn c16 throughput vs {ks_label}",
                c16(subject, "burn", "throughput"), c16(kserve, "burn", "throughput"),
                ">=", 1.9, "infer/s", "10"),
        _versus("xgb_c16_vs_kserve", f"XGBoost c16 throughput vs {ks_label}",
                c16(subject, XGB, "throughput"), c16(kserve, XGB, "throughput"),
                ">=", 1.5, "infer/s", "22"),
        _versus("xgb_c16_vs_mlserver", f"XGBoost c16 throughput vs {peer_label}",
                c16(subject, XGB, "throughput"), c16(peer, XGB, "throughput"),
                ">=", 1.0, "infer/s", "22"),
        _versus("memory_xgb", "memory (x) the XGBoost model, 2 workers: PSS vs MLServer",
                mib("x", subject), mib("x", peer), "<=", 0.5, "MiB", "22"),
        *light_targets(results, subject, kserve, inline),
    ]  # fmt: skip


BARE_ECHO_WHEN_SET = 0.13
"""CPU ms per echo call of the bare grpc.aio server (bench/peers/bare_server.py) in
the run the whole tree's 0.24 ms was set against: the host's speed then. Published
runs on this host have measured it from 0.13 to 0.39 ms (bench/results history)."""


def light_targets(results: Results, subject: str, kserve: str, inline: str) -> list[Target]:
    """Issue 31 (light models at the limit): echo, inline echo and XGBoost against
    KServe's one process, and the whole tree's CPU per echo request, absolute and
    against KServe's, from the same rounds."""

    def c16(server: str, model: str) -> float | None:
        return cell(results, server, model, 16, "throughput")

    cpu = cpu_per_request(results.get("runs", []))
    ours = cpu.get(subject, {}).get("echo", {}).get("total")
    theirs = cpu.get(kserve, {}).get("echo", {}).get("total")
    bare = cpu.get("bare", {}).get("echo", {}).get("total")
    label = "KServe (1 process)"
    whole = "whole-tree CPU per echo c16 request"
    host = (  # the absolute row depends on the host's speed: this says how fast it was
        f"; a bare grpc.aio echo server, same run: {fmt(bare, 3)} ms"
        f" ({BARE_ECHO_WHEN_SET} ms when the target was set)"
        if bare
        else ""
    )
    return [
        _versus("light_echo_vs_kserve", f"echo c16 throughput vs {label}",
                c16(subject, "echo"), c16(kserve, "echo"), ">=", 0.85, "infer/s", "31"),
        _versus("light_inline_vs_kserve", f"echo inline (fast) c16 throughput vs {label}",
                c16(inline, "echo"), c16(kserve, "echo"), ">=", 1.0, "infer/s", "31"),
        _versus("light_xgb_vs_kserve", f"XGBoost c16 throughput vs {label}",
                c16(subject, XGB), c16(kserve, XGB), ">=", 1.5, "infer/s", "31"),
        Target("light_cpu_ms", f"{whole} (ms)", ours, "<=", 0.24,
               f"{fmt(ours, 3)} ms{host}", "31"),
        Target("light_cpu_vs_kserve", f"{whole} vs {label}", ratio(ours, theirs), "<=", 1.3,
               f"{fmt(ours, 3)} vs {fmt(theirs, 3)} ms", "31"),
    ]  # fmt: skip


def summarize(results: Results) -> Results:
    """Adds the derived ``cells``, ``targets`` and CPU figures to a run's results."""
    runs = results.get("runs", [])
    results["cells"] = cells(runs)
    results["model_cpu_ms"] = model_cpu_ms(runs)
    results["physical_limit"] = physical_limit(results)
    results["targets"] = [t.to_json() for t in targets(results)]
    results["targets"] += [t for part in PARTS for t in part.targets(results)]
    results["cpu_per_request_ms"] = cpu_per_request(runs)
    results["foreign_load"] = foreign_load(runs)
    return results


# -- CPU ---------------------------------------------------------------------------------


def _requests(run: Mapping[str, Any]) -> float:
    """Requests served during the cell: counted by burn itself, else estimated for echo
    as its throughput over perf_analyzer's whole run."""
    if run["cpu"].get("executions"):
        return float(run["cpu"]["executions"])
    return float(run["result"]["throughput"]) * float(run["cpu"]["wall_s"])


def model_cpu_ms(runs: Sequence[Mapping[str, Any]], concurrency: int = 16) -> dict[str, float]:
    """server -> median CPU ms of one burn loop, measured by the model inside that server."""
    samples: dict[str, list[float]] = {}
    for run in runs:
        cpu = run.get("cpu") or {}
        if (
            run["model"] == "burn"
            and int(run["concurrency"]) == concurrency
            and cpu.get("model_cpu_ms")
        ):
            samples.setdefault(run["server"], []).append(float(cpu["model_cpu_ms"]))
    return {server: statistics.median(v) for server, v in sorted(samples.items())}


def physical_limit(results: Results, subject: str = "poolserve") -> float | None:
    """cores / per-request CPU: the burn loop's CPU as measured inside the subject during its
    burn c16 cells (same contention as the figure it is compared with); else the calibration."""
    cores = results.get("meta", {}).get("cores")
    inside = results.get("model_cpu_ms", {}).get(subject)
    if cores and inside:
        return float(cores) / (float(inside) / 1000)
    limit = results.get("meta", {}).get("physical_limit")
    return float(limit) if limit else None


def cpu_per_request(
    runs: Sequence[Mapping[str, Any]], concurrency: int = 16
) -> dict[str, dict[str, dict[str, float]]]:
    """server -> model -> process name (and "total") -> median CPU ms per request."""
    samples: dict[tuple[str, str, str], list[float]] = {}
    for run in runs:
        if int(run["concurrency"]) != concurrency or not run.get("result") or not run.get("cpu"):
            continue
        requests = _requests(run)
        if requests <= 0:
            continue
        parts = {"total": float(run["cpu"]["cpu_s"]), **run["cpu"].get("cpu_by_process", {})}
        for name, seconds in parts.items():
            key = (run["server"], run["model"], name)
            samples.setdefault(key, []).append(1000 * float(seconds) / requests)
    out: dict[str, dict[str, dict[str, float]]] = {}
    for (server, model, name), values in sorted(samples.items()):
        out.setdefault(server, {}).setdefault(model, {})[name] = statistics.median(values)
    return out


def foreign_load(runs: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """Cores used by processes outside the bench during the cells: median and max."""
    values = [float(r["cpu"]["foreign_cores"]) for r in runs if r.get("cpu")]
    if not values:
        return {}
    repeated = sum(1 for r in runs if int(r.get("attempts", 1)) > 1)
    return {
        "median_cores": statistics.median(values),
        "max_cores": max(values),
        "cells_measured_again": repeated,
    }


# -- Markdown -------------------------------------------------------------------------


def fmt(value: float | None, digits: int = 1) -> str:
    if value is None:
        return "n/a"
    return f"{value:,.{digits}f}"


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _labels(results: Results) -> dict[str, str]:
    return {s["key"]: s["label"] for s in results.get("servers", [])}


def serves(results: Results, server: str, model: str) -> bool:
    """Whether ``server`` serves ``model`` in the rounds (every model, for older results)."""
    for s in results.get("servers", []):
        if s["key"] == server:
            return model in s.get("models", MODELS)
    return True


def _shown(results: Results, server: str, model: str, c: int, what: str) -> str:
    if not serves(results, server, model):
        return "-"
    return fmt(cell(results, server, model, c, what))


def perf_tables(results: Results) -> str:
    labels = _labels(results)
    header = ["server"] + [f"{m} c{c}" for m in MODELS for c in CONCURRENCIES]
    tp_rows, p99_rows = [], []
    points = [(m, c) for m in MODELS for c in CONCURRENCIES]
    for key, label in labels.items():
        tp_rows.append([label] + [_shown(results, key, m, c, "throughput") for m, c in points])
        p99_rows.append([label] + [_shown(results, key, m, c, "p99_ms") for m, c in points])
    n = results.get("meta", {}).get("runs", "?")
    return (
        f"Throughput (infer/s, median of {n} runs per cell)\n\n"
        + table(header, tp_rows)
        + f"\n\np99 latency (ms, median of {n} runs per cell)\n\n"
        + table(header, p99_rows)
    )


def xgb_tables(results: Results) -> str:
    """Throughput and p99 of the XGBoost model, for the servers that serve it."""
    labels = _labels(results)
    header = ["server"] + [f"{XGB} c{c} infer/s" for c in CONCURRENCIES]
    header += [f"{XGB} c{c} p99 ms" for c in CONCURRENCIES]
    rows = []
    for key, label in labels.items():
        if not serves(results, key, XGB):
            continue
        rows.append(
            [label]
            + [fmt(cell(results, key, XGB, c, "throughput")) for c in CONCURRENCIES]
            + [fmt(cell(results, key, XGB, c, "p99_ms")) for c in CONCURRENCIES]
        )
    if not rows:
        return ""
    return (
        "XGBoost (a 200-tree regressor, FP32 [1,20] per request, each server's own way to serve "
        "it; median of the runs per cell)\n\n" + table(header, rows)
    )


def memory_table(results: Results) -> str:
    memory = results.get("memory", {})
    labels = _labels(results)
    names = {
        "a": "(a) echo + burn in one pool, 2 workers",
        "b": "(b) echo and burn each in its own gid, 2 workers each",
        "c": "(c) one model holding a 400 MiB array, 4 workers",
        "x": "(x) the XGBoost model alone, 2 workers",
    }
    servers = sorted({k for config in memory.values() for k in config if k in labels})
    rows = []
    for config, name in names.items():
        found = memory.get(config, {})
        row = [name]
        for key in servers:
            entry = found.get(key)
            row.append(
                f"{entry['pss_bytes'] / MIB:,.0f} MiB ({entry['processes']} proc)" if entry else "-"
            )
        rows.append(row)
    return table(["configuration"] + [labels[k] for k in servers], rows)


def memory_note(results: Results) -> str:
    if not any("kserve" in config for config in results.get("memory", {}).values()):
        return ""
    return (
        "\n\nKServe is measured in (a) only: one process holds every model, with no pools, gids "
        "or workers, so (b) and (c) do not apply to it."
    )


def memory_breakdown(results: Results, subject: str = "poolserve") -> str:
    lines = []
    for config, servers in sorted(results.get("memory", {}).items()):
        found = servers.get(subject) if isinstance(servers, dict) else None
        if not found or not found.get("by_process"):
            continue
        parts = ", ".join(f"{name} {b / MIB:,.0f}" for name, b in found["by_process"])
        lines.append(f"- {subject} ({config}), MiB by process: {parts}")
    return "\n".join(lines)


def host_calibration(o: dict[str, Any]) -> str:
    """The host beside an overload figure: how long burn takes here, and the outside load."""
    if o.get("burn_cpu_ms") is None:
        return ""
    return (
        f" (host: burn {fmt(o.get('burn_cpu_ms'), 1)} ms CPU, physical limit "
        f"{fmt(o.get('physical_limit'))}/s, other processes {fmt(o.get('foreign_cores'), 2)} cores)"
    )


def overload_table(results: Results) -> str:
    labels = _labels(results)
    rows = []
    for key, found in results.get("overload", {}).items():
        for o in found.get("repeats", [found]):
            share = o.get("abandoned_fraction")
            before, after = o.get("capacity_before"), o.get("capacity_after")
            rows.append(
                [
                    labels.get(key, key),
                    fmt(o.get("capacity"))
                    + (f" ({fmt(before)} / {fmt(after)})" if before is not None else ""),
                    fmt(o.get("offered_rate")),
                    fmt(o.get("goodput_per_s")),
                    fmt(o.get("goodput_ratio"), 2),
                    fmt(o.get("goodput_ratio_client_clock"), 2),
                    str(o.get("executions", "n/a")),
                    fmt(100 * share if share is not None else None) + " %",
                    fmt(o.get("burn_cpu_ms"), 1),
                    fmt(o.get("foreign_cores"), 2),
                    fmt(o.get("server_cpu_s")),
                ]
            )
    header = [
        "server",
        "capacity/s (before / after)",
        "offered/s",
        "goodput/s",
        "goodput / capacity",
        "same, client's clock",
        "burn executions",
        "executions for callers gone",
        "burn ms CPU (host)",
        "other load (cores)",
        "server CPU s",
    ]
    return table(header, rows)


def overload_console(results: Results) -> str:
    """What `bench/run.py --only overload` prints."""
    meta = results.get("meta", {})
    head = (
        f"overload only ({meta.get('mode', '?')}), {meta.get('cores', '?')} cores "
        f"({meta.get('cpu', '?')}): burn {meta.get('iterations', '?')} iterations = "
        f"{fmt(meta.get('burn_cpu_ms'), 2)} ms CPU on this host, physical limit "
        f"{fmt(meta.get('physical_limit'))}/s; {meta.get('overload_s', '?')} s per run"
    )
    return head + "\n\n" + overload_table(results)


def cpu_table(results: Results) -> str:
    labels = _labels(results)
    per = results.get("cpu_per_request_ms", {})
    rows = []
    for key, label in labels.items():
        found = per.get(key, {})
        row = [label]
        for model in MODELS:
            parts = found.get(model, {})
            split = ", ".join(
                f"{name} {ms:.2f}" for name, ms in sorted(parts.items()) if name != "total"
            )
            total = parts.get("total")
            if total is not None:
                row.append(f"{fmt(total, 2)} ({split})")
            else:
                row.append("n/a" if serves(results, key, model) else "-")
        rows.append(row)
    return table(["server", "echo c16: ms CPU/request (by process)", "burn c16"], rows)


def targets_table(results: Results, with_issue: bool = True) -> str:
    rows = []
    for t in results.get("targets", []):
        value = fmt(t["value"], 2) if t["value"] is not None else "n/a"
        detail = f" ({t['detail']})" if t.get("detail") else ""
        verdict = "PASS" if t["passed"] else "MISS"
        row = [t["label"] + detail, value, f"{t['op']} {t['threshold']}", verdict]
        rows.append([t.get("issue", ""), *row] if with_issue else row)
    header = ["target (poolserve, same run)", "measured", "target", "result"]
    return table(["issue", *header] if with_issue else header, rows)


def burn_line(results: Results) -> str:
    inside = results.get("model_cpu_ms", {})
    if not inside:
        return ""
    labels = _labels(results)
    parts = ", ".join(f"{labels.get(k, k)} {v:.2f} ms" for k, v in inside.items())
    cores = results.get("meta", {}).get("cores", "?")
    return (
        f"CPU of one burn loop measured by the model inside each server during the burn c16 "
        f"cells (median): {parts}. Physical limit = {cores} cores / poolserve's = "
        f"{fmt(results.get('physical_limit'))}/s."
    )


def load_line(results: Results) -> str:
    load = results.get("foreign_load", {})
    if not load:
        return ""
    return (
        f"This machine is shared: processes outside the bench used a median "
        f"{load['median_cores']:.2f} cores (max {load['max_cores']:.2f}) of "
        f"{results.get('meta', {}).get('cores', '?')} during the perf_analyzer cells "
        f"(kept attempt of each cell; {load.get('cells_measured_again', 0)} cells were measured "
        "again because other processes used more than 0.35 cores)."
    )


def header_lines(results: Results) -> list[str]:
    meta = results.get("meta", {})
    versions = meta.get("versions", {})
    lines = [
        f"Run {meta.get('date', '?')} ({meta.get('mode', '?')} mode, `{meta.get('command', '')}`), "
        f"{meta.get('cores', '?')} cores ({meta.get('cpu', '?')}), "
        f"Python {versions.get('python', '?')}.",
        "Versions: " + ", ".join(f"{k} {v}" for k, v in versions.items() if k != "python") + ".",
        f"Client: perf_analyzer over gRPC, FP32 [1,16], concurrency 1/4/16, servers interleaved "
        f"per round, {meta.get('window_ms', '?')} ms windows x 3 per cell. `burn`: "
        f"{meta.get('iterations', '?')} iterations, calibrated once to "
        f"{fmt(meta.get('burn_cpu_ms'), 2)} ms CPU and passed to every server.",
        burn_line(results),
        *server_lines(results),
        load_line(results),
    ]
    return [line for line in lines if line]


def server_lines(results: Results) -> list[str]:
    """What the bench added to or changed in each peer, and the inline configuration."""
    keys = set(_labels(results))
    mlserver = any(k.startswith("mlserver") for k in keys)
    kserve = "kserve" in keys
    peers = [name for name, present in (("MLServer", mlserver), ("KServe", kserve)) if present]
    lines = []
    if peers:
        names = " and ".join(peers)
        lines.append(
            f"{names} {'lacks' if len(peers) == 1 else 'lack'} ModelConfig and ModelStatistics, "
            "which perf_analyzer needs: the bench added those two handlers around the unmodified "
            f"{names} server{'s' if len(peers) > 1 else ''} (statistics report zero counts, "
            'version "1").'
        )
    if mlserver:
        lines.append(
            "MLServer runs with its defaults except parallel_workers, loopback host and ports, "
            "debug false (its default true adds an access-log interceptor to every call) and "
            "grpc_max_message_length 64 MiB."
        )
    if kserve:
        lines.append(
            "KServe runs its models (kserve.Model subclasses, tensors declared through "
            "get_input_types/get_output_types for ModelMetadata) on kserve.ModelServer with its "
            "defaults (one process: its --workers adds REST processes only) except "
            "KSERVE_LOGLEVEL=WARNING (at its default INFO it logs every gRPC call and every "
            "request's latency), 64 MiB gRPC message limits and free ports (--grpc_port, "
            "--http_port). KServe has no listen-address setting and binds gRPC to [::]:PORT: "
            "the bench's launcher (bench/peers/kserve_server.py) binds it to 127.0.0.1 by "
            "rewriting the address KServe passes to add_insecure_port, and sets its uvicorn "
            "REST host to 127.0.0.1."
        )
    if "poolserve-inline" in keys:
        lines.append(
            f"{_labels(results)['poolserve-inline']}: the same echo model with "
            '`"parallel_workers": 0` and `parameters.extra.inline_fast: true` in its '
            "model-settings.json, so it runs inside the pool server process, on its event loop, "
            "with no worker hop; it serves echo only."
        )
    return lines


def markdown(results: Results) -> str:
    parts = [
        "# poolserve bench: latest run",
        "\n".join(header_lines(results)),
        "## Targets\n\n" + targets_table(results),
        "## Throughput and latency\n\n" + perf_tables(results),
        *(
            ["## XGBoost\n\n" + xgb_note(results) + "\n\n" + xgb_tables(results)]
            if xgb_tables(results)
            else []
        ),
        "## Memory (PSS of the whole process tree, after warm-up)\n\n"
        + memory_table(results)
        + memory_note(results)
        + "\n\n"
        + memory_breakdown(results),
        "## Server CPU per request at concurrency 16 (approximate)\n\n"
        "CPU of the server's process tree during a cell over the requests it served "
        "(throughput x duration of the perf_analyzer run), median of the runs.\n\n"
        + cpu_table(results),
        "## Overload\n\n" + overload_note(results) + "\n\n" + overload_table(results),
        *(
            [f"## MLServer runtimes under poolserve\n\n{dropin_table(results)}"]
            * bool(dropin_table(results))
        ),
        *(["## Batching\n\n" + batching.markdown(results["batching"])]
          if results.get("batching") else []),
        *(["## Decoupled models\n\n" + decoupled.markdown(results["decoupled"])]
          if results.get("decoupled") else []),
        *parts_sections(results, "##"),
    ]  # fmt: skip
    return "\n\n".join(parts) + "\n"


def dropin_table(results: Results) -> str:
    """bench/mlserver_dropin.py's table, rendered by that phase."""
    return str((results.get("mlserver_dropin") or {}).get("table", ""))


def parts_sections(results: Results, level: str) -> list[str]:
    found = [(part.TITLE, part.section(results)) for part in PARTS]
    return [f"{level} {title}\n\n{text}" for title, text in found if text]


def xgb_note(results: Results) -> str:
    return (
        "One XGBoost model file, trained once per run (`XGBRegressor`, 200 trees of depth 6, 20 "
        "features; bench/peers/workload.py), loaded by every server from the same xgboost-cpu "
        "release. poolserve: a model class that loads it into a `Booster`, warms it up in "
        "`load()` and predicts with `inplace_predict` (XGBoost's advice for one row at a time), 2 "
        "forked workers, default settings (threads_per_worker 1). "
        "MLServer: its own XGBoost runtime (mlserver-xgboost 1.7.1, `mlserver_xgboost."
        "XGBoostModel`, `parameters.uri`), parallel_workers 2 (mlserver-xgboost installed "
        "without its `xgboost` dependency, the GPU build, beside xgboost-cpu). KServe: the "
        "model code of KServe's XGBoost server (kserve/python/xgbserver, not on PyPI: a "
        "`Booster` with nthread 1, its default, and a `DMatrix` per request) as a kserve.Model "
        "on kserve.ModelServer, one process. perf_analyzer sends FP32 [1,20] per request."
    )


def overload_note(results: Results) -> str:
    meta = results.get("meta", {})
    return (
        f"`burn` offered open-loop at 2x each server's capacity for "
        f"{meta.get('overload_s', '?')} s by the bench's grpc.aio client, 200 ms deadline per "
        "request. Capacity is that same client's burn throughput in a closed loop at "
        "concurrency 16, measured just before and just after the overload (their mean): on a "
        "shared host the cores left to the servers drift within minutes, so perf_analyzer's "
        "figure from the rounds above is not the capacity of that moment. Goodput = OK replies "
        "per second (gRPC ends a call at its deadline, so an OK came in time; the column "
        "\"same, client's clock\" counts only replies whose latency on the client's own clock, "
        "which includes its event loop's lag, was within 200 ms). Executions are counted by the "
        "model itself (one record appended to a file per finished `burn`, the same code in "
        "every server) until the count stops moving; executions minus OK replies is the work "
        "done for callers that had already given up (every execution costs the same loop). "
        "An overload during which other processes used more than 0.35 cores is measured again "
        "(twice at most), keeping the quietest. `make bench` runs it on every server that "
        "serves `burn` (KServe included), `make bench-quick` on poolserve only; "
        "`bench/run.py --only overload` runs it alone."
    )


def duration_line(results: Results) -> str:
    """How long the run took, from its own timings (meta.timings_s.total)."""
    meta = results.get("meta", {})
    total = meta.get("timings_s", {}).get("total")
    if not total:
        return ""
    return (
        f"This run took {total / 60:.0f} minutes on {meta.get('cores', '?')} cores "
        "(`meta.timings_s` in bench/results/latest.json has each phase); `make bench` then "
        "runs bench/workerpool_bench.py too. `make bench-quick` measures one run per cell "
        "instead of three, and is shorter."
    )


def docs_section(results: Results, chart: str = "../bench/results/latest.png") -> str:
    """The generated part of docs/performance.md: the whole report of a run, one
    heading level down, without the tracker's issue numbers."""
    memory = memory_table(results)
    dropin = dropin_table(results)
    return "\n\n".join(
        part
        for part in [
            SECTION_START,
            "## Benchmark",
            "`make bench` installs MLServer, KServe and perf_analyzer under bench/.peers and "
            "measures poolserve against them and a bare grpc.aio server side by side. Every "
            "figure below is generated from bench/results/latest.json; the same figures are in "
            "[bench/results/latest.md](../bench/results/latest.md).",
            duration_line(results),
            "\n".join(header_lines(results)),
            "### Targets\n\n" + targets_table(results, with_issue=False),
            "### Throughput and latency\n\n" + perf_tables(results),
            ("### XGBoost\n\n" + xgb_note(results) + "\n\n" + xgb_tables(results))
            if xgb_tables(results)
            else "",
            (
                "### Memory (PSS of the whole process tree, after warm-up)\n\n"
                + memory
                + memory_note(results)
            )
            if memory
            else "",
            "### Server CPU per request at concurrency 16 (approximate)\n\n"
            "CPU of the server's process tree during a cell over the requests it served "
            "(throughput x duration of the perf_analyzer run), median of the runs.\n\n"
            + cpu_table(results),
            "### Overload\n\n" + overload_note(results) + "\n\n" + overload_table(results),
            f"### MLServer runtimes under poolserve\n\n{dropin}" if dropin else "",
            ("### Batching\n\n" + batching.markdown(results["batching"]))
            if results.get("batching")
            else "",
            ("### Decoupled models\n\n" + decoupled.markdown(results["decoupled"]))
            if results.get("decoupled")
            else "",
            *parts_sections(results, "###"),
            f"![throughput and p99 per concurrency]({chart})",
            SECTION_END,
        ]
        if part
    )


def update_section(text: str, section: str) -> str:
    """Replaces what is between the markers (adds them at the end when missing)."""
    start, end = text.find(SECTION_START), text.find(SECTION_END)
    if start == -1 or end == -1 or end < start:
        return text.rstrip("\n") + "\n\n" + section + "\n"
    return text[:start] + section + text[end + len(SECTION_END) :]


def console(results: Results) -> str:
    return "\n\n".join(
        part
        for part in [
            "\n".join(header_lines(results)),
            targets_table(results),
            perf_tables(results),
            xgb_tables(results),
            memory_table(results) + memory_note(results),
            memory_breakdown(results),
            cpu_table(results),
            overload_table(results),
            dropin_table(results),
            batching.markdown(results.get("batching") or {}),
            decoupled.markdown(results.get("decoupled") or {}),
        ]
        if part
    )
