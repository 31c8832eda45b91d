"""Tests of the tensor codec: round trips in both wire forms and every malformed tensor."""

from __future__ import annotations

import re
import struct
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt
import pytest
from google.protobuf.message import Message
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from poolserve.protos import inference_pb2 as pb
from poolserve.service.contract.errors import InvalidInput, ModelError
from poolserve.service.inference import codec

M = TypeVar("M", bound=Message)
FIXED = [datatype for datatype in codec.DATATYPES if datatype != "BYTES"]
TYPED = [datatype for datatype in codec.DATATYPES if datatype != "FP16"]


def _sample(datatype: str) -> npt.NDArray[Any]:
    """A 2x3 array with the extremes of its datatype."""
    if datatype == "BYTES":
        values: list[Any] = [b"", b"a", b"\x00\xff", "é".encode(), b"x" * 300, b"z"]
        return np.array(values, dtype=object).reshape(2, 3)
    dtype = codec.dtype_for(datatype)
    if datatype == "BOOL":
        return np.array([[True, False, True], [False, False, True]])
    if dtype.kind == "f":
        info = np.finfo(dtype)
        return np.array([[info.min, info.max, np.nan], [np.inf, -0.0, info.tiny]], dtype=dtype)
    iinfo = np.iinfo(dtype)
    return np.array([[iinfo.min, iinfo.max, 0], [1, iinfo.max - 1, iinfo.min + 1]], dtype=dtype)


def _wire(message: M) -> M:
    """The message as a peer sees it, after serialization."""
    return type(message).FromString(message.SerializeToString())


def _assert_same(actual: npt.NDArray[Any], expected: npt.NDArray[Any]) -> None:
    assert actual.shape == expected.shape
    if expected.dtype.kind in "OSU":
        assert actual.dtype == np.dtype(object)
        encoded = [x.encode() if isinstance(x, str) else x for x in expected.ravel().tolist()]
        assert actual.ravel().tolist() == encoded
    else:
        assert actual.dtype == expected.dtype
        np.testing.assert_array_equal(actual, expected)


def _request(inputs: dict[str, npt.NDArray[Any]], *, raw: bool) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="m")
    codec.encode_inputs(inputs, request, raw=raw)
    return request


def _respond(
    outputs: dict[str, npt.NDArray[Any]], *, raw: bool, requested: tuple[str, ...] = ()
) -> pb.ModelInferResponse:
    request = pb.ModelInferRequest(model_name="m")
    for name in requested:
        request.outputs.add(name=name)
    if raw:
        request.inputs.add(name="in", datatype="UINT8", shape=[0])
        request.raw_input_contents.append(b"")
    response = pb.ModelInferResponse(model_name="m")
    codec.encode_outputs(request, outputs, response)
    return _wire(response)


# --- datatypes ----------------------------------------------------------------


def test_datatypes_are_the_protocol_ones() -> None:
    expected = (
        "BOOL",
        *("UINT8", "UINT16", "UINT32", "UINT64"),
        *("INT8", "INT16", "INT32", "INT64"),
        *("FP16", "FP32", "FP64"),
        "BYTES",
    )
    assert expected == codec.DATATYPES


@pytest.mark.parametrize("datatype", codec.DATATYPES)
def test_dtype_and_datatype_are_inverse(datatype: str) -> None:
    dtype = codec.dtype_for(datatype)
    assert codec.datatype_for(np.empty(0, dtype=dtype)) == datatype
    if datatype != "BYTES":
        assert codec.datatype_for(np.empty(0, dtype=dtype.newbyteorder(">"))) == datatype


def test_bytes_datatype_for_str_and_fixed_width_bytes() -> None:
    assert codec.dtype_for("BYTES") == np.dtype(object)
    assert codec.datatype_for(np.array(["a"])) == "BYTES"
    assert codec.datatype_for(np.array([b"a"])) == "BYTES"


def test_unknown_datatype() -> None:
    with pytest.raises(InvalidInput, match="BF16"):
        codec.dtype_for("BF16")


