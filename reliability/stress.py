"""Concurrency stress (issue 9.1): many channels, many concurrent calls, random
deadlines and client cancels; every call accounted for.

    .venv/bin/python reliability/stress.py            # 50 x 25, 20,000 calls, then
                                                      # the seeds' shape (below)
    .venv/bin/python reliability/stress.py --quick    # 10 x 10, 2,000 calls
    .venv/bin/python reliability/stress.py --assert-bound   # also fail on any
                                                             # call > deadline + 20 ms

Each call goes to ``echo`` (pool ``default``) or ``sleep`` (pool ``slow``)
with a payload unique to the call, a deadline drawn from [1, 500] ms and, for
some calls, a client cancel at a random moment before the deadline. A call
ends OK with its own payload, DEADLINE_EXCEEDED, CANCELLED or
RESOURCE_EXHAUSTED; anything else (another status, another call's payload, a
call that never ends) is a failure; so is a RESOURCE_EXHAUSTED without the
message of a bound (a pool's queue, or max_concurrent_streams). Afterwards: no "Traceback" in any
process log, no worker died, every queue is empty, the process tree is
exactly as it started, and the server answers normally.

Then the seeds' shape (issue 28 §6, :data:`SEEDS_SHAPE`): 50 channels with 25
``echo`` calls each always in flight, 20 s deadlines, no cancels; every call
must end OK (or RESOURCE_EXHAUSTED from a bound, with its message). It
failed with grpc's channel option ``grpc.max_concurrent_streams`` at 1,024,
which grpcio 1.81 applies to the whole server: 25-40% of the calls were
refused at the transport (UNAVAILABLE, RST_STREAM REFUSED_STREAM).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import random
import shutil
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import grpc

from poolserve.protos import inference_pb2 as pb

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import (
    INFER,
    Tree,
    channel_options,
    infer_bytes,
    make_repo,
    output_bytes,
    payload,
    percentiles,
    pool_status,
    probe_ok,
    wait_serving,
)

EXPECTED = ("OK", "DEADLINE_EXCEEDED", "CANCELLED", "RESOURCE_EXHAUSTED")
# what a RESOURCE_EXHAUSTED must say: a pool's bounded queue, or the router's
# bound on one connection's calls in flight
BOUNDS = ("queue is full", "max_concurrent_streams")
BOUND_S = 0.020  # the bound: no call longer than its deadline + 20 ms
HANG_S = 10.0  # a call still running this long after its deadline has hung


@dataclass
class Config:
    channels: int = 50
    concurrency: int = 25  # concurrent calls per channel
    calls: int = 20_000
    min_deadline_s: float = 0.001
    max_deadline_s: float = 0.5
    cancel_rate: float = 0.1
    max_sleep_ms: int = 20
    sleep_share: float = 0.5
    workers: int = 2  # per pool
    max_queue: int = 1024
    seed: int = 9
    client_procs: int = 1  # client processes sharing the channels


# 50 clients x 25 concurrent async calls, long deadlines, no cancels (issue 28 §6)
SEEDS_SHAPE = {
    "channels": 50,
    "concurrency": 25,
    "calls": 5000,
    "min_deadline_s": 20.0,
    "max_deadline_s": 20.0,
    "cancel_rate": 0.0,
    "sleep_share": 0.0,
}


@dataclass
class Outcome:
    key: int
    model: str
    code: str
    duration: float
    deadline: float
    cancelled_by_client: bool = False
    wrong_payload: bool = False
    details: str = ""
    began: float = 0.0


@dataclass
class Report:
    config: dict[str, Any]
    calls: int = 0
    wall_s: float = 0.0
    codes: dict[str, int] = field(default_factory=dict)
    by_model: dict[str, dict[str, int]] = field(default_factory=dict)
    unexpected: list[str] = field(default_factory=list)
    wrong_payloads: int = 0
    unbounded_refusals: list[str] = field(
        default_factory=list
    )  # RESOURCE_EXHAUSTED, no bound named
    hung: int = 0
    server_cancelled: int = 0
    # DEADLINE_EXCEEDED sent by the server (router or pool, with its reason) before
    # the client's own timer fired, versus the client library's own "Deadline Exceeded"
    deadline_by_server: int = 0
    overshoot_ms: dict[str, float] = field(default_factory=dict)
    overshoot_deadline_exceeded_ms: dict[str, float] = field(default_factory=dict)
    over_bound: int = 0
    over_bound_by_code: dict[str, int] = field(default_factory=dict)
    tracebacks: list[str] = field(default_factory=list)
    workers_replaced: list[int] = field(default_factory=list)
    queue_after: dict[str, int] = field(default_factory=dict)
    census_before: str = ""
    census_after: str = ""
    census_ok: bool = True
    serves_after: bool = False
    late_replies_dropped: int = 0
    client_loop_lag_ms: dict[str, float] = field(default_factory=dict)
    # per model, from ModelStatistics: executions, and successes the pool answered
    executions: dict[str, int] = field(default_factory=dict)
    pool_successes: dict[str, int] = field(default_factory=dict)

    def problems(self, slack_s: float | None = None) -> list[str]:
        """Everything that breaks the contract; ``slack_s`` also bounds lateness."""
        out = []
        if self.calls != sum(self.codes.values()):
            out.append(f"{self.calls} calls but {sum(self.codes.values())} outcomes")
        if self.unexpected:
            out.append(f"unexpected statuses: {self.unexpected[:5]}")
        if self.wrong_payloads:
            out.append(f"{self.wrong_payloads} OK calls came back with another payload")
        if self.unbounded_refusals:
            out.append(f"RESOURCE_EXHAUSTED naming no bound: {self.unbounded_refusals[:5]}")
        if self.hung:
            out.append(f"{self.hung} calls hung past their deadline + {HANG_S} s")
        if self.tracebacks:
            out.append(f"{len(self.tracebacks)} tracebacks in the log:\n{self.tracebacks[0]}")
        if self.workers_replaced:
            out.append(f"workers died during the run: {self.workers_replaced}")
        if any(self.queue_after.values()):
            out.append(f"queues not empty afterwards: {self.queue_after}")
        if not self.census_ok:
            out.append(f"process tree afterwards: {self.census_after}")
        if not self.serves_after:
            out.append("the server did not serve normally afterwards")
        if slack_s is not None and self.overshoot_ms.get("p100", 0.0) > slack_s * 1000:
            out.append(
                f"{self.over_bound} calls took longer than deadline + {BOUND_S * 1000:.0f} ms; "
                f"worst {self.overshoot_ms['p100']:.1f} ms over (slack {slack_s * 1000:.0f} ms)"
            )
        return out


def plan(config: Config) -> list[tuple[str, bytes, bytes, float, float | None]]:
    """Every call up front: (model, request, expected output, deadline, cancel_at)."""
    rng = random.Random(config.seed)
    calls = []
    for key in range(config.calls):
        array = payload(key, extra=config.seed)
        if rng.random() < config.sleep_share:
            model = "sleep"
            body = infer_bytes(model, array, sleep_ms=rng.randint(0, config.max_sleep_ms))
        else:
            model = "echo"
            body = infer_bytes(model, array)
        deadline = rng.uniform(config.min_deadline_s, config.max_deadline_s)
        cancel_at = rng.uniform(0, deadline) if rng.random() < config.cancel_rate else None
        calls.append((model, body, array.tobytes(), deadline, cancel_at))
    return calls


async def one_call(
    method: grpc.aio.UnaryUnaryMultiCallable[bytes, bytes],
    key: int,
    spec: tuple[str, bytes, bytes, float, float | None],
) -> Outcome:
    model, body, expected, deadline, cancel_at = spec
    loop = asyncio.get_running_loop()
    began = time.monotonic()
    call = method(body, timeout=deadline)
    outcome = Outcome(key, model, "", 0.0, deadline, began=began)
    hung: list[bool] = []

    def watchdog() -> None:  # a call must end by itself; this one did not
        hung.append(True)
        call.cancel()

    timers = [loop.call_later(deadline + HANG_S, watchdog)]
    if cancel_at is not None:
        timers.append(loop.call_later(cancel_at, call.cancel))
    try:
        reply = await call
        outcome.code = "OK"
        outcome.wrong_payload = output_bytes(reply) != expected
    except asyncio.CancelledError:
        if not call.cancelled():
            raise
        outcome.code = "HUNG" if hung else "CANCELLED"
        outcome.cancelled_by_client = not hung
    except grpc.aio.AioRpcError as exc:
        outcome.code = exc.code().name
        outcome.details = exc.details() or ""
    outcome.duration = time.monotonic() - began
    for timer in timers:
        timer.cancel()
    return outcome


async def drive(
    address: str,
    config: Config,
    shard: int = 0,
    shards: int = 1,
    go: Callable[[], Awaitable[None]] | None = None,
) -> tuple[list[Outcome], float, list[float]]:
    """Runs this shard's calls (key % shards == shard) over its share of channels."""
    specs = plan(config)
    outcomes: list[Outcome] = []
    cursor = iter(range(shard, len(specs), shards))

    async def lane(method: grpc.aio.UnaryUnaryMultiCallable[bytes, bytes]) -> None:
        for key in cursor:  # shared iterator: lanes take the next call as they free up
            outcomes.append(await one_call(method, key, specs[key]))

    mine = len(range(shard, config.channels, shards))
    channels = [grpc.aio.insecure_channel(address, options=channel_options()) for _ in range(mine)]
    lags: list[float] = []
    try:
        for channel in channels:  # every connection up before the clock starts
            await channel.channel_ready()
        if go is not None:
            await go()
        began = time.monotonic()
        lanes = [
            lane(channel.unary_unary(INFER))
            for channel in channels
            for _ in range(config.concurrency)
        ]
        monitor = asyncio.ensure_future(loop_lag(lags))
        await asyncio.gather(*lanes)
        monitor.cancel()
        wall = time.monotonic() - began
    finally:
        for channel in channels:
            await channel.close()
    return outcomes, wall, lags


