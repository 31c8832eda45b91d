"""The metrics, without a server: the pool's counts, the router's continuity
and its exposition parsed back with prometheus_client's parsers; the metrics
port over real HTTP on loopback; a pool that does not answer in time."""

from __future__ import annotations

import asyncio
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path

import grpc
import pytest
from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as openmetrics_families,
)
from prometheus_client.parser import text_string_to_metric_families

from poolserve.protos import control_pb2 as cpb
from poolserve.service.contract.errors import (
    DeadlineExceeded,
    InvalidInput,
    ModelError,
    QueueFull,
    Unavailable,
)
from poolserve.service.grpcserver.sockets import bind_private_unix
from poolserve.service.poolcore.fleet import death_cause
from poolserve.service.poolcore.jobs import WorkerGone
from poolserve.service.poolcore.stats import BUCKETS_S, ModelStats, Timings
from poolserve.service.router.metrics import (
    Continuity,
    MetricsSource,
    RouterCounts,
    Snapshot,
    pool_counters,
    render,
)
from poolserve.service.router.metrics_http import MetricsServer
from poolserve.supervisor.top_cli import Sample, parse_metrics, quantile

MS = 1_000_000


def model(
    name: str, success: int, *, failures: Mapping[str, int] | None = None
) -> cpb.ModelMetrics:
    stats = ModelStats()
    for _ in range(success):
        stats.record_success(2 * MS, Timings(0, 3 * MS, 0), 7 * MS)
    for reason, count in (failures or {}).items():
        error = {
            "deadline": DeadlineExceeded("late", stage="pool queue"),
            "invalid": InvalidInput("bad"),
        }[reason]
        for _ in range(count):
            stats.record_failure(40 * MS, error=error)
    from poolserve.service.poolserver.catalog import ModelEntry, ModelState
    from poolserve.service.poolserver.metrics import model_metrics

    return model_metrics(ModelEntry(name, "1", "g", ModelState.READY, stats=stats))


def pool(gid: str, instance: str, *models: cpb.ModelMetrics, restarts: int = 0) -> cpb.PoolMetrics:
    return cpb.PoolMetrics(
        gid=gid,
        instance=instance,
        queue_depth=3,
        workers={"idle": 1, "busy": 2, "starting": 0},
        worker_restarts={"signal": restarts},
        models=list(models),
        bucket_bounds_s=BUCKETS_S,
    )


def scrape(
    answers: Mapping[str, cpb.PoolMetrics | None], state: dict[str, Continuity], accept: str = ""
) -> tuple[str, str]:
    for gid, answer in answers.items():
        if answer is not None:
            state.setdefault(gid, Continuity()).update(answer.instance, pool_counters(answer))
    body, content_type = render(Snapshot(answers, state, RouterCounts({})), accept)
    return body.decode(), content_type


def values(text: str, name: str) -> dict[frozenset[tuple[str, str]], float]:
    return {
        frozenset(s.labels.items()): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name
    }


def test_stats_buckets_reasons_and_stages() -> None:
    stats = ModelStats()
    stats.record_success(0, Timings(0, MS, 0), MS)  # exactly 1 ms: in le=0.001
    stats.record_success(MS, Timings(0, 40 * 1000 * MS, 0), 31 * 1000 * MS)  # above 30 s
    stats.record_failure(5, error=DeadlineExceeded("late", stage="worker"))
    stats.record_failure(5, error=DeadlineExceeded("late", stage="router"))
    stats.record_failure(5, error=QueueFull("full"))
    stats.record_failure(5, error=ModelError("boom"))
    stats.record_failure(5, error=Unavailable("down"))
    assert stats.request_buckets[BUCKETS_S.index(0.001)] == 1
    assert stats.request_buckets[-1] == 1
    assert stats.request_buckets[0] == 5  # the failures took 5 ns
    assert stats.compute_buckets[-1] == 1 and stats.compute_buckets[BUCKETS_S.index(0.001)] == 1
    assert dict(stats.failures) == {"deadline": 2, "exhausted": 1, "internal": 1, "unavailable": 1}
    assert dict(stats.deadlines) == {"worker": 1, "router": 1}


def test_worker_restart_causes() -> None:
    assert death_cause(WorkerGone(1, "killed by SIGKILL", "", "")) == "signal"
    assert death_cause(WorkerGone(1, "exited with code 3", "", "")) == "exit"
    assert (
        death_cause(WorkerGone(1, "killed by SIGABRT", "", "stopped heartbeating for 3 s"))
        == "heartbeat"
    )
    assert death_cause(WorkerGone(1, "killed by SIGABRT", "m", "model 'm' ran longer")) == "timeout"
    assert death_cause(WorkerGone(1, "exited with code 0", "", "", retired=True)) == "roll"


