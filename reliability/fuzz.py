"""Fuzzing the door (issue 9.3) against a real tree, with figures.

    .venv/bin/python reliability/fuzz.py             # crafted cases + 20,000 random inputs
    .venv/bin/python reliability/fuzz.py --quick     # crafted cases + 2,000

And the HTTP/REST door (:mod:`http_fuzzing`): 5,000 hostile requests (500
with --quick) on fresh connections, each answered with a 4xx or closed
without an answer (never a 5xx), the valid ones among them echoed exactly;
the first half before the memory is first measured (it warms the heaps),
the second half after the gRPC run.

And the gRPC port's own HTTP/2 (:mod:`http2_fuzzing`): 3,000 connections of
hostile frames (500 with --quick; ``--h2-count``), after a warm-up of a
tenth and each family's largest: answers by kind, none wrong, the router's
RSS over the measured part, and a grpc.aio call served afterwards.

Raw bytes go through ``channel.unary_unary(...)`` with no stubs: crafted
attacks, mutants of valid requests and noise. Every answer must be the
in-process oracle's (:mod:`fuzzing`) and, where it judges, the oracle written
from the protocol (:mod:`spec_oracle`): INVALID_ARGUMENT for malformed input,
NOT_FOUND for a well-formed unknown model, RESOURCE_EXHAUSTED for size, OK
with the exact reply for what is valid. Also: other methods with garbage,
unknown methods (UNIMPLEMENTED), no process dies (the PIDs are the same
before and after), memory (RSS) of router, pools and workers before and
after the long run, and no traceback in the logs.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import shutil
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent))

import http2_fuzzing
import http_fuzzing

import spec_oracle
from fuzzing import Oracle, crafted, random_inputs, undeclare
from fuzzing import field as wire_field
from harness import (
    INFER,
    Tree,
    channel_options,
    make_repo,
    rss_bytes,
    wait_serving,
)

SERVICE = "inference.GRPCInferenceService"
LIMIT = 1 << 20  # max_message_size of the fuzzed tree
HTTP_CONCURRENCY = 8  # connections at once in the HTTP run
H2_CONCURRENCY = 8  # connections at once in the hostile HTTP/2 run
OTHER_METHODS = (
    "ModelReady",
    "ModelMetadata",
    "ModelConfig",
    "ModelStatistics",
    "RepositoryIndex",
    "RepositoryModelLoad",
    "RepositoryModelUnload",
)
GARBAGE = (b"\xff\xff\xff\xff", b"\x0a\x80", b"\x12", b"\x0a\x02\xff\xfe", b"\x08")
UNKNOWN_METHODS = (
    f"/{SERVICE}/NoSuchMethod",
    "/inference.NoSuchService/ModelInfer",
    "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
    "/poolserve.control.v1.PoolControl/Status",  # internal: never on the public port
    "/poolserve.control.v1.SupervisorControl/Reload",
)


@dataclass
class Report:
    inputs: int = 0
    crafted: int = 0
    codes: dict[str, int] = field(default_factory=dict)
    mismatches: list[str] = field(default_factory=list)
    spec_checked: int = 0  # inputs the independent oracle judged (it abstains on the rest)
    spec_ok: int = 0
    other_methods: dict[str, str] = field(default_factory=dict)
    unknown_methods: dict[str, str] = field(default_factory=dict)
    pids_same: bool = True
    pids_before: list[int] = field(default_factory=list)
    pids_after: list[int] = field(default_factory=list)
    rss_before: dict[str, int] = field(default_factory=dict)
    rss_after: dict[str, int] = field(default_factory=dict)
    rss_grpc_after: dict[str, int] = field(default_factory=dict)  # between the two
    tracebacks: list[str] = field(default_factory=list)
    wall_s: float = 0.0
    http_inputs: int = 0
    http_statuses: dict[str, int] = field(default_factory=dict)  # "no answer" or the status
    http_families: dict[str, int] = field(default_factory=dict)
    http_mismatches: list[str] = field(default_factory=list)
    http_wall_s: float = 0.0
    h2_inputs: int = 0
    h2_answers: dict[str, int] = field(default_factory=dict)  # the kind of answer
    h2_families: dict[str, int] = field(default_factory=dict)
    h2_mismatches: list[str] = field(default_factory=list)
    h2_wall_s: float = 0.0
    rss_h2_before: dict[str, int] = field(default_factory=dict)
    rss_h2_after: dict[str, int] = field(default_factory=dict)
    h2_grpc_after: str = ""  # a grpc.aio call after the hostile run: "OK" or what failed

    def rss_growth(self) -> dict[str, int]:
        """Over the gRPC run."""
        return {k: self.rss_grpc_after.get(k, 0) - v for k, v in self.rss_before.items()}

    def h2_rss_growth(self) -> dict[str, int]:
        """Over the hostile HTTP/2 run's measured part."""
        return {k: self.rss_h2_after.get(k, 0) - v for k, v in self.rss_h2_before.items()}

    def http_rss_growth(self) -> dict[str, int]:
        """Over the second half of the HTTP run."""
        return {k: self.rss_after.get(k, 0) - v for k, v in self.rss_grpc_after.items()}