@pytest.mark.parametrize("dtype", ["complex128", "datetime64[s]", "V4"])
def test_unsupported_dtype_is_named(dtype: str) -> None:
    array = np.empty(1, dtype=dtype)
    with pytest.raises(InvalidInput, match=re.escape(str(array.dtype))):
        codec.datatype_for(array)


# --- round trips --------------------------------------------------------------


@pytest.mark.parametrize("datatype", codec.DATATYPES)
def test_inputs_round_trip_raw(datatype: str) -> None:
    sample = _sample(datatype)
    request = _wire(_request({"x": sample, "y": sample[:1]}, raw=True))
    assert codec.uses_raw(request)
    assert not request.inputs[0].HasField("contents")
    decoded = codec.decode_inputs(request)
    assert list(decoded) == ["x", "y"]
    _assert_same(decoded["x"], sample)
    _assert_same(decoded["y"], sample[:1])


@pytest.mark.parametrize("datatype", TYPED)
def test_inputs_round_trip_typed(datatype: str) -> None:
    sample = _sample(datatype)
    request = _wire(_request({"x": sample}, raw=False))
    assert not codec.uses_raw(request)
    assert request.inputs[0].datatype == datatype
    assert list(request.inputs[0].shape) == [2, 3]
    _assert_same(codec.decode_inputs(request)["x"], sample)


@pytest.mark.parametrize("raw", [True, False])
@pytest.mark.parametrize("datatype", codec.DATATYPES)
def test_outputs_round_trip(datatype: str, raw: bool) -> None:
    sample = _sample(datatype)
    response = _respond({"out": sample}, raw=raw)
    # Raw whatever form the request used: tritonclient reads raw_output_contents only.
    assert len(response.raw_output_contents) == 1
    assert not response.outputs[0].HasField("contents")
    assert response.outputs[0].datatype == datatype
    _assert_same(codec.decode_outputs(response)["out"], sample)


@pytest.mark.parametrize("datatype", codec.DATATYPES)
def test_outputs_follow_the_spec_layout_for_typed_requests(datatype: str) -> None:
    """Checked against the spec, not against our own decoder: little-endian
    row-major bytes; BYTES elements each behind a 4-byte little-endian length."""
    sample = _sample(datatype)
    [raw] = _respond({"out": sample}, raw=False).raw_output_contents
    if datatype == "BYTES":
        expected = b"".join(struct.pack("<I", len(item)) + item for item in sample.ravel())
    else:
        expected = sample.astype(sample.dtype.newbyteorder("<")).tobytes(order="C")
    assert raw == expected


def test_typed_fp16_input_is_refused_client_side() -> None:
    with pytest.raises(InvalidInput, match=r"'h'.*FP16"):
        _request({"h": np.zeros(2, dtype=np.float16)}, raw=False)


def test_typed_request_gets_every_output_raw() -> None:
    outputs: dict[str, npt.NDArray[Any]] = {
        "a": np.arange(3, dtype=np.int32),
        "h": np.ones(2, dtype=np.float16),
    }
    response = _respond(outputs, raw=False)
    assert len(response.raw_output_contents) == 2
    assert not any(output.HasField("contents") for output in response.outputs)
    decoded = codec.decode_outputs(response)
    _assert_same(decoded["a"], outputs["a"])
    _assert_same(decoded["h"], outputs["h"])


def test_raw_wire_layout_is_little_endian_and_length_prefixed() -> None:
    request = _request({"f": np.array([1.0], dtype=">f4"), "s": np.array(["ab", ""])}, raw=True)
    assert request.raw_input_contents[0] == struct.pack("<f", 1.0)
    assert request.raw_input_contents[1] == b"\x02\x00\x00\x00ab\x00\x00\x00\x00"


