"""The schedule_policy extension end to end: priority levels, the ``timeout``
parameter, and earliest-deadline-first keeping arrival order for deadlines
that gRPC's timeout header cannot tell apart.

Every tree here has one worker in the pool under test, so the order in which
calls finish is the order in which they ran.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import grpc
import numpy as np
import pytest

from poolserve.protos import inference_pb2 as pb
from poolserve.protos import inference_pb2_grpc as pbg
from poolserve.service.inference.codec import encode_inputs

from serving import Serving, pool_status, wait_serving
from support import copy_example

pytestmark = pytest.mark.e2e
Stub = pbg.GRPCInferenceServiceStub
INFER = "/inference.GRPCInferenceService/ModelInfer"


def request(model: str, tag: float, **params: int) -> bytes:
    req = pb.ModelInferRequest(model_name=model)
    encode_inputs({"INPUT0": np.full((1, 4), tag, np.float32)}, req, raw=True)
    for key, value in params.items():
        req.parameters[key].int64_param = value
    return req.SerializeToString()


def with_levels(folder: Path, levels: int, default: int) -> None:
    path = folder / "model-settings.json"
    settings = json.loads(path.read_text())
    extra = settings.setdefault("parameters", {}).setdefault("extra", {})
    extra.update(priority_levels=levels, default_priority_level=default)
    path.write_text(json.dumps(settings))


def copy_blocker(repo: Path) -> None:
    """A second sleep model, "blocker", in the same one-worker pool: its long
    call occupies the worker without teaching "sleep"'s service time a 10 s run
    (the dispatcher would then refuse short deadlines as hopeless)."""
    folder = copy_example(repo, "sleep")
    target = folder.rename(repo / "blocker")
    path = target / "model-settings.json"
    settings = json.loads(path.read_text())
    settings["name"] = "blocker"
    path.write_text(json.dumps(settings))


async def busy_worker(
    serving: Serving, call: grpc.aio.UnaryUnaryMultiCallable, timeout: float = 60
) -> asyncio.Future:
    """Occupies the one worker of pool 'default' and returns once it runs; 10 s
    leaves room for a loaded CI host to queue the calls behind it."""
    blocker = asyncio.ensure_future(call(request("blocker", -1.0, sleep_ms=10000), timeout=timeout))
    end = time.monotonic() + 30
    while time.monotonic() < end:  # the pool's status has no event to wait on
        status = await pool_status(serving)
        if any(w.state == "busy" for w in status.workers):
            return blocker
        await asyncio.sleep(0.01)
    raise AssertionError("the blocking call never reached the worker")


async def queue_depth(serving: Serving, depth: int) -> None:
    end = time.monotonic() + 30
    while time.monotonic() < end:  # the pool's status has no event to wait on
        if (await pool_status(serving)).queue_depth == depth:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"the queue never held {depth} calls")


async def finish_order(calls: dict[str, asyncio.Future[bytes]]) -> list[str]:
    order: list[str] = []

    async def one(name: str, future: asyncio.Future[bytes]) -> None:
        await future
        order.append(name)

    await asyncio.gather(*(one(n, f) for n, f in calls.items()))
    return order


# The queued calls each run this long, so that their replies (on two connections,
# which the client may read in either order when they come together) arrive
# well apart and the client's order of completion is the order they ran in.
SPACED = 300


def test_equal_deadlines_keep_arrival_order_despite_grpc_timeout_inflation(tmp_path: Path) -> None:
    """A deadline travels as grpc-timeout, and grpc-core's HPACK encoder sends a
    timeout up to 3% shorter than one it sent before on the connection as that
    longer one. Here: a 20.5 s call primes connection A; "first" goes on A with
    20 s and arrives as 20.5 s; "second", 60 ms later on connection B with a
    deadline 5 ms after first's, arrives as 20.0 s. The pool saw second's
    deadline 0.44 s before first's and ran it first. Deadlines within the
    header's precision keep arrival order; a clearly earlier one goes first."""
    repo = tmp_path / "repo"
    copy_blocker(repo)
    copy_example(repo, "sleep")

    async def main(serving: Serving) -> None:
        other = [("grpc.use_local_subchannel_pool", 1)]  # a connection of its own
        async with (
            grpc.aio.insecure_channel(serving.address) as channel_a,
            grpc.aio.insecure_channel(serving.address, options=other) as channel_b,
        ):
            await wait_serving(channel_a)
            call_a, call_b = channel_a.unary_unary(INFER), channel_b.unary_unary(INFER)
            await call_b(request("sleep", 0.0, sleep_ms=1), timeout=30)  # B connects
            blocker = await busy_worker(serving, call_a, timeout=20.5)
            sent = time.monotonic()
            first = asyncio.ensure_future(
                call_a(request("sleep", 1.0, sleep_ms=SPACED), timeout=20)
            )
            await queue_depth(serving, 1)
            await asyncio.sleep(0.06)  # the spacing of the report, not a readiness wait
            second_timeout = 20 - (time.monotonic() - sent) + 0.005
            second = asyncio.ensure_future(
                call_b(request("sleep", 2.0, sleep_ms=SPACED), timeout=second_timeout)
            )
            await queue_depth(serving, 2)
            urgent = asyncio.ensure_future(
                call_b(request("sleep", 3.0, sleep_ms=SPACED), timeout=15)
            )
            await queue_depth(serving, 3)
            assert not blocker.done(), "the blocker ended before the three calls were queued"
            order = await finish_order(
                {"blocker": blocker, "first": first, "second": second, "urgent": urgent}
            )
            assert order == ["blocker", "urgent", "first", "second"], second_timeout

    with Serving(repo, tmp_path / "run", workers=1) as serving:
        asyncio.run(main(serving))


