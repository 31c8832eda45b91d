"""A pool that is alive but does not answer (stopped, or its event loop blocked)
is NOT_SERVING at the router within heartbeat_timeout_s, and the supervisor
kills and restarts one that stays so beyond watchdog_grace_s.

Real process trees over loopback. The time to NOT_SERVING is asserted within
a generous bound (NOT_SERVING_WITHIN: a loaded CI machine), one that the
default heartbeat_timeout_s (30 s) would not meet, so the setting is seen to
act; each wait has a generous deadline.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from poolserve.protos import inference_pb2 as pb
from poolserve.protos import inference_pb2_grpc as pbg
from poolserve.service.inference.codec import encode_inputs

from harness import pid_alive
from serving import Serving, pool_status, wait_serving
from support import copy_example, write_model

pytestmark = pytest.mark.e2e
Stub = pbg.GRPCInferenceServiceStub
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
WAIT = 60.0  # generous: CI is a loaded two-core machine
HEARTBEAT_TIMEOUT_S = 2.0
# a stopped pool is NOT_SERVING within heartbeat_timeout_s and a ping interval;
# 7.5 x that here, for a loaded machine, and half the default timeout (30 s)
NOT_SERVING_WITHIN = 15.0

# Inline and declared fast, so predict runs on the pool's event loop: a call
# with parameter "block" blocks that loop for good (a hung C call, a model
# wrongly declared fast).
BLOCKER = """
import time
from poolserve.service import Model

class Blocker(Model):
    inline_fast = True

    def predict(self, inputs, parameters):
        if parameters.get("block"):
            time.sleep(3600)
        return {"OUTPUT0": inputs["INPUT0"]}
"""


def settings(repo: Path, watchdog_grace_s: float) -> None:
    values = {
        "heartbeat_interval_s": 0.25,
        "heartbeat_timeout_s": HEARTBEAT_TIMEOUT_S,
        "watchdog_grace_s": watchdog_grace_s,
    }
    (repo / "settings.json").write_text(json.dumps(values))


def request(model: str, value: float = 1.0, **params: int) -> pb.ModelInferRequest:
    req = pb.ModelInferRequest(model_name=model)
    encode_inputs({"INPUT0": np.full((1, 16), value, np.float32)}, req, raw=True)
    for key, v in params.items():
        req.parameters[key].int64_param = v
    return req


async def status_of(channel: grpc.aio.Channel, service: str) -> int:
    health = health_pb2_grpc.HealthStub(channel)
    reply = await health.Check(health_pb2.HealthCheckRequest(service=service), timeout=WAIT)
    return int(reply.status)


async def wait_status(channel: grpc.aio.Channel, service: str, want: int) -> float:
    """Polls Check until ``service`` says ``want``; returns how long that took."""
    began = time.monotonic()
    while (status := await status_of(channel, service)) != want:
        assert time.monotonic() - began < WAIT, f"{service!r} still {status} after {WAIT} s"
        await asyncio.sleep(0.05)
    return time.monotonic() - began


async def echo_answers(stub: Stub, value: float) -> None:
    reply = await stub.ModelInfer(request("echo", value), timeout=WAIT)
    assert np.frombuffer(reply.raw_output_contents[0], np.float32).tolist() == [value] * 16


def test_a_stopped_pool_is_not_serving_until_it_is_continued(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    copy_example(repo, "echo")
    settings(repo, watchdog_grace_s=600.0)  # the supervisor leaves it alone here

    async def main(serving: Serving) -> None:
        async with grpc.aio.insecure_channel(serving.address) as channel:
            await wait_serving(channel)
            stub = Stub(channel)
            await echo_answers(stub, 1.0)
            pid = (await pool_status(serving)).pid
            watch = health_pb2_grpc.HealthStub(channel).Watch(
                health_pb2.HealthCheckRequest(service="model:echo")
            )
            assert (await watch.read()).status == SERVING
            os.kill(pid, signal.SIGSTOP)
            try:
                took = await wait_status(channel, "", NOT_SERVING)
                print(f"SIGSTOP -> NOT_SERVING in {took:.2f} s (heartbeat_timeout_s 2)")
                assert took < NOT_SERVING_WITHIN, f"NOT_SERVING only after {took:.2f} s"
                for service in ("inference.GRPCInferenceService", "model:echo"):
                    assert await status_of(channel, service) == NOT_SERVING, service
                assert (await asyncio.wait_for(watch.read(), WAIT)).status == NOT_SERVING
                assert not (await stub.ServerReady(pb.ServerReadyRequest(), timeout=WAIT)).ready
                stuck = asyncio.ensure_future(echo_answers(stub, 2.0))  # waits in the lane
            finally:
                os.kill(pid, signal.SIGCONT)
            took = await wait_status(channel, "", SERVING)
            print(f"SIGCONT -> SERVING in {took:.2f} s")
            assert (await asyncio.wait_for(watch.read(), WAIT)).status == SERVING
            assert (await stub.ServerReady(pb.ServerReadyRequest(), timeout=WAIT)).ready
            await stuck  # the call sent while it was stopped is answered
            await echo_answers(stub, 3.0)
            assert (await pool_status(serving)).pid == pid  # continued, not restarted
            watch.cancel()
        assert "has not answered its heartbeat" in serving.log()

    with Serving(repo, tmp_path / "run") as serving:
        asyncio.run(main(serving))


def test_a_pool_whose_loop_stays_blocked_is_killed_and_restarted(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    copy_example(repo, "echo")
    blocker = {
        "implementation": "model.Blocker",
        "parallel_workers": 0,
        "parameters": {"inference_pool_gid": "inline"},
    }
    write_model(repo, "blocker", blocker, BLOCKER)
    settings(repo, watchdog_grace_s=2.0)

    async def main(serving: Serving) -> None:
        async with grpc.aio.insecure_channel(serving.address) as channel:
            await wait_serving(channel)
            stub = Stub(channel)
            await stub.ModelInfer(request("blocker"), timeout=WAIT)
            pid = (await pool_status(serving, "inline")).pid
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.ModelInfer(request("blocker", block=1), timeout=1.0)
            assert info.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
            took = await wait_status(channel, "model:blocker", NOT_SERVING)
            print(f"blocked loop -> NOT_SERVING in {took:.2f} s after the call's 1 s deadline")
            assert await status_of(channel, "") == NOT_SERVING
            # The other pool is not hung: its model stays SERVING and answers.
            assert await status_of(channel, "model:echo") == SERVING
            await echo_answers(stub, 4.0)
            # heartbeat_timeout_s + watchdog_grace_s without a beat: killed, restarted.
            await wait_status(channel, "", SERVING)
            assert not pid_alive(pid)
            assert (await pool_status(serving, "inline")).pid != pid
            reply = await stub.ModelInfer(request("blocker", 5.0), timeout=WAIT)
            assert np.frombuffer(reply.raw_output_contents[0], np.float32)[0] == 5.0
        assert "without a heartbeat" in serving.log()

    with Serving(repo, tmp_path / "run") as serving:
        asyncio.run(main(serving))