def test_big_endian_and_non_contiguous_arrays_encode_by_value() -> None:
    base = np.arange(24, dtype=">i8").reshape(4, 6)
    strided = base[::2, ::-3].T
    assert not strided.flags.c_contiguous
    for raw in (True, False):
        decoded = codec.decode_inputs(_wire(_request({"x": strided}, raw=raw)))["x"]
        np.testing.assert_array_equal(decoded, strided)
        assert decoded.dtype == np.dtype("<i8")


def test_str_elements_are_utf8() -> None:
    for raw in (True, False):
        decoded = codec.decode_outputs(_respond({"s": np.array(["héllo", "✓"])}, raw=raw))
        assert decoded["s"].tolist() == ["héllo".encode(), "✓".encode()]


def test_scalar_and_zero_size_tensors() -> None:
    arrays = {"scalar": np.array(2.5), "empty": np.zeros((3, 0, 2), dtype=np.int16)}
    for raw in (True, False):
        decoded = codec.decode_inputs(_wire(_request(arrays, raw=raw)))
        _assert_same(decoded["scalar"], arrays["scalar"])
        _assert_same(decoded["empty"], arrays["empty"])


def test_raw_decode_is_zero_copy() -> None:
    sample = np.arange(12, dtype=np.float32).reshape(3, 4)
    request = _request({"x": sample}, raw=True)
    decoded = codec.decode_inputs(request)["x"]
    root: Any = decoded
    while isinstance(root, np.ndarray):
        root = root.base
    # The array is a view of the very bytes object that came off the wire.
    assert isinstance(root, bytes)
    assert root == request.raw_input_contents[0]
    assert np.shares_memory(decoded, np.frombuffer(root, dtype=np.uint8))
    assert not decoded.flags.writeable
    _assert_same(decoded, sample)


# --- output selection ---------------------------------------------------------


def _outputs() -> dict[str, npt.NDArray[Any]]:
    return {name: np.full(2, i, dtype=np.int32) for i, name in enumerate("abc")}


@pytest.mark.parametrize("raw", [True, False])
def test_all_outputs_in_model_order_when_none_requested(raw: bool) -> None:
    response = _respond(_outputs(), raw=raw)
    assert [output.name for output in response.outputs] == ["a", "b", "c"]
    assert list(codec.decode_outputs(response)) == ["a", "b", "c"]


@pytest.mark.parametrize("raw", [True, False])
def test_requested_outputs_filter_and_order(raw: bool) -> None:
    response = _respond(_outputs(), raw=raw, requested=("c", "a"))
    assert [output.name for output in response.outputs] == ["c", "a"]
    assert len(response.raw_output_contents) == 2
    decoded = codec.decode_outputs(response)
    assert list(decoded) == ["c", "a"]
    assert decoded["c"].tolist() == [2, 2]
    assert decoded["a"].tolist() == [0, 0]


def test_unknown_requested_output_is_named() -> None:
    with pytest.raises(InvalidInput, match="'nope'"):
        _respond(_outputs(), raw=False, requested=("a", "nope"))


def test_output_requested_twice() -> None:
    with pytest.raises(InvalidInput, match=r"'a'.*more than once"):
        _respond(_outputs(), raw=True, requested=("a", "a"))


@pytest.mark.parametrize("raw", [True, False])
def test_unencodable_outputs_are_named_and_are_the_models_fault(raw: bool) -> None:
    """An output with no wire form is the model's doing: INTERNAL (ModelError), as
    for any other bad return value, not INVALID_ARGUMENT; the same arrays as a
    client's inputs are the client's (InvalidInput)."""
    with pytest.raises(ModelError, match=r"'z'.*complex128.*the model returned it"):
        _respond({"z": np.zeros(1, dtype=np.complex128)}, raw=raw)
    with pytest.raises(ModelError, match=r"'o'.*int"):
        _respond({"o": np.array([b"a", 3], dtype=object)}, raw=raw)
    for inputs in ({"z": np.zeros(1, np.complex128)}, {"o": np.array([b"a", 3], object)}):
        with pytest.raises(InvalidInput, match=r"input '[zo]'") as refused:
            codec.encode_inputs(inputs, pb.ModelInferRequest(), raw=raw)
        assert not isinstance(refused.value, ModelError)


