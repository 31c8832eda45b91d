"""Fuzzing the door (issue 9.3): the router's model-name peek and the worker's
decoder in-process with hypothesis, then raw bytes against a real tree.
Answers are checked against two oracles: poolserve's own code run in-process
(``reliability/fuzzing.py``), and one written from the protocol alone
(``reliability/spec_oracle.py``) that decodes tensors itself.

Every input gets INVALID_ARGUMENT (or RESOURCE_EXHAUSTED for size, NOT_FOUND
for a well-formed unknown model, UNIMPLEMENTED for an unknown method, OK for
what happens to be valid), exactly as the in-process oracle of
``reliability/fuzzing.py`` predicts; no process dies; memory stays flat.
The long run with figures is ``reliability/fuzz.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
import struct
import tracemalloc
from collections.abc import Iterator

import grpc
import http2_fuzzing
import numpy as np
import pytest
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from poolserve.protos import inference_pb2 as pb
from poolserve.service.contract.errors import InvalidInput, ServingError
from poolserve.service.contract.wire import peek_model, peek_routing
from poolserve.service.inference.codec import decode_inputs
from poolserve.service.inference.infer import infer

import fuzz
import fuzzing
import spec_oracle
from harness import Tree, make_repo, rss_bytes, wait_serving

pytestmark = pytest.mark.e2e

LIMIT = fuzz.LIMIT
ORACLE = fuzzing.Oracle(LIMIT)
ECHO = ORACLE.models["echo"]  # declaring nothing: every datatype reaches the decoder
DECLARED = fuzzing.Oracle(LIMIT, declared=True)  # the example echo: INPUT0 FP32 [-1,-1]
INFER = "/inference.GRPCInferenceService/ModelInfer"
RSS_TOLERANCE = 16 << 20  # per process, after a warm-up

# ---------------------------------------------------------------------------
# strategies

DIMS = st.one_of(
    st.integers(min_value=0, max_value=4),
    st.sampled_from([-1, -(2**63), 2**31, 2**40, 10**12, 2**62, 2**63 - 1]),
)


@st.composite
def tensors(draw: st.DrawFn) -> tuple[pb.ModelInferRequest.InferInputTensor, bytes]:
    datatype = draw(st.sampled_from((*fuzzing.DATATYPES, "FP128", "", "bytes")))
    shape = draw(st.lists(DIMS, max_size=4))
    name = draw(st.sampled_from(("INPUT0", "INPUT1", "x", "", "INPUTé")))
    tensor = pb.ModelInferRequest.InferInputTensor(name=name, datatype=datatype, shape=shape)
    raw = draw(
        st.one_of(
            st.binary(max_size=64),
            st.builds(
                lambda n, tail: struct.pack("<I", n) + tail,
                st.sampled_from((0, 1, 3, 1000, 2**32 - 1)),
                st.binary(max_size=8),
            ),
        )
    )
    if datatype in fuzzing.TYPED_FIELD and draw(st.booleans()):
        values = draw(st.lists(st.integers(min_value=0, max_value=1), max_size=6))
        field = fuzzing.TYPED_FIELD[datatype]
        if datatype == "BYTES":
            getattr(tensor.contents, field).extend(bytes([v]) for v in values)
        elif datatype == "BOOL":
            getattr(tensor.contents, field).extend(bool(v) for v in values)
        else:
            getattr(tensor.contents, field).extend(values)
    return tensor, raw


@st.composite
def requests(draw: st.DrawFn) -> bytes:
    """Structured but hostile: any datatype, shape (huge, negative), raw size."""
    request = pb.ModelInferRequest(model_name="echo")
    pairs = draw(st.lists(tensors(), max_size=3))
    for tensor, _ in pairs:
        request.inputs.append(tensor)
    if draw(st.booleans()):
        raws = [raw for _, raw in pairs]
        raws += draw(st.lists(st.binary(max_size=8), max_size=1))
        request.raw_input_contents.extend(raws[: len(pairs) + draw(st.integers(-1, 1))])
    if draw(st.booleans()):
        request.outputs.add(name=draw(st.sampled_from(("OUTPUT0", "OUTPUT9", ""))))
    return request.SerializeToString()


@st.composite
def mutants(draw: st.DrawFn) -> bytes:
    """A valid request, then hypothesis-chosen cuts, flips and insertions."""
    data = bytearray(
        fuzzing.valid_request(random.Random(draw(st.integers(0, 2**16)))).SerializeToString()
    )
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(("flip", "cut", "insert", "delete")))
        at = draw(st.integers(0, len(data)))
        if op == "flip" and data:
            data[min(at, len(data) - 1)] ^= 1 << draw(st.integers(0, 7))
        elif op == "cut":
            del data[at:]
        elif op == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=8))
        else:
            del data[at : at + draw(st.integers(1, 8))]
    return bytes(data)


BODIES = st.one_of(requests(), mutants(), st.binary(max_size=200))

# ---------------------------------------------------------------------------
# in-process: the router's peek


@settings(max_examples=400, deadline=None)
@given(data=BODIES)
def test_peek_raises_only_invalid_input(data: bytes) -> None:
    with contextlib.suppress(InvalidInput):
        peek_routing(data)
    with contextlib.suppress(InvalidInput):
        peek_model(data)


@settings(max_examples=400, deadline=None)
@given(data=st.one_of(requests(), mutants()))
def test_peek_agrees_with_protobuf_when_both_parse(data: bytes) -> None:
    """Whatever the router routes on is what the worker's parser reads."""
    try:
        parsed = pb.ModelInferRequest.FromString(data)
    except DecodeError:
        return
    try:
        name, version = peek_model(data)
    except InvalidInput:
        return  # stricter than protobuf (e.g. groups): the request is refused, not misrouted
    assert (name, version) == (parsed.model_name, parsed.model_version)


