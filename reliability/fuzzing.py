"""Hostile ModelInfer bytes, and the status each one must get (an in-process oracle).

The generators build well-formed requests for the ``echo`` model, mutate them
(bit flips, truncation, splices, inserted garbage, rewritten varints, wrong
wire types) and craft the classic attacks (huge declared shapes with no data,
negative and overflowing dims, raw sizes that disagree with the shape, BYTES
lengths past the end, deeply nested groups, invalid UTF-8 names, oversized
messages). :class:`Oracle` says what the server must answer by running the
very functions the router, the pool and the worker run, in this process, on
the same bytes: the server's status must be the oracle's, and an OK reply
must be byte for byte the oracle's reply.

The fuzzed ``echo`` declares no inputs (:func:`undeclare`): a model that
declares none takes any tensor, so every datatype and shape reaches the
decoder and comes back. ``Oracle(limit, declared=True)`` is the example echo
as shipped (INPUT0 FP32 [-1,-1]), whose declared inputs are enforced.
"""

from __future__ import annotations

import dataclasses
import json
import random
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from poolserve.protos import inference_pb2 as pb
from poolserve.service.contract.errors import ServingError
from poolserve.service.contract.repository import parse_model_settings
from poolserve.service.contract.rest import reserved_field
from poolserve.service.contract.schedule import schedule
from poolserve.service.contract.wire import peek_model, peek_routing
from poolserve.service.grpcserver.status import grpc_status
from poolserve.service.inference.infer import infer
from poolserve.service.inference.model import Model, instantiate

from harness import EXAMPLES

DATATYPES = (
    "BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64",
    "FP16", "FP32", "FP64", "BYTES",
)  # fmt: skip
TYPED_FIELD = {
    "BOOL": "bool_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}
ITEMSIZE = {
    "BOOL": 1, "UINT8": 1, "UINT16": 2, "UINT32": 4, "UINT64": 8, "INT8": 1, "INT16": 2,
    "INT32": 4, "INT64": 8, "FP16": 2, "FP32": 4, "FP64": 8,
}  # fmt: skip


def varint(value: int) -> bytes:
    value &= (1 << 64) - 1
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def field(number: int, wire: int, payload: bytes = b"", value: int = 0) -> bytes:
    key = varint((number << 3) | wire)
    if wire == 0:
        return key + varint(value)
    if wire == 1:
        return key + struct.pack("<Q", value & ((1 << 64) - 1))
    if wire == 5:
        return key + struct.pack("<I", value & 0xFFFFFFFF)
    if wire == 2:
        return key + varint(len(payload)) + payload
    return key  # groups: start (3) and end (4) carry nothing


# ---------------------------------------------------------------------------
# well-formed requests


def _shape(rng: random.Random) -> list[int]:
    return [rng.choice((0, 1, 1, 2, 3, 4)) for _ in range(rng.randint(0, 3))]


def _values(rng: random.Random, datatype: str, count: int) -> list[object]:
    if datatype == "BOOL":
        return [rng.random() < 0.5 for _ in range(count)]
    if datatype == "BYTES":
        return [rng.randbytes(rng.randint(0, 6)) for _ in range(count)]
    if datatype.startswith("FP"):
        return [rng.uniform(-1e3, 1e3) for _ in range(count)]
    bits = ITEMSIZE[datatype] * 8
    if datatype.startswith("U"):
        return [rng.randrange(0, 1 << bits) for _ in range(count)]
    return [rng.randrange(-(1 << (bits - 1)), 1 << (bits - 1)) for _ in range(count)]


def _raw(rng: random.Random, datatype: str, values: list[object]) -> bytes:
    if datatype == "BYTES":
        return b"".join(struct.pack("<I", len(v)) + v for v in values)  # type: ignore[arg-type]
    if datatype == "FP16":
        return rng.randbytes(2 * len(values))
    dtype = {"BOOL": "?", "FP32": "<f4", "FP64": "<f8"}.get(datatype)
    if dtype is None:
        dtype = ("<u" if datatype.startswith("U") else "<i") + str(ITEMSIZE[datatype])
    return np.asarray(values, dtype=dtype).tobytes()


def valid_request(rng: random.Random, model: str = "echo") -> pb.ModelInferRequest:
    """A request the echo model answers OK (raw or typed, any datatype)."""
    request = pb.ModelInferRequest(model_name=model)
    if rng.random() < 0.3:
        request.id = rng.choice(("", "req-1", "ü", "x" * 20))
    if rng.random() < 0.2:
        request.model_version = "1"
    raw = rng.random() < 0.6
    for k in range(rng.randint(0, 3)):
        datatype = rng.choice(DATATYPES if raw else tuple(TYPED_FIELD))
        shape = _shape(rng)
        count = int(np.prod(shape)) if shape else 1
        values = _values(rng, datatype, count)
        tensor = request.inputs.add(name=f"INPUT{k}", datatype=datatype, shape=shape)
        if raw:
            request.raw_input_contents.append(_raw(rng, datatype, values))
        else:
            getattr(tensor.contents, TYPED_FIELD[datatype]).extend(values)
    if rng.random() < 0.2:
        request.parameters["priority"].int64_param = rng.randint(-5, 5)
    if rng.random() < 0.2:
        request.parameters["note"].string_param = "fuzz"
    if request.inputs and rng.random() < 0.2:
        request.outputs.add(name="OUTPUT0")
    return request


# ---------------------------------------------------------------------------
# mutations


def _flip(data: bytearray, rng: random.Random) -> None:
    if data:
        data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)