# --- malformed tensors ----------------------------------------------------------


def _tensor(
    name: str = "t", datatype: str = "FP32", shape: tuple[int, ...] = (2,), **contents: Any
) -> pb.ModelInferRequest.InferInputTensor:
    tensor = pb.ModelInferRequest.InferInputTensor(name=name, datatype=datatype, shape=shape)
    if contents:
        tensor.contents.CopyFrom(pb.InferTensorContents(**contents))
    return tensor


def _raw_request(*tensors: tuple[pb.ModelInferRequest.InferInputTensor, bytes]) -> Any:
    return pb.ModelInferRequest(
        inputs=[tensor for tensor, _ in tensors], raw_input_contents=[data for _, data in tensors]
    )


def _bytes_raw(*items: bytes) -> bytes:
    return b"".join(struct.pack("<I", len(item)) + item for item in items)


MALFORMED: dict[str, tuple[pb.ModelInferRequest, str]] = {
    "typed count": (
        pb.ModelInferRequest(inputs=[_tensor(shape=(2, 2), fp32_contents=[1, 2, 3])]),
        "3 values in fp32_contents, shape \\[2, 2\\] needs 4",
    ),
    "typed missing values": (pb.ModelInferRequest(inputs=[_tensor()]), "0 values"),
    "negative dim": (
        _raw_request((_tensor(shape=(-1, 2)), b"\0" * 8)),
        "negative dimension in shape \\[-1, 2\\]",
    ),
    "negative dim typed": (
        pb.ModelInferRequest(inputs=[_tensor(shape=(2, -1), fp32_contents=[1, 2])]),
        "negative dimension",
    ),
    "mixed raw and typed": (
        pb.ModelInferRequest(
            model_name="m",
            inputs=[_tensor(name="u"), _tensor(fp32_contents=[1, 2])],
            raw_input_contents=[b"\0" * 8, b"\0" * 8],
        ),
        "contents field must not be specified when using raw_input_contents for 't' for model 'm'",
    ),
    # Triton's grpc_explicit_int_content_client.py: one raw entry for two typed
    # inputs is refused for the typed contents, in Triton's words, not the count.
    "typed beside fewer raw entries": (
        pb.ModelInferRequest(
            model_name="simple",
            inputs=[_tensor(name="u", fp32_contents=[1, 2]), _tensor(fp32_contents=[1, 2])],
            raw_input_contents=[b"\0" * 8],
        ),
        "contents field must not be specified when using raw_input_contents for 'u' "
        "for model 'simple'",
    ),
    "too few raw entries": (
        pb.ModelInferRequest(inputs=[_tensor(name="u"), _tensor()], raw_input_contents=[b"\0" * 8]),
        "has no raw contents entry: 2 inputs but 1",
    ),
    "too many raw entries": (
        pb.ModelInferRequest(inputs=[_tensor()], raw_input_contents=[b"\0" * 8] * 2),
        "2 raw contents entries but only 1 inputs",
    ),
    "unknown datatype": (
        pb.ModelInferRequest(inputs=[_tensor(datatype="FLOAT32", fp32_contents=[1, 2])]),
        "unknown datatype 'FLOAT32'",
    ),
    "unknown datatype raw": (_raw_request((_tensor(datatype=""), b"")), "unknown datatype ''"),
    "mismatched typed field": (
        pb.ModelInferRequest(inputs=[_tensor(int64_contents=[1, 2])]),
        "FP32 tensor has int64_contents set, expected fp32_contents",
    ),
    "second typed field": (
        pb.ModelInferRequest(inputs=[_tensor(fp32_contents=[1, 2], bytes_contents=[b"a"])]),
        "bytes_contents set",
    ),
    "small ints in int64": (
        pb.ModelInferRequest(inputs=[_tensor(datatype="INT8", int64_contents=[1, 2])]),
        "expected int_contents",
    ),
    "typed FP16": (
        pb.ModelInferRequest(inputs=[_tensor(datatype="FP16", fp32_contents=[1, 2])]),
        "FP16 has no typed contents field",
    ),
    "INT8 out of range": (
        pb.ModelInferRequest(inputs=[_tensor(datatype="INT8", int_contents=[1, 300])]),
        "outside the INT8 range",
    ),
    "UINT16 out of range": (
        pb.ModelInferRequest(inputs=[_tensor(datatype="UINT16", uint_contents=[70000, 0])]),
        "outside the UINT16 range",
    ),
    "raw not a multiple": (_raw_request((_tensor(), b"\0" * 7)), "7 bytes, not a multiple"),
    "raw wrong size": (
        _raw_request((_tensor(), b"\0" * 12)),
        "3 FP32 elements, shape \\[2\\] needs 2",
    ),
    "raw bool not 0 or 1": (
        _raw_request((_tensor(datatype="BOOL"), b"\x01\x02")),
        "BOOL bytes must be 0 or 1",
    ),
    "bytes element past end": (
        _raw_request((_tensor(datatype="BYTES"), _bytes_raw(b"ab") + b"\x09\0\0\0abc")),
        "element 1 of length 9 runs past the end",
    ),
    "bytes prefix past end": (
        _raw_request((_tensor(datatype="BYTES"), _bytes_raw(b"abcdef") + b"\x01\0")),
        "element 1 length prefix runs past the end",
    ),
    "bytes too few for count": (
        _raw_request((_tensor(datatype="BYTES", shape=(3,)), _bytes_raw(b"a", b"b"))),
        "too few for the 3 BYTES elements",
    ),
    "bytes trailing": (
        _raw_request((_tensor(datatype="BYTES", shape=(1,)), _bytes_raw(b"a", b"b"))),
        "5 bytes left after the 1 BYTES elements",
    ),
    "huge shape raw": (
        _raw_request((_tensor(shape=(10**12,)), b"\0" * 4)),
        "1 FP32 elements, shape \\[1000000000000\\] needs 1000000000000",
    ),
    "huge shape typed": (
        pb.ModelInferRequest(inputs=[_tensor(shape=(10**12,), fp32_contents=[1])]),
        "needs 1000000000000",
    ),
    "huge bytes shape": (
        _raw_request((_tensor(datatype="BYTES", shape=(10**12,)), _bytes_raw(b"a"))),
        "too few for the 1000000000000 BYTES elements",
    ),
    "overflowing shape": (
        _raw_request((_tensor(shape=(2**62, 2**62)), b"\0" * 4)),
        "is too large",
    ),
    "overflowing shape with a zero dim": (
        _raw_request((_tensor(shape=(0, 2**62, 2**62)), b"")),
        "is too large",
    ),
    "overflowing shape typed": (
        pb.ModelInferRequest(inputs=[_tensor(shape=(2**40, 2**40), fp32_contents=[1])]),
        "is too large",
    ),
    "too many dimensions": (
        _raw_request((_tensor(shape=(1,) * 80), b"\0" * 4)),
        "unusable shape",
    ),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_input_is_invalid_and_named(case: str) -> None:
    request, message = MALFORMED[case]
    with pytest.raises(InvalidInput, match=message) as caught:
        codec.decode_inputs(_wire(request))
    assert "'t'" in caught.value.message or "'u'" in caught.value.message
    # Also true of the same tensors in a response, read by a client.
    response = pb.ModelInferResponse(
        model_name=request.model_name, raw_output_contents=request.raw_input_contents
    )
    for tensor in request.inputs:
        response.outputs.add().ParseFromString(tensor.SerializeToString())
    with pytest.raises(InvalidInput, match=message.replace("input", "output")):
        codec.decode_outputs(response)


def test_duplicate_input_names() -> None:
    request = _request({"t": np.zeros(2, dtype=np.float32)}, raw=True)
    request.inputs.append(request.inputs[0])
    request.raw_input_contents.append(request.raw_input_contents[0])
    with pytest.raises(InvalidInput, match="input 't' appears more than once"):
        codec.decode_inputs(request)


def test_empty_typed_contents_message_is_not_mixing() -> None:
    request = _request({"t": np.zeros(2, dtype=np.float32)}, raw=True)
    request.inputs[0].contents.SetInParent()
    assert request.inputs[0].HasField("contents")
    assert codec.decode_inputs(request)["t"].tolist() == [0.0, 0.0]


# --- parameters ---------------------------------------------------------------


def test_parameters_to_dict() -> None:
    request = pb.ModelInferRequest()
    request.parameters["b"].bool_param = True
    request.parameters["i"].int64_param = -(2**63)
    request.parameters["s"].string_param = "text"
    request.parameters["d"].double_param = 0.25
    request.parameters["u"].uint64_param = 2**64 - 1
    request.parameters["unset"].SetInParent()
    assert codec.parameters_to_dict(_wire(request).parameters) == {
        "b": True,
        "i": -(2**63),
        "s": "text",
        "d": 0.25,
        "u": 2**64 - 1,
        "unset": None,
    }
    assert codec.parameters_to_dict(pb.ModelInferRequest().parameters) == {}


# --- properties ---------------------------------------------------------------

SHAPES = hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=4)


