"""A pool's counters as the PoolMetrics message the router's /metrics reads.

Built on demand (the router asks at scrape time over the pool's private
socket): the hot path only counts, in :class:`~poolserve.service.poolcore.stats.ModelStats`
and :class:`~poolserve.service.poolcore.fleet.Fleet`; this turns them into one
message. ``instance`` names this pool process's incarnation, so the router
can tell a restarted pool (counts from zero) from a live one.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterable, Mapping

from poolserve.protos import control_pb2 as cpb
from poolserve.service.lifecycle.procstat import proc_stat
from poolserve.service.lifecycle.procutil import pss_bytes
from poolserve.service.poolcore.jobs import Worker, WorkerState
from poolserve.service.poolcore.stats import BUCKETS_S, ModelStats
from poolserve.service.poolserver.catalog import ModelEntry
from poolserve.service.poolserver.response_cache import ResponseCache

# The `state` label of poolserve_workers: a worker in its self-test is starting,
# one still on a job its caller left is busy.
WORKER_STATE = {
    WorkerState.STARTING: "starting",
    WorkerState.WARMING: "starting",
    WorkerState.IDLE: "idle",
    WorkerState.BUSY: "busy",
    WorkerState.STUCK: "busy",
}


def instance_id(pid: int | None = None) -> str:
    """``pid-starttime`` of a process: differs for every incarnation."""
    pid = os.getpid() if pid is None else pid
    stat = proc_stat(pid)
    return f"{pid}-{stat.start_ticks if stat is not None else 0}"


def histogram(buckets: list[int], sum_ns: int) -> cpb.Histogram:
    return cpb.Histogram(buckets=buckets, sum_ns=sum_ns)


def model_metrics(entry: ModelEntry) -> cpb.ModelMetrics:
    s: ModelStats = entry.stats
    return cpb.ModelMetrics(
        name=entry.name,
        version=entry.version,
        ready=entry.ready,
        success=s.success_count,
        failures=dict(s.failures),
        inference_count=s.inference_count,
        execution_count=s.execution_count,
        request_ns=s.success_ns + s.fail_ns,
        queue_ns=s.queue_ns,
        compute_input_ns=s.input_ns,
        compute_infer_ns=s.infer_ns,
        compute_output_ns=s.output_ns,
        request=histogram(s.request_buckets, s.success_ns + s.fail_ns),
        queue=histogram(s.queue_buckets, s.queue_ns),
        compute=histogram(s.compute_buckets, s.infer_ns),
        deadline_exceeded=dict(s.deadlines),
        batch_sizes={size: b.count for size, b in s.batches.items()},
        cache_hits=s.cache_hit_count,
        cache_misses=s.cache_miss_count,
        cache_hit_ns=s.cache_hit_ns,
        cache_miss_ns=s.cache_miss_ns,
    )


def process_metrics(pid: int, kind: str, state: str, pss: bool) -> cpb.ProcessMetrics | None:
    stat = proc_stat(pid)
    if stat is None:
        return None
    return cpb.ProcessMetrics(
        pid=pid,
        kind=kind,
        state=state,
        rss_bytes=stat.rss_bytes,
        pss_bytes=pss_bytes(pid) if pss else 0,
        cpu_seconds=stat.cpu_seconds,
    )


def pool_metrics(
    gid: str,
    instance: str,
    zygote_pid: int,
    queue_depth: int,
    workers: Iterable[Worker],
    restarts: Mapping[str, int],
    entries: Iterable[ModelEntry],
    pss: bool,
    cache: ResponseCache | None = None,
) -> cpb.PoolMetrics:
    live = [w for w in workers if w.state in WORKER_STATE]
    by_state = Counter(WORKER_STATE[w.state] for w in live)
    processes = [
        process_metrics(os.getpid(), "pool", "running", pss),
        process_metrics(zygote_pid, "zygote", "running", pss) if zygote_pid > 0 else None,
    ] + [process_metrics(w.pid, "worker", WORKER_STATE[w.state], pss) for w in live]
    return cpb.PoolMetrics(
        gid=gid,
        instance=instance,
        queue_depth=queue_depth,
        workers={state: by_state.get(state, 0) for state in ("starting", "idle", "busy")},
        worker_restarts=dict(restarts),
        models=[model_metrics(e) for e in entries],
        processes=[p for p in processes if p is not None],
        bucket_bounds_s=BUCKETS_S,
        cache=None if cache is None else cache_metrics(cache),
    )


def cache_metrics(cache: ResponseCache) -> cpb.ResponseCacheMetrics:
    return cpb.ResponseCacheMetrics(
        entries=cache.entries,
        bytes=cache.bytes,
        max_entries=cache.max_entries,
        max_bytes=cache.max_bytes,
        evictions=cache.evictions,
    )
