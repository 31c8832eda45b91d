"""The REST codec (service/inference/rest.py) without a server: every datatype
as JSON (flat and nested) and as Triton's binary data, both ways, and the
errors a malformed body gets."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from poolserve.protos import inference_pb2 as pb
from poolserve.service.contract.errors import InvalidInput, MessageTooLarge
from poolserve.service.contract.rest import (
    DEFLATE,
    GZIP,
    IDENTITY,
    MAX_PEEK,
    MAX_PEEK_COMPRESSED,
    REPLY_HEAD,
    RestHead,
    envelope_head,
    unwrap,
    wrap_head,
)
from poolserve.service.inference.codec import decode_inputs
from poolserve.service.inference.rest import decode_request, encode_response

DATA: list[tuple[str, list[Any], str]] = [
    ("BOOL", [True, False], "?"),
    ("UINT8", [0, 255], "<u1"),
    ("UINT16", [0, 65535], "<u2"),
    ("UINT32", [0, 2**32 - 1], "<u4"),
    ("UINT64", [0, 2**64 - 1], "<u8"),
    ("INT8", [-128, 127], "<i1"),
    ("INT16", [-32768, 32767], "<i2"),
    ("INT32", [-(2**31), 2**31 - 1], "<i4"),
    ("INT64", [-(2**63), 2**63 - 1], "<i8"),
    ("FP16", [0.5, -2.0], "<f2"),
    ("FP32", [1.5, -0.25], "<f4"),
    ("FP64", [1e300, -1e-300], "<f8"),
]


def _decode(
    doc: dict[str, Any], binary: bytes = b""
) -> tuple[pb.ModelInferRequest, list[Any], Any]:
    text = json.dumps(doc).encode()
    header = len(text) if binary else None
    return decode_request(memoryview(text + binary), header)


@pytest.mark.parametrize(("datatype", "values", "dtype"), DATA)
def test_json_data_every_datatype(datatype: str, values: list[Any], dtype: str) -> None:
    doc = {"inputs": [{"name": "x", "shape": [1, 2], "datatype": datatype, "data": values}]}
    request, raw, _ = _decode(doc)
    arr = decode_inputs(request, raw=raw)["x"]
    assert arr.dtype == np.dtype(dtype) and arr.shape == (1, 2)
    assert arr.tolist() == [values]


def test_nested_data_and_bytes_as_strings() -> None:
    doc = {
        "inputs": [
            {"name": "a", "shape": [2, 2], "datatype": "INT32", "data": [[1, 2], [3, 4]]},
            {"name": "s", "shape": [2], "datatype": "BYTES", "data": ["héllo", ""]},
        ]
    }
    request, raw, _ = _decode(doc)
    inputs = decode_inputs(request, raw=raw)
    assert inputs["a"].tolist() == [[1, 2], [3, 4]]
    assert inputs["s"].tolist() == ["héllo".encode(), b""]


def test_binary_inputs_are_views_of_the_body() -> None:
    x = np.arange(4, dtype=np.float32)
    words = b"".join(struct.pack("<I", len(w)) + w for w in (b"ab", b"c"))
    doc = {
        "inputs": [
            {"name": "x", "shape": [4], "datatype": "FP32", "parameters": {"binary_data_size": 16}},
            {
                "name": "w",
                "shape": [2],
                "datatype": "BYTES",
                "parameters": {"binary_data_size": len(words)},
            },
        ],
        "parameters": {"binary_data_output": True, "priority": 1, "note": "n"},
    }
    request, raw, binary = _decode(doc, x.tobytes() + words)
    assert isinstance(raw[0], memoryview)
    inputs = decode_inputs(request, raw=raw)
    assert inputs["x"].tolist() == x.tolist() and inputs["w"].tolist() == [b"ab", b"c"]
    assert binary("any") is True
    assert request.parameters["priority"].int64_param == 1
    assert request.parameters["note"].string_param == "n"
    assert "binary_data_output" not in request.parameters


def _response(
    *outputs: tuple[str, str, list[int], bytes],
) -> tuple[pb.ModelInferResponse, list[Any]]:
    response = pb.ModelInferResponse(model_name="m", model_version="1", id="i")
    views = []
    for name, datatype, shape, data in outputs:
        response.outputs.add(name=name, datatype=datatype, shape=shape)
        views.append(data)
    return response, views


def _reply(parts: list[Any]) -> tuple[dict[str, Any], bytes]:
    whole = b"".join(bytes(p) for p in parts)
    size, _, _ = REPLY_HEAD.unpack_from(whole)
    start = REPLY_HEAD.size
    return json.loads(whole[start : start + size]), whole[start + size :]


def test_outputs_as_json_and_as_binary_per_output() -> None:
    doc = {
        "inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1]}],
        "outputs": [
            {"name": "h", "parameters": {"binary_data": True}},
            {"name": "s"},
            {"name": "f"},
        ],
    }
    request, _, binary = _decode(doc)
    h = np.array([0.5, 1.5], np.float16)
    words = struct.pack("<I", 2) + b"ok"
    response, views = _response(
        ("h", "FP16", [2], h.tobytes()),
        ("s", "BYTES", [1], words),
        ("f", "FP16", [2], h.tobytes()),
    )
    head, tail = _reply(encode_response(request, response, views, binary))
    assert head["model_name"] == "m" and head["id"] == "i"
    h_out, s_out, f_out = head["outputs"]
    assert h_out["parameters"] == {"binary_data_size": 4} and "data" not in h_out
    assert tail == h.tobytes()
    assert s_out["data"] == ["ok"]
    assert f_out["data"] == [0.5, 1.5]  # FP16 as JSON numbers


@pytest.mark.parametrize("datatype", ["FP16", "FP32", "FP64"])
def test_nan_and_infinities_go_both_ways_as_triton_writes_them(datatype: str) -> None:
    """orjson writes NaN and infinities as null (an echo of inf came back NaN in
    tritonclient, silently); they are NaN, Infinity and -Infinity, as Triton's REST
    writes and reads them, and as Python's json (tritonclient.http) reads them."""
    values = [float("nan"), float("inf"), float("-inf"), 1.5]
    text = json.dumps(
        {"inputs": [{"name": "x", "shape": [4], "datatype": datatype, "data": values}]}
    ).encode()
    assert b"NaN" in text and b"-Infinity" in text
    request, raw, binary = decode_request(memoryview(text), None)
    arr = decode_inputs(request, raw=raw)["x"]
    assert np.isnan(arr[0]) and arr[1] == np.inf and arr[2] == -np.inf and arr[3] == 1.5
    response, views = _response(
        ("y", datatype, [4], arr.tobytes()), ("z", datatype, [1], arr[3:].tobytes())
    )
    parts = encode_response(request, response, views, binary)
    whole = b"".join(bytes(p) for p in parts)
    assert b'"data":[NaN,Infinity,-Infinity,1.5]' in whole, whole
    assert b'"data":[1.5]' in whole  # a finite tensor as before
    head, _ = _reply(parts)
    y = head["outputs"][0]["data"]
    assert math.isnan(y[0]) and y[1:] == [math.inf, -math.inf, 1.5]


