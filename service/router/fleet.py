"""A router's peers in a fleet (setting ``routers`` above one).

Every router of a fleet serves the same ports, follows the pools on its own
and has its own lanes; what one router learns that the others must know
travels between them over their private control sockets
(``router-control[-<index>].sock`` in the run dir, :func:`router_control_socket`):

- ``LearnRoute``: a model added to the repository after start and loaded
  through one router is routed by every router (each scans the repository
  itself, :meth:`Routes.learn_route`);
- ``FleetCounts``: what a router counts itself (deadlines spent before it
  could forward, the inference calls it took, streams it ended for stalling)
  and its own process, for the /metrics every router serves (each sums the fleet).

Shared-memory registrations do not travel here: they live in a run-dir store
every router reads (:mod:`poolserve.service.grpcserver.shm_store`). Neither
message is on a request's path; both are small JSON documents.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc

from poolserve.protos import control_pb2 as cpb
from poolserve.service.contract.rundir import router_control_socket
from poolserve.service.grpcserver.handlers import guarded
from poolserve.service.lifecycle.procstat import proc_stat
from poolserve.service.lifecycle.procutil import pss_bytes
from poolserve.service.router.metrics import RouterCounts

log = logging.getLogger(__name__)

FLEET_SERVICE = "poolserve.control.v1.RouterFleet"
PEER_TIMEOUT_S = 2.0  # a peer that does not answer a scrape in time is left out of it
LEARN_TIMEOUT_S = 30.0  # a peer's repository scan for a new model


def _identity(data: bytes) -> bytes:
    return data


class Fleet:
    """Router ``index`` of ``count``, and its calls to the others."""

    def __init__(self, run_dir: Path, index: int, count: int) -> None:
        self.run_dir = run_dir
        self.index = index
        self.count = count

    @property
    def shared(self) -> bool:
        return self.count > 1

    def _peers(self) -> list[int]:
        return [i for i in range(self.count) if i != self.index]

    async def _ask(self, peer: int, method: str, body: bytes, timeout: float) -> bytes | None:
        target = f"unix:{self.run_dir / router_control_socket(peer)}"
        try:
            async with grpc.aio.insecure_channel(target) as channel:
                call = channel.unary_unary(
                    f"/{FLEET_SERVICE}/{method}",
                    request_serializer=_identity,
                    response_deserializer=_identity,
                )
                answer: bytes = await call(body, timeout=timeout)
                return answer
        except grpc.aio.AioRpcError as error:
            log.warning(
                "router %d: router %d did not answer %s: %s",
                self.index,
                peer,
                method,
                error.code().name,
            )
            return None

    async def learned(self, name: str) -> None:
        """Tells every peer that model ``name`` was routed here (a load through this router)."""
        body = name.encode()
        await asyncio.gather(
            *(self._ask(p, "LearnRoute", body, LEARN_TIMEOUT_S) for p in self._peers())
        )

    async def counts(self) -> list[RouterCounts]:
        """Every peer's own counts (peers that do not answer in time are left out)."""
        answers = await asyncio.gather(
            *(self._ask(p, "FleetCounts", b"", PEER_TIMEOUT_S) for p in self._peers())
        )
        return [decode_counts(a) for a in answers if a is not None]

    def handlers(
        self, learn: Callable[[str], Any], own: Callable[[], RouterCounts]
    ) -> grpc.GenericRpcHandler:
        """This router's side: LearnRoute and FleetCounts, on its control socket."""

        async def learn_route(body: bytes, _: Any) -> bytes:
            await learn(body.decode())
            return b""

        async def fleet_counts(_: bytes, __: Any) -> bytes:
            return encode_counts(own())

        def unary(fn: Callable[[bytes, Any], Any]) -> grpc.RpcMethodHandler[Any, Any]:
            return grpc.unary_unary_rpc_method_handler(guarded(fn), _identity, _identity)

        return grpc.method_handlers_generic_handler(
            FLEET_SERVICE,
            {"LearnRoute": unary(learn_route), "FleetCounts": unary(fleet_counts)},
        )


def encode_counts(own: RouterCounts) -> bytes:
    pid = os.getpid()
    stat = proc_stat(pid)
    process = (
        None
        if stat is None
        else {"pid": pid, "rss": stat.rss_bytes, "pss": pss_bytes(pid), "cpu": stat.cpu_seconds}
    )
    return json.dumps(
        {
            "deadlines": [[*key, count] for key, count in own.deadlines.items()],
            "routed": [list(pair) for pair in own.routed],
            "process": process,
            "requests": dict(own.requests),
            "stalled": dict(own.stalled),
        }
    ).encode()


def decode_counts(data: bytes) -> RouterCounts:
    doc = json.loads(data)
    deadlines = {(str(n), str(v), str(g)): int(c) for n, v, g, c in doc["deadlines"]}
    routed = [(str(n), str(g)) for n, g in doc["routed"]]
    process = doc.get("process")
    processes: tuple[cpb.ProcessMetrics, ...] = ()
    if process is not None:
        processes = (
            cpb.ProcessMetrics(
                pid=int(process["pid"]),
                kind="router",
                state="running",
                rss_bytes=int(process["rss"]),
                pss_bytes=int(process["pss"]),
                cpu_seconds=float(process["cpu"]),
            ),
        )
    requests = {str(k): int(v) for k, v in doc.get("requests", {}).items()}
    stalled = {str(k): int(v) for k, v in doc.get("stalled", {}).items()}
    return RouterCounts(deadlines, routed, processes, requests, stalled)
