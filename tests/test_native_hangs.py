"""A hung native call never takes a pool down, and a model that cannot survive
the fork is found by the self-test, not by a caller.

Real trees over loopback. Waits are on status, health and replies, with
generous limits for a loaded machine; nothing asserts a speed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from poolserve.protos import inference_pb2 as pb
from poolserve.protos import inference_pb2_grpc as pbg
from poolserve.service.inference.codec import encode_inputs

from serving import Serving, pool_status, wait_serving
from support import copy_example, write_model

pytestmark = pytest.mark.e2e

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING

# Blocks in C with the GIL released: the worker's heartbeat thread keeps beating.
C_SLEEP = """
import ctypes

from poolserve.service import Model

libc = ctypes.CDLL(None)


class CSleep(Model):
    def predict(self, inputs, parameters):
        libc.sleep(3600)
        return {"OUTPUT0": inputs["INPUT0"]}
"""

# A thread pool started in load(): after the fork its thread is gone, and the
# first prediction waits for it forever (what libgomp does to XGBoost).
HANGS_AFTER_FORK = """
import queue
import threading

from poolserve.service import Model


class PoolInLoad(Model):
    def load(self):
        self.jobs = queue.Queue()
        threading.Thread(target=self.serve, daemon=True).start()
        self.predict({"INPUT0": 1.0}, {})  # a warm-up: works here, in the zygote

    def serve(self):
        while True:
            job, done = self.jobs.get()
            done.put(job * 2)

    def predict(self, inputs, parameters):
        done = queue.Queue()
        self.jobs.put((inputs["INPUT0"], done))
        return {"OUTPUT0": done.get()}
"""

# Zeros are invalid input for it: its warm-up raises, and that is no failure.
PICKY = """
import numpy as np

from poolserve.service import InvalidInput, Model


class Picky(Model):
    def predict(self, inputs, parameters):
        x = inputs["INPUT0"]
        if not np.any(x):
            raise InvalidInput("all zeros")
        return {"OUTPUT0": x}
"""

DECLARED = {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [-1, 4]}]}


def request(model: str, value: float = 1.0) -> pb.ModelInferRequest:
    req = pb.ModelInferRequest(model_name=model)
    encode_inputs({"INPUT0": np.full((1, 4), value, np.float32)}, req, raw=True)
    return req


def repo_with(tmp_path: Path, settings: dict[str, object]) -> Path:
    repo = tmp_path / "repo"
    copy_example(repo, "echo")
    (repo / "settings.json").write_text(json.dumps(settings))
    return repo


class HealthLog:
    """Every status the router's ``""`` health reported, in order (a Watch stream)."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.seen: list[int] = []
        self.changed = asyncio.Event()
        stub = health_pb2_grpc.HealthStub(channel)
        self.stream = stub.Watch(health_pb2.HealthCheckRequest(service=""))
        self.task = asyncio.ensure_future(self._follow())

    async def _follow(self) -> None:
        async for reply in self.stream:
            self.seen.append(reply.status)
            self.changed.set()

    async def until(self, status: int, after: int, timeout: float) -> int:
        """Waits for ``status`` at an index >= ``after``; returns that index."""
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        while True:
            for index in range(after, len(self.seen)):
                if self.seen[index] == status:
                    return index
            self.changed.clear()
            left = end - loop.time()
            if left <= 0:
                raise AssertionError(f"health never said {status} (saw {self.seen[after:]})")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.changed.wait(), left)

    def close(self) -> None:
        self.stream.cancel()
        self.task.cancel()


async def worker_states(serving: Serving) -> dict[int, str]:
    return {w.pid: w.state for w in (await pool_status(serving)).workers}


async def poll(serving: Serving, predicate: object, timeout: float) -> dict[int, str]:
    """Polls the pool's Status RPC (no event to wait on) until ``predicate(states)``."""
    end = time.monotonic() + timeout
    while True:
        states = await worker_states(serving)
        if predicate(states):  # type: ignore[operator]
            return states
        assert time.monotonic() < end, f"never held; worker states: {states}"
        await asyncio.sleep(0.05)