def _set_byte(data: bytearray, rng: random.Random) -> None:
    if data:
        data[rng.randrange(len(data))] = rng.choice((0x00, 0x7F, 0x80, 0xFF, rng.randrange(256)))


def _truncate(data: bytearray, rng: random.Random) -> None:
    if data:
        del data[rng.randrange(len(data)) :]


def _delete(data: bytearray, rng: random.Random) -> None:
    if data:
        start = rng.randrange(len(data))
        del data[start : start + rng.randint(1, 8)]


def _insert(data: bytearray, rng: random.Random) -> None:
    at = rng.randint(0, len(data))
    data[at:at] = rng.randbytes(rng.randint(1, 8))


def _duplicate(data: bytearray, rng: random.Random) -> None:
    if data:
        start = rng.randrange(len(data))
        chunk = data[start : start + rng.randint(1, 32)]
        at = rng.randint(0, len(data))
        data[at:at] = chunk


def _append_field(data: bytearray, rng: random.Random) -> None:
    number = rng.choice((1, 2, 3, 4, 5, 6, 7, 8, 99, 536870911))
    wire = rng.choice((0, 1, 2, 3, 4, 5, 6, 7))
    data += field(number, wire, rng.randbytes(rng.randint(0, 6)), rng.getrandbits(64))


def _huge_length(data: bytearray, rng: random.Random) -> None:
    number = rng.choice((1, 5, 7))
    at = rng.randint(0, len(data))
    data[at:at] = varint((number << 3) | 2) + varint(rng.choice((1 << 31, 1 << 62, 2**64 - 1)))


MUTATIONS: tuple[Callable[[bytearray, random.Random], None], ...] = (
    _flip, _set_byte, _truncate, _delete, _insert, _duplicate, _append_field, _huge_length,
)  # fmt: skip


def mutate(data: bytes, rng: random.Random) -> bytes:
    out = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        rng.choice(MUTATIONS)(out, rng)
    return bytes(out)


# ---------------------------------------------------------------------------
# crafted attacks


def _tensor(
    name: str = "INPUT0", datatype: str = "FP32", shape: list[int] | None = None
) -> pb.ModelInferRequest.InferInputTensor:
    return pb.ModelInferRequest.InferInputTensor(name=name, datatype=datatype, shape=shape or [])


def _request(*tensors: pb.ModelInferRequest.InferInputTensor, raw: list[bytes] | None = None,
             name: str = "echo") -> bytes:  # fmt: skip
    request = pb.ModelInferRequest(model_name=name, inputs=list(tensors))
    request.raw_input_contents.extend(raw or [])
    return request.SerializeToString()