async def send(
    method: grpc.aio.UnaryUnaryMultiCallable[bytes, bytes], body: bytes
) -> tuple[str, bytes, str]:
    try:
        reply = await method(body, timeout=30)
    except grpc.aio.AioRpcError as exc:
        return exc.code().name, b"", exc.details() or ""
    return "OK", reply, ""


def rss_by_role(tree: Tree, expected: dict[str, int]) -> dict[str, int]:
    census = tree.census(expected)
    out: dict[str, int] = {}
    for proc in census.procs:
        if proc.role in ("router", "pool", "worker"):
            out[f"{proc.role} {proc.pid}"] = rss_bytes(proc.pid)
    return out


async def fuzz_infer(
    channel: grpc.aio.Channel,
    oracle: Oracle,
    cases: list[tuple[str, bytes]],
    report: Report,
    concurrency: int = 16,
) -> None:
    method = channel.unary_unary(INFER)
    queue = iter(cases)

    async def lane() -> None:
        for name, body in queue:
            code, reply, details = await send(method, body)
            want = oracle.expect(body)
            report.codes[code] = report.codes.get(code, 0) + 1
            report.inputs += 1
            shown = f"bytes {body[:48].hex()}{'...' if len(body) > 48 else ''}"
            if code != want.code or (code == "OK" and reply != want.reply):
                report.mismatches.append(
                    f"{name}: got {code} ({details[:80]}), expected {want.code}; {shown}"
                )
            verdict = spec_oracle.predict(body, LIMIT)
            if verdict is not None:
                report.spec_checked += 1
                report.spec_ok += verdict.code == "OK"
                differs = spec_oracle.disagreement(verdict, code, reply)
                if differs:
                    report.mismatches.append(f"{name}: {differs} ({details[:80]}); {shown}")

    await asyncio.gather(*(lane() for _ in range(concurrency)))


async def fuzz_doors(channel: grpc.aio.Channel, report: Report) -> None:
    for name in OTHER_METHODS:
        method = channel.unary_unary(f"/{SERVICE}/{name}")
        for garbage in GARBAGE:
            code, _, details = await send(method, garbage)
            report.other_methods[f"{name} {garbage.hex()}"] = f"{code} {details[:60]}"
    for path in UNKNOWN_METHODS:
        code, _, _ = await send(channel.unary_unary(path), b"")
        report.unknown_methods[path] = code


