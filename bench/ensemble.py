"""The ensemble part of the bench (issue 44, item 2): an ensemble of two light
steps against one direct call, and against a client that calls both steps itself.

One tree (router, pool ``default``, 2 workers): ``echo`` (FP32 [1,16]) and
the same echo as ``echo_b``, and ``echo2``, the ensemble ``{"pipeline":
["echo", "echo_b"]}``: both steps in one pool, so each of its calls runs as
one job on one worker (service/contract/chain.py). The same again with
``echo_b`` in a pool of its own (``other``: the router forwards each step),
and with both echos inline (the router forwards each step, no worker hop),
reported beside the targets' rows. One client
process, grpc.aio with the messages' bytes made once (no tensor codec in the
loop), closed loop:

- latency at concurrency 1: the median of ``echo2`` over the median of a
  direct ``echo`` call, in alternating windows (target <= 1.3x);
- throughput at concurrency 16: ``echo2`` calls/s over the pipelines/s of
  clients that call ``echo``, build ``echo_b``'s request from its reply
  (protobuf, the raw bytes passed on) and call ``echo_b`` (target >= 2x).

    .venv/bin/python bench/ensemble.py [--seconds 5] [--rounds 3]
    .venv/bin/python bench/run.py --only ensemble

Only the standard library at import time: run.py registers this module's
section in report.py, and tests load it by path.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
TITLE = "Ensembles (two light steps)"
ISSUE = "44"  # a string, as every part's issue is (the report joins them)
INFER = "/inference.GRPCInferenceService/ModelInfer"
LATENCY_TARGET = 1.3  # ensemble p50 / direct p50, at c1
THROUGHPUT_TARGET = 2.0  # ensemble calls/s / a client's own two-step pipelines/s, at c16
C = 16


LAYOUTS = ("one_pool", "two_pools", "inline")


def _repository(repo: Path, layout: str) -> None:
    echo = ROOT / "examples" / "models" / "echo"
    inline = layout == "inline"
    second = "default" if layout == "one_pool" else "other"
    for name, gid in (("echo", "default"), ("echo_b", second)):
        shutil.copytree(echo, repo / name, ignore=shutil.ignore_patterns("__pycache__"))
        path = repo / name / "model-settings.json"
        settings = json.loads(path.read_text())
        settings["name"] = name
        params = settings.setdefault("parameters", {})
        params["inference_pool_gid"] = gid
        if inline:  # run in the pool server, on its event loop: no worker hop
            settings["parallel_workers"] = 0
            params.setdefault("extra", {})["inline_fast"] = True
        path.write_text(json.dumps(settings))
    (repo / "echo2").mkdir()
    (repo / "echo2" / "model-settings.json").write_text(
        json.dumps(
            {
                "name": "echo2",
                "platform": "ensemble",
                "parameters": {"extra": {"pipeline": ["echo", "echo_b"]}},
            }
        )
    )


def _request(model: str) -> bytes:
    from poolserve.protos import inference_pb2 as pb

    request = pb.ModelInferRequest(model_name=model)
    request.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 16])
    request.raw_input_contents.append(bytes(64))
    return request.SerializeToString()


def _second_step(reply: bytes) -> bytes:
    """What a client does between its two calls: the first reply's output as
    the second request's input, its raw bytes passed on."""
    from poolserve.protos import inference_pb2 as pb

    response = pb.ModelInferResponse.FromString(reply)
    request = pb.ModelInferRequest(model_name="echo_b")
    out = response.outputs[0]
    request.inputs.add(name="INPUT0", datatype=out.datatype, shape=out.shape)
    request.raw_input_contents.append(response.raw_output_contents[0])
    return request.SerializeToString()


async def _latencies(call: Any, body: bytes, seconds: float) -> list[float]:
    out = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        began = time.perf_counter()
        await call(body, timeout=30)
        out.append(time.perf_counter() - began)
    return out


async def _rate(one: Any, seconds: float) -> float:
    """Closed loop at concurrency C: completed units per second."""
    done = 0
    end = 0.0

    async def loop() -> None:
        nonlocal done
        while time.monotonic() < end:
            await one()
            done += 1

    end = time.monotonic() + 0.5  # warm-up
    await asyncio.gather(*(loop() for _ in range(C)))
    done = 0
    began = time.monotonic()
    end = began + seconds
    await asyncio.gather(*(loop() for _ in range(C)))
    return done / (time.monotonic() - began)


