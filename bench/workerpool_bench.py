"""MLPool's comparison, reproduced on this machine with poolserve's WorkerPool.

One uvicorn process serves examples/fastapi_app. N concurrent clients (10 by
default) each send M requests (50) of a CPU-burn model, first to
``/predict-inline`` (scoring in the API process: a plain ``def`` endpoint on
FastAPI's thread pool, one request computing at a time under the GIL), then to
``/predict`` (scoring through the pool, 2 workers by default). It prints both
wall times, their ratio, and the physical limit of that ratio: min(workers,
cores), since the pool cannot compute faster than its workers on the cores
there are; it also measures what as many plain processes burning side by side
get now, since a shared machine gives less. MLPool reported 338 s against
84 s (4.0x) with 11 workers on its machine.

    .venv/bin/python bench/workerpool_bench.py            # 10 clients x 50 requests
    .venv/bin/python bench/workerpool_bench.py --quick    # 10 x 5, a smoke run

Needs fastapi and uvicorn in the environment. Every process it starts is
stopped by PID before it exits.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import http.client
import json
import os
import selectors
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
APP_DIR = ROOT / "examples" / "fastapi_app"
BIN = Path(sys.executable).parent
READY = "Application startup complete."
MLPOOL = "MLPool published 338 s in the API process vs 84 s with 11 workers (4.0x)"


@dataclass
class Run:
    mode: str
    wall_s: float
    requests: int
    errors: int
    p50_ms: float
    p95_ms: float

    @property
    def throughput(self) -> float:
        return self.requests / self.wall_s


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def descendants(pid: int) -> list[int]:
    found: list[int] = []
    stack = [pid]
    while stack:
        parent = stack.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            with contextlib.suppress(OSError):
                for kid in (task / "children").read_text().split():
                    found.append(int(kid))
                    stack.append(int(kid))
    return found


@contextlib.contextmanager
def uvicorn(workers: int) -> Iterator[int]:
    """Runs the example app under uvicorn on a loopback port; yields the port."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen(128)
    port = int(listener.getsockname()[1])
    argv = [str(BIN / "uvicorn"), "app:app", "--app-dir", str(APP_DIR)]
    argv += ["--fd", str(listener.fileno()), "--log-level", "info", "--no-access-log"]
    proc = subprocess.Popen(
        argv,
        pass_fds=(listener.fileno(),),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "WORKERS": str(workers), "MAX_QUEUE": "10000"},
    )
    listener.close()
    seen: set[int] = set()
    try:
        wait_ready(proc)
        assert proc.stderr is not None
        drain = threading.Thread(target=proc.stderr.read, daemon=True)  # the rest of its log
        drain.start()
        seen.update(descendants(proc.pid))
        yield port
    finally:
        seen.update(descendants(proc.pid))
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for pid in seen:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def wait_ready(proc: subprocess.Popen[str], timeout: float = 120.0) -> None:
    """Reads uvicorn's log until the app's lifespan has started (the pool is up)."""
    assert proc.stderr is not None
    deadline = time.monotonic() + timeout
    log: list[str] = []
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stderr, selectors.EVENT_READ)
        while time.monotonic() < deadline:
            if not sel.select(timeout=max(0.0, deadline - time.monotonic())):
                break
            line = proc.stderr.readline()
            if not line:
                break
            log.append(line)
            if READY in line:
                return
    raise RuntimeError("uvicorn did not start:\n" + "".join(log))


def post(conn: http.client.HTTPConnection, path: str, body: dict[str, Any]) -> int:
    conn.request("POST", path, json.dumps(body), {"content-type": "application/json"})
    response = conn.getresponse()
    response.read()
    return response.status


def client(port: int, path: str, body: dict[str, Any], requests: int) -> list[float | None]:
    """One client: ``requests`` sequential calls on a keep-alive connection."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    latencies: list[float | None] = []
    try:
        for _ in range(requests):
            began = time.perf_counter()
            status = post(conn, path, body)
            latencies.append(time.perf_counter() - began if status == 200 else None)
    finally:
        conn.close()
    return latencies


def run(mode: str, port: int, path: str, args: argparse.Namespace) -> Run:
    body = {"features": [0.25, 0.5, 0.75, 1.0], "work": args.work}
    client(port, path, body, 2)  # warm: connections, first calls
    began = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(args.clients) as pool:
        futures = [
            pool.submit(client, port, path, body, args.requests) for _ in range(args.clients)
        ]
        results = [f.result() for f in futures]
    wall = time.perf_counter() - began
    latencies = [x for r in results for x in r]
    ok = sorted(x for x in latencies if x is not None)
    p95 = ok[int(0.95 * (len(ok) - 1))] if ok else 0.0
    return Run(
        mode,
        wall,
        len(latencies),
        sum(1 for x in latencies if x is None),
        statistics.median(ok) * 1000 if ok else 0.0,
        p95 * 1000,
    )


BURN = """
import sys, time
sys.path.insert(0, sys.argv[1])
from cpu_model import load_model, score
model = load_model()
began = time.perf_counter()
for _ in range(int(sys.argv[3])):
    score(model, [0.25, 0.5, 0.75, 1.0], int(sys.argv[2]))