def crafted() -> list[tuple[str, bytes]]:
    """Named hostile inputs, each aimed at one check."""

    def nested(depth: int) -> bytes:
        return field(99, 3) * depth + field(99, 4) * depth

    cases = [
        ("empty body (model '')", b""),
        ("shape [1e12], no data", _request(_tensor(shape=[10**12]), raw=[b""])),
        ("shape [1e12], typed, no values", _request(_tensor(shape=[10**12]))),
        ("BYTES shape [1e12], 4 bytes", _request(_tensor(datatype="BYTES", shape=[10**12]),
                                                 raw=[b"\0\0\0\0"])),
        ("shape [2**62, 2**62] overflows", _request(_tensor(shape=[2**62, 2**62]), raw=[b""])),
        ("shape [2**63-1]", _request(_tensor(shape=[2**63 - 1]), raw=[b"\0" * 4])),
        ("negative dim [-1, 4]", _request(_tensor(shape=[-1, 4]), raw=[b"\0" * 16])),
        ("negative dim [-2**63]", _request(_tensor(shape=[-(2**63)]), raw=[b""])),
        ("zero dim with huge others", _request(_tensor(shape=[0, 2**62, 2**62]), raw=[b""])),
        ("70 dimensions of 1", _request(_tensor(shape=[1] * 70), raw=[b"\0" * 4])),
        ("raw 15 bytes for FP32 [1, 4]", _request(_tensor(shape=[1, 4]), raw=[b"\0" * 15])),
        ("raw 20 bytes for FP32 [1, 4]", _request(_tensor(shape=[1, 4]), raw=[b"\0" * 20])),
        ("two tensors, one raw entry", _request(_tensor(), _tensor("INPUT1"), raw=[b"\0" * 4])),
        ("one tensor, two raw entries", _request(_tensor(), raw=[b"\0" * 4, b"\0" * 4])),
        ("BYTES length past the end", _request(_tensor(datatype="BYTES", shape=[1]),
                                               raw=[struct.pack("<I", 1000) + b"abc"])),
        ("BYTES length 2**32-1", _request(_tensor(datatype="BYTES", shape=[2]),
                                          raw=[struct.pack("<I", 2**32 - 1) + b"abcd"])),
        ("BYTES prefix cut", _request(_tensor(datatype="BYTES", shape=[2]),
                                      raw=[struct.pack("<I", 1) + b"a" + b"\0\0"])),
        ("BYTES bytes left over", _request(_tensor(datatype="BYTES", shape=[1]),
                                           raw=[struct.pack("<I", 1) + b"ab"])),
        ("BOOL raw byte 2", _request(_tensor(datatype="BOOL", shape=[1]), raw=[b"\x02"])),
        ("unknown datatype", _request(_tensor(datatype="FP128", shape=[1]), raw=[b"\0" * 16])),
        ("FP16 typed", _request(_tensor(datatype="FP16", shape=[1]))),
        ("duplicate input names", _request(_tensor(shape=[1]), _tensor(shape=[1]),
                                           raw=[b"\0" * 4, b"\0" * 4])),
        ("input named 'x' (echo refuses)", _request(_tensor("x", shape=[1]), raw=[b"\0" * 4])),
        ("invalid UTF-8 model name", field(1, 2, b"\xff\xfe\xfd")),
        ("invalid UTF-8 version", field(1, 2, b"echo") + field(2, 2, b"\xc3\x28")),
        ("invalid UTF-8 input name", field(1, 2, b"echo") + field(5, 2, field(1, 2, b"\xff"))),
        ("unknown model", field(1, 2, b"no-such-model")),
        ("model name with a NUL", field(1, 2, b"echo\x00")),
        ("path trick ../echo", field(1, 2, b"../echo")),
        ("path trick /etc/passwd", field(1, 2, b"/etc/passwd")),
        ("unknown version", field(1, 2, b"echo") + field(2, 2, b"7")),
        ("model_name as a varint", field(1, 0, value=5)),
        ("model_name as fixed64", field(1, 1, value=5)),
        ("inputs as a varint", field(1, 2, b"echo") + field(5, 0, value=1)),
        ("raw contents as fixed32", field(1, 2, b"echo") + field(7, 5, value=1)),
        ("field number 0", b"\x02\x00"),
        ("wire type 6", field(1, 2, b"echo") + varint((9 << 3) | 6)),
        ("wire type 7", field(1, 2, b"echo") + varint((9 << 3) | 7)),
        ("varint of 11 bytes", field(1, 2, b"echo") + varint(9 << 3) + b"\xff" * 10 + b"\x01"),
        ("length 2**64-1", field(1, 2, b"echo") + varint((7 << 3) | 2) + b"\xff" * 9 + b"\x01"),
        ("truncated length", field(1, 2, b"echo") + varint((7 << 3) | 2) + b"\x80"),
        ("unknown field 99 (allowed)", field(1, 2, b"echo") + field(99, 2, b"junk")),
        ("a REST wrapper forged (field 4095)",
         field(1, 2, b"echo") + field(4095, 2, b'{"inputs": []}')),
        ("reserved field 4089 after a request", _typed_mismatch() + field(4089, 0, value=1)),
        ("nested groups, depth 5", field(1, 2, b"echo") + nested(5)),
        ("nested groups, depth 200", field(1, 2, b"echo") + nested(200)),
        ("unbalanced group end", field(1, 2, b"echo") + field(99, 4)),
        ("parameters map garbage", field(1, 2, b"echo") + field(4, 2, b"\xff\xff\xff")),
        ("priority param truncated", field(1, 2, b"echo")
         + field(4, 2, field(1, 2, b"priority") + field(2, 2, b"\x10"))),
        ("typed count mismatch", _typed_mismatch()),
        ("typed UINT8 out of range", _typed_out_of_range()),
        ("raw and typed mixed", _mixed()),
        ("requested output that is not produced", _missing_output()),
    ]  # fmt: skip
    return cases