# ---------------------------------------------------------------------------
# in-process: the worker's decoder and the whole inference


@settings(max_examples=400, deadline=None)
@given(data=BODIES)
def test_worker_inference_raises_only_serving_errors(data: bytes) -> None:
    message = ""
    try:
        reply, _ = infer(ECHO, data)
    except ServingError as exc:
        message = exc.message or "(empty)"
        reply = b""
    if message:
        assert message != "(empty)", "an error without a message"
    else:
        pb.ModelInferResponse.FromString(reply)  # whatever comes out is a valid response


@settings(max_examples=200, deadline=None)
@given(request=requests())
def test_decode_allocates_nothing_for_declared_sizes(request: bytes) -> None:
    """A shape declares sizes; only the bytes actually sent may cost memory."""
    parsed = pb.ModelInferRequest.FromString(request)
    tracemalloc.start()
    try:
        with contextlib.suppress(InvalidInput):
            decode_inputs(parsed)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 256 * 1024 + 64 * len(request), peak


@pytest.mark.parametrize(("name", "body"), fuzzing.crafted(), ids=[n for n, _ in fuzzing.crafted()])
def test_crafted_inputs_in_process(name: str, body: bytes) -> None:
    expected = ORACLE.expect(body)
    assert expected.code in {"INVALID_ARGUMENT", "NOT_FOUND", "OK"}, (name, expected)
    if "shape" in name or "dim" in name or "BYTES" in name:
        assert expected.code == "INVALID_ARGUMENT", name


def test_shape_1e12_with_no_data_is_refused_without_allocating() -> None:
    request = pb.ModelInferRequest(model_name="echo")
    request.inputs.add(name="INPUT0", datatype="FP64", shape=[10**12])
    request.raw_input_contents.append(b"")
    tracemalloc.start()
    try:
        with pytest.raises(InvalidInput, match="needs"):
            decode_inputs(request)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


# ---------------------------------------------------------------------------
# in-process: poolserve's decoder against the oracle written from the protocol


def agrees_with_spec(body: bytes, code: str, reply: bytes) -> str:
    """ "" when the spec oracle abstains or agrees with (code, reply)."""
    verdict = spec_oracle.predict(body, LIMIT)
    return "" if verdict is None else spec_oracle.disagreement(verdict, code, reply)


@settings(max_examples=400, deadline=None)
@given(data=BODIES)
def test_decoder_agrees_with_the_spec_oracle(data: bytes) -> None:
    expected = ORACLE.expect(data)
    assert agrees_with_spec(data, expected.code, expected.reply) == ""


@settings(max_examples=400, deadline=None)
@given(data=BODIES)
def test_declared_inputs_agree_with_the_spec_oracle(data: bytes) -> None:
    """The example echo as shipped, its declared inputs enforced: poolserve and
    Triton's rules written from the spec give the same code (and reply)."""
    expected = DECLARED.expect(data)
    verdict = spec_oracle.predict(data, LIMIT, fuzzing.declared_inputs("echo"))
    if verdict is not None:
        assert spec_oracle.disagreement(verdict, expected.code, expected.reply) == ""