async def fuzz_http(
    address: str,
    cases: list[http_fuzzing.Case],
    report: Report,
    concurrency: int = HTTP_CONCURRENCY,
) -> None:
    """Each case on its own connection; the answers judged (:func:`http_fuzzing.judge`)."""
    host, port = address.rsplit(":", 1)
    queue = iter(cases)

    async def lane() -> None:
        for case in queue:
            valid = case.kind == http_fuzzing.VALID
            answer = await http_fuzzing.send(host, int(port), case.request, half_open=valid)
            status = http_fuzzing.status_of(http_fuzzing.final(answer))  # past a 100
            key = "no answer" if status is None else str(status)
            report.http_statuses[key] = report.http_statuses.get(key, 0) + 1
            report.http_families[case.family] = report.http_families.get(case.family, 0) + 1
            report.http_inputs += 1
            wrong = http_fuzzing.judge(case, answer)
            if wrong is not None:
                report.http_mismatches.append(f"{case.family}: {wrong}; {case.request[:80]!r}")

    await asyncio.gather(*(lane() for _ in range(concurrency)))


async def fuzz_h2(
    address: str,
    cases: list[http2_fuzzing.Case],
    report: Report,
    concurrency: int = H2_CONCURRENCY,
) -> None:
    """Each case on its own connection to the gRPC port; the answers judged
    (:func:`http2_fuzzing.judge`)."""
    host, port = address.rsplit(":", 1)
    queue = iter(cases)

    async def lane() -> None:
        for case in queue:
            answer, _ = await http2_fuzzing.send(host, int(port), case)
            key = http2_fuzzing.kind_of(case, answer)
            report.h2_answers[key] = report.h2_answers.get(key, 0) + 1
            report.h2_families[case.family] = report.h2_families.get(case.family, 0) + 1
            report.h2_inputs += 1
            wrong = http2_fuzzing.judge(case, answer)
            if wrong is not None:
                report.h2_mismatches.append(f"{case.family}: {wrong}; {case.data[24:88].hex()}")

    await asyncio.gather(*(lane() for _ in range(concurrency)))


async def grpc_still_served(address: str) -> str:
    """A grpc.aio client's ModelInfer for echo: "OK", or what went wrong."""
    body, ident, tensor = http2_fuzzing.infer_body(random.Random(0))
    async with grpc.aio.insecure_channel(address, options=channel_options(local=False)) as channel:
        code, reply, details = await send(channel.unary_unary(INFER), body)
    if code != "OK":
        return f"{code} {details[:80]}"
    wrong = http2_fuzzing.echo_differs(len(reply).to_bytes(5, "big") + reply, ident, tensor)
    return wrong or "OK"


def oversized() -> list[tuple[str, bytes]]:
    big = wire_field(1, 2, b"echo") + wire_field(7, 2, b"\0" * (LIMIT + 16))
    return [("message over max_message_size", big)]