def test_exposition_parses_back_with_triton_names_and_histograms() -> None:
    state: dict[str, Continuity] = {}
    text, content_type = scrape(
        {"a": pool("a", "1-1", model("m", 4, failures={"deadline": 2, "invalid": 1})), "b": None},
        state,
    )
    assert content_type.startswith("text/plain")
    assert "# TYPE nv_inference_request_success counter\n" in text  # Triton's name, no _total
    assert 'nv_inference_request_success{model="m",pool="a",version="1"} 4.0' in text
    ok = values(text, "nv_inference_request_success_total")  # the parser's name for a counter
    assert ok == {frozenset({("model", "m"), ("version", "1"), ("pool", "a")}): 4.0}
    failed = values(text, "nv_inference_request_failure_total")
    by_reason = {dict(k)["reason"]: v for k, v in failed.items()}
    assert by_reason == {
        "deadline": 2.0, "invalid": 1.0, "cancelled": 0.0, "internal": 0.0,
        "unavailable": 0.0, "exhausted": 0.0,
    }  # fmt: skip
    stages = {
        dict(k)["stage"]: v for k, v in values(text, "poolserve_deadline_exceeded_total").items()
    }
    assert stages == {"pool": 0.0, "queue": 2.0, "worker": 0.0}
    buckets = {
        dict(k)["le"]: v
        for k, v in values(text, "nv_inference_request_duration_seconds_bucket").items()
    }
    assert buckets["0.005"] == 0 and buckets["0.01"] == 4 and buckets["0.05"] == 7
    assert buckets["+Inf"] == 7
    (count,) = values(text, "nv_inference_request_duration_seconds_count").values()
    assert count == 7
    (total,) = values(text, "nv_inference_request_duration_seconds_sum").values()
    assert total == pytest.approx(4 * 0.007 + 3 * 0.040)
    (queue_us,) = values(text, "nv_inference_queue_duration_us_total").values()
    assert queue_us == pytest.approx(4 * 2000)
    assert values(text, "poolserve_pool_up") == {
        frozenset({("pool", "a")}): 1.0,
        frozenset({("pool", "b")}): 0.0,
    }
    workers = {dict(k)["state"]: v for k, v in values(text, "poolserve_workers").items()}
    assert workers == {"idle": 1.0, "busy": 2.0, "starting": 0.0}


def test_batch_sizes_are_a_histogram_that_continues_across_restarts() -> None:
    stats = ModelStats()
    for size in (3, 3, 32, 1):
        stats.record_batch(size, Timings(0, MS, 0))
    from poolserve.service.poolserver.catalog import ModelEntry, ModelState
    from poolserve.service.poolserver.metrics import model_metrics

    batched = model_metrics(ModelEntry("b", "1", "g", ModelState.READY, stats=stats))
    assert dict(batched.batch_sizes) == {3: 2, 32: 1, 1: 1}
    state: dict[str, Continuity] = {}
    text, _ = scrape({"a": pool("a", "1-1", batched, model("m", 2))}, state)
    buckets = {
        dict(k)["le"]: v
        for k, v in values(text, "poolserve_batch_size_bucket").items()
        if dict(k)["model"] == "b"
    }
    assert (buckets["1"], buckets["2"], buckets["4"], buckets["16"], buckets["32"]) == (
        1, 1, 3, 3, 4,
    )  # fmt: skip
    assert buckets["+Inf"] == 4
    assert values(text, "poolserve_batch_size_sum") == {
        frozenset({("model", "b"), ("version", "1"), ("pool", "a")}): 3 + 3 + 32 + 1
    }  # a model that does not batch has no series
    # the pool restarts and counts one batch of 5 from zero: the histogram continues
    again = ModelStats()
    again.record_batch(5, Timings(0, MS, 0))
    restarted = model_metrics(ModelEntry("b", "1", "g", ModelState.READY, stats=again))
    text, _ = scrape({"a": pool("a", "2-2", restarted)}, state)
    (count,) = values(text, "poolserve_batch_size_count").values()
    assert count == 5


def test_openmetrics_on_accept() -> None:
    state: dict[str, Continuity] = {}
    text, content_type = scrape(
        {"a": pool("a", "1-1", model("m", 2))}, state, "application/openmetrics-text; version=1.0.0"
    )
    assert content_type.startswith("application/openmetrics-text")
    assert text.endswith("# EOF\n")
    families = {f.name: f for f in openmetrics_families(text)}
    assert families["nv_inference_request_success"].samples[0].value == 2
    assert families["nv_inference_request_duration_seconds"].type == "histogram"
    assert families["poolserve_worker_restarts"].type == "counter"


