"""The root's control socket: ``SupervisorControl`` (Status, Reload,
EnsurePool) on ``<run_dir>/supervisor.sock``, mode 0600, and the client
helpers that talk to it, to the pools' ``PoolControl`` and to the router's
``RouterControl``.

:class:`ControlService` is a child of the root (its first, so the socket
answers while pools start and until the rest of the tree has stopped). It
owns the reload runner (:meth:`Reconciler.run`), so SIGHUP and the Reload RPC
end up in the same queue.

Why gRPC in the root is safe: the root never forks a copy of itself. It
starts children with vfork+exec and no Python code in between (see
:mod:`poolserve.supervisor.process`), so the threads grpc.aio starts cannot
leave a lock held in a child.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc

from poolserve.protos import control_pb2 as cpb
from poolserve.service.contract.errors import (
    FailedPrecondition,
    InvalidInput,
    ModelNotFound,
    Unavailable,
)
from poolserve.service.contract.rundir import (
    CONTROL_SOCKET,
    pool_socket_path,
    remove_own,
    router_control_socket,
)
from poolserve.service.contract.settings import ConfigError
from poolserve.service.grpcserver.handlers import guarded
from poolserve.service.grpcserver.sockets import bind_private_unix
from poolserve.supervisor.reconcile import Reconciler, ReloadReport, Routes
from poolserve.supervisor.spec import ChildState, ChildStatus
from poolserve.supervisor.tree import Supervisor

log = logging.getLogger(__name__)

SUPERVISOR_SERVICE = "poolserve.control.v1.SupervisorControl"
POOL_SERVICE = "poolserve.control.v1.PoolControl"
ROUTER_SERVICE = "poolserve.control.v1.RouterControl"
POOL_STATUS_TIMEOUT = 5.0  # a pool that does not answer in time shows an error
# A channel of its own subchannels: a pool that was down a moment ago (in
# connection backoff in a shared pool) must not fail the next question.
CHANNEL_OPTIONS = (("grpc.use_local_subchannel_pool", 1),)


def control_socket_path(run_dir: Path) -> Path:
    return run_dir / CONTROL_SOCKET


def router_control_path(run_dir: Path, index: int = 0) -> Path:
    return run_dir / router_control_socket(index)


# -- the tree as a message --------------------------------------------------------


def tree_node(status: ChildStatus, now: float) -> cpb.TreeNode:
    """One supervisor's view of a child (and its nested children) as a TreeNode."""
    started = status.started_at
    return cpb.TreeNode(
        id=status.id,
        pid=status.pid or 0,
        state=status.state.value,
        uptime_s=0.0 if started is None else max(0.0, now - started),
        restarts=status.restarts,
        children=[tree_node(child, now) for child in status.children],
        last_exit=status.last_exit or "",
    )


def root_node(root: Supervisor, started_at: float, now: float) -> cpb.TreeNode:
    return cpb.TreeNode(
        id=root.id,
        pid=os.getpid(),
        state=ChildState.RUNNING.value,
        uptime_s=max(0.0, now - started_at),
        children=[tree_node(child, now) for child in root.status()],
    )


def walk(node: cpb.TreeNode) -> Iterator[cpb.TreeNode]:
    yield node
    for child in node.children:
        yield from walk(child)


def pool_gid(node: cpb.TreeNode) -> str | None:
    """The gid of a ``pool:<gid>`` node, else None."""
    return node.id.removeprefix("pool:") if node.id.startswith("pool:") else None


async def fill_pool_status(root: cpb.TreeNode, run_dir: Path) -> None:
    """Asks every running pool of the tree for its PoolStatus, concurrently."""

    async def one(node: cpb.TreeNode, gid: str) -> None:
        try:
            node.pool.CopyFrom(await fetch_pool_status(run_dir, gid, POOL_STATUS_TIMEOUT))
        except grpc.aio.AioRpcError as error:
            node.pool_error = f"{error.code().name}: {error.details()}"

    asks = [
        one(node, gid)
        for node in walk(root)
        if (gid := pool_gid(node)) is not None and node.pid and node.state == "running"
    ]
    await asyncio.gather(*asks)