print(time.perf_counter() - began)
"""


def burn_s(processes: int, work: int, calls: int) -> float:
    """Mean time ``processes`` plain processes take to burn ``calls`` calls each, side by side."""
    argv = [sys.executable, "-c", BURN, str(APP_DIR), str(work), str(calls)]
    procs = [subprocess.Popen(argv, stdout=subprocess.PIPE, text=True) for _ in range(processes)]
    times = [float(p.communicate()[0]) for p in procs]
    return sum(times) / len(times)


def capacity(processes: int, work: int, calls: int = 10) -> float:
    """How much faster ``processes`` processes burn than one, measured now, pool aside:
    what the cores (and whatever else runs on them) really give."""
    alone = burn_s(1, work, calls)
    side_by_side = burn_s(processes, work, calls)
    return processes * alone / side_by_side


def compute_ms(port: int) -> float:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("GET", "/stats")
        stats = json.loads(conn.getresponse().read())
    finally:
        conn.close()
    burn = stats["models"]["burn"]
    return float(burn["compute_ns"]) / max(1, int(burn["executed"])) / 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--requests", type=int, default=50, help="per client")
    parser.add_argument("--work", type=int, default=300_000, help="model iterations a request")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="5 requests per client")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    if args.quick:
        args.requests = 5
    limit = min(args.workers, cores())
    total = args.clients * args.requests
    print(f"{args.clients} clients x {args.requests} requests = {total}, work={args.work}")
    print(f"machine: {cores()} cores; pool: {args.workers} workers; one uvicorn process")
    before = capacity(args.workers, args.work)
    print(f"  {args.workers} plain processes burn {before:.2f}x as fast as one (measured now)")
    with uvicorn(args.workers) as port:
        inline = run("in the API process", port, "/predict-inline", args)
        print(f"  in the API process: {inline.wall_s:7.1f} s", flush=True)
        pooled = run(f"WorkerPool ({args.workers} workers)", port, "/predict", args)
        print(f"  through the pool:   {pooled.wall_s:7.1f} s", flush=True)
        per_call = compute_ms(port)
    after = capacity(args.workers, args.work)
    measured = (before + after) / 2
    ratio = inline.wall_s / pooled.wall_s
    print()
    print(f"{'mode':<24}{'wall s':>9}{'req/s':>9}{'p50 ms':>9}{'p95 ms':>9}{'errors':>8}")
    for r in (inline, pooled):
        print(
            f"{r.mode:<24}{r.wall_s:>9.1f}{r.throughput:>9.1f}"
            f"{r.p50_ms:>9.0f}{r.p95_ms:>9.0f}{r.errors:>8}"
        )
    print()
    print(f"speed-up through the pool: {ratio:.2f}x")
    print(
        f"physical limit:            {limit:.2f}x  (min({args.workers} workers, {cores()} cores);"
        f" {ratio / limit:.0%} of it)"
    )
    print(
        f"measured parallelism:      {measured:.2f}x  ({args.workers} plain processes vs one, "
        f"before and after: {before:.2f}x, {after:.2f}x; the pool reaches "
        f"{ratio / measured:.0%} of it)"
    )
    print(f"score compute time:        {per_call:.1f} ms a call, in a worker")
    print(f"load average:              {os.getloadavg()[0]:.2f} (1 min, at the end)")
    print(f"reference:                 {MLPOOL}")
    if args.json is not None:
        report = {
            "clients": args.clients,
            "requests_per_client": args.requests,
            "work": args.work,
            "workers": args.workers,
            "cores": cores(),
            "runs": [asdict(inline), asdict(pooled)],
            "ratio": ratio,
            "limit": limit,
            "measured_parallelism": [before, after],
            "load_average": os.getloadavg()[0],
            "compute_ms": per_call,
        }
        args.json.write_text(json.dumps(report, indent=2))
    return 0 if inline.errors == pooled.errors == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