def test_counters_continue_across_pool_restarts_and_model_reloads() -> None:
    state: dict[str, Continuity] = {}

    def success(text: str) -> float:
        (value,) = values(text, "nv_inference_request_success_total").values()
        return value

    assert success(scrape({"a": pool("a", "1-1", model("m", 5), restarts=1)}, state)[0]) == 5
    assert success(scrape({"a": pool("a", "1-1", model("m", 7), restarts=1)}, state)[0]) == 7
    text = scrape({"a": None}, state)[0]  # down: its last counts stay, up 0
    assert success(text) == 7
    text = scrape({"a": pool("a", "2-9", model("m", 3))}, state)[0]  # restarted: from zero
    assert success(text) == 10
    restarts = values(text, "poolserve_pool_restarts_total")
    assert restarts == {frozenset({("pool", "a")}): 1.0}
    signals = {
        dict(k)["cause"]: v for k, v in values(text, "poolserve_worker_restarts_total").items()
    }
    assert signals["signal"] == 1  # the previous instance's, kept
    assert success(scrape({"a": pool("a", "2-9", model("m", 3))}, state)[0]) == 10  # no double
    # The same instance, the model's counts fell: it was reloaded.
    assert success(scrape({"a": pool("a", "2-9", model("m", 1))}, state)[0]) == 11


class _SilentPool:
    """A PoolControl whose Metrics never answers (a pool that is stopped)."""

    def __init__(self) -> None:
        self.asked = asyncio.Event()

    async def metrics(self, _: cpb.PoolMetricsRequest, context: object) -> cpb.PoolMetrics:
        self.asked.set()
        await asyncio.sleep(3600)
        raise AssertionError("unreachable")

    def handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(
            "poolserve.control.v1.PoolControl",
            {
                "Metrics": grpc.unary_unary_rpc_method_handler(
                    self.metrics,
                    cpb.PoolMetricsRequest.FromString,
                    cpb.PoolMetrics.SerializeToString,
                )
            },
        )


def _get(url: str, accept: str = "") -> tuple[int, str, str]:
    request = urllib.request.Request(url, headers={"Accept": accept} if accept else {})
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return reply.status, reply.headers["Content-Type"], reply.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, "", ""


def test_metrics_port_and_a_pool_that_does_not_answer(tmp_path: Path) -> None:
    async def main() -> None:
        silent = _SilentPool()
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((silent.handler(),))
        bind_private_unix(server, tmp_path / "silent.sock")
        await server.start()
        channel = grpc.aio.insecure_channel(f"unix:{tmp_path / 'silent.sock'}")
        source = MetricsSource(lambda: {"quiet": channel}, lambda: RouterCounts({}), timeout_s=0.5)
        http = MetricsServer(source)
        port = await http.start("127.0.0.1", 0)
        try:
            url = f"http://127.0.0.1:{port}"
            status, content_type, text = await asyncio.to_thread(_get, url + "/metrics")
            assert silent.asked.is_set()
            assert status == 200 and content_type.startswith("text/plain")
            assert values(text, "poolserve_pool_up") == {frozenset({("pool", "quiet")}): 0.0}
            status, content_type, _ = await asyncio.to_thread(
                _get, url + "/metrics", "application/openmetrics-text; version=1.0.0"
            )
            assert content_type.startswith("application/openmetrics-text")
            assert (await asyncio.to_thread(_get, url + "/nope"))[0] == 404
        finally:
            await http.stop()
            await channel.close()
            await server.stop(0)

    asyncio.run(main())


def test_top_quantiles_and_parsing() -> None:
    state: dict[str, Continuity] = {}
    text = scrape({"a": pool("a", "1-1", model("m", 4, failures={"invalid": 1}))}, state)[0]
    sample = Sample(at=0.0)
    parse_metrics(text, sample)
    key = ("m", "1", "a")
    assert sample.requests[key] == 5 and sample.errors[key] == 1
    assert sample.queue["a"] == 3 and sample.busy["a"] == 2 and sample.workers["a"] == 3
    p50 = quantile(0.5, sample.buckets[key])
    assert p50 is not None and 0.005 < p50 <= 0.01  # four of five took 7 ms
    assert quantile(0.5, [(0.1, 0.0), (float("inf"), 0.0)]) is None