def test_a_body_that_is_not_json_is_refused_with_or_without_nan() -> None:
    for text in (b'{"inputs": [NaN', b"{NaN: 1}", b"[" * 100_000 + b"NaN" + b"]" * 100_000):
        with pytest.raises(InvalidInput, match="not valid JSON"):
            decode_request(memoryview(text), None)


@pytest.mark.parametrize(
    ("doc", "words"),
    [
        ({"inputs": []}, "non-empty"),
        ({"inputs": [{"name": "x", "shape": [2], "datatype": "FP32", "data": [1]}]}, "elements"),
        ({"inputs": [{"name": "x", "shape": [1], "datatype": "INT8", "data": [300]}]}, "range"),
        ({"inputs": [{"name": "x", "shape": [1], "datatype": "INT32", "data": [1.5]}]}, "INT32"),
        (
            {"inputs": [{"name": "x", "shape": [2], "datatype": "INT64", "data": [1, math.nan]}]},
            "not integers .*NaN.*, not INT64",
        ),
        (
            {"inputs": [{"name": "x", "shape": [1], "datatype": "UINT8", "data": [math.inf]}]},
            "not integers .*infinities.*, not UINT8",
        ),
        ({"inputs": [{"name": "x", "shape": [1], "datatype": "BOOL", "data": [1]}]}, "BOOL"),
        (
            {"inputs": [{"name": "x", "shape": [2], "datatype": "FP32", "data": [[1], [2, 3]]}]},
            "regular",
        ),
        ({"inputs": [{"name": "x", "shape": [1], "datatype": "NOPE", "data": [1]}]}, "datatype"),
        ({"inputs": [{"name": "x", "shape": [1], "datatype": "FP32"}]}, "neither"),
        ({"inputs": [{"name": "x", "shape": "1", "datatype": "FP32", "data": [1]}]}, "shape"),
        (
            {"inputs": [{"name": "x", "shape": [-1, 2], "datatype": "FP32", "data": [1, 2]}]},
            r"negative dimension in shape \[-1, 2\]",
        ),
        ({"inputs": [{"name": "x", "shape": [1], "datatype": "BYTES", "data": [1]}]}, "strings"),
        (
            {
                "inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1]}],
                "parameters": {"p": [1]},
            },
            "parameter",
        ),
    ],
)
def test_malformed_bodies_are_invalid_input(doc: dict[str, Any], words: str) -> None:
    with pytest.raises(InvalidInput, match=words):
        _decode(doc)


