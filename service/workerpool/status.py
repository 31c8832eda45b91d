"""What WorkerPool reports: per-model counters (:class:`ScoreStats`) and the
pool's processes, queue and models (:class:`PoolStatus`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ScoreStats:
    """One model's counters; durations in nanoseconds, summed over ``executed`` calls."""

    calls: int = 0  # score() calls for this model
    succeeded: int = 0
    raised: int = 0  # score raised: ScoreError
    deadline_exceeded: int = 0
    queue_full: int = 0
    cancelled: int = 0  # the caller went away (or the pool closed first)
    failed: int = 0  # anything else: worker died, model not ready, bad arguments...
    executed: int = 0  # calls a worker ran to the end (succeeded + raised)
    queue_ns: int = 0  # waiting for a worker
    decode_ns: int = 0  # unpickling the arguments, in the worker
    compute_ns: int = 0  # score itself
    encode_ns: int = 0  # pickling the result, in the worker

    @property
    def mean_queue_s(self) -> float:
        return self.queue_ns / self.executed / 1e9 if self.executed else 0.0

    @property
    def mean_compute_s(self) -> float:
        return self.compute_ns / self.executed / 1e9 if self.executed else 0.0


@dataclass(frozen=True)
class WorkerInfo:
    pid: int
    state: str
    served: int
    generation: int
    retiring: bool


@dataclass(frozen=True)
class PoolStatus:
    name: str
    state: str
    zygote_pid: int
    workers: tuple[WorkerInfo, ...]
    queue_depth: int
    late_replies_dropped: int
    expired_in_queue: int
    respawns: int
    segment_dir: str
    models: dict[str, str]  # name -> "serving", "loading", "failed: ...", "disabled: ..."