def test_worker_stuck_in_c_after_its_caller_left_is_replaced(tmp_path: Path) -> None:
    grace = 2.0
    repo = repo_with(tmp_path, {"abandon_grace_s": grace})
    write_model(repo, "csleep", {"implementation": "model.CSleep"}, C_SLEEP)

    async def main() -> None:
        async with grpc.aio.insecure_channel(serving.address) as channel:
            await wait_serving(channel)
            stub = pbg.GRPCInferenceServiceStub(channel)
            health = HealthLog(channel)
            try:
                await health.until(SERVING, 0, 60)
                # SERVING needs one live worker; the other may still be in its self-test.
                await poll(serving, lambda s: sorted(s.values()) == ["idle", "idle"], 60)

                # One worker stuck: its caller is told at its deadline, the other serves.
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await stub.ModelInfer(request("csleep"), timeout=1.0)
                assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                left_at = time.monotonic()
                states = await poll(serving, lambda s: "stuck" in s.values(), 30)
                stuck = next(pid for pid, state in states.items() if state == "stuck")
                for k in range(5):  # other models serve meanwhile
                    reply = await stub.ModelInfer(request("echo", k), timeout=30)
                    assert reply.raw_output_contents[0] == np.full((1, 4), k, np.float32).tobytes()
                await poll(serving, lambda s: stuck not in s and len(s) == 2, 30)
                took = time.monotonic() - left_at
                print(f"stuck worker replaced {took:.2f} s after its caller left (grace {grace})")
                assert took < grace + 15  # SIGABRT at the grace, SIGKILL 1 s later, a fork

                # Every worker stuck: health is not SERVING until replacements serve.
                mark = len(health.seen)
                calls = [stub.ModelInfer(request("csleep"), timeout=1.0) for _ in range(2)]
                for call in calls:
                    with pytest.raises(grpc.aio.AioRpcError) as info:
                        await call
                    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                down = await health.until(NOT_SERVING, mark, 30)
                await health.until(SERVING, down, 60)
                reply = await stub.ModelInfer(request("echo", 9.0), timeout=30)
                assert reply.raw_output_contents[0] == np.full((1, 4), 9, np.float32).tobytes()
            finally:
                health.close()

    with Serving(repo, tmp_path / "run", workers=2) as serving:
        asyncio.run(main())
        log = serving.log()
        assert "still running 2 s after its caller left" in log, log


def test_model_that_hangs_after_fork_is_marked_unavailable_by_the_self_test(
    tmp_path: Path,
) -> None:
    repo = repo_with(tmp_path, {"warmup_timeout_s": 2})
    write_model(repo, "hangs", {"implementation": "model.PoolInLoad", **DECLARED}, HANGS_AFTER_FORK)
    write_model(repo, "picky", {"implementation": "model.Picky", **DECLARED}, PICKY)

    async def main() -> None:
        async with grpc.aio.insecure_channel(serving.address) as channel:
            stub = pbg.GRPCInferenceServiceStub(channel)
            await wait_serving(channel, "model:echo", timeout=90)

            async def index() -> dict[str, pb.RepositoryIndexResponse.ModelIndex]:
                reply = await stub.RepositoryIndex(pb.RepositoryIndexRequest())
                return {m.name: m for m in reply.models}

            hangs = (await index())["hangs"]
            assert hangs.state == "UNAVAILABLE", hangs
            assert (
                "model hangs after fork: a native thread pool started in load()? "
                "see threads_per_worker / start_method" in hangs.reason
            ), hangs.reason
            assert not (await stub.ServerReady(pb.ServerReadyRequest())).ready
            assert not (await stub.ModelReady(pb.ModelReadyRequest(name="hangs"))).ready
            check = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service="model:hangs")
            )
            assert check.status == NOT_SERVING
            # the others serve, on workers that left the failed warm-up out
            reply = await stub.ModelInfer(request("echo", 3.0), timeout=30)
            assert reply.raw_output_contents[0] == np.full((1, 4), 3, np.float32).tobytes()
            assert (await index())["picky"].state == "READY"  # its warm-up raised: not a hang
            reply = await stub.ModelInfer(request("picky", 2.0), timeout=30)
            assert reply.raw_output_contents[0] == np.full((1, 4), 2, np.float32).tobytes()
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.ModelInfer(request("hangs"), timeout=30)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            # a worker forked before the model was marked still warms it up, and is
            # replaced too: then both serve
            await poll(serving, lambda s: sorted(s.values()) == ["idle", "idle"], 60)

    with Serving(repo, tmp_path / "run", workers=2) as serving:
        asyncio.run(main())
        log = serving.log()
        assert "warm-up prediction of model 'hangs' did not finish within 2 s" in log, log
        assert "model 'picky' raised InvalidInput: all zeros" in log, log