def test_binary_sizes_must_add_up() -> None:
    doc = {
        "inputs": [
            {"name": "x", "shape": [1], "datatype": "FP32", "parameters": {"binary_data_size": 8}}
        ]
    }
    with pytest.raises(InvalidInput, match="past the end"):
        _decode(doc, b"\0" * 4)
    doc["inputs"][0]["parameters"]["binary_data_size"] = 4  # type: ignore[index]
    with pytest.raises(InvalidInput, match="no input claims"):
        _decode(doc, b"\0" * 8)


def test_deep_nesting_is_refused() -> None:
    deep: Any = [1.0]
    for _ in range(200):
        deep = [deep]
    doc = {"inputs": [{"name": "x", "shape": [1], "datatype": "BYTES", "data": deep}]}
    with pytest.raises(InvalidInput):
        _decode(doc)


def test_the_wrapper_round_trips() -> None:
    body = b'{"inputs": []}'
    head = RestHead(7, GZIP, GZIP, 100)
    assert unwrap(wrap_head("m", "2", len(body), head) + body) == (head, body)
    assert unwrap(wrap_head("m", "", len(body), RestHead()) + body) == (RestHead(), body)
    assert unwrap(pb.ModelInferRequest(model_name="m").SerializeToString()) is None
    # names and versions short and long (a length of two bytes), with fields after them
    for name in ("m", "m" * 200):
        for version in ("", "2", "v" * 150):
            assert unwrap(wrap_head(name, version, len(body), head) + body) == (head, body)
            request = pb.ModelInferRequest(model_name=name, model_version=version, id="x")
            request.inputs.add(name="INPUT0", datatype="FP32", shape=[1])
            assert unwrap(request.SerializeToString()) is None
            assert unwrap(request.SerializeToString()[: len(name) + 2]) is None


def test_scheduling_parameters_reach_the_pools_peeks() -> None:
    from poolserve.service.contract.sequence import peek_sequence
    from poolserve.service.contract.wire import peek_routing
    from poolserve.service.poolserver.rest_scheduling import scheduling_view

    params = {"priority": 2, "timeout": 5000, "sequence_id": "s1", "sequence_start": True, "x": 1}
    body = json.dumps({"parameters": params, "inputs": []}).encode()
    wrapped = wrap_head("m", "3", len(body), RestHead()) + body
    view = scheduling_view(wrapped)
    routing = peek_routing(view)
    assert (routing.name, routing.version, routing.priority, routing.timeout_us) == (
        "m",
        "3",
        2,
        5000,
    )
    control = peek_sequence(view)
    assert (control.id, control.start, control.end) == ("s1", True, False)
    big = json.dumps({"parameters": {"priority": 2}, "pad": "x" * MAX_PEEK}).encode()
    routing = peek_routing(scheduling_view(wrap_head("m", "", len(big), RestHead()) + big))
    assert routing.priority is None  # too large to read on the pool's loop: the defaults
    grpc_body = pb.ModelInferRequest(model_name="m").SerializeToString()
    assert scheduling_view(grpc_body) == grpc_body
    # a body with NaN in its tensors is read by the pool as by the worker: its
    # parameters are not dropped (orjson alone refuses NaN)
    tensor = {"name": "x", "shape": [1], "datatype": "FP32", "data": [float("nan")]}
    nan = json.dumps({"parameters": {"priority": 2}, "inputs": [tensor]}).encode()
    assert b"NaN" in nan
    routing = peek_routing(scheduling_view(wrap_head("m", "", len(nan), RestHead()) + nan))
    assert routing.priority == 2


