"""ModelMetadata and Triton ModelConfig responses built from tensor specs."""

from __future__ import annotations

from collections.abc import Sequence

from poolserve.protos import inference_pb2 as pb
from poolserve.service.contract.repository import INPUT_FORMATS, TensorSpec

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
    version: str,
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
        versions=[version] if version else [],
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
    return pb.ModelConfigResponse(config=config)