def declared_echo_requests(seed: int, count: int) -> Iterator[bytes]:
    """Requests that fit the example echo's declaration (INPUT0 FP32, 2 dims),
    raw or typed, and mutants of them."""
    rng = random.Random(seed)
    for _ in range(count):
        shape = [rng.randint(0, 3), rng.randint(0, 4)]
        values = np.asarray([rng.uniform(-9, 9) for _ in range(shape[0] * shape[1])], "<f4")
        request = pb.ModelInferRequest(model_name="echo")
        tensor = request.inputs.add(name="INPUT0", datatype="FP32", shape=shape)
        if rng.random() < 0.5:
            request.raw_input_contents.append(values.tobytes())
        else:
            tensor.contents.fp32_contents.extend(values.tolist())
        body = request.SerializeToString()
        yield body
        yield fuzzing.mutate(body, rng)


def test_the_spec_oracle_judges_declared_inputs_both_ways() -> None:
    declared = fuzzing.declared_inputs("echo")
    judged = {"OK": 0, "INVALID_ARGUMENT": 0}
    bodies = itertools.chain(
        (body for _, body in itertools.islice(fuzzing.random_inputs(12), 2000)),
        declared_echo_requests(13, 300),
    )
    for body in bodies:
        verdict = spec_oracle.predict(body, LIMIT, declared)
        if verdict is None:
            continue
        judged[verdict.code] += 1
        expected = DECLARED.expect(body)
        assert spec_oracle.disagreement(verdict, expected.code, expected.reply) == "", body.hex()
    assert judged["OK"] >= 200 and judged["INVALID_ARGUMENT"] >= 100, judged


def test_spec_oracle_judges_most_random_inputs_and_agrees() -> None:
    """On the fuzz stream (mostly mutants that protobuf itself refuses) and the
    crafted attacks: the spec oracle judges OK inputs (tensors compared) and
    invalid ones, and no opinion of it differs from poolserve's decoder."""
    judged = {"OK": 0, "INVALID_ARGUMENT": 0}
    for _, body in itertools.islice(fuzzing.random_inputs(11), 3000):
        verdict = spec_oracle.predict(body, LIMIT)
        if verdict is None:
            continue
        judged[verdict.code] += 1
        expected = ORACLE.expect(body)
        assert spec_oracle.disagreement(verdict, expected.code, expected.reply) == "", body.hex()
    assert judged["OK"] >= 100 and judged["INVALID_ARGUMENT"] >= 5, judged
    crafted = [spec_oracle.predict(body, LIMIT) for _, body in fuzzing.crafted()]
    assert sum(v is not None and v.code == "INVALID_ARGUMENT" for v in crafted) >= 15


def test_spec_oracle_catches_a_wrong_decoding() -> None:
    """It is not poolserve's decoder in disguise: replies that decode one element
    wrong, a BYTES element short, or as another datatype are all caught."""
    values = np.array([[1.5, -2.0, 3.25]], dtype=np.float32)
    request = pb.ModelInferRequest(model_name="echo")
    request.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 3])
    request.raw_input_contents.append(values.tobytes())
    strings = pb.ModelInferRequest(model_name="echo")
    strings.inputs.add(name="INPUT0", datatype="BYTES", shape=[2])
    strings.raw_input_contents.append(struct.pack("<I", 2) + b"ab" + struct.pack("<I", 1) + b"c")
    for body in (request.SerializeToString(), strings.SerializeToString()):
        verdict = spec_oracle.predict(body, LIMIT)
        good = ORACLE.expect(body)
        assert verdict is not None and verdict.code == good.code == "OK"
        assert spec_oracle.disagreement(verdict, "OK", good.reply) == ""
        response = pb.ModelInferResponse.FromString(good.reply)
        wrong_value = bytearray(response.raw_output_contents[0])
        wrong_value[-1] ^= 1
        wrong_type = pb.ModelInferResponse()
        wrong_type.CopyFrom(response)
        wrong_type.outputs[0].datatype = "INT32" if body is not strings else "UINT8"
        short = pb.ModelInferResponse()
        short.CopyFrom(response)
        del short.raw_output_contents[:]
        short.raw_output_contents.append(bytes(wrong_value[:-1]))
        flipped = pb.ModelInferResponse()
        flipped.CopyFrom(response)
        del flipped.raw_output_contents[:]
        flipped.raw_output_contents.append(bytes(wrong_value))
        for bad in (wrong_type, short, flipped):
            assert spec_oracle.disagreement(verdict, "OK", bad.SerializeToString()) != ""
    assert spec_oracle.disagreement(verdict, "INVALID_ARGUMENT", b"") != ""


