"""What ``poolserve serve`` tells the person (or script) that started it.

Two lines on stdout, in this order:

- ``poolserve: listening on ADDR (N models loading)`` once the router
  listens: calls are accepted from then on, and answered UNAVAILABLE for a
  model that is not loaded yet; systemd's ``READY=1`` goes with this line.
  With ``; M not served, see the log``: the repository has M models that
  cannot be served (an invalid model-settings.json), each logged as an
  error, and the ready line will not come until they are fixed and reloaded;
- ``poolserve: ready, N models serving on ADDR`` the first time the router's
  health ``""`` turns SERVING (every configured model loaded, every pool up),
  followed on the router's control socket, where health is served as on its
  port (which may need TLS and a client certificate). It is also systemd's
  ``STATUS=``. A repository with a model that never loads never prints it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from poolserve.service.contract.rundir import router_control_socket
from poolserve.supervisor.notify import SystemdNotifier

log = logging.getLogger(__name__)

LISTENING_PREFIX = "poolserve: listening on "
READY_PREFIX = "poolserve: ready, "
RETRY_S = (0.1, 2.0)  # back-off between attempts while the router restarts


def models(count: int) -> str:
    return f"{count} model" + ("" if count == 1 else "s")


def listening_line(address: str, count: int, invalid: int = 0) -> str:
    """``invalid``: the repository's models that cannot be served (the log says why)."""
    unserved = f"; {invalid} not served, see the log" if invalid else ""
    return f"{LISTENING_PREFIX}{address} ({models(count)} loading{unserved})"


def ready_line(address: str, count: int) -> str:
    return f"{READY_PREFIX}{models(count)} serving on {address}"


async def announce_serving(
    run_dir: Path,
    listening: asyncio.Event,
    address: Callable[[], str],
    count: Callable[[], int],
    notifier: SystemdNotifier,
    routers: int = 1,
) -> None:
    """Prints the ready line once every router's health turned SERVING, then returns.

    Runs until then (cancel it when the tree stops); a router that restarts
    meanwhile is followed again after a short back-off.
    """
    await listening.wait()
    for index in range(routers):
        if not await _serving(run_dir, index):
            return
    line = ready_line(address(), count())
    with contextlib.suppress(OSError):  # nobody reads stdout any more
        print(line, flush=True)
    notifier.status(line.removeprefix("poolserve: "))


async def _serving(run_dir: Path, index: int) -> bool:
    """Waits for router ``index``'s health SERVING; False: it serves no health."""
    target = f"unix:{run_dir / router_control_socket(index)}"
    request = health_pb2.HealthCheckRequest(service="")
    delay = RETRY_S[0]
    while True:
        try:
            async with grpc.aio.insecure_channel(target) as channel:
                stream = health_pb2_grpc.HealthStub(channel).Watch(request, wait_for_ready=True)
                async for reply in stream:
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        return True
        except grpc.aio.AioRpcError as error:
            if error.code() == grpc.StatusCode.UNIMPLEMENTED:
                log.warning("the router serves no health on its control socket")
                return False
        await asyncio.sleep(delay)  # back-off between reconnects, not a readiness wait
        delay = min(delay * 2, RETRY_S[1])
