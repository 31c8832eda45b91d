"""The router's /metrics: every pool's counters, collected at scrape time.

Pools own their counters and histograms (:mod:`poolserve.service.poolserver.metrics`);
at each scrape the router asks every pool for them over the pool's private
socket (PoolControl.Metrics) with a short deadline, all pools at once. A pool
that does not answer in time is reported ``poolserve_pool_up 0`` with its
last known counts, and does not stall the scrape.

Counters never go backwards while the router runs: :class:`Continuity` keeps,
per pool, the counts of the pool's previous incarnations (a restarted pool
has a new ``instance``) and of a model's previous load (its counts fell), and
adds them to what the pool reports now. Scrapes are serialized, so two
concurrent scrapes cannot apply a pool's answers out of order.

The families are Prometheus' data model built with ``prometheus_client``
(text format, or OpenMetrics when the scraper's Accept asks for it), named as
Triton names them where Triton has a name.
"""

from __future__ import annotations

import asyncio
import bisect
import os
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field

import grpc
from prometheus_client.core import (
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from poolserve.protos import control_pb2 as cpb
from poolserve.service.lifecycle.procstat import proc_stat
from poolserve.service.lifecycle.procutil import pss_bytes

POOL_METRICS_METHOD = "/poolserve.control.v1.PoolControl/Metrics"
POOL_TIMEOUT_S = 2.0  # a pool that has not answered within this is reported down
FAILURE_REASONS = ("deadline", "cancelled", "invalid", "internal", "unavailable", "exhausted")
DEADLINE_STAGES = ("router", "pool", "queue", "worker")
WORKER_STATES = ("starting", "idle", "busy")
RESTART_CAUSES = ("exit", "signal", "heartbeat", "timeout", "roll")
PROCESS_KINDS = ("supervisor", "router", "pool", "zygote", "worker")
NS_PER_US = 1000.0

# Triton's counters, named without the `_total` OpenMetrics gives counters:
# (name, help, the ModelMetrics field in nanoseconds or a count).
TRITON_COUNTERS = (
    ("nv_inference_request_success", "Number of successful inference requests", "success"),
    ("nv_inference_count", "Number of inferences performed", "inference_count"),
    ("nv_inference_exec_count", "Number of model executions performed", "execution_count"),
    (
        "nv_inference_request_duration_us",
        "Cumulative inference request duration in microseconds",
        "request_ns",
    ),
    ("nv_inference_queue_duration_us", "Cumulative queue duration in microseconds", "queue_ns"),
    (
        "nv_inference_compute_input_duration_us",
        "Cumulative compute input duration in microseconds",
        "compute_input_ns",
    ),
    (
        "nv_inference_compute_infer_duration_us",
        "Cumulative compute inference duration in microseconds",
        "compute_infer_ns",
    ),
    (
        "nv_inference_compute_output_duration_us",
        "Cumulative compute output duration in microseconds",
        "compute_output_ns",
    ),
    ("nv_cache_num_hits_per_model", "Number of response cache hits per model", "cache_hits"),
    (
        "nv_cache_num_misses_per_model",
        "Number of response cache misses per model",
        "cache_misses",
    ),
    (
        "nv_cache_hit_duration_per_model",
        "Cumulative time requests spend retrieving a cached response per model (microseconds)",
        "cache_hit_ns",
    ),
    (
        "nv_cache_miss_duration_per_model",
        "Cumulative time requests spend looking up and inserting responses into the cache "
        "on a cache miss (microseconds)",
        "cache_miss_ns",
    ),
)
FAILURE_COUNTER = "nv_inference_request_failure"
EVICTIONS = "nv_cache_num_evictions"  # a pool's response cache (Triton's name before 23.03)
UNSUFFIXED = (*(name for name, _, _ in TRITON_COUNTERS), FAILURE_COUNTER, EVICTIONS)
# A pool's response cache (ResponseCacheMetrics): (name, help, its value).
CACHE_GAUGES: tuple[tuple[str, str, Callable[[cpb.ResponseCacheMetrics], float]], ...] = (
    ("nv_cache_num_entries", "Responses in the pool's response cache", lambda c: c.entries),
    (
        "nv_cache_util",
        "Response cache utilization (bytes held over response_cache_bytes, 0.0 - 1.0)",
        lambda c: c.bytes / c.max_bytes if c.max_bytes else 0.0,
    ),
    ("poolserve_cache_bytes", "Bytes the pool's response cache holds", lambda c: c.bytes),
    ("poolserve_cache_max_bytes", "The response cache's bound in bytes", lambda c: c.max_bytes),
    (
        "poolserve_cache_max_entries",
        "The response cache's bound in entries",
        lambda c: c.max_entries,
    ),
)
# poolserve_batch_size: rows per execution of a batching model (upper bounds).
BATCH_BOUNDS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
BATCH_COUNT = "poolserve_batch_size:count"

HISTOGRAMS = (
    ("nv_inference_request_duration_seconds", "Request time (success and failure)", "request"),
    ("nv_inference_queue_duration_seconds", "Time in the pool's queue", "queue"),
    ("nv_inference_compute_infer_duration_seconds", "Model compute time", "compute"),
)

Labels = tuple[str, ...]
Key = tuple[str, Labels]  # a series: family name, label values


@dataclass
class Continuity:
    """One pool's counters as the router reports them: never going backwards.

    ``update`` takes the pool's counts by group (a model, or ``""`` for the
    pool's own): when the pool's instance changed, every count so far moves
    into the base; when one group's counts fell (a model reloaded), that
    group's do.
    """

    instance: str = ""
    restarts: int = 0
    last: dict[str, dict[Key, float]] = field(default_factory=dict)
    base: dict[Key, float] = field(default_factory=dict)

    def update(self, instance: str, groups: Mapping[str, Mapping[Key, float]]) -> None:
        if self.instance and instance != self.instance:
            self.restarts += 1
            for values in self.last.values():
                self._rebase(values)
            self.last = {}
        self.instance = instance
        for group, counts in groups.items():
            previous = self.last.get(group)
            if previous is not None and sum(counts.values()) < sum(previous.values()):
                self._rebase(previous)
            self.last[group] = dict(counts)

    def _rebase(self, values: Mapping[Key, float]) -> None:
        for key, value in values.items():
            self.base[key] = self.base.get(key, 0.0) + value

    def totals(self) -> dict[Key, float]:
        out = dict(self.base)
        for values in self.last.values():
            for key, value in values.items():
                out[key] = out.get(key, 0.0) + value
        return out


def pool_counters(metrics: cpb.PoolMetrics) -> dict[str, dict[Key, float]]:
    """A pool's counters as series, grouped by model (``""``: the pool's own)."""
    gid = metrics.gid
    groups: dict[str, dict[Key, float]] = {}
    for m in metrics.models:
        labels = (m.name, m.version, gid)
        values: dict[Key, float] = {}
        for name, _, attr in TRITON_COUNTERS:
            raw = float(getattr(m, attr))
            values[(name, labels)] = raw / NS_PER_US if attr.endswith("_ns") else raw
        for reason in FAILURE_REASONS:
            values[(FAILURE_COUNTER, (*labels, reason))] = float(m.failures.get(reason, 0))
        for stage in DEADLINE_STAGES[1:]:
            values[("poolserve_deadline_exceeded", (*labels, stage))] = float(
                m.deadline_exceeded.get(stage, 0)
            )
        for name, _, attr in HISTOGRAMS:
            hist: cpb.Histogram = getattr(m, attr)
            for i, count in enumerate(hist.buckets):
                values[(f"{name}:bucket", (*labels, str(i)))] = float(count)
            values[(f"{name}:sum", labels)] = hist.sum_ns / 1e9
        for size, count in m.batch_sizes.items():
            values[(BATCH_COUNT, (*labels, str(size)))] = float(count)
        groups[f"model:{m.name}:{m.version}"] = values
    groups[""] = {
        ("poolserve_worker_restarts", (gid, cause)): float(metrics.worker_restarts.get(cause, 0))
        for cause in RESTART_CAUSES
    }
    if metrics.HasField("cache"):
        groups[""][(EVICTIONS, (gid,))] = float(metrics.cache.evictions)
    return groups


@dataclass(frozen=True)
class RouterCounts:
    """What the router itself counts: deadlines spent before it could forward,
    by (model, version, pool)."""

    deadlines: Mapping[tuple[str, str, str], int]
    routed: Iterable[tuple[str, str]] = ()  # (model, pool): their series start at 0
    # the other routers of a fleet (their own answers, fleet.py): rows of kind router
    processes: tuple[cpb.ProcessMetrics, ...] = ()
    # inference calls each router took, by router index (its own, or a fleet's)
    requests: Mapping[str, int] = field(default_factory=dict)
    # streams ended by stream_stall_s, by model
    stalled: Mapping[str, int] = field(default_factory=dict)


def merge_counts(own: RouterCounts, peers: Iterable[RouterCounts]) -> RouterCounts:
    """A fleet's counts: every router's deadlines summed, routes and processes together."""
    deadlines: dict[tuple[str, str, str], int] = dict(own.deadlines)
    routed = set(own.routed)
    processes = list(own.processes)
    requests = dict(own.requests)
    stalled = dict(own.stalled)
    for peer in peers:
        for key, count in peer.deadlines.items():
            deadlines[key] = deadlines.get(key, 0) + count
        routed.update(peer.routed)
        processes.extend(peer.processes)
        requests.update(peer.requests)  # each router answers for its own index
        for model, count in peer.stalled.items():
            stalled[model] = stalled.get(model, 0) + count
    return RouterCounts(deadlines, sorted(routed), tuple(processes), requests, stalled)


class Snapshot(Collector):
    """One scrape's families, built from the pools' answers and the router's bases."""

    def __init__(
        self,
        answers: Mapping[str, cpb.PoolMetrics | None],
        continuity: Mapping[str, Continuity],
        own: RouterCounts,
        openmetrics: bool = False,
    ) -> None:
        self.answers = answers
        self.continuity = continuity
        self.own = own
        self.openmetrics = openmetrics

    def collect(self) -> Iterator[Metric]:
        totals: dict[Key, float] = {}
        for state in self.continuity.values():
            totals.update(state.totals())
        yield from self._triton(totals)
        yield from self._histograms(totals)
        yield from self._batch_sizes(totals)
        yield from self._pools(totals)
        yield from self._caches(totals)
        yield from self._routers()
        yield from self._processes()

    def _counter(self, name: str, doc: str) -> Metric:
        # Triton's names carry no `_total`: typed counter in the text format as
        # Triton does (see render), unknown in OpenMetrics, where a counter's
        # samples must end in _total.
        return Metric(name, doc, "unknown" if self.openmetrics else "counter")

    def _triton(self, totals: Mapping[Key, float]) -> Iterator[Metric]:
        for name, doc, _ in TRITON_COUNTERS:
            family = self._counter(name, doc)
            for (fam, labels), value in sorted(totals.items()):
                if fam == name:
                    family.add_sample(name, _labels(("model", "version", "pool"), labels), value)
            yield family
        family = self._counter(FAILURE_COUNTER, "Number of failed inference requests, by reason")
        names = ("model", "version", "pool", "reason")
        for (fam, labels), value in sorted(totals.items()):
            if fam == FAILURE_COUNTER:
                family.add_sample(FAILURE_COUNTER, _labels(names, labels), value)
        yield family

    def _histograms(self, totals: Mapping[Key, float]) -> Iterator[Metric]:
        bounds: tuple[float, ...] = ()
        for answer in self.answers.values():
            if answer is not None and answer.bucket_bounds_s:
                bounds = tuple(answer.bucket_bounds_s)
                break
        for name, doc, _ in HISTOGRAMS:
            family = HistogramMetricFamily(name, doc, labels=("model", "version", "pool"))
            counts: dict[Labels, list[float]] = {}
            for (fam, labels), value in totals.items():
                if fam == f"{name}:bucket":
                    slots = counts.setdefault(labels[:3], [0.0] * (len(bounds) + 1))
                    index = int(labels[3])
                    if index < len(slots):
                        slots[index] = value
            for labels, slots in sorted(counts.items()):
                running = 0.0
                buckets = []
                for bound, count in zip((*map(_le, bounds), "+Inf"), slots, strict=True):
                    running += count
                    buckets.append((bound, running))
                family.add_metric(labels, buckets, totals.get((f"{name}:sum", labels), 0.0))
            yield family

    def _batch_sizes(self, totals: Mapping[Key, float]) -> Iterator[Metric]:
        """Executions by rows, from the pools' counts per batch size."""
        family = HistogramMetricFamily(
            "poolserve_batch_size",
            "Rows per execution of a batching model",
            labels=("model", "version", "pool"),
        )
        slots: dict[Labels, list[float]] = {}
        sums: dict[Labels, float] = {}
        for (fam, labels), count in totals.items():
            if fam != BATCH_COUNT:
                continue
            size = int(labels[3])
            counts = slots.setdefault(labels[:3], [0.0] * (len(BATCH_BOUNDS) + 1))
            counts[bisect.bisect_left(BATCH_BOUNDS, size)] += count
            sums[labels[:3]] = sums.get(labels[:3], 0.0) + size * count
        for labels, counts in sorted(slots.items()):
            running, buckets = 0.0, []
            for bound, count in zip((*map(str, BATCH_BOUNDS), "+Inf"), counts, strict=True):
                running += count
                buckets.append((bound, running))
            family.add_metric(labels, buckets, sums[labels])
        yield family

    def _pools(self, totals: Mapping[Key, float]) -> Iterator[Metric]:
        up = GaugeMetricFamily(
            "poolserve_pool_up", "1: the pool answered this scrape", labels=("pool",)
        )
        queue = GaugeMetricFamily(
            "poolserve_queue_depth", "Requests waiting in the pool's queue", labels=("pool",)
        )
        workers = GaugeMetricFamily(
            "poolserve_workers", "Workers by state", labels=("pool", "state")
        )
        ready = GaugeMetricFamily(
            "poolserve_model_ready", "1: the model is READY", labels=("model", "version", "pool")
        )
        restarts = Metric("poolserve_pool_restarts", "Pool restarts the router saw", "counter")
        worker_restarts = Metric(
            "poolserve_worker_restarts", "Workers replaced, by cause", "counter"
        )
        deadlines = Metric(
            "poolserve_deadline_exceeded",
            "Requests whose deadline ran out, by the stage where it did",
            "counter",
        )
        for gid, answer in sorted(self.answers.items()):
            up.add_metric((gid,), 1.0 if answer is not None else 0.0)
            state = self.continuity.get(gid)
            restarts.add_sample(
                "poolserve_pool_restarts_total",
                {"pool": gid},
                float(state.restarts if state is not None else 0),
            )
            if answer is None:
                continue
            queue.add_metric((gid,), float(answer.queue_depth))
            for s in WORKER_STATES:
                workers.add_metric((gid, s), float(answer.workers.get(s, 0)))
            for m in answer.models:
                ready.add_metric((m.name, m.version, gid), 1.0 if m.ready else 0.0)
        for (fam, labels), value in sorted(totals.items()):
            if fam == "poolserve_worker_restarts":
                worker_restarts.add_sample(
                    "poolserve_worker_restarts_total", _labels(("pool", "cause"), labels), value
                )
        versions = {
            (labels[0], labels[2]): labels[1]
            for fam, labels in totals
            if fam == "nv_inference_count"
        }
        router_deadlines: dict[Key, float] = {
            ("poolserve_deadline_exceeded", (name, version, gid, "router")): 0.0
            for (name, gid), version in versions.items()
            if (name, gid) in set(self.own.routed)
        }
        for (name, version, gid), count in self.own.deadlines.items():
            version = version or versions.get((name, gid), "")  # the call named no version
            key = ("poolserve_deadline_exceeded", (name, version, gid, "router"))
            router_deadlines[key] = router_deadlines.get(key, 0.0) + count
        for (fam, labels), value in sorted({**totals, **router_deadlines}.items()):
            if fam == "poolserve_deadline_exceeded":
                deadlines.add_sample(
                    "poolserve_deadline_exceeded_total",
                    _labels(("model", "version", "pool", "stage"), labels),
                    value,
                )
        yield from (up, queue, workers, ready, restarts, worker_restarts, deadlines)

    def _caches(self, totals: Mapping[Key, float]) -> Iterator[Metric]:
        """Each pool's response cache: what it holds, its bounds, its evictions."""
        gauges = [
            (GaugeMetricFamily(name, doc, labels=("pool",)), value)
            for name, doc, value in CACHE_GAUGES
        ]
        for gid, answer in sorted(self.answers.items()):
            if answer is not None and answer.HasField("cache"):
                for family, value in gauges:
                    family.add_metric((gid,), value(answer.cache))
        evictions = self._counter(EVICTIONS, "Responses evicted from the pool's response cache")
        for (fam, labels), count in sorted(totals.items()):
            if fam == EVICTIONS:
                evictions.add_sample(EVICTIONS, {"pool": labels[0]}, count)
        yield from (*(family for family, _ in gauges), evictions)

    def _routers(self) -> Iterator[Metric]:
        """What the routers count themselves: calls per router, stalled streams."""
        requests = Metric(
            "poolserve_router_requests",
            "Inference calls each router took (a fleet's spread), by router index",
            "counter",
        )
        for index, count in sorted(self.own.requests.items(), key=lambda kv: int(kv[0])):
            requests.add_sample("poolserve_router_requests_total", {"router": index}, count)
        stalled = Metric(
            "poolserve_streams_stalled",
            "Streams ended because their client read none of their responses for stream_stall_s",
            "counter",
        )
        for model, count in sorted(self.own.stalled.items()):
            stalled.add_sample("poolserve_streams_stalled_total", {"model": model}, count)
        yield from (requests, stalled)

    def _processes(self) -> Iterator[Metric]:
        rss = GaugeMetricFamily(
            "poolserve_process_rss_bytes",
            "Resident memory, by process kind",
            labels=("kind", "pool"),
        )
        pss = GaugeMetricFamily(
            "poolserve_process_pss_bytes",
            "Proportional set size (shared pages split), by process kind",
            labels=("kind", "pool"),
        )
        count = GaugeMetricFamily(
            "poolserve_processes", "Processes, by kind", labels=("kind", "pool")
        )
        rows: dict[tuple[str, str], list[float]] = {}
        for proc in (*own_processes(), *self.own.processes):
            row = rows.setdefault((proc.kind, ""), [0.0, 0.0, 0.0])
            row[0] += proc.rss_bytes
            row[1] += proc.pss_bytes
            row[2] += 1
        for gid, answer in self.answers.items():
            if answer is None:
                continue
            for proc in answer.processes:
                row = rows.setdefault((proc.kind, gid), [0.0, 0.0, 0.0])
                row[0] += proc.rss_bytes
                row[1] += proc.pss_bytes
                row[2] += 1
        for labels, (r, p, n) in sorted(rows.items()):
            rss.add_metric(labels, r)
            pss.add_metric(labels, p)
            count.add_metric(labels, n)
        yield from (rss, pss, count)


def own_processes() -> list[cpb.ProcessMetrics]:
    """The router and, when it runs under one, the supervisor that started it."""
    out = []
    for pid, kind in ((os.getpid(), "router"), (os.getppid(), "supervisor")):
        if kind == "supervisor" and not _is_supervisor(pid):
            continue
        stat = proc_stat(pid)
        if stat is not None:
            out.append(
                cpb.ProcessMetrics(
                    pid=pid,
                    kind=kind,
                    state="running",
                    rss_bytes=stat.rss_bytes,
                    pss_bytes=pss_bytes(pid),
                    cpu_seconds=stat.cpu_seconds,
                )
            )
    return out


def _is_supervisor(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    except OSError:
        return False
    return b"serve" in argv and any(b"poolserve" in arg for arg in argv)


def _labels(names: Iterable[str], values: Labels) -> dict[str, str]:
    return dict(zip(names, values, strict=True))


def _le(bound: float) -> str:
    return repr(float(bound))


class MetricsSource:
    """Collects a scrape: every pool at once, serialized, with the router's bases."""

    def __init__(
        self,
        pools: Callable[[], Mapping[str, grpc.aio.Channel | None]],
        own: Callable[[], RouterCounts],
        timeout_s: float = POOL_TIMEOUT_S,
        peers: Callable[[], Awaitable[list[RouterCounts]]] | None = None,
    ) -> None:
        self._pools = pools
        self._own = own
        self._peers = peers  # a fleet's other routers (each router serves the fleet's /metrics)
        self.timeout_s = timeout_s
        self.continuity: dict[str, Continuity] = {}
        self._lock = asyncio.Lock()  # scrapes only, never the request path

    async def _ask(self, channel: grpc.aio.Channel | None) -> cpb.PoolMetrics | None:
        if channel is None:
            return None
        call = channel.unary_unary(
            POOL_METRICS_METHOD,
            request_serializer=cpb.PoolMetricsRequest.SerializeToString,
            response_deserializer=cpb.PoolMetrics.FromString,
        )
        try:
            answer: cpb.PoolMetrics = await call(
                cpb.PoolMetricsRequest(pss=True), timeout=self.timeout_s
            )
        except grpc.aio.AioRpcError:
            return None
        return answer

    async def snapshot(self, openmetrics: bool = False) -> Snapshot:
        async with self._lock:
            pools = dict(self._pools())
            answers = await asyncio.gather(*(self._ask(ch) for ch in pools.values()))
            by_gid = dict(zip(pools, answers, strict=True))
            for gid, answer in by_gid.items():
                if answer is not None:
                    self.continuity.setdefault(gid, Continuity()).update(
                        answer.instance, pool_counters(answer)
                    )
            for gone in set(self.continuity) - set(pools):
                del self.continuity[gone]  # a pool removed by a reload: its series end
            own = self._own()
            if self._peers is not None:
                own = merge_counts(own, await self._peers())
            return Snapshot(by_gid, dict(self.continuity), own, openmetrics)


def render(snapshot: Snapshot, accept: str = "") -> tuple[bytes, str]:
    """The exposition and its content type, as the scraper's Accept asks."""
    from prometheus_client.exposition import choose_encoder, generate_latest

    snapshot.openmetrics = False
    encoder, content_type = choose_encoder(accept)
    if encoder is not generate_latest:
        snapshot.openmetrics = True
        return encoder(snapshot), content_type
    text = generate_latest(snapshot)
    # The text format names a counter's family `<name>_total`; Triton's keep
    # their own names (samples and HELP/TYPE lines agree, as Triton writes them).
    for name in UNSUFFIXED:
        text = text.replace(f"# HELP {name}_total ".encode(), f"# HELP {name} ".encode(), 1)
        text = text.replace(f"# TYPE {name}_total ".encode(), f"# TYPE {name} ".encode(), 1)
    return text, content_type
