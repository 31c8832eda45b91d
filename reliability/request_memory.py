"""The router's memory under large requests (issue 42 §1 and §4), on a real tree.

    .venv/bin/python reliability/request_memory.py slow-readers   # §1
    .venv/bin/python reliability/request_memory.py large-reps     # §4
    ... --engine grpcio          # the same against grpc's own server
    ... --set max_request_bytes_held=67108864   # any setting, into settings.json

``slow-readers``: 8 connections (each its own process, tests/clients/
unread_replies.py) open 32 streams each and send an 8 MiB echo request on
every one, and never read a reply (no WINDOW_UPDATE). Meanwhile another
connection makes small echo calls one after the other. Prints the router's
RSS before (baseline), its peak while the clients hold their calls, after
they are killed, and the honest client's latency (p50, p99, max) and errors.

``large-reps``: six reps of: a stopped reader (two 15 MiB calls with a 2 s
deadline whose replies it never reads), then 3 rounds of 16 concurrent 15 MiB
echo calls with short deadlines (0.2 to 1.5 s), the reader killed. Prints the
router's RSS a few seconds after each rep, against its baseline.

Figures go in docs/reliability.md (Hostile clients). Every PID started is
killed by PID at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from poolserve.protos import inference_pb2 as pb

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import (
    INFER,
    ROOT,
    Tree,
    channel_options,
    comm,
    encode_inputs,
    kill_pids,
    make_repo,
    rss_bytes,
    wait_serving,
)

MIB = 1024 * 1024
UNREAD = ROOT / "tests" / "clients" / "unread_replies.py"
SAMPLE_S = 0.05


def echo_request(mib: float) -> bytes:
    request = pb.ModelInferRequest(model_name="echo")
    encode_inputs({"INPUT0": np.ones((1, int(mib * MIB) // 4), np.float32)}, request, raw=True)
    return request.SerializeToString()


def router_pid(tree: Tree) -> int:
    for pid in tree.snapshot():
        if comm(pid) == "poolserve-rtr":
            return pid
    raise RuntimeError("no router process")


def rss_parts(pid: int) -> dict[str, Any]:
    """The router's resident memory by kind: its heap and stacks (anon), the
    slabs and other shared mappings it touched (shmem), files (MiB); and how
    many slabs it has mapped."""
    parts: dict[str, Any] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("RssAnon", "RssShmem", "RssFile"):
            parts[key[3:].lower()] = round(int(value.split()[0]) / 1024, 1)
    maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
    parts["slabs_mapped"] = sum(1 for line in maps if "poolserve-slab-" in line)
    return parts


def mib(size: float) -> float:
    return round(size / MIB, 1)


class Sampler:
    """The router's RSS every SAMPLE_S, in the background."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.peak = 0
        self.peak_parts: dict[str, float] = {}
        self.last = 0
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        while True:
            self.last = rss_bytes(self.pid)
            if self.last > self.peak:
                self.peak = self.last
                self.peak_parts = rss_parts(self.pid)
            await asyncio.sleep(SAMPLE_S)

    def __enter__(self) -> Sampler:
        self._task = asyncio.get_running_loop().create_task(self._run())
        return self

    def __exit__(self, *_: object) -> None:
        if self._task is not None:
            self._task.cancel()


async def settled_rss(pid: int, seconds: float) -> int:
    """The lowest RSS seen over ``seconds`` (the heap trimmer checks every second)."""
    low = rss_bytes(pid)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        await asyncio.sleep(0.2)
        low = min(low, rss_bytes(pid))
    return low


async def warm_up(stub: Any) -> None:
    small = echo_request(16 / MIB)
    for _ in range(20):
        await stub(small, timeout=30)


def unread_client(address: str, request: Path, count: int, *extra: str) -> subprocess.Popen[str]:
    argv = [sys.executable, "-P", str(UNREAD), address, INFER, str(request), str(count), *extra]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)


def stop_clients(clients: list[subprocess.Popen[str]]) -> list[dict[str, Any]]:
    kill_pids([client.pid for client in clients])
    lines = []
    for client in clients:
        out, _ = client.communicate(timeout=30)
        lines.extend(json.loads(line) for line in out.splitlines() if line.strip())
    return lines


async def honest_calls(
    stub: Any, stop: asyncio.Event, latencies: list[float], errors: list[str]
) -> None:
    small = echo_request(64 / MIB)
    while not stop.is_set():
        began = time.perf_counter()
        try:
            await stub(small, timeout=10)
        except grpc.aio.AioRpcError as error:
            errors.append(f"{error.code().name}: {error.details()}")
        latencies.append(time.perf_counter() - began)
        await asyncio.sleep(0.005)


