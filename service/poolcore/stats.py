"""Per-model inference statistics: the counts and durations of Triton's ModelStatistics.

Durations are nanoseconds. Queue time is measured by whoever queued the
request (the pool's dispatcher); decode, compute and encode come from the
worker's own timings, so they cost no extra clock reads on the hot path.
Counting only: the message is built by :mod:`poolserve.service.poolserver.statistics`.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from dataclasses import dataclass, field


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
    recent_compute_ns: deque[int] = field(default_factory=lambda: deque(maxlen=64))
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
        self._record_execution(queue_ns, timings, execution)

    def record_failure(
        self, total_ns: int, queue_ns: int = 0, timings: Timings | None = None
    ) -> None:
        self.fail_count += 1
        self.fail_ns += total_ns
        if timings is not None:
            self._record_execution(queue_ns, timings)

    def _record_execution(self, queue_ns: int, timings: Timings, execution: bool = True) -> None:
        self.queue_count += 1
        self.queue_ns += queue_ns
        self.compute_count += 1
        self.input_ns += timings.decode_ns
        self.infer_ns += timings.compute_ns
        self.output_ns += timings.encode_ns
        self.recent_compute_ns.append(timings.decode_ns + timings.compute_ns + timings.encode_ns)
        self.inference_count += 1
        self.execution_count += execution
        self.last_inference_ms = time.time_ns() // 1_000_000