def run(
    count: int, seed: int, workdir: Path, http_count: int = 5000, h2_count: int = 3000
) -> Report:
    repo = make_repo(workdir / "repo", {"echo": None, "sleep": "slow"}, {"max_message_size": LIMIT})
    undeclare(repo)  # every datatype and shape reaches the decoder (fuzzing.Oracle)
    expected = {"default": 2, "slow": 2}
    report = Report()
    oracle = Oracle(LIMIT)
    with Tree(repo, workdir / "run", workers=2) as tree:

        async def main() -> None:
            async with grpc.aio.insecure_channel(
                tree.address, options=channel_options(local=False)
            ) as channel:
                await wait_serving(channel)
                before = tree.census(expected)
                report.pids_before = sorted(p.pid for p in before.procs)
                began = time.monotonic()
                warmup = list(itertools.islice(random_inputs(seed + 1), min(1000, count)))
                await fuzz_infer(channel, oracle, crafted() + oversized() + warmup, report)
                report.crafted = len(crafted()) + 1
                http = (tree.run_dir / "http.addr").read_text().strip()
                hostile = http_fuzzing.cases(seed)
                # the HTTP run's first half warms the heaps (JSON bombs take tens of MiB
                # in a worker, freed but kept by the allocator); the gRPC run's growth is
                # measured from there, the second half's from the end of the gRPC run
                first = http_fuzzing.largest() * 2 + list(
                    itertools.islice(hostile, http_count // 2)
                )
                began_http = time.monotonic()
                await fuzz_http(http, first, report)
                report.http_wall_s = time.monotonic() - began_http
                report.rss_before = rss_by_role(tree, expected)
                stream = list(itertools.islice(random_inputs(seed), count))
                await fuzz_infer(channel, oracle, stream, report)
                await fuzz_doors(channel, report)
                report.wall_s = time.monotonic() - began - report.http_wall_s
                report.rss_grpc_after = rss_by_role(tree, expected)
                began_http = time.monotonic()
                second = list(itertools.islice(hostile, http_count - http_count // 2))
                await fuzz_http(http, second, report)
                report.http_wall_s += time.monotonic() - began_http
                report.rss_after = rss_by_role(tree, expected)
                # hostile HTTP/2 at the gRPC port: a tenth (and each family's largest
                # allocations) warms the router's heap, the rest is measured
                hostile_h2 = http2_fuzzing.cases(seed)
                warm = http2_fuzzing.largest() + list(itertools.islice(hostile_h2, h2_count // 10))
                began_h2 = time.monotonic()
                await fuzz_h2(tree.address, warm, report)
                report.rss_h2_before = rss_by_role(tree, expected)
                rest = list(itertools.islice(hostile_h2, h2_count - h2_count // 10))
                await fuzz_h2(tree.address, rest, report)
                report.h2_wall_s = time.monotonic() - began_h2
                report.rss_h2_after = rss_by_role(tree, expected)
                report.h2_grpc_after = await grpc_still_served(tree.address)
                after = tree.census(expected)
                report.pids_after = sorted(p.pid for p in after.procs)
                report.pids_same = report.pids_before == report.pids_after and after.ok

        asyncio.run(main())
        report.tracebacks = tree.tracebacks()
    return report


def problems(report: Report, rss_tolerance: int) -> list[str]:
    out = []
    if report.mismatches:
        out.append(
            f"{len(report.mismatches)} answers differ from the oracle: "
            + "\n  ".join(report.mismatches[:10])
        )
    bad = {k: v for k, v in report.other_methods.items() if not v.startswith("INVALID_ARGUMENT")}
    if bad:
        out.append(f"garbage to other methods: {bad}")
    bad = {k: v for k, v in report.unknown_methods.items() if v != "UNIMPLEMENTED"}
    if bad:
        out.append(f"unknown methods: {bad}")
    if not report.pids_same:
        out.append(f"processes changed: {report.pids_before} -> {report.pids_after}")
    grown = {k: v for k, v in report.rss_growth().items() if v > rss_tolerance}
    if grown:
        out.append(f"RSS grew more than {rss_tolerance >> 20} MiB: {grown}")
    if report.tracebacks:
        out.append(f"{len(report.tracebacks)} tracebacks in the log:\n{report.tracebacks[0]}")
    # Bodies up to LIMIT on HTTP_CONCURRENCY connections at once, each body held
    # two or three times over (router, worker): how far the heaps' high-water mark
    # may still move between two measures without anything kept.
    bound = rss_tolerance + 4 * HTTP_CONCURRENCY * LIMIT
    grown = {k: v for k, v in report.http_rss_growth().items() if v > bound}
    if grown:
        out.append(f"RSS grew more than {bound >> 20} MiB over the HTTP run: {grown}")
    grown = {
        k: v for k, v in report.h2_rss_growth().items() if k.startswith("router") and v > bound
    }
    if grown:
        out.append(f"RSS grew more than {bound >> 20} MiB over the HTTP/2 run: {grown}")
    if report.h2_mismatches:
        out.append(
            f"{len(report.h2_mismatches)} wrong answers at the gRPC port's HTTP/2: "
            + "\n  ".join(report.h2_mismatches[:10])
        )
    if report.h2_inputs and report.h2_grpc_after != "OK":
        out.append(f"a grpc client after the HTTP/2 run: {report.h2_grpc_after}")
    if report.http_mismatches:
        out.append(
            f"{len(report.http_mismatches)} wrong answers at the HTTP door: "
            + "\n  ".join(report.http_mismatches[:10])
        )
    return out


def print_report(report: Report) -> None:
    r = report
    print(
        f"fuzz: {r.inputs} ModelInfer inputs ({r.crafted} crafted) in {r.wall_s:.1f} s: "
        f"{json.dumps(r.codes, sort_keys=True)}"
    )
    print(
        f"  answers that differ from the in-process oracle or the spec oracle: "
        f"{len(r.mismatches)}; the spec oracle judged {r.spec_checked} inputs "
        f"({r.spec_ok} OK with their tensors decoded, {r.spec_checked - r.spec_ok} invalid)"
    )
    other = Counter(v.split()[0] for v in r.other_methods.values())
    print(f"  garbage to {len(OTHER_METHODS)} other methods: {dict(other)}")
    print(f"  unknown methods: {dict(Counter(r.unknown_methods.values()))}")
    print(f"  processes unchanged: {r.pids_same} ({len(r.pids_after)} processes)")
    growth = ", ".join(f"{k} {v / 1024:+.0f} KiB" for k, v in sorted(r.rss_growth().items()))
    print(f"  RSS growth over the gRPC run: {growth}")
    print(f"  tracebacks in logs: {len(r.tracebacks)}")
    print(
        f"fuzz: {r.http_inputs} hostile HTTP requests in {r.http_wall_s:.1f} s "
        f"({json.dumps(r.http_families, sort_keys=True)}): answers "
        f"{json.dumps(r.http_statuses, sort_keys=True)}; wrong: {len(r.http_mismatches)}"
    )
    growth = ", ".join(f"{k} {v / 1024:+.0f} KiB" for k, v in sorted(r.http_rss_growth().items()))
    print(f"  RSS growth over the HTTP run's second half: {growth}")
    print(
        f"fuzz: {r.h2_inputs} hostile HTTP/2 connections to the gRPC port in {r.h2_wall_s:.1f} s "
        f"({json.dumps(r.h2_families, sort_keys=True)}): answers "
        f"{json.dumps(r.h2_answers, sort_keys=True)}; wrong: {len(r.h2_mismatches)}"
    )
    growth = ", ".join(f"{k} {v / 1024:+.0f} KiB" for k, v in sorted(r.h2_rss_growth().items()))
    print(f"  RSS growth over the HTTP/2 run (after its warm-up): {growth}")
    print(f"  a grpc.aio call after it: {r.h2_grpc_after}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2,000 random inputs")
    parser.add_argument("--count", type=int, help="random inputs (default 20,000)")
    parser.add_argument("--http-count", type=int, help="hostile HTTP requests (default 5,000)")
    parser.add_argument(
        "--h2-count", type=int, help="hostile HTTP/2 connections to the gRPC port (default 3,000)"
    )
    parser.add_argument("--seed", type=int, default=9)
    parser.add_argument("--rss-tolerance-mib", type=int, default=8)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--keep", type=Path)
    args = parser.parse_args(argv)
    count = args.count or (2000 if args.quick else 20_000)
    http_count = args.http_count or (500 if args.quick else 5000)
    h2_count = args.h2_count or (500 if args.quick else 3000)
    if args.keep:
        shutil.rmtree(args.keep, ignore_errors=True)
        args.keep.mkdir(parents=True)
        report = run(count, args.seed, args.keep, http_count, h2_count)
    else:
        with tempfile.TemporaryDirectory(prefix="poolserve-fuzz-") as tmp:
            report = run(count, args.seed, Path(tmp), http_count, h2_count)
    print_report(report)
    if args.json:
        args.json.write_text(json.dumps(asdict(report), indent=2, default=str))
    found = problems(report, args.rss_tolerance_mib << 20)
    for problem in found:
        print(f"FAIL: {problem}")
    print("fuzz: " + ("FAILED" if found else "passed"))
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
