"""What a /metrics scrape costs the router: 4 pools x 8 workers by default.

Starts ``poolserve serve`` with ``--pools`` copies of the echo model, each in
its own pool, ``--workers`` workers per pool; waits until every worker is
idle; sends a few requests to each model; then scrapes ``/metrics``
``--scrapes`` times, one after the other, and prints the router's CPU time
per scrape (user + system from /proc, so the pools' work answering is not
counted), the wall time per scrape, and the exposition's size.

    .venv/bin/python bench/metrics_scrape.py                  # 4 pools x 8 workers, 50 scrapes
    .venv/bin/python bench/metrics_scrape.py --pools 2 --workers 2 --scrapes 20

Every process it starts is stopped by PID before it exits.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "reliability"))

from poolserve.service.lifecycle.procstat import proc_stat  # noqa: E402

from harness import INFER, Tree, comm, infer_bytes, make_repo, payload, pool_status  # noqa: E402


async def _wait_idle(run_dir: Path, gids: list[str], workers: int, timeout: float) -> None:
    end = time.monotonic() + timeout
    for gid in gids:
        while True:
            states = [w.state for w in (await pool_status(run_dir, gid)).workers]
            if states.count("idle") >= workers:
                break
            if time.monotonic() > end:
                raise RuntimeError(f"pool {gid}: workers {states} after {timeout} s")
            await asyncio.sleep(0.2)  # polling the pool's status: it has no event


async def _traffic(address: str, models: list[str], each: int) -> None:
    import grpc

    async with grpc.aio.insecure_channel(address) as channel:
        call = channel.unary_unary(INFER)
        for model in models:
            for key in range(each):
                await call(infer_bytes(model, payload(key)), timeout=30)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pools", type=int, default=4)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--scrapes", type=int, default=50)
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="metrics-bench-"))
    gids = [f"p{i}" for i in range(args.pools)]
    repo = make_repo(work / "repo", {})
    for gid in gids:
        make_repo(work / "src", {"echo": gid})
        shutil.move(str(work / "src" / "echo"), repo / f"echo_{gid}")
        settings = repo / f"echo_{gid}" / "model-settings.json"
        settings.write_text(settings.read_text().replace('"echo"', f'"echo_{gid}"'))
    tree = Tree(repo, work / "run", workers=args.workers, extra=("--metrics-port", "0"))
    try:
        tree.start(timeout=300)
        asyncio.run(_wait_idle(tree.run_dir, gids, args.workers, 600))
        asyncio.run(_traffic(tree.address, [f"echo_{g}" for g in gids], 20))
        router = next(p for p in tree.snapshot() if comm(p) == "poolserve-rtr")
        url = f"http://{(tree.run_dir / 'metrics.addr').read_text().strip()}/metrics"
        size = len(urllib.request.urlopen(url, timeout=30).read())  # warm: channels open
        walls = []
        before = proc_stat(router)
        for _ in range(args.scrapes):
            began = time.perf_counter()
            urllib.request.urlopen(url, timeout=30).read()
            walls.append(time.perf_counter() - began)
        after = proc_stat(router)
        assert before is not None and after is not None
        cpu_ms = (after.cpu_seconds - before.cpu_seconds) * 1000 / args.scrapes
        print(
            f"metrics scrape, {args.pools} pools x {args.workers} workers, {args.scrapes} scrapes: "
            f"router CPU {cpu_ms:.1f} ms/scrape (clock ticks of 10 ms, averaged), "
            f"wall p50 {statistics.median(walls) * 1000:.1f} ms, "
            f"max {max(walls) * 1000:.1f} ms, {size} bytes"
        )
    finally:
        tree.close()
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