def _typed_mismatch() -> bytes:
    request = pb.ModelInferRequest(model_name="echo")
    tensor = request.inputs.add(name="INPUT0", datatype="INT32", shape=[3])
    tensor.contents.int_contents.extend([1, 2])
    return request.SerializeToString()


def _typed_out_of_range() -> bytes:
    request = pb.ModelInferRequest(model_name="echo")
    tensor = request.inputs.add(name="INPUT0", datatype="UINT8", shape=[1])
    tensor.contents.uint_contents.append(300)
    return request.SerializeToString()


def _mixed() -> bytes:
    request = pb.ModelInferRequest(model_name="echo")
    tensor = request.inputs.add(name="INPUT0", datatype="INT32", shape=[1])
    tensor.contents.int_contents.append(1)
    request.raw_input_contents.append(b"\0" * 4)
    return request.SerializeToString()


def _missing_output() -> bytes:
    request = pb.ModelInferRequest(model_name="echo")
    request.inputs.add(name="INPUT0", datatype="INT32", shape=[1])
    request.raw_input_contents.append(b"\0" * 4)
    request.outputs.add(name="OUTPUT9")
    return request.SerializeToString()


def random_inputs(seed: int) -> Iterator[tuple[str, bytes]]:
    """An endless, reproducible stream of hostile inputs: mostly mutants of valid
    requests, some pure noise, some valid ones (which must work)."""
    rng = random.Random(seed)
    while True:
        roll = rng.random()
        if roll < 0.1:
            yield "valid", valid_request(rng).SerializeToString()
        elif roll < 0.2:
            yield "noise", rng.randbytes(rng.randint(0, 300))
        else:
            yield "mutant", mutate(valid_request(rng).SerializeToString(), rng)


# ---------------------------------------------------------------------------
# the oracle


@dataclass(frozen=True)
class Expected:
    code: str  # a grpc.StatusCode name
    reply: bytes = b""  # for OK: the exact response bytes


def undeclare(repo: Path, name: str = "echo") -> None:
    """Drops the declared inputs and outputs of ``name`` in ``repo``: it takes any tensor."""
    path = repo / name / "model-settings.json"
    settings = json.loads(path.read_text())
    settings.pop("inputs", None)
    settings.pop("outputs", None)
    path.write_text(json.dumps(settings))


def declared_inputs(name: str = "echo") -> dict[str, tuple[str, tuple[int, ...]]]:
    """An example model's declared inputs as the spec oracle reads them."""
    settings = json.loads((EXAMPLES / name / "model-settings.json").read_text())
    return {i["name"]: (i["datatype"], tuple(i["shape"])) for i in settings["inputs"]}


class Oracle:
    """What a tree serving the example ``echo`` (and ``sleep``) answers to bytes."""

    def __init__(self, max_message_size: int, *, declared: bool = False) -> None:
        self.limit = max_message_size
        self.models: dict[str, Model] = {}
        settings = parse_model_settings(EXAMPLES / "echo" / "model-settings.json")
        if not declared:  # as the fuzzed tree serves it (undeclare)
            settings = dataclasses.replace(settings, inputs=(), outputs=())
        model = instantiate(settings)
        model.load()
        self.models["echo"] = model
        self.served = {"echo", "sleep"}

    def expect(self, body: bytes) -> Expected:
        if len(body) > self.limit:
            return Expected("RESOURCE_EXHAUSTED")
        try:
            name, version = peek_model(body)
            if reserved_field(body) is not None:  # the REST door's own fields
                return Expected("INVALID_ARGUMENT")
            if name not in self.served:
                return Expected("NOT_FOUND")
            routing = peek_routing(body)
            if version and version != "1":  # Triton: a version that is no number is invalid
                number = version.isascii() and version.isdigit()
                return Expected("NOT_FOUND" if number else "INVALID_ARGUMENT")
            model = self.models.get(name)
            if model is None:
                return Expected("?")  # not modelled: callers send echo only
            levels = model.settings.priority
            schedule(name, levels, routing.priority, routing.timeout_us, 60.0, 0.0)
            reply, _ = infer(model, body)
        except ServingError as exc:
            return Expected(grpc_status(exc)[0].name)
        if len(reply) > self.limit:
            return Expected("RESOURCE_EXHAUSTED")
        return Expected("OK", reply)