def test_rest_batch_keys_match_for_json_and_binary_tensors() -> None:
    from poolserve.service.poolserver.rest_scheduling import rest_batch, scheduling_routing

    def wrapped(doc: dict[str, Any], binary: bytes = b"") -> bytes:
        text = json.dumps(doc).encode()
        head = RestHead(len(text) if binary else None)
        return wrap_head("m", "", len(text) + len(binary), head) + text + binary

    tensor = {"name": "x", "shape": [2, 3], "datatype": "FP32"}
    as_json = wrapped({"inputs": [{**tensor, "data": [0] * 6}]})
    as_binary = wrapped(
        {
            "inputs": [{**tensor, "parameters": {"binary_data_size": 24}}],
            "parameters": {"binary_data_output": True, "priority": 1},
        },
        b"\0" * 24,
    )
    json_key, binary_key = rest_batch(as_json, frozenset()), rest_batch(as_binary, frozenset())
    assert json_key is not None and json_key == binary_key and json_key[0] == 2
    other = wrapped({"inputs": [{**tensor, "data": [0] * 6}], "parameters": {"mode": "x"}})
    assert rest_batch(other, frozenset()) != json_key
    assert rest_batch(other, frozenset({"mode"})) == json_key
    assert rest_batch(wrapped({"inputs": [{**tensor, "shape": [3]}]}), frozenset()) is not None
    assert rest_batch(wrapped({"inputs": []}), frozenset()) is None
    # from what the pool's routing kept of the body (read once): the same keys
    bodies = [as_json, as_binary, other, wrapped({"inputs": [None]}), wrapped({"inputs": "x"})]
    bodies.append(wrapped({"inputs": [{**tensor, "data": [0] * 6}], "pad": "x" * MAX_PEEK}))
    for body in bodies:
        for safe in (frozenset(), frozenset({"mode"})):
            kept = rest_batch(body, safe, scheduling_routing(body))
            assert kept == rest_batch(body, safe), body[:80]


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)
TENSORS = st.fixed_dictionaries(
    {
        "name": st.sampled_from(["INPUT0", "x", ""]) | JSON_VALUES,
        "datatype": st.sampled_from(["FP32", "INT8", "BYTES", "BOOL", "FP16", "UINT64", "X"])
        | JSON_VALUES,
        "shape": st.lists(st.integers(-2, 4) | st.integers(), max_size=3) | JSON_VALUES,
    },
    optional={
        "data": JSON_VALUES,
        "parameters": st.dictionaries(
            st.sampled_from(["binary_data_size", "shared_memory_region", "p"]), JSON_VALUES
        ),
    },
)
DOCS = st.fixed_dictionaries(
    {},
    optional={
        "inputs": st.lists(TENSORS, max_size=3) | JSON_VALUES,
        "outputs": st.lists(
            st.fixed_dictionaries({"name": JSON_VALUES}, optional={"parameters": JSON_VALUES}),
            max_size=2,
        )
        | JSON_VALUES,
        "parameters": st.dictionaries(st.text(max_size=8), JSON_VALUES, max_size=3) | JSON_VALUES,
        "id": JSON_VALUES,
    },
)


@settings(max_examples=1000, deadline=None)
@given(doc=DOCS, binary=st.binary(max_size=32))
def test_any_json_body_is_decoded_or_invalid_input(doc: dict[str, Any], binary: bytes) -> None:
    """Whatever the JSON: a request (then the codec's decode), or InvalidInput;
    never another exception (which the client would see as INTERNAL)."""
    try:
        request, raw, _ = _decode(doc, binary)
        decode_inputs(request, raw=raw)
    except InvalidInput:
        pass


def _compressed(text: bytes, encoding: int) -> bytes:
    import gzip
    import zlib

    return gzip.compress(text) if encoding == GZIP else zlib.compress(text)


