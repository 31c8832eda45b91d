"""Calls in flight per client connection are bounded by the router itself
(issue 28 §6): past max_concurrent_streams a call ends with RESOURCE_EXHAUSTED
saying so, and no other connection notices. grpc's own option, which grpcio
1.81 applies to the whole server, is not set."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from poolserve.protos import inference_pb2 as pb
from poolserve.protos import inference_pb2_grpc as pbg
from poolserve.service.contract.settings import ServerSettings
from poolserve.service.grpcserver.status import grpc_status
from poolserve.service.router.router import server_options
from poolserve.service.router.streams import StreamLimit, TooManyStreams

from harness import channel_options
from serving import Serving, wait_serving
from support import copy_example

WAIT = 60.0  # generous: CI is a loaded two-core machine


def test_grpc_is_not_given_a_stream_limit() -> None:
    options = dict(server_options(ServerSettings(max_concurrent_streams=7)))
    assert "grpc.max_concurrent_streams" not in options


def test_a_connection_past_its_bound_gets_resource_exhausted() -> None:
    limit = StreamLimit(2)
    limit.enter("a")
    limit.enter("a")
    with pytest.raises(TooManyStreams) as refused:
        limit.enter("a")
    assert grpc_status(refused.value)[0] is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "max_concurrent_streams is 2" in refused.value.message
    assert "2 calls in flight" in refused.value.message
    limit.enter("b")  # another connection is not held back
    limit.leave("a")
    limit.enter("a")  # one ended: one more may start
    for peer in ("a", "a", "b"):
        limit.leave(peer)
    assert limit.open == {}


async def live_code(
    live: grpc.aio.UnaryUnaryMultiCallable[pb.ServerLiveRequest, pb.ServerLiveResponse],
) -> grpc.StatusCode:
    try:
        await live(pb.ServerLiveRequest(), timeout=WAIT)
    except grpc.aio.AioRpcError as error:
        return error.code()
    return grpc.StatusCode.OK


@pytest.mark.e2e
def test_the_router_bounds_one_connections_calls_and_no_other(tmp_path: Path) -> None:
    """max_concurrent_streams 4: four health Watch streams open on one
    connection hold its four places; a fifth call on it (any method) ends with
    RESOURCE_EXHAUSTED at once, another connection's calls pass, and once a
    Watch ends its connection may call again. (With grpc's option, the client
    would have queued the fifth call until its deadline.)"""
    repo = tmp_path / "repo"
    copy_example(repo, "echo")
    (repo / "settings.json").write_text(json.dumps({"max_concurrent_streams": 4}))

    async def scenario(address: str) -> None:
        async with (
            grpc.aio.insecure_channel(address, options=channel_options()) as held,
            grpc.aio.insecure_channel(address, options=channel_options()) as other,
        ):
            await wait_serving(other)
            health = health_pb2_grpc.HealthStub(held)
            watches = [
                health.Watch(health_pb2.HealthCheckRequest(), timeout=WAIT) for _ in range(4)
            ]
            for watch in watches:  # each handler runs: its first answer came
                await watch.read()
            live = pbg.GRPCInferenceServiceStub(held).ServerLive
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await live(pb.ServerLiveRequest(), timeout=WAIT)
            assert refused.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "max_concurrent_streams is 4" in (refused.value.details() or "")
            other_live = pbg.GRPCInferenceServiceStub(other).ServerLive
            assert (await other_live(pb.ServerLiveRequest(), timeout=WAIT)).live
            watches[0].cancel()
            end = asyncio.get_running_loop().time() + WAIT
            while (code := await live_code(live)) is not grpc.StatusCode.OK:
                # the router hears of the cancel soon; there is nothing to wait on
                assert code is grpc.StatusCode.RESOURCE_EXHAUSTED, code
                assert asyncio.get_running_loop().time() < end, "the Watch never ended"
                await asyncio.sleep(0.05)
            for watch in watches[1:]:
                watch.cancel()

    with Serving(repo, tmp_path / "run", workers=1) as serving:
        asyncio.run(scenario(serving.address))
        assert "Traceback" not in serving.log()
