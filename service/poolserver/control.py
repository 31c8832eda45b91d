"""The PoolControl service of a pool server (``poolserve.control.v1``):
``Status``, the pool's processes, queue, workers, memory and models as the
supervisor and ``poolserve status`` see them; ``Metrics``, the pool's counters
for the router's /metrics (:mod:`poolserve.service.poolserver.metrics`)."""

from __future__ import annotations

import os
from typing import Any

import grpc

from poolserve.protos import control_pb2 as cpb
from poolserve.service.grpcserver.handlers import guarded
from poolserve.service.inference.cargo import InferenceZygote
from poolserve.service.lifecycle.procutil import pss_bytes
from poolserve.service.poolcore.dispatcher import Dispatcher
from poolserve.service.poolcore.fleet import Fleet
from poolserve.service.poolserver.catalog import Catalog
from poolserve.service.poolserver.inline import InlineRunner
from poolserve.service.poolserver.metrics import instance_id, pool_metrics
from poolserve.service.poolserver.response_cache import ResponseCache

CONTROL_SERVICE = "poolserve.control.v1.PoolControl"


class PoolControl:
    """The PoolControl handlers over one pool server's parts."""

    def __init__(
        self,
        gid: str,
        zygote: InferenceZygote,
        dispatcher: Dispatcher,
        inline: InlineRunner,
        catalog: Catalog,
        fleet: Fleet | None = None,
        cache: ResponseCache | None = None,
    ) -> None:
        self.cache = cache
        self.gid = gid
        self.zygote = zygote
        self.dispatcher = dispatcher
        self.inline = inline
        self.catalog = catalog
        self.fleet = fleet
        self.instance = instance_id()

    async def status(self, _: cpb.PoolStatusRequest, __: Any) -> cpb.PoolStatus:
        pids = [os.getpid(), self.zygote.pid] + [w.pid for w in self.dispatcher.workers()]
        return cpb.PoolStatus(
            gid=self.gid,
            pid=os.getpid(),
            zygote_pid=self.zygote.pid,
            queue_depth=self.dispatcher.queue_depth() + self.inline.queue_depth(),
            workers=[
                cpb.WorkerStatus(pid=w.pid, state=str(w.state), requests_served=w.served)
                for w in self.dispatcher.workers()
            ],
            pss_bytes=sum(pss_bytes(p) for p in pids),
            models=[
                cpb.ModelState(name=e.name, version=e.version, state=str(e.state), reason=e.reason)
                for e in self.catalog.entries()
            ],
            late_replies_dropped=self.dispatcher.late_replies + self.inline.late_replies,
        )

    async def metrics(self, request: cpb.PoolMetricsRequest, _: Any) -> cpb.PoolMetrics:
        return pool_metrics(
            self.gid,
            self.instance,
            self.zygote.pid,
            self.dispatcher.queue_depth() + self.inline.queue_depth(),
            self.dispatcher.workers(),
            self.fleet.restarts if self.fleet is not None else {},
            self.catalog.entries(),
            request.pss,
            self.cache,
        )

    def generic_handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(
            CONTROL_SERVICE,
            {
                "Status": grpc.unary_unary_rpc_method_handler(
                    guarded(self.status),
                    cpb.PoolStatusRequest.FromString,
                    cpb.PoolStatus.SerializeToString,
                ),
                "Metrics": grpc.unary_unary_rpc_method_handler(
                    guarded(self.metrics),
                    cpb.PoolMetricsRequest.FromString,
                    cpb.PoolMetrics.SerializeToString,
                ),
            },
        )