@st.composite
def tensors(draw: st.DrawFn, datatypes: list[str]) -> npt.NDArray[Any]:
    datatype = draw(st.sampled_from(datatypes))
    shape = draw(SHAPES)
    if datatype == "BYTES":
        return draw(hnp.arrays(object, shape, elements=st.binary(max_size=12)))
    return draw(hnp.arrays(codec.dtype_for(datatype), shape))


def _round_trips(arrays: list[npt.NDArray[Any]], raw: bool) -> None:
    named = {f"t{i}": array for i, array in enumerate(arrays)}
    decoded = codec.decode_inputs(_wire(_request(named, raw=raw)))
    assert list(decoded) == list(named)
    for name, array in named.items():
        _assert_same(decoded[name], array)
    response = _respond(named, raw=raw)
    for name, array in codec.decode_outputs(response).items():
        _assert_same(array, named[name])


@settings(max_examples=100, deadline=None)
@given(st.lists(tensors(list(codec.DATATYPES)), min_size=1, max_size=3))
def test_property_raw_round_trip(arrays: list[npt.NDArray[Any]]) -> None:
    _round_trips(arrays, raw=True)


@settings(max_examples=100, deadline=None)
@given(st.lists(tensors(TYPED), min_size=1, max_size=3))
def test_property_typed_round_trip(arrays: list[npt.NDArray[Any]]) -> None:
    _round_trips(arrays, raw=False)