def test_priority_levels_order_and_bounds(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    copy_blocker(repo)
    with_levels(copy_example(repo, "sleep"), levels=3, default=2)
    copy_example(repo, "echo")  # declares no levels

    async def main(serving: Serving) -> None:
        async with grpc.aio.insecure_channel(serving.address) as channel:
            await wait_serving(channel)
            call = channel.unary_unary(INFER)
            blocker = await busy_worker(serving, call)
            calls = {"blocker": blocker}
            # queued in this order; deadlines would put them the other way round
            for name, priority, timeout in (
                ("level 3", 3, 20),
                ("default (0 -> 2)", 0, 25),
                ("unset (-> 2)", None, 30),
                ("level 1", 1, 40),
            ):
                params = {} if priority is None else {"priority": priority}
                body = request("sleep", 1.0, sleep_ms=1, **params)
                calls[name] = asyncio.ensure_future(call(body, timeout=timeout))
                await queue_depth(serving, len(calls) - 1)  # arrival order, for level 2
            assert not blocker.done(), "the blocker ended before the calls were queued"
            order = await finish_order(calls)
            assert order == ["blocker", "level 1", "default (0 -> 2)", "unset (-> 2)", "level 3"]

            for model, priority, words in (
                ("sleep", 4, "levels 1 to 3"),
                ("sleep", -1, ">= 0"),
                ("echo", 1, "declares no priority levels"),
            ):
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await call(request(model, 0.0, priority=priority), timeout=30)
                assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value
                assert words in (info.value.details() or ""), info.value.details()
            assert await call(request("echo", 0.0, priority=0), timeout=30)

            wrong = pb.ModelInferRequest.FromString(request("sleep", 0.0))
            wrong.parameters["priority"].string_param = "high"
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await call(wrong.SerializeToString(), timeout=30)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "priority" in (info.value.details() or "")

            metadata = await Stub(channel).ServerMetadata(pb.ServerMetadataRequest())
            assert "schedule_policy" in metadata.extensions

    with Serving(repo, tmp_path / "run", workers=1) as serving:
        asyncio.run(main(serving))


def test_timeout_parameter_caps_the_deadline(tmp_path: Path) -> None:
    """``timeout`` (microseconds) ends a call that long after it reached the pool,
    long before its own 60 s deadline; it never runs."""
    repo = tmp_path / "repo"
    copy_blocker(repo)
    copy_example(repo, "sleep")

    async def main(serving: Serving) -> None:
        async with grpc.aio.insecure_channel(serving.address) as channel:
            await wait_serving(channel)
            stub = Stub(channel)
            call = channel.unary_unary(INFER)
            blocker = await busy_worker(serving, call)
            began = time.monotonic()
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await call(request("sleep", 1.0, sleep_ms=1, timeout=200_000), timeout=60)
            waited = time.monotonic() - began
            assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, info.value
            assert "never reached a worker" in (info.value.details() or "")
            assert not blocker.done(), f"answered after {waited:.2f} s, not at its 0.2 s timeout"
            await blocker
            stats = await stub.ModelStatistics(pb.ModelStatisticsRequest(name="sleep"))
            assert stats.model_stats[0].execution_count == 0  # the timed-out call never ran

            with pytest.raises(grpc.aio.AioRpcError) as info:
                await call(request("sleep", 0.0, timeout=-5), timeout=30)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert ">= 0" in (info.value.details() or "")
            wrong = pb.ModelInferRequest.FromString(request("sleep", 0.0))
            wrong.parameters["timeout"].double_param = 0.5
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await call(wrong.SerializeToString(), timeout=30)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "int64_param" in (info.value.details() or "")
            # 0 means no timeout, as in Triton
            assert await call(request("sleep", 0.0, sleep_ms=1, timeout=0), timeout=30)

    with Serving(repo, tmp_path / "run", workers=1) as serving:
        asyncio.run(main(serving))