# ---------------------------------------------------------------------------
# a real tree, raw bytes through a channel without our stubs


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Tree]:
    root = tmp_path_factory.mktemp("fuzz")
    repo = make_repo(root / "repo", {"echo": None, "sleep": "slow"}, {"max_message_size": LIMIT})
    fuzzing.undeclare(repo)  # as ORACLE's echo: every datatype and shape reaches the decoder
    with Tree(repo, root / "run", workers=2) as started:

        async def ready() -> None:
            async with grpc.aio.insecure_channel(started.address) as channel:
                await wait_serving(channel)

        asyncio.run(ready())
        START["pids"] = sorted(p.pid for p in started.census(EXPECTED).procs)
        yield started


EXPECTED = {"default": 2, "slow": 2}
START: dict[str, list[int]] = {}


@pytest.fixture(scope="module")
def channel(tree: Tree) -> Iterator[grpc.Channel]:
    options = [("grpc.max_send_message_length", 8 * LIMIT)]
    with grpc.insecure_channel(tree.address, options=options) as opened:
        yield opened


def call(channel: grpc.Channel, body: bytes, method: str = INFER) -> tuple[str, bytes, str]:
    try:
        reply = channel.unary_unary(method)(body, timeout=30)
    except grpc.RpcError as exc:
        return exc.code().name, b"", exc.details() or ""  # type: ignore[attr-defined]
    return "OK", reply, ""


@pytest.mark.parametrize(
    ("name", "body"),
    fuzzing.crafted() + fuzz.oversized(),
    ids=[n for n, _ in fuzzing.crafted() + fuzz.oversized()],
)
def test_crafted_inputs_against_the_server(channel: grpc.Channel, name: str, body: bytes) -> None:
    code, reply, details = call(channel, body)
    expected = ORACLE.expect(body)
    assert code == expected.code, f"{name}: {code} {details}"
    assert agrees_with_spec(body, code, reply) == "", name
    assert code in {"INVALID_ARGUMENT", "NOT_FOUND", "RESOURCE_EXHAUSTED", "OK"}
    if code == "OK":
        assert reply == expected.reply
    elif code == "RESOURCE_EXHAUSTED":
        assert str(LIMIT) in details, details
    else:
        assert details, "an error without a message"


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(data=BODIES)
def test_hypothesis_bytes_against_the_server(channel: grpc.Channel, data: bytes) -> None:
    code, reply, details = call(channel, data)
    expected = ORACLE.expect(data)
    assert code == expected.code, f"{code} {details!r} for {data.hex()}"
    assert agrees_with_spec(data, code, reply) == "", data.hex()
    if code == "OK":
        assert reply == expected.reply


def test_unknown_methods_are_unimplemented(channel: grpc.Channel) -> None:
    for path in fuzz.UNKNOWN_METHODS:
        assert call(channel, b"", path)[0] == "UNIMPLEMENTED", path


@pytest.mark.parametrize("method", [m for m in fuzz.OTHER_METHODS if m != "RepositoryIndex"])
def test_garbage_to_other_methods_is_invalid_argument(channel: grpc.Channel, method: str) -> None:
    for garbage in fuzz.GARBAGE:
        code, _, details = call(channel, garbage, f"/{fuzz.SERVICE}/{method}")
        assert code == "INVALID_ARGUMENT", (method, garbage, code, details)


def test_garbage_to_repository_index_is_invalid_argument(tree: Tree, channel: grpc.Channel) -> None:
    before = len(tree.tracebacks())
    code, _, details = call(channel, b"\xff\xff\xff\xff", f"/{fuzz.SERVICE}/RepositoryIndex")
    assert code == "INVALID_ARGUMENT", (code, details)
    assert len(tree.tracebacks()) == before


