"""``poolserve top``: a live view of a running tree, refreshed every second.

Built on the same data as the metrics: the router's ``/metrics`` (found in
``<run_dir>/metrics.addr``, or given with ``--addr``), parsed with
``prometheus_client``, for each model's request rate, p50/p99, queue depth,
busy workers and errors; and, with a run directory, the supervisor's tree
(``poolserve status``) for each process's pid, kind and state, with CPU %
and RSS read from /proc between two samples. ``--once`` prints one frame
(two samples one interval apart) and exits: for scripts and pipes. Without a
terminal, frames follow each other without clearing the screen.

Exit codes: 0, or 4 when neither the metrics nor the supervisor answer.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from poolserve.service.contract.rundir import METRICS_ADDRESS_FILE
from poolserve.service.lifecycle.procstat import proc_stat
from poolserve.supervisor.status_cli import (
    EXIT_OK,
    EXIT_UNREACHABLE,
    format_bytes,
    resolve_run_dir,
)

CLEAR = "\x1b[H\x1b[2J"
FETCH_TIMEOUT_S = 5.0
ModelKey = tuple[str, str, str]  # model, version, pool


def add_top_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--run-dir", help="the server's run directory")
    parser.add_argument("--grpc-port", type=int, help="the server's port, to find its run dir")
    parser.add_argument("--addr", help="the router's metrics address host:port (no run dir)")
    parser.add_argument("--once", action="store_true", help="print one frame and exit")
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between frames")


@dataclass
class Sample:
    """One reading of the metrics and of the processes."""

    at: float
    requests: dict[ModelKey, float] = field(default_factory=dict)  # success + failure
    errors: dict[ModelKey, float] = field(default_factory=dict)
    buckets: dict[ModelKey, list[tuple[float, float]]] = field(default_factory=dict)
    queue: dict[str, float] = field(default_factory=dict)
    busy: dict[str, float] = field(default_factory=dict)
    workers: dict[str, float] = field(default_factory=dict)
    up: dict[str, float] = field(default_factory=dict)
    processes: list[tuple[int, str, str]] = field(default_factory=list)  # pid, kind, state
    cpu: dict[int, float] = field(default_factory=dict)  # cpu seconds by pid
    rss: dict[int, int] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)


def parse_metrics(text: str, sample: Sample) -> None:
    """The families ``top`` shows, from the router's exposition."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = s.labels
            key = (labels.get("model", ""), labels.get("version", ""), labels.get("pool", ""))
            name = s.name.removesuffix("_total")  # the parser adds it to Triton's counters
            if name == "nv_inference_request_success":
                sample.requests[key] = sample.requests.get(key, 0.0) + s.value
            elif name == "nv_inference_request_failure":
                sample.requests[key] = sample.requests.get(key, 0.0) + s.value
                sample.errors[key] = sample.errors.get(key, 0.0) + s.value
            elif s.name == "nv_inference_request_duration_seconds_bucket":
                le = labels["le"]
                bound = float("inf") if le == "+Inf" else float(le)
                sample.buckets.setdefault(key, []).append((bound, s.value))
            elif s.name == "poolserve_queue_depth":
                sample.queue[labels["pool"]] = s.value
            elif s.name == "poolserve_workers":
                pool = labels["pool"]
                sample.workers[pool] = sample.workers.get(pool, 0.0) + s.value
                if labels["state"] == "busy":
                    sample.busy[pool] = s.value
            elif s.name == "poolserve_pool_up":
                sample.up[labels["pool"]] = s.value


def quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """As PromQL's histogram_quantile: ``buckets`` are (upper bound, cumulative count)."""
    ordered = sorted(buckets)
    if not ordered or ordered[-1][1] <= 0:
        return None
    rank = q * ordered[-1][1]
    lower, below = 0.0, 0.0
    for bound, count in ordered:
        if count >= rank:
            if bound == float("inf"):
                return lower  # above the last bound: its lower edge, as Prometheus
            inside = count - below
            return lower + (bound - lower) * ((rank - below) / inside if inside else 0.0)
        lower, below = bound, count
    return lower


def _delta_buckets(
    now: list[tuple[float, float]], before: list[tuple[float, float]] | None
) -> list[tuple[float, float]]:
    if not before:
        return now
    old = dict(before)
    return [(bound, count - old.get(bound, 0.0)) for bound, count in now]


