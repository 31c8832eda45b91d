"""ModelMetadata and Triton ModelConfig responses built from tensor specs."""

from __future__ import annotations

from collections.abc import Sequence

from poolserve.protos import inference_pb2 as pb
from poolserve.service.contract.repository import INPUT_FORMATS, TensorSpec
from poolserve.service.contract.sequence import SequencePolicy

PLATFORM = "poolserve_python"

_CONFIG_TYPES: dict[str, int] = {
    "BOOL": pb.TYPE_BOOL,
    "UINT8": pb.TYPE_UINT8,
    "UINT16": pb.TYPE_UINT16,
    "UINT32": pb.TYPE_UINT32,
    "UINT64": pb.TYPE_UINT64,
    "INT8": pb.TYPE_INT8,
    "INT16": pb.TYPE_INT16,
    "INT32": pb.TYPE_INT32,
    "INT64": pb.TYPE_INT64,
    "FP16": pb.TYPE_FP16,
    "FP32": pb.TYPE_FP32,
    "FP64": pb.TYPE_FP64,
    "BYTES": pb.TYPE_STRING,
    "BF16": pb.TYPE_BF16,
}


def model_metadata(
    name: str,
    versions: Sequence[str],
    platform: str,
    inputs: Sequence[TensorSpec],
    outputs: Sequence[TensorSpec],
) -> pb.ModelMetadataResponse:
    def tensors(specs: Sequence[TensorSpec]) -> list[pb.ModelMetadataResponse.TensorMetadata]:
        return [
            pb.ModelMetadataResponse.TensorMetadata(
                name=s.name, datatype=s.datatype, shape=list(s.shape)
            )
            for s in specs
        ]

    return pb.ModelMetadataResponse(
        name=name,
        versions=[v for v in versions if v],
        platform=platform or PLATFORM,
        inputs=tensors(inputs),
        outputs=tensors(outputs),
    )


def model_config(
    name: str,
    platform: str,
    max_batch_size: int,
    inputs: Sequence[TensorSpec],
    outputs: Sequence[TensorSpec],
    sequence: SequencePolicy | None = None,
    decoupled: bool = False,
) -> pb.ModelConfigResponse:
    # Triton's dims exclude the batch dimension when max_batch_size > 0.
    skip = 1 if max_batch_size > 0 else 0
    config = pb.ModelConfig(
        name=name,
        platform=platform or PLATFORM,
        backend="python",
        max_batch_size=max_batch_size,
        input=[
            pb.ModelInput(
                name=s.name,
                data_type=_CONFIG_TYPES.get(s.datatype, pb.TYPE_INVALID),  # type: ignore[arg-type]
                format=s.format if s.format in INPUT_FORMATS else "FORMAT_NONE",
                dims=list(s.shape[skip:]),
            )
            for s in inputs
        ],
        output=[
            pb.ModelOutput(
                name=s.name,
                data_type=_CONFIG_TYPES.get(s.datatype, pb.TYPE_INVALID),  # type: ignore[arg-type]
                dims=list(s.shape[skip:]),
                label_filename=s.label_filename,
            )
            for s in outputs
        ],
    )
    if sequence is not None:
        config.sequence_batching.CopyFrom(sequence_batching(sequence))
    if decoupled:
        config.model_transaction_policy.decoupled = True
    return pb.ModelConfigResponse(config=config)


_KINDS = {
    "START": pb.ModelSequenceBatching.Control.CONTROL_SEQUENCE_START,
    "READY": pb.ModelSequenceBatching.Control.CONTROL_SEQUENCE_READY,
    "END": pb.ModelSequenceBatching.Control.CONTROL_SEQUENCE_END,
    "CORRID": pb.ModelSequenceBatching.Control.CONTROL_SEQUENCE_CORRID,
}


def sequence_batching(policy: SequencePolicy) -> pb.ModelSequenceBatching:
    """A sequence model as Triton's config says it: idle timeout, control inputs."""
    batching = pb.ModelSequenceBatching(
        max_sequence_idle_microseconds=round(policy.idle_timeout_s * 1e6)
    )
    for c in policy.controls:
        control = pb.ModelSequenceBatching.Control(kind=_KINDS[c.kind])
        if c.kind == "CORRID":
            control.data_type = _CONFIG_TYPES[c.datatype]  # type: ignore[assignment]
        elif c.datatype == "INT32":
            control.int32_false_true.extend((0, 1))
        elif c.datatype == "FP32":
            control.fp32_false_true.extend((0.0, 1.0))
        else:
            control.bool_false_true.extend((False, True))
        batching.control_input.add(name=c.name, control=[control])
    return batching
