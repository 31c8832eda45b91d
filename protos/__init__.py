"""Protocol sources and their generated modules.

``inference`` is the Open Inference Protocol (KServe V2) with Triton's
ModelConfig and ModelStatistics; ``control`` is poolserve's internal control
plane. Regenerate with ``make protos``.
"""