def test_long_random_run_matches_the_oracle_and_leaks_nothing(tree: Tree) -> None:
    """2,000 inputs after a 600-input warm-up: no answer differs from the oracle,
    RSS of router, pools and workers stays within the tolerance."""

    async def main() -> None:
        async with grpc.aio.insecure_channel(tree.address) as aio:
            report = fuzz.Report()
            warmup = list(itertools.islice(fuzzing.random_inputs(3), 600))
            await fuzz.fuzz_infer(aio, ORACLE, warmup, report)
            before = fuzz.rss_by_role(tree, EXPECTED)
            stream = list(itertools.islice(fuzzing.random_inputs(4), 2000))
            await fuzz.fuzz_infer(aio, ORACLE, stream, report)
            after = fuzz.rss_by_role(tree, EXPECTED)
        assert report.mismatches == []
        assert report.inputs == 2600
        assert report.spec_ok >= 100 and report.spec_checked - report.spec_ok >= 5, report
        assert set(report.codes) <= {"INVALID_ARGUMENT", "NOT_FOUND", "OK"}, report.codes
        grown = {k: after.get(k, 0) - v for k, v in before.items()}
        assert all(v < RSS_TOLERANCE for v in grown.values()), grown
        assert all(after.get(k, 0) > 0 for k in before), "a process went away"

    asyncio.run(main())


def test_reply_over_the_size_limit_is_a_clear_resource_exhausted(
    tree: Tree, channel: grpc.Channel
) -> None:
    """echo's reply is a few bytes longer than its request: a request just under
    the limit makes a reply just over it."""
    body = b""
    for size in range(LIMIT - 64, LIMIT):  # the largest request that fits
        request = pb.ModelInferRequest(model_name="echo")
        request.inputs.add(name="INPUT0", datatype="UINT8", shape=[1, size])
        request.raw_input_contents.append(b"\0" * size)
        if len(request.SerializeToString()) <= LIMIT:
            body = request.SerializeToString()
    assert body and len(infer(ECHO, body)[0]) > LIMIT
    before = len(tree.tracebacks())
    code, _, details = call(channel, body)
    assert code == "RESOURCE_EXHAUSTED", (code, details)
    assert "max_message_size" in details or "reply" in details, details
    assert len(tree.tracebacks()) == before, tree.tracebacks()[-1]


def test_hostile_http2_at_the_grpc_port(tree: Tree) -> None:
    """300 connections of hostile HTTP/2 frames (reliability/http2_fuzzing.py, a
    fixed seed) to the gRPC port: no wrong answer (the valid calls among them
    echoed exactly, the bad ones refused: GOAWAY, RST_STREAM, a status not 0 or
    closed), no process changed, no traceback, and grpc's client served after."""

    async def main() -> tuple[fuzz.Report, str]:
        report = fuzz.Report()
        hostile = list(itertools.islice(http2_fuzzing.cases(11), 300))
        await fuzz.fuzz_h2(tree.address, hostile, report)
        return report, await fuzz.grpc_still_served(tree.address)

    report, after = asyncio.run(main())
    assert report.h2_inputs == 300
    assert report.h2_mismatches == [], "\n".join(report.h2_mismatches[:10])
    assert report.h2_answers.get("served", 0) >= 30, report.h2_answers
    assert sum(v for k, v in report.h2_answers.items() if k.startswith("GOAWAY")) >= 30
    assert after == "OK"
    census = tree.census(EXPECTED)
    assert census.ok, census.summary()
    assert sorted(p.pid for p in census.procs) == START["pids"]
    assert tree.tracebacks() == []


def test_valid_requests_still_served_exactly(channel: grpc.Channel) -> None:
    array = np.arange(16, dtype=np.float32).reshape(1, 16)
    request = pb.ModelInferRequest(model_name="echo", id="after-fuzz")
    request.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 16])
    request.raw_input_contents.append(array.tobytes())
    code, reply, _ = call(channel, request.SerializeToString())
    assert code == "OK"
    response = pb.ModelInferResponse.FromString(reply)
    assert response.id == "after-fuzz"
    assert response.raw_output_contents[0] == array.tobytes()


def test_no_process_died_and_no_unexpected_traceback(tree: Tree) -> None:
    """Last in this module: every input above left the tree exactly as it was."""
    census = tree.census(EXPECTED)
    assert census.ok, census.summary()
    assert sorted(p.pid for p in census.procs) == START["pids"]
    assert tree.tracebacks() == []
    assert all(rss_bytes(p.pid) > 0 for p in census.procs)
