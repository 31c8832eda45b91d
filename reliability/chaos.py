"""Chaos (issue 9.2): under steady load, kill parts of the tree and measure.

    .venv/bin/python reliability/chaos.py            # 4 rounds of every fault
    .venv/bin/python reliability/chaos.py --quick    # 1 round
    .venv/bin/python reliability/chaos.py --rounds 10 --interval 5

Two pools (``default`` serving echo, ``slow`` serving sleep), two workers
each, under a steady load of callers with 2 s deadlines. Each round applies,
in a random order: SIGKILL to a random worker, to a random pool server, to a
random zygote and to the router, and SIGSTOP to a random worker (SIGCONT
once the pool has replaced it: ``heartbeat_timeout_s`` is set low). For
each fault: the calls in flight at that moment, the calls that failed
afterwards (and their statuses), and the time until full service (the
census is exactly the expected tree again, health says SERVING and a call to
each model succeeds). At the end: the census, every call accounted for (a
status within its deadline, nothing hung), a clean SIGTERM, nothing left.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import (
    INFER,
    Tree,
    channel_options,
    free_port,
    health_check,
    infer_bytes,
    make_repo,
    output_bytes,
    payload,
    percentiles,
    pid_alive,
    probe_ok,
    wait_serving,
)

FAULTS = ("worker", "pool", "zygote", "router", "stop")
POOLS = {"default": "echo", "slow": "sleep"}
ALLOWED = {"OK", "UNAVAILABLE", "DEADLINE_EXCEEDED"}
HANG_S = 10.0


@dataclass
class Config:
    rounds: int = 4
    faults: tuple[str, ...] = FAULTS
    workers: int = 2
    callers: int = 8
    deadline_s: float = 2.0
    max_sleep_ms: int = 20
    interval_s: float = 3.0  # calm time between faults (after full service)
    recover_timeout_s: float = 60.0
    heartbeat_interval_s: float = 0.1
    heartbeat_timeout_s: float = 1.0
    seed: int = 9


@dataclass
class Call:
    key: int
    model: str
    began: float
    ended: float = 0.0
    code: str = ""
    details: str = ""
    deadline: float = 0.0
    wrong_payload: bool = False


@dataclass
class Fault:
    kind: str
    pid: int
    target: str
    at: float
    in_flight: int = 0
    in_flight_by_model: dict[str, int] = field(default_factory=dict)
    failed_in_flight: int = 0
    failed_after: int = 0  # calls started after the fault that failed before full service
    failed_codes: dict[str, int] = field(default_factory=dict)
    recover_s: float | None = None
    note: str = ""


@dataclass
class Report:
    config: dict[str, Any]
    calls: int = 0
    codes: dict[str, int] = field(default_factory=dict)
    faults: list[Fault] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    wrong_payloads: int = 0
    hung: int = 0
    late: list[str] = field(default_factory=list)
    lateness_ms: dict[str, float] = field(default_factory=dict)
    recovery_s: dict[str, dict[str, float]] = field(default_factory=dict)
    census_final: str = ""
    census_ok: bool = False
    exit_code: int | None = None
    leftovers: list[int] = field(default_factory=list)
    tracebacks: int = 0
    log_excerpts: list[str] = field(default_factory=list)

    def problems(self, slack_s: float) -> list[str]:
        out = []
        if self.calls != sum(self.codes.values()):
            out.append(f"{self.calls} calls but {sum(self.codes.values())} outcomes")
        if self.unexpected:
            out.append(f"{len(self.unexpected)} unexpected statuses: {self.unexpected[:5]}")
        if self.wrong_payloads:
            out.append(f"{self.wrong_payloads} OK calls came back with another payload")
        if self.hung:
            out.append(f"{self.hung} calls hung")
        if self.lateness_ms.get("p100", 0.0) > slack_s * 1000:
            out.append(f"calls ended later than deadline + {slack_s} s: {self.late[:5]}")
        unrecovered = [f"{f.kind} {f.pid}" for f in self.faults if f.recover_s is None]
        if unrecovered:
            out.append(f"no full service again after: {unrecovered}")
        if not self.census_ok:
            out.append(f"final census: {self.census_final}")
        if self.exit_code != 0:
            out.append(f"SIGTERM exit code {self.exit_code}")
        if self.leftovers:
            out.append(f"processes left after the stop: {self.leftovers}")
        return out


class Load:
    """Steady callers; every call is recorded with its outcome."""

    def __init__(self, address: str, config: Config) -> None:
        self.address = address
        self.config = config
        self.calls: list[Call] = []
        self.open: dict[int, Call] = {}
        self._stop = asyncio.Event()
        self._keys = iter(range(1 << 40))

    async def run(self) -> None:
        channels = [
            grpc.aio.insecure_channel(self.address, options=channel_options(fast_reconnect=True))
            for _ in range(max(1, self.config.callers // 2))
        ]
        try:
            await asyncio.gather(
                *(
                    self._caller(channels[i % len(channels)], random.Random(self.config.seed + i))
                    for i in range(self.config.callers)
                )
            )
        finally:
            for channel in channels:
                await channel.close()

    def stop(self) -> None:
        self._stop.set()

    async def _caller(self, channel: grpc.aio.Channel, rng: random.Random) -> None:
        method = channel.unary_unary(INFER)
        while not self._stop.is_set():
            key = next(self._keys)
            model = rng.choice(tuple(POOLS.values()))
            array = payload(key, extra=7)
            params = (
                {"sleep_ms": rng.randint(1, self.config.max_sleep_ms)} if model == "sleep" else {}
            )
            call = Call(key, model, time.monotonic(), deadline=self.config.deadline_s)
            self.open[key] = call
            await self._one(method, call, infer_bytes(model, array, **params), array.tobytes())
            del self.open[key]
            self.calls.append(call)
            if call.code == "UNAVAILABLE":
                await asyncio.sleep(0.02)  # no router: do not spin; not a readiness wait

    async def _one(
        self,
        method: grpc.aio.UnaryUnaryMultiCallable[bytes, bytes],
        call: Call,
        body: bytes,
        expected: bytes,
    ) -> None:
        rpc = method(body, timeout=self.config.deadline_s)
        hung: list[bool] = []

        def watchdog() -> None:
            hung.append(True)
            rpc.cancel()

        timer = asyncio.get_running_loop().call_later(self.config.deadline_s + HANG_S, watchdog)
        try:
            reply = await rpc
            call.code = "OK"
            call.wrong_payload = output_bytes(reply) != expected
        except asyncio.CancelledError:
            if not rpc.cancelled():
                raise
            call.code = "HUNG" if hung else "CANCELLED"
        except grpc.aio.AioRpcError as exc:
            call.code = exc.code().name
            call.details = exc.details() or ""
        finally:
            timer.cancel()
        call.ended = time.monotonic()


class Chaos:
    def __init__(self, tree: Tree, config: Config) -> None:
        self.tree = tree
        self.config = config
        self.rng = random.Random(config.seed)
        self.expected = {gid: config.workers for gid in POOLS}
        self.probe_key = 1 << 41

    async def full_service(self, channel: grpc.aio.Channel) -> bool:
        if not self.tree.census(self.expected).ok:
            return False
        if not await health_check(channel, timeout=1.0):
            return False
        for model in POOLS.values():
            self.probe_key += 1
            if not await probe_ok(channel, model, self.probe_key, timeout=2.0):
                return False
        return True

    async def wait_full_service(self, channel: grpc.aio.Channel, since: float) -> float | None:
        """Seconds from ``since`` until full service, polling (no event covers it all)."""
        end = since + self.config.recover_timeout_s
        while time.monotonic() < end:
            if await self.full_service(channel):
                return time.monotonic() - since
            await asyncio.sleep(0.05)
        return None

    def pick(self, kind: str) -> tuple[int, str]:
        census = self.tree.census(self.expected)
        if kind == "router":
            return census.pids("router")[0], "router"
        gid = self.rng.choice(sorted(POOLS))
        if kind == "pool":
            return census.pids("pool", gid)[0], f"pool {gid}"
        if kind == "zygote":
            return census.pids("zygote", gid)[0], f"zygote {gid}"
        return self.rng.choice(census.pids("worker", gid)), f"worker {gid}"

    async def apply(self, kind: str, channel: grpc.aio.Channel, load: Load) -> Fault:
        pid, target = self.pick(kind)
        in_flight = list(load.open.values())
        fault = Fault(kind, pid, target, time.monotonic())
        fault.in_flight = len(in_flight)
        fault.in_flight_by_model = dict(Counter(c.model for c in in_flight))
        if kind == "stop":
            os.kill(pid, signal.SIGSTOP)
            fault.at = time.monotonic()
            # The pool kills a worker that stopped heartbeating: wait for that.
            gone = await self._wait_replaced(pid)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
            fault.note = "killed by the pool" if gone else "NOT killed by the pool"
        else:
            os.kill(pid, signal.SIGKILL)
            fault.at = time.monotonic()
            # SIGKILL lands when the kernel next runs the task: measure from its death.
            await self._wait_dead(pid, timeout=10.0)
        fault.recover_s = await self.wait_full_service(channel, fault.at)
        recovered_at = fault.at + (fault.recover_s or self.config.recover_timeout_s)
        flying = {c.key for c in in_flight}
        failed = [
            c
            for c in load.calls
            if c.code != "OK" and c.ended >= fault.at and c.began <= recovered_at
        ]
        fault.failed_in_flight = sum(c.key in flying for c in failed)
        fault.failed_after = len(failed) - fault.failed_in_flight
        fault.failed_codes = dict(Counter(c.code for c in failed))
        return fault

    async def _wait_replaced(self, pid: int) -> bool:
        """Polls until the stopped ``pid`` is dead (the pool killed it)."""
        return await self._wait_dead(pid, self.config.heartbeat_timeout_s * 4 + 10)

    @staticmethod
    async def _wait_dead(pid: int, timeout: float) -> bool:
        """Polls /proc (a process's death has no event for a non-parent) until
        ``pid`` is a zombie or gone; False after ``timeout``."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if not pid_alive(pid):
                return True
            await asyncio.sleep(0.005)
        return False


def run(config: Config, workdir: Path, extra_settings: dict[str, Any] | None = None) -> Report:
    settings = {
        "heartbeat_interval_s": config.heartbeat_interval_s,
        "heartbeat_timeout_s": config.heartbeat_timeout_s,
        **(extra_settings or {}),
    }
    repo = make_repo(workdir / "repo", {"echo": None, "sleep": "slow"}, settings)
    report = Report(config=asdict(config))
    tree = Tree(repo, workdir / "run", workers=config.workers, port=free_port())
    with tree:
        chaos = Chaos(tree, config)

        async def main() -> None:
            async with grpc.aio.insecure_channel(
                tree.address, options=channel_options(fast_reconnect=True)
            ) as channel:
                await wait_serving(channel)
                load = Load(tree.address, config)
                loader = asyncio.ensure_future(load.run())
                try:
                    for _ in range(config.rounds):
                        kinds = list(config.faults)
                        chaos.rng.shuffle(kinds)
                        for kind in kinds:
                            calm = time.monotonic()
                            await chaos.wait_full_service(channel, calm)
                            # a calm stretch between faults, under load: not a readiness wait
                            await asyncio.sleep(config.interval_s)
                            fault = await chaos.apply(kind, channel, load)
                            report.faults.append(fault)
                            print(describe(fault), flush=True)
                    await chaos.wait_full_service(channel, time.monotonic())
                finally:
                    load.stop()
                    await asyncio.wait_for(loader, config.deadline_s + HANG_S + 5)
                summarize(report, load.calls)

        asyncio.run(main())
        census = tree.census(chaos.expected)
        report.census_final = census.summary()
        report.census_ok = census.ok
        report.exit_code = tree.terminate(timeout=120)
        report.leftovers = [p for p in tree.leftovers() if p != tree.pid]
        tracebacks = tree.tracebacks()
        report.tracebacks = len(tracebacks)
        report.log_excerpts = tracebacks[:3]
    return report


def describe(fault: Fault) -> str:
    recovered = "NEVER" if fault.recover_s is None else f"{fault.recover_s:.2f} s"
    note = f" ({fault.note})" if fault.note else ""
    return (
        f"  {fault.kind:6s} {fault.target:14s} pid {fault.pid}: {fault.in_flight} in flight, "
        f"{fault.failed_in_flight} of them failed, {fault.failed_after} later calls failed "
        f"{json.dumps(fault.failed_codes, sort_keys=True)}; full service after {recovered}{note}"
    )


def summarize(report: Report, calls: list[Call]) -> None:
    report.calls = len(calls)
    report.codes = dict(Counter(c.code for c in calls))
    report.unexpected = [f"{c.model}: {c.code} {c.details}" for c in calls if c.code not in ALLOWED]
    report.wrong_payloads = sum(c.wrong_payload for c in calls)
    report.hung = sum(c.code == "HUNG" for c in calls)
    over = [(c.ended - c.began - c.deadline) * 1000 for c in calls]
    report.lateness_ms = percentiles(over)
    report.late = [
        f"{c.model} {c.code} after {c.ended - c.began:.3f} s"
        for c in calls
        if c.ended - c.began > c.deadline + 0.5
    ]
    by_kind: dict[str, list[float]] = {}
    for f in report.faults:
        if f.recover_s is not None:
            by_kind.setdefault(f.kind, []).append(f.recover_s)
    report.recovery_s = {
        kind: {"min": min(v), "median": sorted(v)[len(v) // 2], "max": max(v)}
        for kind, v in by_kind.items()
    }


def print_report(report: Report) -> None:
    r = report
    print(f"chaos: {len(r.faults)} faults, {r.calls} calls: {json.dumps(r.codes, sort_keys=True)}")
    for kind, figures in sorted(r.recovery_s.items()):
        print(
            f"  time to full service after {kind:6s}: "
            + ", ".join(f"{k} {v:.2f} s" for k, v in figures.items())
        )
    totals: dict[str, list[int]] = {}
    for f in r.faults:
        t = totals.setdefault(f.kind, [0, 0, 0])
        t[0] += f.in_flight
        t[1] += f.failed_in_flight
        t[2] += f.failed_after
    for kind, (flying, failed, after) in sorted(totals.items()):
        print(
            f"  {kind:6s}: {failed} of {flying} calls in flight failed; "
            f"{after} calls started later failed before full service"
        )
    fmt = ", ".join(f"{k} {v:+.0f}" for k, v in r.lateness_ms.items())
    print(f"  duration - deadline (ms): {fmt}")
    print(
        f"  unexpected statuses: {len(r.unexpected)}; wrong payloads: {r.wrong_payloads}; "
        f"hung: {r.hung}"
    )
    print(f"  final census: {r.census_final}")
    print(
        f"  SIGTERM: exit code {r.exit_code}; left behind: {r.leftovers}; "
        f"tracebacks in logs: {r.tracebacks}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one round, 1 s between faults")
    parser.add_argument("--rounds", type=int)
    parser.add_argument("--interval", type=float, help="seconds of calm load between faults")
    parser.add_argument("--callers", type=int)
    parser.add_argument(
        "--recover-timeout", type=float, help="seconds to wait for full service (default 60)"
    )
    parser.add_argument("--seed", type=int)
    parser.add_argument("--faults", help=f"comma-separated subset of {','.join(FAULTS)}")
    parser.add_argument("--json", type=Path, help="write the report here")
    parser.add_argument("--keep", type=Path, help="work directory to keep (logs)")
    args = parser.parse_args(argv)
    config = Config(rounds=1, interval_s=1.0) if args.quick else Config()
    if args.rounds is not None:
        config.rounds = args.rounds
    if args.interval is not None:
        config.interval_s = args.interval
    if args.callers is not None:
        config.callers = args.callers
    if args.recover_timeout is not None:
        config.recover_timeout_s = args.recover_timeout
    if args.seed is not None:
        config.seed = args.seed
    if args.faults:
        config.faults = tuple(args.faults.split(","))
    print(f"chaos: {config.rounds} rounds of {', '.join(config.faults)}")
    if args.keep:
        shutil.rmtree(args.keep, ignore_errors=True)
        args.keep.mkdir(parents=True)
        report = run(config, args.keep)
    else:
        with tempfile.TemporaryDirectory(prefix="poolserve-chaos-") as tmp:
            report = run(config, Path(tmp))
    print_report(report)
    if args.json:
        args.json.write_text(json.dumps(asdict(report), indent=2))
    problems = report.problems(slack_s=0.5)
    for problem in problems:
        print(f"FAIL: {problem}")
    print("chaos: " + ("FAILED" if problems else "passed"))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