def _shard_process(
    address: str,
    config: dict[str, Any],
    shard: int,
    shards: int,
    ready: Any,
    start: Any,
    results: Any,
) -> None:
    """One client process (spawned): its channels, its calls, outcomes back as dicts."""

    async def go() -> None:
        ready.set()
        await asyncio.to_thread(start.wait)

    outcomes, wall, lags = asyncio.run(drive(address, Config(**config), shard, shards, go))
    results.put(([asdict(o) for o in outcomes], wall, lags))


async def drive_processes(address: str, config: Config) -> tuple[list[Outcome], float, list[float]]:
    """The calls spread over ``config.client_procs`` client processes, started together."""
    if config.client_procs <= 1:
        return await drive(address, config)
    context = multiprocessing.get_context("spawn")
    start = context.Event()
    results = context.Queue()
    readies = []
    procs = []
    for shard in range(config.client_procs):
        ready = context.Event()
        proc = context.Process(
            target=_shard_process,
            args=(address, asdict(config), shard, config.client_procs, ready, start, results),
            daemon=True,
        )
        proc.start()
        readies.append(ready)
        procs.append(proc)
    try:
        for ready in readies:
            await asyncio.to_thread(ready.wait, 120)
        began = time.monotonic()
        start.set()
        outcomes: list[Outcome] = []
        lags: list[float] = []
        for _ in procs:
            shard_outcomes, _, shard_lags = await asyncio.to_thread(results.get, True, 600)
            outcomes += [Outcome(**o) for o in shard_outcomes]
            lags += shard_lags
        wall = time.monotonic() - began
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join()
    return outcomes, wall, lags