def quantile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def slow_readers(tree: Tree, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    router = router_pid(tree)
    request = work / "request.bin"
    request.write_bytes(echo_request(args.mib))
    async with grpc.aio.insecure_channel(tree.address, options=channel_options()) as channel:
        await wait_serving(channel)
        stub = channel.unary_unary(INFER)
        await warm_up(stub)
        baseline = await settled_rss(router, 2.0)
        latencies: list[float] = []
        errors: list[str] = []
        stop = asyncio.Event()
        honest = asyncio.get_running_loop().create_task(honest_calls(stub, stop, latencies, errors))
        clients = [
            unread_client(tree.address, request, args.streams, "--at-once")
            for _ in range(args.connections)
        ]
        try:
            with Sampler(router) as held:
                await asyncio.sleep(args.hold_s)
        finally:
            lines = stop_clients(clients)
        stop.set()
        await honest
        after = await settled_rss(router, 5.0)
        after_parts = rss_parts(router)
    ended = [line for line in lines if "ended" in line]
    return {
        "engine": args.engine,
        "clients": f"{args.connections} x {args.streams} x {args.mib} MiB",
        "rss_baseline_mib": mib(baseline),
        "rss_peak_mib": mib(held.peak),
        "rss_peak_over_baseline_mib": mib(held.peak - baseline),
        "rss_parts_at_peak_mib": held.peak_parts,
        "rss_after_mib": mib(after),
        "rss_parts_after_mib": after_parts,
        "streams_ended_while_held": len(ended),
        "streams_sent_whole": sum(line.get("sent", 0) for line in lines),
        "honest_calls": len(latencies),
        "honest_p50_ms": round(quantile(latencies, 0.5) * 1000, 1),
        "honest_p99_ms": round(quantile(latencies, 0.99) * 1000, 1),
        "honest_max_ms": round(max(latencies, default=0.0) * 1000, 1),
        "honest_errors": errors[:3],
        "honest_error_count": len(errors),
    }


async def large_reps(tree: Tree, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    router = router_pid(tree)
    body = echo_request(15)
    request = work / "request.bin"
    request.write_bytes(body)
    rng = random.Random(42)
    async with grpc.aio.insecure_channel(tree.address, options=channel_options()) as channel:
        await wait_serving(channel)
        stub = channel.unary_unary(INFER)
        await warm_up(stub)
        baseline = await settled_rss(router, 2.0)
        reps = []
        parts: list[dict[str, float]] = []
        codes: dict[str, int] = {}

        async def one() -> None:
            try:
                await stub(body, timeout=rng.uniform(0.2, 1.5))
                code = "OK"
            except grpc.aio.AioRpcError as error:
                code = error.code().name
            codes[code] = codes.get(code, 0) + 1

        with Sampler(router) as sampler:
            for _ in range(args.reps):
                reader = unread_client(tree.address, request, 2, "--at-once", "--timeout", "2S")
                try:
                    for _ in range(3):
                        await asyncio.gather(*(one() for _ in range(16)))
                finally:
                    stop_clients([reader])
                reps.append(mib(await settled_rss(router, args.settle_s)))
                parts.append(rss_parts(router))
    return {
        "engine": args.engine,
        "rss_baseline_mib": mib(baseline),
        "rss_after_each_rep_mib": reps,
        "rss_most_over_baseline_mib": round(max(reps) - mib(baseline), 1),
        "rss_parts_after_each_rep_mib": parts,
        "rss_peak_mib": mib(sampler.peak),
        "codes": codes,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("scenario", choices=("slow-readers", "large-reps"))
    parser.add_argument("--engine", default="poolserve", choices=("poolserve", "grpcio"))
    parser.add_argument("--connections", type=int, default=8)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--mib", type=float, default=8)
    parser.add_argument("--hold-s", type=float, default=20.0, help="how long the clients hold")
    parser.add_argument("--reps", type=int, default=6)
    parser.add_argument("--settle-s", type=float, default=3.0, help="after each rep")
    parser.add_argument("--set", action="append", default=[], help="SETTING=JSON_VALUE")
    parser.add_argument("--log", type=Path, help="keep the tree's log here")
    args = parser.parse_args()
    settings: dict[str, Any] = {"grpc_engine": args.engine}
    for item in args.set:
        key, _, value = item.partition("=")
        settings[key] = json.loads(value)
    with tempfile.TemporaryDirectory(prefix="request-memory-") as tmp:
        work = Path(tmp)
        repo = make_repo(work / "repo", {"echo": None}, settings)
        with Tree(repo, work / "run", workers=2) as tree:
            scenario = slow_readers if args.scenario == "slow-readers" else large_reps
            result = asyncio.run(scenario(tree, args, work))
            result["router_tracebacks"] = len(tree.tracebacks())
            if args.log is not None:
                args.log.write_text(tree.log())
    result["settings"] = settings
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
