"""Peeking the model name from wire bytes agrees with protobuf's own parser."""

from __future__ import annotations

import contextlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from poolserve.protos import inference_pb2 as pb
from poolserve.service.contract.errors import InvalidInput
from poolserve.service.contract.wire import encode_len_field, peek_model, peek_routing


@settings(max_examples=200, deadline=None)
@given(
    name=st.text(max_size=40),
    version=st.text(max_size=10),
    request_id=st.text(max_size=10),
    raw=st.lists(st.binary(max_size=64), max_size=3),
    shape=st.lists(st.integers(min_value=0, max_value=2**40), max_size=4),
    pvalue=st.floats(allow_nan=False),
)
def test_peek_matches_protobuf(
    name: str, version: str, request_id: str, raw: list[bytes], shape: list[int], pvalue: float
) -> None:
    request = pb.ModelInferRequest(model_name=name, model_version=version, id=request_id)
    request.inputs.add(name="x", datatype="FP32", shape=shape)
    request.raw_input_contents.extend(raw)
    request.parameters["p"].double_param = pvalue
    assert peek_model(request.SerializeToString()) == (name, version)


@settings(max_examples=100, deadline=None)
@given(
    name=st.text(min_size=100, max_size=300),
    raw=st.binary(min_size=128, max_size=20000),
    unknown=st.integers(min_value=16, max_value=2**20),
)
def test_peek_reads_long_fields_and_large_field_numbers(
    name: str, raw: bytes, unknown: int
) -> None:
    """Lengths of 128 bytes and more, and tags of two bytes and more (fields from 16):
    the multi-byte varints next to the one-byte fast path."""
    request = pb.ModelInferRequest(model_name=name, model_version="7")
    request.raw_input_contents.append(raw)
    data = request.SerializeToString() + encode_len_field(unknown, b"x" * 130)
    assert peek_model(data) == (name, "7")
    assert peek_routing(data).name == name
    with pytest.raises(InvalidInput):
        peek_model(data[:-1])  # the unknown field's payload runs past the end


def test_fields_in_any_order_last_wins() -> None:
    data = encode_len_field(3, b"id") + encode_len_field(1, b"a") + encode_len_field(1, b"b")
    assert peek_model(data) == ("b", "")


@pytest.mark.parametrize(
    "data",
    [b"\x0a\x05ab", b"\x0a", b"\xff" * 11, b"\x0b", b"\x00\x01", b"\x0a\x02\xff\xfe"],
)
def test_malformed_bytes_are_invalid_input(data: bytes) -> None:
    with pytest.raises(InvalidInput):
        peek_model(data)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_never_raise_anything_else(data: bytes) -> None:
    with contextlib.suppress(InvalidInput):
        peek_model(data)


@settings(max_examples=200, deadline=None)
@given(
    priority=st.one_of(st.none(), st.integers(min_value=-(2**63), max_value=2**63 - 1)),
    idempotent=st.one_of(st.none(), st.booleans()),
    noise=st.dictionaries(
        st.text(max_size=10).filter(lambda k: k not in ("priority", "idempotent")),
        st.integers(min_value=0, max_value=9),
        max_size=3,
    ),
)
def test_scheduling_parameters(
    priority: int | None, idempotent: bool | None, noise: dict[str, int]
) -> None:
    request = pb.ModelInferRequest(model_name="m")
    for key, value in noise.items():
        request.parameters[key].int64_param = value
    if priority is not None:
        request.parameters["priority"].int64_param = priority
    if idempotent is not None:
        request.parameters["idempotent"].bool_param = idempotent
    routing = peek_routing(request.SerializeToString())
    assert routing.name == "m"
    assert routing.priority == priority
    assert routing.idempotent is (True if idempotent is None else idempotent)


_FIELD_NUMBERS = st.sampled_from([1, 2, 3, 5, 7, 4088, 4089, 4092, 4095, 4096, 9000])


@given(
    st.lists(st.tuples(_FIELD_NUMBERS, st.sampled_from([0, 2]), st.binary(max_size=6)), max_size=6)
)
def test_the_wrapper_field_peek_routing_finds_is_the_one_the_gRPC_door_refuses(
    fields: list[tuple[int, int, bytes]],
) -> None:
    """The router's one walk of a ModelInfer (peek_routing) finds the first of the
    REST wrapper's fields (4089-4095) as the separate walk that refuses them does."""
    from poolserve.service.contract.rest import RESERVED, reserved_field
    from poolserve.service.contract.wire import WRAPPER_FIELDS, encode_varint

    assert RESERVED == WRAPPER_FIELDS
    data = b""
    for number, wire_type, value in fields:
        data += encode_varint(number << 3 | wire_type)
        if wire_type == 0:
            data += encode_varint(len(value))
        else:
            data += encode_varint(len(value)) + value
    if any(number in (1, 2) and wire_type == 2 for number, wire_type, _ in fields):
        with contextlib.suppress(InvalidInput):  # a name that is not UTF-8
            routing = peek_routing(data, with_parameters=False)
            assert routing.wrapper_field == (reserved_field(data) or 0)
        return
    assert peek_routing(data, with_parameters=False).wrapper_field == (reserved_field(data) or 0)
