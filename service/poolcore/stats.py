"""Per-model inference statistics: the counts and durations of Triton's ModelStatistics.

Durations are nanoseconds. Queue time is measured by whoever queued the
request (the pool's dispatcher); decode, compute and encode come from the
worker's own timings, so they cost no extra clock reads on the hot path.
Counting only: the message is built by :mod:`poolserve.service.poolserver.statistics`,
the Prometheus metrics by the router from :mod:`poolserve.service.poolserver.metrics`.

Histograms of request, queue and compute time are counted here too, on the
same call as the sums (one ``bisect`` per duration, no lock: the pool's event
loop is the only writer): ``*_buckets[i]`` counts the durations in
``(BUCKETS_NS[i-1], BUCKETS_NS[i]]``, the last slot those above every bound.
"""

from __future__ import annotations

import statistics
import time
from bisect import bisect_left
from collections import Counter, deque
from dataclasses import dataclass, field

from poolserve.service.contract.errors import Failure, ServingError

# The histograms' upper bounds, 0.5 ms to 30 s (Prometheus' `le`, in seconds).
BUCKETS_S = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip
BUCKETS_NS = tuple(round(b * 1e9) for b in BUCKETS_S)
_REASON = {
    Failure.DEADLINE: "deadline",
    Failure.CANCELLED: "cancelled",
    Failure.INVALID_INPUT: "invalid",
    Failure.TOO_LARGE: "invalid",
    Failure.NOT_FOUND: "invalid",
    Failure.FAILED_PRECONDITION: "invalid",
    Failure.UNIMPLEMENTED: "invalid",
    Failure.UNAVAILABLE: "unavailable",
    Failure.NOT_READY: "unavailable",
    Failure.QUEUE_FULL: "exhausted",
}
# A DeadlineExceeded's stage as the metrics' `stage` label.
_STAGE = {"router": "router", "pool": "pool", "pool queue": "queue", "worker": "worker"}


def failure_reason(error: ServingError) -> str:
    """The ``reason`` label of a failed request (``internal`` for model errors too)."""
    return _REASON.get(error.failure, "internal")


def deadline_stage(error: ServingError) -> str:
    """The ``stage`` label of a deadline that ran out."""
    return _STAGE.get(error.stage, "pool")


def _buckets() -> list[int]:
    return [0] * (len(BUCKETS_NS) + 1)


@dataclass(slots=True)
class Timings:
    """What a worker measured for one request, in nanoseconds."""

    decode_ns: int = 0
    compute_ns: int = 0
    encode_ns: int = 0


@dataclass(slots=True)
class BatchStats:
    """Executions of one batch size: how many, and their compute times."""

    count: int = 0
    input_ns: int = 0
    infer_ns: int = 0
    output_ns: int = 0


@dataclass(slots=True)
class ModelStats:
    success_count: int = 0
    success_ns: int = 0
    fail_count: int = 0
    fail_ns: int = 0
    queue_count: int = 0
    queue_ns: int = 0
    compute_count: int = 0
    input_ns: int = 0
    infer_ns: int = 0
    output_ns: int = 0
    inference_count: int = 0
    execution_count: int = 0
    last_inference_ms: int = 0
    late_replies: int = 0
    # the response cache (Triton's cache_hit and cache_miss): lookups that found
    # the reply, and the time to find and copy it out; lookups that did not,
    # and the time to look up and to insert the computed reply
    cache_hit_count: int = 0
    cache_hit_ns: int = 0
    cache_miss_count: int = 0
    cache_miss_ns: int = 0
    recent_compute_ns: deque[int] = field(default_factory=lambda: deque(maxlen=64))
    failures: Counter[str] = field(default_factory=Counter)  # by failure_reason
    deadlines: Counter[str] = field(default_factory=Counter)  # by deadline_stage
    request_buckets: list[int] = field(default_factory=_buckets)  # success and failure
    queue_buckets: list[int] = field(default_factory=_buckets)
    compute_buckets: list[int] = field(default_factory=_buckets)  # the model's compute only
    batches: dict[int, BatchStats] = field(default_factory=dict)  # per batch size (rows)

    def record_batch(self, size: int, timings: Timings) -> None:
        """One execution of ``size`` rows (Triton's batch_stats)."""
        stats = self.batches.get(size)
        if stats is None:
            stats = self.batches[size] = BatchStats()
        stats.count += 1
        stats.input_ns += timings.decode_ns
        stats.infer_ns += timings.compute_ns
        stats.output_ns += timings.encode_ns

    def p50_compute_s(self) -> float | None:
        """Median compute time of the recent executions (None before any)."""
        if not self.recent_compute_ns:
            return None
        return statistics.median(self.recent_compute_ns) / 1e9

    def record_success(
        self, queue_ns: int, timings: Timings, total_ns: int, execution: bool = True
    ) -> None:
        """``execution`` False: a request of a batch whose execution another counted."""
        self.success_count += 1
        self.success_ns += total_ns
        self.request_buckets[bisect_left(BUCKETS_NS, total_ns)] += 1
        self._record_execution(queue_ns, timings, execution)

    def record_cache_hit(self, lookup_ns: int, total_ns: int) -> None:
        """A request answered from the response cache, as Triton counts one: a
        success, with a queue time (of 0) but no compute and no execution, and
        not in ``inference_count``."""
        self.success_count += 1
        self.success_ns += total_ns
        self.request_buckets[bisect_left(BUCKETS_NS, total_ns)] += 1
        self.queue_count += 1
        self.queue_buckets[0] += 1
        self.cache_hit_count += 1
        self.cache_hit_ns += lookup_ns
        self.last_inference_ms = time.time_ns() // 1_000_000

    def record_cache_miss(self, lookup_ns: int) -> None:
        """A lookup that found nothing (the request is computed and counted as
        any); the insertion's time is added by :meth:`record_cache_insert`."""
        self.cache_miss_count += 1
        self.cache_miss_ns += lookup_ns

    def record_cache_insert(self, insert_ns: int) -> None:
        self.cache_miss_ns += insert_ns

    def record_failure(
        self,
        total_ns: int,
        queue_ns: int = 0,
        timings: Timings | None = None,
        error: ServingError | None = None,
    ) -> None:
        self.fail_count += 1
        self.fail_ns += total_ns
        self.request_buckets[bisect_left(BUCKETS_NS, total_ns)] += 1
        if error is None:
            self.failures["internal"] += 1
        else:
            self.failures[failure_reason(error)] += 1
            if error.failure is Failure.DEADLINE:
                self.deadlines[deadline_stage(error)] += 1
        if timings is not None:
            self._record_execution(queue_ns, timings)

    def _record_execution(self, queue_ns: int, timings: Timings, execution: bool = True) -> None:
        self.queue_count += 1
        self.queue_ns += queue_ns
        self.compute_count += 1
        self.input_ns += timings.decode_ns
        self.infer_ns += timings.compute_ns
        self.output_ns += timings.encode_ns
        compute_ns = timings.decode_ns + timings.compute_ns + timings.encode_ns
        self.recent_compute_ns.append(compute_ns)
        self.queue_buckets[bisect_left(BUCKETS_NS, queue_ns)] += 1
        self.compute_buckets[bisect_left(BUCKETS_NS, timings.compute_ns)] += 1
        self.inference_count += 1
        self.execution_count += execution
        self.last_inference_ms = time.time_ns() // 1_000_000