@settings(max_examples=100, deadline=None)
@given(tensors(FIXED), st.binary(max_size=3))
def test_property_raw_size_mismatch_is_invalid(array: npt.NDArray[Any], extra: bytes) -> None:
    request = _request({"t": array}, raw=True)
    request.raw_input_contents[0] += extra
    if extra:
        with pytest.raises(InvalidInput, match="input 't'"):
            codec.decode_inputs(request)
    else:
        _assert_same(codec.decode_inputs(request)["t"], array)


# --- shared memory and long names ---------------------------------------------


def _in_region(tensor: pb.ModelInferRequest.InferInputTensor, region: str = "r0") -> Any:
    tensor.parameters["shared_memory_region"].string_param = region
    tensor.parameters["shared_memory_byte_size"].int64_param = 8
    return tensor


@pytest.mark.parametrize("order", ["region first", "region last", "region between"])
def test_an_input_in_shared_memory_takes_no_raw_entry_and_is_named(order: str) -> None:
    """Raw entries belong to the inputs that carry bytes, in order: the input that
    names a region is the one refused, never a neighbour blamed for its entry."""
    shm = _in_region(_tensor(name="in_shm", shape=(3,)))
    a, b = _tensor(name="a"), _tensor(name="b", datatype="INT32")
    inputs = {
        "region first": [shm, a, b],
        "region last": [a, b, shm],
        "region between": [a, shm, b],
    }[order]
    request = pb.ModelInferRequest(
        inputs=inputs, raw_input_contents=[struct.pack("<2f", 1, 2), struct.pack("<2i", 3, 4)]
    )
    with pytest.raises(InvalidInput) as caught:
        codec.decode_inputs(_wire(request))
    message = caught.value.message
    assert message.startswith("input 'in_shm' names shared-memory region 'r0'"), message
    assert "no shared memory is read here" in message
    assert "'a'" not in message and "'b'" not in message