async def _measure(address: str, seconds: float, rounds: int) -> dict[str, Any]:
    import grpc

    direct, ensemble, step2 = _request("echo"), _request("echo2"), _request("echo_b")
    async with grpc.aio.insecure_channel(address) as channel:
        call = channel.unary_unary(INFER)
        for body in (direct, ensemble, step2):  # warm every path
            for _ in range(50):
                await call(body, timeout=30)
        p50: dict[str, list[float]] = {"direct": [], "ensemble": [], "client_two_calls": []}
        rate: dict[str, list[float]] = {"ensemble": [], "client_two_calls": []}

        async def by_ensemble() -> None:
            await call(ensemble, timeout=30)

        async def by_client() -> None:
            await call(_second_step(await call(direct, timeout=30)), timeout=30)

        async def two_calls(body: bytes, timeout: float) -> None:
            await call(_second_step(await call(body, timeout=timeout)), timeout=timeout)

        for r in range(rounds):  # the sides alternate: the host drifts
            order = ("direct", "ensemble", "client_two_calls")
            for key in order if r % 2 == 0 else order[::-1]:
                body = ensemble if key == "ensemble" else direct
                one = two_calls if key == "client_two_calls" else call
                p50[key].append(statistics.median(await _latencies(one, body, seconds)))
            sides = (("ensemble", by_ensemble), ("client_two_calls", by_client))
            for key, one in sides if r % 2 == 0 else sides[::-1]:
                rate[key].append(await _rate(one, seconds))
    latency_ratio = statistics.median(
        e / d for e, d in zip(p50["ensemble"], p50["direct"], strict=True)
    )
    rate_ratio = statistics.median(
        e / c for e, c in zip(rate["ensemble"], rate["client_two_calls"], strict=True)
    )
    return {
        "seconds": seconds,
        "rounds": rounds,
        "direct_p50_ms": round(1000 * statistics.median(p50["direct"]), 3),
        "ensemble_p50_ms": round(1000 * statistics.median(p50["ensemble"]), 3),
        "client_two_calls_p50_ms": round(1000 * statistics.median(p50["client_two_calls"]), 3),
        "latency_ratio": round(latency_ratio, 2),
        "ensemble_rps": round(statistics.median(rate["ensemble"]), 1),
        "client_two_calls_rps": round(statistics.median(rate["client_two_calls"]), 1),
        "throughput_ratio": round(rate_ratio, 2),
        "concurrency": C,
    }


def measure(seconds: float = 5.0, rounds: int = 3) -> dict[str, Any]:
    """Both steps in one pool (the targets' figures), then in two pools, then inline."""
    found = _measure_tree(seconds, rounds, "one_pool")
    for layout in LAYOUTS[1:]:
        found[layout] = _measure_tree(seconds, rounds, layout)
    return found


def _measure_tree(seconds: float, rounds: int, layout: str) -> dict[str, Any]:
    sys.path.insert(0, str(ROOT / "reliability"))
    from harness import Tree

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        repo = work / "repo"
        repo.mkdir()
        _repository(repo, layout)
        with Tree(repo, work / "run", workers=2) as tree:
            return asyncio.run(_measure(tree.address, seconds, rounds))


def targets(results: Mapping[str, Any]) -> list[dict[str, Any]]:
    found = results.get("ensemble")
    if not found:
        return []
    latency, rate = found["latency_ratio"], found["throughput_ratio"]
    return [
        {"key": "ensemble_latency_c1", "issue": ISSUE, "op": "<=", "threshold": LATENCY_TARGET,
         "label": "ensemble of two light steps / one direct call, p50 latency at c1",
         "value": latency, "passed": latency <= LATENCY_TARGET,
         "detail": f"{found['ensemble_p50_ms']} vs {found['direct_p50_ms']} ms; a client's "
                   f"own two calls {found['client_two_calls_p50_ms']} ms"},
        {"key": "ensemble_throughput_c16", "issue": ISSUE, "op": ">=",
         "threshold": THROUGHPUT_TARGET,
         "label": "ensemble / a client calling both steps itself, throughput at c16",
         "value": rate, "passed": rate >= THROUGHPUT_TARGET,
         "detail": f"{found['ensemble_rps']} vs {found['client_two_calls_rps']} calls/s"},
    ]  # fmt: skip


def section(results: Mapping[str, Any]) -> str:
    found = results.get("ensemble")
    if not found:
        return ""
    rows = [
        f"| {t['label']} ({t['detail']}) | {t['value']} | {t['op']} {t['threshold']} "
        f"| {'PASS' if t['passed'] else 'MISS'} |"
        for t in targets(results)
    ]
    lines = ["`echo` -> `echo_b` in one pool of 2 workers, each ensemble call one job on one "
             "worker (bench/ensemble.py), medians of "
             f"{found['rounds']} alternating rounds of {found['seconds']:g} s.", "",
             "| target | measured | target | result |", "|---|---|---|---|", *rows]  # fmt: skip
    others = [(k, found[k]) for k in LAYOUTS[1:] if found.get(k)]
    if others:
        lines += ["", "The same where the router forwards each step: `echo_b` in a pool of its "
                  "own (2 workers each), or both echos inline (`parallel_workers: 0`, "
                  "`inline_fast`: no worker hop):", "",
                  "| steps | p50 at c1: ensemble / direct / client's two calls, ms | ratio "
                  f"| calls/s at c{C}: ensemble / client's two calls | ratio |",
                  "|---|---|---|---|---|"]  # fmt: skip
        names = {"two_pools": "in two pools", "inline": "inline, one pool"}
        for key, o in others:
            lines.append(
                f"| {names[key]} | {o['ensemble_p50_ms']} / {o['direct_p50_ms']} / "
                f"{o['client_two_calls_p50_ms']} | {o['latency_ratio']} | {o['ensemble_rps']} / "
                f"{o['client_two_calls_rps']} | {o['throughput_ratio']} |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    measured = measure(args.seconds, args.rounds)
    print(json.dumps(measured))
    print(section({"ensemble": measured}))