@pytest.mark.parametrize("encoding", [GZIP, DEFLATE])
def test_scheduling_parameters_of_compressed_bodies_reach_the_pools_peeks(encoding: int) -> None:
    from poolserve.service.contract.wire import peek_routing
    from poolserve.service.poolserver.rest_scheduling import rest_batch, scheduling_view

    tensor = {"name": "x", "shape": [2, 3], "datatype": "FP32", "data": [0] * 6}
    text = json.dumps({"parameters": {"priority": 2}, "inputs": [tensor]}).encode()
    body = _compressed(text, encoding)
    wrapped = wrap_head("m", "", len(body), RestHead(None, encoding, 0, 1 << 20)) + body
    assert peek_routing(scheduling_view(wrapped)).priority == 2
    batch = rest_batch(wrapped, frozenset())
    assert batch is not None and batch[0] == 2
    # binary tensors after the JSON, the whole compressed: the JSON is inflated, not the rest
    doc = {
        "parameters": {"timeout": 7000},
        "inputs": [{**tensor, "data": None, "parameters": {"binary_data_size": 24}}],
    }
    text = json.dumps(doc).encode()
    body = _compressed(text + bytes(24), encoding)
    head = RestHead(len(text), encoding, 0, 1 << 20)
    assert (
        peek_routing(scheduling_view(wrap_head("m", "", len(body), head) + body)).timeout_us == 7000
    )


@pytest.mark.parametrize("encoding", [IDENTITY, GZIP])
def test_a_slabs_envelope_head_holds_what_the_pool_schedules_by(encoding: int) -> None:
    """A body over the slab threshold travels in a slab; the head the pool peeks
    at gives the same scheduling parameters as the whole body."""
    from poolserve.service.contract.wire import peek_routing
    from poolserve.service.poolserver.rest_scheduling import scheduling_view

    rng = np.random.default_rng(29)
    tensors = rng.integers(0, 255, 200_000, dtype=np.uint8).tobytes()  # incompressible
    doc = {
        "parameters": {"priority": 2, "sequence_id": 9, "sequence_start": True},
        "inputs": [{"name": "x", "shape": [len(tensors)], "datatype": "UINT8",
                    "parameters": {"binary_data_size": len(tensors)}}],
    }  # fmt: skip
    text = json.dumps(doc).encode()
    body = text + tensors
    if encoding != IDENTITY:
        body = _compressed(body, encoding)
    rest = RestHead(len(text), encoding, 0, 1 << 24)
    whole = wrap_head("m", "", len(body), rest) + body
    envelope = envelope_head("m", "", rest, body)
    assert len(envelope) < 70_000 < len(whole)
    for view in (scheduling_view(whole), scheduling_view(envelope)):
        assert peek_routing(view).priority == 2
    # a JSON-only body just under the peek limit: in a slab once wrapped, read all the same
    small = json.dumps({"parameters": {"priority": 2}, "pad": "x" * (MAX_PEEK - 50)}).encode()
    assert len(small) <= MAX_PEEK
    envelope = envelope_head("m", "", RestHead(), small)
    assert peek_routing(scheduling_view(envelope)).priority == 2


def test_scheduling_parameters_the_pool_cannot_read_are_refused_by_the_worker() -> None:
    from typing import cast

    from poolserve.service.inference.model import Model
    from poolserve.service.inference.rest import decode

    def call(params: dict[str, Any], encoding: int = IDENTITY) -> None:
        tensor = {"name": "x", "shape": [20_000], "datatype": "FP32", "data": [0.5] * 20_000}
        text = json.dumps({"parameters": params, "inputs": [tensor]}).encode()
        assert len(text) > MAX_PEEK
        body = text if encoding == IDENTITY else _compressed(text, encoding)
        rest = RestHead(None, encoding, 0, 1 << 24)
        decode(wrap_head("m", "", len(body), rest) + body, cast(Model, None))

    call({"mode": "x"})  # not one the pool schedules by: goes to the model
    for params in ({"priority": 1}, {"sequence_id": 3}, {"timeout": 100}):
        for encoding in (IDENTITY, GZIP):
            with pytest.raises(InvalidInput, match=f"'{next(iter(params))}' is in a JSON of more"):
                call(params, encoding)


def _bytes_tensor(*items: bytes) -> bytes:
    return b"".join(struct.pack("<I", len(item)) + item for item in items)


