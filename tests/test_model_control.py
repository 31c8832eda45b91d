"""Model control cannot be turned against the server (issue 21 §3).

End to end: a flood of loads for names that do not exist leaves echo's
latency where it was, and loads of a model that is already loaded from the
same files replace no worker. Unit tests pace the rescans and reloads with
an injected clock, without sleeping.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from poolserve.protos import inference_pb2 as pb
from poolserve.protos import inference_pb2_grpc as pbg
from poolserve.service.contract.repository import fingerprint, scan
from poolserve.service.grpcserver.pacing import Pacer, Rescanner

from serving import Serving, pool_status, wait_serving
from support import CLIENTS, copy_example, infer_request

Stub = pbg.GRPCInferenceServiceStub


# -- pacing, with an injected clock -------------------------------------------


class FakeClock:
    """A clock that moves only when someone sleeps on it."""

    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds
        await asyncio.sleep(0)


def rescanner(clock: FakeClock, job_runs: list[int], interval: float = 5.0) -> Rescanner[int]:
    def job() -> int:
        job_runs.append(threading.get_ident())
        return len(job_runs)

    return Rescanner(job, interval, clock=clock, sleep=clock.sleep)


def test_concurrent_callers_share_one_scan_run_on_a_thread() -> None:
    async def main() -> None:
        clock, runs = FakeClock(), []
        scans = rescanner(clock, runs)
        owner = asyncio.create_task(scans.serve())
        results = await asyncio.gather(*(scans.fresh() for _ in range(50)))
        assert results == [1] * 50
        assert len(runs) == 1 and scans.runs == 1
        assert runs[0] != threading.get_ident(), "the scan ran on the event loop's thread"
        assert clock.slept == []  # the first scan needs no waiting
        owner.cancel()

    asyncio.run(main())


def test_scans_start_at_most_once_per_interval_and_callers_in_between_share_the_next() -> None:
    async def main() -> None:
        clock, runs = FakeClock(), []
        scans = rescanner(clock, runs, interval=5.0)
        owner = asyncio.create_task(scans.serve())
        assert await scans.fresh() == 1
        clock.now += 1.0  # 1 s later: the next scan waits 4 s, and everyone shares it
        assert await asyncio.gather(*(scans.fresh() for _ in range(20))) == [2] * 20
        assert clock.slept == [4.0]
        clock.now += 10.0  # long after: no waiting at all
        assert await scans.fresh() == 3
        assert clock.slept == [4.0]
        assert scans.runs == 3
        owner.cancel()

    asyncio.run(main())


def test_an_initial_result_counts_as_a_scan_and_a_fresh_one_is_newer() -> None:
    async def main() -> None:
        clock = FakeClock()
        scans = Rescanner(lambda: "new", 2.0, clock=clock, sleep=clock.sleep, initial="start")
        assert scans.latest == "start"
        owner = asyncio.create_task(scans.serve())
        assert await scans.fresh() == "new"  # a load never answers from an older scan
        assert clock.slept == [2.0]
        owner.cancel()

    asyncio.run(main())


def test_a_failed_scan_reaches_every_waiter_and_the_next_call_scans_again() -> None:
    async def main() -> None:
        clock = FakeClock()
        outcomes = iter([OSError("repository gone"), 7])

        def job() -> int:
            outcome = next(outcomes)
            if isinstance(outcome, Exception):
                raise outcome
            return outcome

        scans = Rescanner(job, 1.0, clock=clock, sleep=clock.sleep)
        owner = asyncio.create_task(scans.serve())
        failed = await asyncio.gather(scans.fresh(), scans.fresh(), return_exceptions=True)
        assert [str(f) for f in failed] == ["repository gone"] * 2
        assert await scans.fresh() == 7
        owner.cancel()

    asyncio.run(main())


def test_a_caller_that_goes_away_does_not_disturb_the_others() -> None:
    async def main() -> None:
        clock, runs = FakeClock(), []
        scans = rescanner(clock, runs)
        owner = asyncio.create_task(scans.serve())
        await scans.fresh()
        gone = asyncio.create_task(scans.fresh())
        stays = asyncio.create_task(scans.fresh())
        await asyncio.sleep(0)
        gone.cancel()
        assert await stays == 2
        assert gone.cancelled()
        owner.cancel()

    asyncio.run(main())


def test_pacer_lets_one_start_per_key_per_interval() -> None:
    async def main() -> None:
        clock = FakeClock()
        pacer = Pacer(10.0, clock=clock, sleep=clock.sleep)
        starts: list[float] = []

        async def start(key: str) -> bool:
            waited = await pacer.turn(key)
            if key == "echo":
                starts.append(clock())
            return waited

        assert await start("echo") is False
        assert await start("other") is False  # keys do not share a turn
        clock.now += 3.0
        assert await start("echo") is True
        assert clock.slept == [7.0]
        await asyncio.gather(*(start("echo") for _ in range(3)))  # all at once: in turn
        assert starts[0] == 100.0 and starts[1] == 110.0
        assert all(b - a >= 10.0 for a, b in itertools.pairwise(starts))
        assert len(starts) == 5

    asyncio.run(main())


def test_fingerprint_sees_changed_files_but_not_bytecode(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    folder = copy_example(repo, "echo")
    settings = scan(repo).models[0]
    before = fingerprint(settings)
    assert before is not None and any(key.endswith("model.py") for key, *_ in before)
    (folder / "__pycache__").mkdir(exist_ok=True)
    (folder / "__pycache__" / "model.cpython-311.pyc").write_bytes(b"bytecode")
    assert fingerprint(settings) == before
    (folder / "model.py").write_text((folder / "model.py").read_text() + "\n# edited\n")
    assert fingerprint(settings) != before


# -- end to end -------------------------------------------------------------------

SAMPLES = 400  # echo calls per phase: medians of this many hold on a loaded machine
EMPTY_FOLDERS = 10_000
FLOOD_S = 4.0  # long enough for several rescans while echo is measured
MAX_PHASE_S = 20.0


def many_folders(repo: Path, count: int) -> None:
    for i in range(count):
        os.mkdir(repo / f"empty-{i:05d}")


async def echo_latencies(stub: Stub, count: int, at_least_s: float = 0.0) -> list[float]:
    """Latencies of ``count`` sequential echo calls (more, until ``at_least_s`` passed;
    fewer if MAX_PHASE_S passed first, as it does when every call is slow)."""
    body = pb.ModelInferRequest.FromString(infer_request("echo", np.ones((1, 16), np.float32)))
    took: list[float] = []
    began = time.perf_counter()
    while len(took) < count or time.perf_counter() < began + at_least_s:
        if time.perf_counter() > began + MAX_PHASE_S:
            break
        sent = time.perf_counter()
        await stub.ModelInfer(body, timeout=30)
        took.append(time.perf_counter() - sent)
    return took


@pytest.mark.e2e
def test_echo_latency_holds_under_a_flood_of_loads_for_unknown_names(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    copy_example(repo, "echo")
    many_folders(repo, EMPTY_FOLDERS)
    # A short interval, so that the flood makes the router scan several times
    # while echo is measured: the scans run, just not on the event loop.
    (repo / "settings.json").write_text(json.dumps({"repository_rescan_s": 0.5}))

    async def main(serving: Serving) -> None:
        async with grpc.aio.insecure_channel(serving.address) as channel:
            await wait_serving(channel)
            stub = Stub(channel)
            await echo_latencies(stub, 50)  # warm up
            quiet = await echo_latencies(stub, SAMPLES)
            flood = await asyncio.create_subprocess_exec(
                *(sys.executable, "-P", str(CLIENTS / "load_flood.py"), serving.address, "16"),
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
            )
            try:
                assert flood.stdout is not None and flood.stdin is not None
                assert await flood.stdout.readline() == b"flooding\n"
                flooded = await echo_latencies(stub, SAMPLES, at_least_s=FLOOD_S)
                live = await stub.ServerLive(pb.ServerLiveRequest(), timeout=10)
                health = health_pb2_grpc.HealthStub(channel)
                check = await health.Check(health_pb2.HealthCheckRequest(), timeout=10)
                flood.stdin.write(b"stop\n")
                await flood.stdin.drain()
                report = json.loads(await flood.stdout.readline())
            finally:
                if flood.returncode is None:
                    flood.kill()
                await flood.wait()
            quiet += await echo_latencies(stub, SAMPLES)
        assert live.live and check.status == health_pb2.HealthCheckResponse.SERVING
        assert report["calls"] > 0 and set(report["codes"]) == {"NOT_FOUND"}, report
        assert report["details"].startswith("failed to load 'no-such-model-"), report
        base, loaded = statistics.median(quiet), statistics.median(flooded)
        print(
            f"echo median {base * 1000:.2f} ms quiet, {loaded * 1000:.2f} ms under "
            f"{report['calls']} loads of unknown names ({EMPTY_FOLDERS} folders)"
        )
        assert loaded <= 3 * base, (base, loaded, report)

    with Serving(repo, tmp_path / "run", workers=1) as serving:
        asyncio.run(main(serving))


@pytest.mark.e2e
def test_loads_of_a_loaded_model_replace_no_worker_until_its_files_change(
    tmp_path: Path,
) -> None:
    repo = tmp_path / "repo"
    copy_example(repo, "echo")

    async def main(serving: Serving) -> None:
        async with grpc.aio.insecure_channel(serving.address) as channel:
            await wait_serving(channel)
            stub = Stub(channel)
            load = pb.RepositoryModelLoadRequest(model_name="echo")
            workers = {w.pid for w in (await pool_status(serving)).workers}
            for _ in range(10):
                await stub.RepositoryModelLoad(load, timeout=60)
            await asyncio.gather(*(stub.RepositoryModelLoad(load, timeout=60) for _ in range(10)))
            assert {w.pid for w in (await pool_status(serving)).workers} == workers
            assert "loaded live" not in serving.log()

            code = repo / "echo" / "model.py"
            code.write_text(code.read_text() + "\n# a new version\n")
            await asyncio.gather(*(stub.RepositoryModelLoad(load, timeout=60) for _ in range(5)))
            replaced = {w.pid for w in (await pool_status(serving)).workers}
            assert replaced and not replaced & workers
            await stub.RepositoryModelLoad(load, timeout=60)  # nothing changed since
            assert {w.pid for w in (await pool_status(serving)).workers} == replaced
            assert serving.log().count("model echo loaded live") == 1
            reply = await stub.ModelInfer(
                pb.ModelInferRequest.FromString(infer_request("echo", np.ones((1, 3), np.float32))),
                timeout=30,
            )
            assert reply.outputs

    with Serving(repo, tmp_path / "run", workers=2) as serving:
        asyncio.run(main(serving))