def test_an_input_in_shared_memory_is_named_in_a_typed_request() -> None:
    typed = _tensor(name="a", fp32_contents=[1, 2])
    request = pb.ModelInferRequest(inputs=[typed, _in_region(_tensor(name="in_shm"))])
    with pytest.raises(InvalidInput, match=r"^input 'in_shm' names shared-memory region"):
        codec.decode_inputs(_wire(request))


def test_raw_entries_are_counted_without_the_inputs_in_shared_memory() -> None:
    request = pb.ModelInferRequest(
        inputs=[_in_region(_tensor(name="in_shm")), _tensor(name="a"), _tensor(name="b")],
        raw_input_contents=[b"\0" * 8],
    )
    with pytest.raises(InvalidInput, match=r"^input 'b' has no raw contents entry: 2 inputs"):
        codec.decode_inputs(_wire(request))


def test_long_client_names_are_cut_in_messages() -> None:
    name = "n" * (1 << 20)
    request = pb.ModelInferRequest(inputs=[_tensor(name=name, datatype="X" * (1 << 20))])
    with pytest.raises(InvalidInput) as caught:
        codec.decode_inputs(_wire(request))
    message = caught.value.message
    assert len(message) < 1000
    assert f"input '{'n' * 200}...[{1 << 20} characters]'" in message


def test_inputs_split_off_the_wire_decode_as_views_and_bytes_elements_stay_bytes() -> None:
    """The worker's path (issue 20): raw entries cut from the request's bytes as
    views; fixed-size tensors are views of those bytes, BYTES elements are bytes
    (a model echoing them must be able to answer), outputs go out as views."""
    from poolserve.service.inference.rawwire import raw_output_parts, split_raw_inputs

    encode_inputs, decode_inputs = codec.encode_inputs, codec.decode_inputs
    encode_outputs, decode_outputs = codec.encode_outputs, codec.decode_outputs
    request = pb.ModelInferRequest(model_name="m", id="x")
    floats = np.arange(6, dtype=np.float32).reshape(2, 3)
    encode_inputs({"F": floats, "S": np.array([b"ab", b"c"], dtype=object)}, request, raw=True)
    wire = request.SerializeToString()
    head, raw = split_raw_inputs(memoryview(wire))
    parsed = pb.ModelInferRequest.FromString(head)
    assert not parsed.raw_input_contents and parsed.id == "x" and len(raw) == 2
    arrays = decode_inputs(parsed, raw=raw)
    assert np.array_equal(arrays["F"], floats) and not arrays["F"].flags.writeable
    assert arrays["F"].base is not None  # a view, not a copy
    assert [type(x) for x in arrays["S"].ravel()] == [bytes, bytes]
    response = pb.ModelInferResponse(model_name="m")
    views: list[Any] = []
    encode_outputs(parsed, arrays, response, raw=views)
    assert isinstance(views[0], memoryview) and views[0].obj is not None
    body = response.SerializeToString() + b"".join(bytes(p) for p in raw_output_parts(views))
    back = decode_outputs(pb.ModelInferResponse.FromString(body))
    assert np.array_equal(back["F"], floats)
    assert list(back["S"].ravel()) == [b"ab", b"c"]