async def loop_lag(lags: list[float], period: float = 0.005) -> None:
    """How late this client's own event loop wakes up: the part of a call's
    overshoot that is the client's, not the server's."""
    while True:
        began = time.monotonic()
        await asyncio.sleep(period)
        lags.append((time.monotonic() - began - period) * 1000)


def summarize(config: Config, outcomes: list[Outcome], wall: float) -> Report:
    report = Report(config=asdict(config), calls=config.calls, wall_s=wall)
    report.codes = dict(Counter(o.code for o in outcomes))
    by_model: dict[str, Counter[str]] = {}
    for o in outcomes:
        by_model.setdefault(o.model, Counter())[o.code] += 1
    report.by_model = {m: dict(c) for m, c in by_model.items()}
    report.unexpected = [
        f"call {o.key} ({o.model}): {o.code} {o.details}"
        for o in outcomes
        if o.code not in EXPECTED
    ]
    report.wrong_payloads = sum(o.wrong_payload for o in outcomes)
    report.unbounded_refusals = [
        f"call {o.key} ({o.model}): {o.details}"
        for o in outcomes
        if o.code == "RESOURCE_EXHAUSTED" and not any(bound in o.details for bound in BOUNDS)
    ]
    report.hung = sum(o.code == "HUNG" for o in outcomes)
    report.server_cancelled = sum(
        o.code == "CANCELLED" and not o.cancelled_by_client for o in outcomes
    )
    report.deadline_by_server = sum(
        o.code == "DEADLINE_EXCEEDED" and o.details != "Deadline Exceeded" for o in outcomes
    )
    over = [(o.duration - o.deadline) * 1000 for o in outcomes]
    report.overshoot_ms = percentiles(over)
    report.overshoot_deadline_exceeded_ms = percentiles(
        [(o.duration - o.deadline) * 1000 for o in outcomes if o.code == "DEADLINE_EXCEEDED"]
    )
    late = [o for o in outcomes if o.duration > o.deadline + BOUND_S]
    report.over_bound = len(late)
    report.over_bound_by_code = dict(Counter(o.code for o in late))
    return report