def test_bytes_outputs_are_text_or_base64_with_mlservers_content_type() -> None:
    import base64

    from poolserve.service.inference.rest import encode_v1

    request, _, binary = _decode(
        {"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1]}]}
    )
    raw = [b"\xff\x00ok", b"caf\xc3\xa9"]
    response, views = _response(
        ("text", "BYTES", [2], _bytes_tensor(b"ok", "café".encode())),
        ("raw", "BYTES", [2], _bytes_tensor(*raw)),
    )
    head, _ = _reply(encode_response(request, response, views, binary))
    text, packed = head["outputs"]
    assert text["data"] == ["ok", "café"] and "parameters" not in text
    assert packed["parameters"] == {"content_type": "base64"}
    assert [base64.b64decode(item) for item in packed["data"]] == raw  # as MLServer decodes
    v1, _ = _reply(
        encode_v1(_response(("raw", "BYTES", [2], _bytes_tensor(*raw)))[0], [views[1]], 0)
    )
    assert v1 == {"predictions": [{"b64": base64.b64encode(raw[0]).decode()}, "café"]}


def test_a_base64_input_reaches_the_model_as_sent_with_its_content_type() -> None:
    """As MLServer's REST server: the model's codec (MLServer's Base64Codec) decodes it."""
    doc = {
        "inputs": [
            {
                "name": "b",
                "shape": [1],
                "datatype": "BYTES",
                "data": ["aGk="],
                "parameters": {"content_type": "base64"},
            }
        ]
    }
    request, raw, _ = _decode(doc)
    assert bytes(raw[0]) == _bytes_tensor(b"aGk=")
    assert request.inputs[0].parameters["content_type"].string_param == "base64"


def _peek_sizes() -> list[tuple[bytes, int | None]]:
    """(body, Inference-Header-Content-Length) on both sides of the pool's
    bounds: the JSON near MAX_PEEK inflated, the compressed body near
    MAX_PEEK_COMPRESSED (random bytes: gzip stores them), binary tensors after."""
    rng = np.random.default_rng(31)
    cases: list[tuple[bytes, int | None]] = []
    for pad in (10, MAX_PEEK - 100, MAX_PEEK - 30, MAX_PEEK + 10, 3 * MAX_PEEK):
        for noise in (False, True):
            filler = rng.integers(97, 123, pad, dtype=np.uint8).tobytes() if noise else b"x" * pad
            text = json.dumps({"parameters": {"priority": 2}, "pad": filler.decode()}).encode()
            cases.append((text, None))
            tensors = rng.integers(0, 255, 5000, dtype=np.uint8).tobytes()
            cases.append((text + tensors, len(text)))
    for size in (MAX_PEEK - 200, MAX_PEEK, MAX_PEEK + 1, MAX_PEEK_COMPRESSED):
        cases.append((rng.integers(0, 255, size, dtype=np.uint8).tobytes(), None))
    return cases


@pytest.mark.parametrize("encoding", [GZIP, DEFLATE])
def test_the_workers_one_inflation_knows_what_the_pool_read(encoding: int) -> None:
    """The worker inflates a body once and learns from that whether the pool
    read its JSON: the same answer as the pool's own read, at every bound."""
    import zlib

    from poolserve.service.contract.rest import scheduling_json
    from poolserve.service.inference.rest import inflate

    for plain, length in _peek_sizes():
        body = _compressed(plain, encoding)
        out, read = inflate(body, 1 << 24, length)
        assert out == plain
        pool = scheduling_json(RestHead(length, encoding, 0, 1 << 24), body)
        assert read == (pool is not None), (len(plain), len(body), length)
        with pytest.raises(InvalidInput, match="truncated"):
            inflate(body[:-9], 1 << 24, length)
        with pytest.raises(MessageTooLarge):
            inflate(body, len(plain) - 1, length)
    with pytest.raises(InvalidInput, match="cannot be inflated"):
        inflate(b"\x1f\x8b not gzip at all", 1 << 20)
    assert inflate(zlib.compress(b"{}") + b"trailing", 100) == (b"{}", True)


@pytest.mark.parametrize(
    ("folder", "parameters"),
    [
        ("rows", {"timeout": 30_000_000}),  # batching: the pool reads its batch key
        ("simple_sequence", {"sequence_id": 5, "sequence_start": True}),  # its sequence
    ],
)
def test_a_compressed_body_is_inflated_once_by_the_pool(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    folder: str,
    parameters: dict[str, Any],
) -> None:
    """One gzip REST call through a pool, its model run inline (in this process):
    the pool reads the body once for its routing, batching and sequences, and
    the model's decode inflates the whole body once, learning from it whether
    the pool read the scheduling parameters: two inflations, not four."""
    import asyncio
    import time
    import zlib
    from typing import cast

    from poolserve.service.contract.repository import scan
    from poolserve.service.poolcore.dispatcher import Dispatcher
    from poolserve.service.poolserver.backend import PoolBackend
    from poolserve.service.poolserver.catalog import Catalog
    from poolserve.service.poolserver.inline import InlineRunner
    from poolserve.service.poolserver.servicer import InferenceServicer

    from batch_models import ROWS_MODEL
    from support import copy_example, write_model

    repo = tmp_path / "repo"
    if folder == "rows":
        settings = {"name": "rows", "implementation": "model.RowsModel", "max_batch_size": 4}
        write_model(repo, "rows", {**settings, "max_batch_time": 0.001}, ROWS_MODEL)
        tensor = {"name": "INPUT0", "shape": [1, 3], "datatype": "FP32", "data": [1.0] * 3}
    else:
        copy_example(repo, folder)
        tensor = {"name": "INPUT", "shape": [1, 1], "datatype": "INT32", "data": [4]}
    path = repo / folder / "model-settings.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "parallel_workers": 0}))
    (model_settings,) = scan(repo).models
    text = json.dumps({"parameters": parameters, "inputs": [tensor]}).encode()
    body = _compressed(text, GZIP)
    wrapped = wrap_head(folder, "", len(body), RestHead(None, GZIP, 0, 1 << 24)) + body

    inflations = 0
    decompressobj = zlib.decompressobj

    def counted(*args: Any, **kwargs: Any) -> Any:
        nonlocal inflations
        inflations += 1
        return decompressobj(*args, **kwargs)

    async def main() -> bytes:
        catalog = Catalog.from_settings([model_settings])
        inline = InlineRunner(catalog)
        assert await inline.load([model_settings]) == {}
        backend = PoolBackend(cast(Dispatcher, None), inline, needs_workers=False)
        servicer = InferenceServicer(catalog, backend)
        monkeypatch.setattr(zlib, "decompressobj", counted)
        try:
            return bytes(await servicer.infer_bytes(wrapped, time.monotonic() + 30))
        finally:
            monkeypatch.undo()
            inline.close()

    reply = asyncio.run(main())
    json_length, encoding, _ = REPLY_HEAD.unpack_from(reply)
    assert encoding == IDENTITY
    answer = json.loads(reply[REPLY_HEAD.size : REPLY_HEAD.size + json_length])
    assert answer["model_name"] == folder and answer["outputs"], answer
    assert inflations == 2


def test_mlserver_models_bodies_are_read_as_mlservers_types_read_them() -> None:
    """``loose`` (an MLServer model: WireModel.rest_as_mlserver): a BYTES input
    whose data does not fill its shape goes as sent (MLServer's custom-json
    example), a null parameter is unset, a body without an id gets a UUID.
    Native models keep the protocol's checks."""
    text = '{"name": "Foo Bar"}'
    doc = {
        "inputs": [
            {
                "name": "echo_request",
                "shape": [len(text)],
                "datatype": "BYTES",
                "data": [text],
                "parameters": {"content_type": "str", "headers": None},
            }
        ],
        "outputs": [{"name": "echo_response", "parameters": {"binary_data": None}}],
    }
    body = memoryview(json.dumps(doc).encode())
    request, raw, binary = decode_request(body, None, loose=True)
    assert list(request.inputs[0].shape) == [len(text)]
    assert bytes(raw[0]) == struct.pack("<I", len(text)) + text.encode()
    assert dict(request.inputs[0].parameters) == {
        "content_type": pb.InferParameter(string_param="str")
    }
    assert not binary("echo_response")
    assert len(request.id) == 36 and request.id.count("-") == 4
    with_id = memoryview(json.dumps({**doc, "id": ""}).encode())
    assert decode_request(with_id, None, loose=True)[0].id == ""  # an empty id stays empty
    with pytest.raises(InvalidInput, match="parameter 'headers' must be a boolean"):
        decode_request(body, None)
    del doc["inputs"][0]["parameters"]["headers"], doc["outputs"]
    with pytest.raises(InvalidInput, match=r"1 elements in 'data', shape \[19\] holds 19"):
        decode_request(memoryview(json.dumps(doc).encode()), None)
    doc["inputs"][0]["shape"] = [1]
    assert decode_request(memoryview(json.dumps(doc).encode()), None)[0].id == ""  # no UUID
