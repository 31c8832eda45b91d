"""A model's counters (:class:`~poolserve.service.poolcore.stats.ModelStats`) as
the Open Inference Protocol's ModelStatistics message."""

from __future__ import annotations

from poolserve.protos import inference_pb2 as pb
from poolserve.service.poolcore.stats import ModelStats


def model_statistics(stats: ModelStats, name: str, version: str) -> pb.ModelStatistics:
    """``stats`` as the ModelStatistics message of one model version."""

    def d(count: int, ns: int) -> pb.StatisticDuration:
        return pb.StatisticDuration(count=count, ns=ns)

    return pb.ModelStatistics(
        name=name,
        version=version,
        last_inference=stats.last_inference_ms,
        inference_count=stats.inference_count,
        execution_count=stats.execution_count,
        inference_stats=pb.InferStatistics(
            success=d(stats.success_count, stats.success_ns),
            fail=d(stats.fail_count, stats.fail_ns),
            queue=d(stats.queue_count, stats.queue_ns),
            compute_input=d(stats.compute_count, stats.input_ns),
            compute_infer=d(stats.compute_count, stats.infer_ns),
            compute_output=d(stats.compute_count, stats.output_ns),
            cache_hit=d(stats.cache_hit_count, stats.cache_hit_ns),
            cache_miss=d(stats.cache_miss_count, stats.cache_miss_ns),
        ),
        batch_stats=[
            pb.InferBatchStatistics(
                batch_size=size,
                compute_input=d(b.count, b.input_ns),
                compute_infer=d(b.count, b.infer_ns),
                compute_output=d(b.count, b.output_ns),
            )
            for size, b in sorted(stats.batches.items())
        ],
    )