# -- the service ------------------------------------------------------------------


class ControlService:
    """Serves SupervisorControl on the control socket; runs the reload queue.

    A tree child: ``serve`` binds, starts, reports ready, and runs until
    cancelled; the socket is removed when it stops.
    """

    def __init__(
        self,
        run_dir: Path,
        root: Callable[[], Supervisor],
        reconciler: Reconciler,
        *,
        started_at: float,
    ) -> None:
        self.socket_path = control_socket_path(run_dir)
        self._run_dir = run_dir
        self._root = root
        self._reconciler = reconciler
        self._started_at = started_at  # the root's start (monotonic), for its uptime

    async def serve(self, ready: Callable[[], None]) -> None:
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((self._handler(),))
        bound = bind_private_unix(server, self.socket_path)
        await server.start()
        try:
            log.info("control socket: %s", self.socket_path)
            ready()
            await self._reconciler.run()
        finally:
            await server.stop(1.0)
            remove_own(self.socket_path, bound)

    # -- RPCs: thin; the work is in plain functions and the reconciler -----

    async def status(
        self, request: cpb.TreeStatusRequest, _: grpc.aio.ServicerContext[Any, Any]
    ) -> cpb.TreeStatus:
        node = root_node(self._root(), self._started_at, time.monotonic())
        if not request.skip_pools:
            await fill_pool_status(node, self._run_dir)
        invalid = [
            cpb.InvalidModelRoute(name=bad.name, reason=bad.reason)
            for bad in self._reconciler.current.invalid
        ]
        return cpb.TreeStatus(root=node, invalid=invalid)

    async def reload(
        self, _: cpb.ReloadRequest, __: grpc.aio.ServicerContext[Any, Any]
    ) -> cpb.ReloadResponse:
        # Shielded: a client that leaves does not cut a reload in half.
        return reload_response(await asyncio.shield(self._reconciler.request_reload()))

    async def ensure_pool(
        self, request: cpb.EnsurePoolRequest, _: grpc.aio.ServicerContext[Any, Any]
    ) -> cpb.EnsurePoolResponse:
        try:
            ensured = await self._reconciler.ensure_pool(request.gid)
        except ValueError as error:
            raise InvalidInput(str(error)) from None
        except LookupError as error:
            raise ModelNotFound(str(error)) from None
        except ConfigError as error:
            raise FailedPrecondition(f"invalid configuration: {error}") from None
        except RuntimeError as error:
            raise Unavailable(str(error)) from None
        return cpb.EnsurePoolResponse(address=ensured.address, started=ensured.started)

    def _handler(self) -> grpc.GenericRpcHandler:
        def unary(fn: Any, request: Any, response: Any) -> grpc.RpcMethodHandler[Any, Any]:
            return grpc.unary_unary_rpc_method_handler(
                guarded(fn), request.FromString, response.SerializeToString
            )

        return grpc.method_handlers_generic_handler(
            SUPERVISOR_SERVICE,
            {
                "Status": unary(self.status, cpb.TreeStatusRequest, cpb.TreeStatus),
                "Reload": unary(self.reload, cpb.ReloadRequest, cpb.ReloadResponse),
                "EnsurePool": unary(
                    self.ensure_pool, cpb.EnsurePoolRequest, cpb.EnsurePoolResponse
                ),
            },
        )


def reload_response(report: ReloadReport) -> cpb.ReloadResponse:
    return cpb.ReloadResponse(
        summary=report.summary(),
        ok=report.ok,
        started=report.started,
        stopped=report.stopped,
        updated=report.updated,
        restarted=report.restarted,
        failures=report.failures,
        router_updated=report.router_updated,
    )


# -- clients ----------------------------------------------------------------------