def take_sample(run_dir: Path | None, addr: str | None, timeout: float) -> Sample:
    sample = Sample(at=time.monotonic())
    address = addr
    if address is None and run_dir is not None:
        try:
            address = (run_dir / METRICS_ADDRESS_FILE).read_text().strip()
        except OSError:
            sample.problems.append(
                f"no {run_dir / METRICS_ADDRESS_FILE}: metrics are off (metrics_port -1) "
                "or the router is not running"
            )
    if address:
        try:
            with urllib.request.urlopen(f"http://{address}/metrics", timeout=timeout) as reply:
                parse_metrics(reply.read().decode(), sample)
        except (OSError, urllib.error.URLError) as exc:
            sample.problems.append(f"metrics at {address}: {exc}")
    if run_dir is not None:
        sample.processes = _tree_processes(run_dir, timeout, sample.problems)
    for pid, _, _ in sample.processes:
        stat = proc_stat(pid)
        if stat is not None:
            sample.cpu[pid] = stat.cpu_seconds
            sample.rss[pid] = stat.rss_bytes
    return sample


def _tree_processes(
    run_dir: Path, timeout: float, problems: list[str]
) -> list[tuple[int, str, str]]:
    import grpc

    from poolserve.supervisor.control import fetch_tree_status, pool_gid, walk

    try:
        status = asyncio.run(fetch_tree_status(run_dir, timeout))
    except grpc.RpcError as exc:
        details = exc.details() if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
        problems.append(f"supervisor in {run_dir}: {details}")
        return []
    rows: list[tuple[int, str, str]] = []
    for node in walk(status.root):
        gid = pool_gid(node)
        if node is status.root and node.pid:
            rows.append((node.pid, "supervisor", node.state))
        elif gid is not None:
            if node.pid:
                rows.append((node.pid, f"pool {gid}", node.state))
            if node.HasField("pool"):
                pool = node.pool
                if pool.zygote_pid:
                    rows.append((pool.zygote_pid, f"zygote {gid}", "running"))
                rows += [(w.pid, f"worker {gid}", w.state) for w in pool.workers]
        elif node.pid:
            rows.append((node.pid, node.id, node.state))
    return rows


def render(before: Sample, now: Sample) -> str:
    elapsed = max(now.at - before.at, 1e-6)
    lines = [f"poolserve top  {time.strftime('%H:%M:%S')}  interval {elapsed:.1f} s", ""]
    if now.processes:
        lines.append(f"{'PID':>8}  {'KIND':<20} {'STATE':<9} {'CPU%':>6} {'RSS':>11}")
        for pid, kind, state in now.processes:
            cpu = ""
            if pid in now.cpu and pid in before.cpu:
                cpu = f"{100 * (now.cpu[pid] - before.cpu[pid]) / elapsed:.1f}"
            rss = format_bytes(now.rss[pid]) if pid in now.rss else ""
            lines.append(f"{pid:>8}  {kind:<20} {state:<9} {cpu:>6} {rss:>11}")
        lines.append("")
    if now.requests or now.up:
        lines.append(
            f"{'MODEL':<20} {'POOL':<12} {'REQ/S':>8} {'P50 MS':>8} {'P99 MS':>8} "
            f"{'QUEUE':>6} {'BUSY':>6} {'ERRORS':>7}"
        )
        for key in sorted(now.requests):
            name, version, pool = key
            rate = (now.requests[key] - before.requests.get(key, 0.0)) / elapsed
            window = _delta_buckets(now.buckets.get(key, []), before.buckets.get(key))
            if not window or max(c for _, c in window) <= 0:
                window = now.buckets.get(key, [])  # nothing new: the whole run's
            p50, p99 = quantile(0.5, window), quantile(0.99, window)
            label = f"{name}:{version}" if version else name
            busy = f"{now.busy.get(pool, 0):.0f}/{now.workers.get(pool, 0):.0f}"
            lines.append(
                f"{label:<20} {pool:<12} {rate:>8.1f} {_ms(p50):>8} {_ms(p99):>8} "
                f"{now.queue.get(pool, 0):>6.0f} {busy:>6} {now.errors.get(key, 0):>7.0f}"
            )
        down = [pool for pool, up in sorted(now.up.items()) if not up]
        if down:
            lines.append(f"pools not answering: {', '.join(down)}")
    lines += [f"! {problem}" for problem in now.problems]
    return "\n".join(lines) + "\n"


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f}"


def top_main(args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    run_dir = (
        None if args.addr and not args.run_dir else resolve_run_dir(args.run_dir, args.grpc_port)
    )
    interval = max(0.1, args.interval)
    before = take_sample(run_dir, args.addr, FETCH_TIMEOUT_S)
    clear = out.isatty() and not args.once
    try:
        while True:
            time.sleep(interval)  # the refresh period, not a readiness wait
            now = take_sample(run_dir, args.addr, FETCH_TIMEOUT_S)
            frame = render(before, now)
            out.write((CLEAR if clear else "") + frame + ("" if clear or args.once else "\n"))
            out.flush()
            if args.once:
                answered = bool(now.requests or now.up or now.processes)
                return EXIT_OK if answered else EXIT_UNREACHABLE
            before = now
    except KeyboardInterrupt:
        return EXIT_OK