async def check_after(tree: Tree, report: Report, before: dict[str, list[int]]) -> None:
    async with grpc.aio.insecure_channel(tree.address) as channel:
        await wait_serving(channel, timeout=30)
        oks = [
            await probe_ok(channel, model, 10**6 + i, timeout=10)
            for i, model in enumerate(["echo", "sleep", "echo", "sleep"])
        ]
        report.serves_after = all(oks)
        stats = await channel.unary_unary(
            "/inference.GRPCInferenceService/ModelStatistics",
            request_serializer=pb.ModelStatisticsRequest.SerializeToString,
            response_deserializer=pb.ModelStatisticsResponse.FromString,
        )(pb.ModelStatisticsRequest(), timeout=10)
        for m in stats.model_stats:
            report.executions[m.name] = m.execution_count
            report.pool_successes[m.name] = m.inference_stats.success.count
    for gid, pids in before.items():
        status = await pool_status(tree.run_dir, gid)
        now = [w.pid for w in status.workers]
        report.workers_replaced += [p for p in pids if p not in now]
        report.queue_after[gid] = status.queue_depth
        report.late_replies_dropped += status.late_replies_dropped


POOLS = {"default": "echo", "slow": "sleep"}


def run(config: Config, workdir: Path) -> Report:
    repo = make_repo(
        workdir / "repo",
        {"echo": None, "sleep": "slow"},
        {"max_queue": config.max_queue},
    )
    expected = {gid: config.workers for gid in POOLS}
    with Tree(repo, workdir / "run", workers=config.workers) as tree:

        async def main() -> Report:
            async with grpc.aio.insecure_channel(tree.address) as channel:
                await wait_serving(channel)
            before = {
                gid: [w.pid for w in (await pool_status(tree.run_dir, gid)).workers]
                for gid in POOLS
            }
            census = tree.census(expected)
            outcomes, wall, lags = await drive_processes(tree.address, config)
            report = summarize(config, outcomes, wall)
            report.client_loop_lag_ms = percentiles(lags)
            report.census_before = census.summary()
            await check_after(tree, report, before)
            return report

        report = asyncio.run(main())
        after = tree.census(expected)
        report.census_after = after.summary()
        report.census_ok = after.ok
        report.tracebacks = tree.tracebacks()
    return report


