"""The router's health follows its lane to a pool, not only the pool's Watch streams.

A Watch stream says SERVING until the router reads its end: for a moment after
a pool died (longer on a loaded host) the router believed it, said its models
SERVING, and sent calls to a lane that refused them (a CI run of
test_tree_e2e.py's SIGKILL test failed so). Here a fake pool in this process
keeps its gRPC socket and health SERVING while its lane goes away and comes
back, so the lane alone decides what the router says.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from poolserve.service.contract import slab
from poolserve.service.contract.errors import Unavailable
from poolserve.service.contract.lane import Trace, lane_path
from poolserve.service.contract.repository import scan
from poolserve.service.contract.rundir import pool_socket_path
from poolserve.service.contract.settings import ServerSettings
from poolserve.service.grpcserver.health import NOT_SERVING, SERVING, Health
from poolserve.service.grpcserver.sockets import bind_private_unix
from poolserve.service.poolserver.lane_server import LaneServer
from poolserve.service.router.routes import Routes

from support import copy_example

WAIT = 60.0  # generous: CI is a loaded two-core machine


async def echo(body: bytes, deadline: float, trace: Trace) -> bytes:
    return body


async def until(predicate: Callable[[], bool], what: str) -> None:
    end = time.monotonic() + WAIT
    while not predicate():
        assert time.monotonic() < end, f"not {what} after {WAIT} s"
        await asyncio.sleep(0.02)


def test_a_lost_lane_is_not_serving_while_the_pools_watch_still_says_serving(
    tmp_path: Path,
) -> None:
    repo = tmp_path / "repo"
    copy_example(repo, "echo")
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    repository = scan(repo)
    (gid,) = repository.pools()
    path = pool_socket_path(run_dir, gid)
    settings = ServerSettings(heartbeat_interval_s=0.1, heartbeat_timeout_s=30.0)

    async def main() -> None:
        health = Health()  # the fake pool's: SERVING throughout
        health.set_many({"": True, "model:echo": True})
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((health.generic_handler(),))
        bind_private_unix(server, path)
        await server.start()
        async with asyncio.TaskGroup() as tasks:
            lane = LaneServer(lane_path(path), echo, f"pool '{gid}'")
            await lane.start(tasks)
            routes = Routes(repository, settings, run_dir, slab.Arena(1 << 20))
            routes.open_channels()
            routes.start_watching(tasks)
            route = routes.pools[gid]
            assert route.lane is not None
            try:
                await until(lambda: routes.health.status("model:echo") == SERVING, "SERVING")
                assert routes.ready()
                assert await route.lane.call(b"x", time.monotonic() + WAIT, ()) == b"x"

                await lane.stop(0.0)  # the lane goes; the pool's gRPC socket and Watch stay
                await until(lambda: routes.health.status("model:echo") == NOT_SERVING, "down")
                assert routes.health.status("") == NOT_SERVING
                assert not routes.ready()
                assert route.serving and route.model_serving["echo"]  # what the Watch says
                with pytest.raises(Unavailable, match="is not reachable"):
                    await route.lane.call(b"x", time.monotonic() + WAIT, ())
                assert routes.health.status("model:echo") == NOT_SERVING  # a refusal keeps it

                lane = LaneServer(lane_path(path), echo, f"pool '{gid}'")
                await lane.start(tasks)  # back: the heartbeat finds it
                await until(lambda: routes.health.status("model:echo") == SERVING, "back")
                assert routes.ready()
                assert await route.lane.call(b"y", time.monotonic() + WAIT, ()) == b"y"
            finally:
                routes.stop_watching()
                await routes.close()
                await lane.stop(0.0)
        await server.stop(None)

    asyncio.run(main())