def _call(channel: grpc.aio.Channel, service: str, method: str, response: Any) -> Any:
    return channel.unary_unary(
        f"/{service}/{method}",
        request_serializer=lambda message: message.SerializeToString(),
        response_deserializer=response.FromString,
    )


async def fetch_tree_status(
    run_dir: Path, timeout: float, *, skip_pools: bool = False
) -> cpb.TreeStatus:
    async with grpc.aio.insecure_channel(
        f"unix:{control_socket_path(run_dir)}", options=CHANNEL_OPTIONS
    ) as channel:
        call = _call(channel, SUPERVISOR_SERVICE, "Status", cpb.TreeStatus)
        request = cpb.TreeStatusRequest(skip_pools=skip_pools)
        status: cpb.TreeStatus = await call(request, timeout=timeout)
        return status


async def request_reload(run_dir: Path, timeout: float) -> cpb.ReloadResponse:
    async with grpc.aio.insecure_channel(
        f"unix:{control_socket_path(run_dir)}", options=CHANNEL_OPTIONS
    ) as channel:
        call = _call(channel, SUPERVISOR_SERVICE, "Reload", cpb.ReloadResponse)
        response: cpb.ReloadResponse = await call(cpb.ReloadRequest(), timeout=timeout)
        return response


async def request_pool(run_dir: Path, gid: str, timeout: float) -> cpb.EnsurePoolResponse:
    async with grpc.aio.insecure_channel(
        f"unix:{control_socket_path(run_dir)}", options=CHANNEL_OPTIONS
    ) as channel:
        call = _call(channel, SUPERVISOR_SERVICE, "EnsurePool", cpb.EnsurePoolResponse)
        request = cpb.EnsurePoolRequest(gid=gid)
        response: cpb.EnsurePoolResponse = await call(request, timeout=timeout)
        return response


async def fetch_pool_status(run_dir: Path, gid: str, timeout: float) -> cpb.PoolStatus:
    async with grpc.aio.insecure_channel(
        f"unix:{pool_socket_path(run_dir, gid)}", options=CHANNEL_OPTIONS
    ) as channel:
        call = _call(channel, POOL_SERVICE, "Status", cpb.PoolStatus)
        status: cpb.PoolStatus = await call(cpb.PoolStatusRequest(), timeout=timeout)
        return status


def route_table(routes: Routes, generation: int, run_dir: Path) -> cpb.RouteTable:
    return cpb.RouteTable(
        generation=generation,
        pools=[
            cpb.PoolRoutes(
                gid=gid, address=f"unix:{pool_socket_path(run_dir, gid)}", models=list(models)
            )
            for gid, models in sorted(routes.pools.items())
        ],
        invalid=[
            cpb.InvalidModelRoute(name=name, reason=reason)
            for name, reason in sorted(routes.invalid.items())
        ],
    )


async def push_fleet_routes(
    run_dir: Path, routers: int, routes: Routes, generation: int, timeout: float
) -> bool:
    """:func:`push_routes` to every router of the fleet at once; False unless all took it."""
    pushes = (push_routes(run_dir, routes, generation, timeout, i) for i in range(routers))
    return all(await asyncio.gather(*pushes))


async def push_routes(
    run_dir: Path, routes: Routes, generation: int, timeout: float, index: int = 0
) -> bool:
    """Sends the route table to router ``index``; False when the router cannot take
    it live (no control socket, or SetRoutes unimplemented): restart it then."""
    path = router_control_path(run_dir, index)
    if not path.exists():
        return False
    async with grpc.aio.insecure_channel(f"unix:{path}", options=CHANNEL_OPTIONS) as channel:
        call = _call(channel, ROUTER_SERVICE, "SetRoutes", cpb.SetRoutesResponse)
        try:
            await call(route_table(routes, generation, run_dir), timeout=timeout)
        except grpc.aio.AioRpcError as error:
            log.warning("router SetRoutes: %s: %s", error.code().name, error.details())
            return False
    return True