def print_report(report: Report) -> None:
    r = report
    print(f"stress: {r.calls} calls in {r.wall_s:.1f} s ({r.calls / max(r.wall_s, 1e-9):.0f}/s)")
    print(f"  statuses: {json.dumps(r.codes, sort_keys=True)}")
    for model, codes in sorted(r.by_model.items()):
        print(f"    {model}: {json.dumps(codes, sort_keys=True)}")
    print(f"  RESOURCE_EXHAUSTED naming no bound: {len(r.unbounded_refusals)}")
    print(
        f"  wrong payloads: {r.wrong_payloads}; hung: {r.hung}; "
        f"CANCELLED not from the client: {r.server_cancelled}"
    )
    print(
        f"  DEADLINE_EXCEEDED answered by the server before the client's timer: "
        f"{r.deadline_by_server} of {r.codes.get('DEADLINE_EXCEEDED', 0)}"
    )
    fmt = ", ".join(f"{k} {v:+.1f}" for k, v in r.overshoot_ms.items())
    print(f"  duration - deadline (ms), all calls: {fmt}")
    fmt = ", ".join(f"{k} {v:+.1f}" for k, v in r.overshoot_deadline_exceeded_ms.items())
    print(f"  duration - deadline (ms), DEADLINE_EXCEEDED: {fmt}")
    print(
        f"  calls over deadline + {BOUND_S * 1000:.0f} ms: {r.over_bound} "
        f"{json.dumps(r.over_bound_by_code, sort_keys=True)}"
    )
    fmt = ", ".join(f"{k} {v:.1f}" for k, v in r.client_loop_lag_ms.items())
    print(f"  client event-loop lag (ms): {fmt}")
    print(f"  late replies dropped by pools: {r.late_replies_dropped}")
    print(
        f"  executions on workers: {r.executions}; answered OK by pools: {r.pool_successes} "
        f"(the 4 probes afterwards included)"
    )
    print(f"  tree before: {r.census_before}")
    print(f"  tree after:  {r.census_after}")
    print(
        f"  tracebacks in logs: {len(r.tracebacks)}; workers died: {r.workers_replaced}; "
        f"queues after: {r.queue_after}; serves normally after: {r.serves_after}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="10 channels x 10, 2,000 calls")
    parser.add_argument("--channels", type=int)
    parser.add_argument("--concurrency", type=int)
    parser.add_argument("--calls", type=int)
    parser.add_argument("--workers", type=int)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--cancel-rate", type=float)
    parser.add_argument("--max-queue", type=int)
    parser.add_argument("--client-procs", type=int, help="client processes (default 1)")
    parser.add_argument(
        "--assert-bound",
        action="store_true",
        help=f"fail when any call took longer than its deadline + {BOUND_S * 1000:.0f} ms",
    )
    parser.add_argument(
        "--no-seeds-shape",
        action="store_true",
        help="skip the second run, the seeds' shape (50 x 25 echo, 20 s deadlines)",
    )
    parser.add_argument("--json", type=Path, help="write the report here")
    parser.add_argument("--keep", type=Path, help="work directory to keep (logs)")
    args = parser.parse_args(argv)
    config = Config(channels=10, concurrency=10, calls=2000) if args.quick else Config()
    for name in (
        "channels",
        "concurrency",
        "calls",
        "workers",
        "seed",
        "cancel_rate",
        "max_queue",
        "client_procs",
    ):
        value = getattr(args, name)
        if value is not None:
            setattr(config, name, value)
    runs = [("stress", config, BOUND_S if args.assert_bound else None)]
    if not (args.quick or args.no_seeds_shape):
        seeds = Config(**{**asdict(Config(seed=config.seed)), **SEEDS_SHAPE})
        runs.append(("seeds' shape", seeds, None))  # 20 s deadlines: no lateness bound
    reports = []
    problems: list[str] = []
    for name, each, bound in runs:
        if args.keep:
            workdir = args.keep / name.replace("'", "").replace(" ", "-")
            shutil.rmtree(workdir, ignore_errors=True)
            workdir.mkdir(parents=True)
            report = run(each, workdir)
        else:
            with tempfile.TemporaryDirectory(prefix="poolserve-stress-") as tmp:
                report = run(each, Path(tmp))
        print(f"-- {name}: {each.channels} channels x {each.concurrency} calls in flight")
        print_report(report)
        reports.append(asdict(report))
        problems += [f"{name}: {problem}" for problem in report.problems(bound)]
    if args.json:
        args.json.write_text(json.dumps(reports if len(reports) > 1 else reports[0], indent=2))
    for problem in problems:
        print(f"FAIL: {problem}")
    print("stress: " + ("FAILED" if problems else "passed"))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
