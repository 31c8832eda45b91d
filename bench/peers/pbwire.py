"""A few KServe V2 / Triton messages encoded and decoded by hand.

The bench's client and the add-on handlers it puts around MLServer speak
protobuf without importing any generated ``inference`` package: MLServer,
tritonclient and poolserve each register their own ``inference`` protos, and
two of them cannot share a process. Only the fields the bench reads or
writes are here; field numbers follow grpc_service.proto and
model_config.proto (Triton), which KServe V2 extends.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

VARINT = 0
FIXED64 = 1
LEN = 2
FIXED32 = 5

# Triton model_config.proto DataType, for the datatypes the bench uses.
DATA_TYPE = {"BOOL": 1, "UINT8": 2, "INT32": 8, "INT64": 9, "FP32": 11, "FP64": 12, "BYTES": 13}

SERVICE = "inference.GRPCInferenceService"


def varint(value: int) -> bytes:
    if value < 0:
        value += 1 << 64  # int64 negatives are ten-byte varints
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def tag(field: int, wire_type: int) -> bytes:
    return varint((field << 3) | wire_type)


def f_varint(field: int, value: int) -> bytes:
    return tag(field, VARINT) + varint(value) if value else b""


def f_bytes(field: int, value: bytes) -> bytes:
    return tag(field, LEN) + varint(len(value)) + value


def f_str(field: int, value: str) -> bytes:
    return f_bytes(field, value.encode()) if value else b""


def f_packed(field: int, values: Iterable[int]) -> bytes:
    body = b"".join(varint(v) for v in values)
    return f_bytes(field, body) if body else b""


Fields = dict[int, list[int | bytes]]


def decode(buf: bytes) -> Fields:
    """Field number -> values in order (varints as int, everything else as bytes)."""
    fields: Fields = {}
    pos, end = 0, len(buf)
    while pos < end:
        key, pos = _read_varint(buf, pos)
        field, wire_type = key >> 3, key & 7
        value: int | bytes
        if wire_type == VARINT:
            value, pos = _read_varint(buf, pos)
        elif wire_type == LEN:
            size, pos = _read_varint(buf, pos)
            value, pos = buf[pos : pos + size], pos + size
            if pos > end:
                raise ValueError("truncated length-delimited field")
        elif wire_type == FIXED64:
            value, pos = buf[pos : pos + 8], pos + 8
        elif wire_type == FIXED32:
            value, pos = buf[pos : pos + 4], pos + 4
        else:
            raise ValueError(f"unsupported wire type {wire_type}")
        fields.setdefault(field, []).append(value)
    return fields


def _read_varint(buf: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf):
            raise ValueError("truncated varint")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7


def first_int(fields: Fields, field: int, default: int = 0) -> int:
    for value in fields.get(field, ()):
        if isinstance(value, int):
            return value
    return default


def first_bytes(fields: Fields, field: int) -> bytes:
    for value in fields.get(field, ()):
        if isinstance(value, bytes):
            return value
    return b""


def first_str(fields: Fields, field: int) -> str:
    return first_bytes(fields, field).decode()


# -- requests the bench's client sends ------------------------------------------


def infer_request(model: str, name: str, datatype: str, shape: Sequence[int], raw: bytes) -> bytes:
    """ModelInferRequest with one input tensor in raw_input_contents."""
    tensor = f_str(1, name) + f_str(2, datatype) + f_packed(3, shape)
    return f_str(1, model) + f_bytes(5, tensor) + f_bytes(7, raw)


def name_request(name: str, version: str = "") -> bytes:
    """ModelReadyRequest, ModelConfigRequest and ModelStatisticsRequest share this shape."""
    return f_str(1, name) + f_str(2, version)


def parse_bool_response(body: bytes) -> bool:
    """ServerLiveResponse, ServerReadyResponse and ModelReadyResponse: field 1."""
    return bool(first_int(decode(body), 1))


# -- ModelConfig / ModelStatistics (the add-on handlers for MLServer) -----------


@dataclass(frozen=True)
class TensorSpec:
    name: str
    datatype: str
    shape: tuple[int, ...]


def model_config_response(
    name: str, platform: str, inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec]
) -> bytes:
    """ModelConfigResponse{config: ModelConfig} with max_batch_size 0 (no batching)."""
    config = f_str(1, name) + f_str(2, platform)
    for spec in inputs:  # ModelInput: name 1, data_type 2, dims 4
        body = f_str(1, spec.name) + f_varint(2, DATA_TYPE.get(spec.datatype, 0))
        config += f_bytes(5, body + f_packed(4, spec.shape))
    for spec in outputs:  # ModelOutput: name 1, data_type 2, dims 3
        body = f_str(1, spec.name) + f_varint(2, DATA_TYPE.get(spec.datatype, 0))
        config += f_bytes(6, body + f_packed(3, spec.shape))
    return f_bytes(1, config)


@dataclass(frozen=True)
class ModelStats:
    name: str
    version: str
    inference_count: int = 0
    execution_count: int = 0
    success_count: int = 0
    success_ns: int = 0


def _duration(count: int, ns: int) -> bytes:
    return f_varint(1, count) + f_varint(2, ns)


def model_statistics_response(stats: Sequence[ModelStats]) -> bytes:
    out = b""
    for s in stats:
        infer_stats = f_bytes(1, _duration(s.success_count, s.success_ns))
        infer_stats += b"".join(f_bytes(k, b"") for k in (2, 3, 4, 5, 6))
        body = f_str(1, s.name) + f_str(2, s.version)
        body += f_varint(4, s.inference_count) + f_varint(5, s.execution_count)
        body += f_bytes(6, infer_stats)
        out += f_bytes(1, body)
    return out


def parse_model_statistics(body: bytes) -> list[ModelStats]:
    found = []
    for raw in decode(body).get(1, []):
        assert isinstance(raw, bytes)
        f = decode(raw)
        success = decode(first_bytes(decode(first_bytes(f, 6)), 1))
        found.append(
            ModelStats(
                name=first_str(f, 1),
                version=first_str(f, 2),
                inference_count=first_int(f, 4),
                execution_count=first_int(f, 5),
                success_count=first_int(success, 1),
                success_ns=first_int(success, 2),
            )
        )
    return found
