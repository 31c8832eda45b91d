"""MLServer's documentation examples, side by side (issue 42, item 6):
``mlserver start`` (MLServer 1.7.1, from this environment: tests/mlserver_peer.py)
and ``poolserve serve`` on copies of the same folder, each sent the requests
its README sends, REST and gRPC, by tests/clients/mlserver_readme.py (which
imports MLServer's generated stubs, so it runs in a process of its own), and
the answers compared: statuses, bodies, outputs, error codes and texts.

- custom-json (``examples/mlserver/custom-json``): the README's REST body
  sends one JSON string with shape [its length]; MLServer hands it to the
  model as sent, and so does poolserve for an MLServer model.
- streaming (``examples/mlserver/streaming``): the README's gRPC client reads
  MLServer's stream messages (bare ModelInferResponses), which a stream of an
  MLServer model speaks by default (``stream_messages: "auto"``); its REST
  client sends the request as MLServer's types dump it, nulls included.
- model-repository: the README's index, unload and load calls, over REST and
  over MLServer's model repository service. Its folder is written here (the
  models are trained on the data scikit-learn ships); its second model is a
  scikit-learn one under the example's name, as mlserver-xgboost is not a
  dependency of this project.

What stays different, on purpose, is asserted as such (and listed in
docs/migrating-from-mlserver.md): MLServer's CloudEvents headers
(``ce-*``, and in its REST bodies the ``parameters`` they leave behind), the
order of the repository index (poolserve sorts by name), and the data plane's
RepositoryIndex, which keeps KServe's and Triton's words for their clients.
"""

from __future__ import annotations

import asyncio
import base64
import json
import re
import shutil
from pathlib import Path
from typing import Any

import grpc
import joblib
import pytest
from sklearn.datasets import load_digits, load_iris
from sklearn.svm import SVC
from sklearn.tree import DecisionTreeClassifier

from poolserve.protos import inference_pb2 as pb
from poolserve.protos import model_repository_pb2 as mr

from mlserver_peer import PEER_HTTP, mlserver_serving
from serving import Serving, serve_as_settings_say
from support import ROOT, copy_example, run_client, write_model

pytestmark = pytest.mark.e2e

WAIT = 120.0
EXAMPLES = ROOT / "examples" / "mlserver"
UUID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
GREETING = "Got your request. Hello from the server."
TOKENS = ["What", " is", " the", " capital", " of", " France?"]

Answers = tuple[dict[str, Any], dict[str, Any]]  # the README's requests': (ours, MLServer's)


def http_of(serving: Serving) -> str:
    return (serving.run_dir / "http.addr").read_text().strip()


def answers_of(
    tmp: pytest.TempPathFactory,
    example: str,
    folder: Path,
    models: tuple[str, ...],
    *extra: str,
    peer_settings: dict[str, Any] | None = None,
) -> Answers:
    """Both servers, each on its own copy of ``folder`` (MLServer's settings.json
    gets its ports written into it, and ``peer_settings``; poolserve's workers
    as its settings say), each sent the README's requests once."""
    root = tmp.mktemp(example)
    skip = shutil.ignore_patterns("__pycache__")
    ours = shutil.copytree(folder, root / "poolserve", ignore=skip)
    theirs = shutil.copytree(folder, root / "mlserver", ignore=skip)
    if peer_settings:
        settings = theirs / "settings.json"
        written = json.loads(settings.read_text()) if settings.exists() else {}
        settings.write_text(json.dumps({**written, **peer_settings}))
    with mlserver_serving(theirs, root / "mlserver.log", *models) as peer:
        serving = serve_as_settings_say(ours, root / "run", models, timeout=WAIT)
        try:
            address, http = serving.address, http_of(serving)
            mine = run_client("mlserver_readme.py", example, address, http, *extra)
        finally:
            serving.__exit__(None, None, None)
        return mine, run_client("mlserver_readme.py", example, peer, PEER_HTTP[peer], *extra)


def reply_of(answer: dict[str, Any], message: Any) -> Any:
    """A gRPC answer's reply parsed (poolserve's protos), or its status."""
    if "reply" not in answer:
        return tuple(answer["status"])
    return message.FromString(base64.b64decode(answer["reply"]))


def without_cloudevents(body: Any) -> Any:
    """A REST body without what MLServer's CloudEvents middleware leaves in it:
    ``parameters.headers`` (``Ce-*``) and the ``parameters`` emptied of them."""
    if isinstance(body, dict):
        body = dict(body)
        parameters = dict(body.get("parameters") or {})
        parameters.pop("headers", None)
        if parameters:
            body["parameters"] = parameters
        else:
            body.pop("parameters", None)
    return body


# -- custom-json --------------------------------------------------------------------


@pytest.fixture(scope="module")
def custom_json(tmp_path_factory: pytest.TempPathFactory) -> Answers:
    """The folder as it is: settings.json says only "debug", so both run their
    default parallel workers (MLServer's 1, written out for the peer, whose
    harness would otherwise run it inline; poolserve's 2)."""
    folder = EXAMPLES / "custom-json"
    assert json.loads((folder / "settings.json").read_text()) == {"debug": "true"}
    return answers_of(
        tmp_path_factory,
        "custom-json",
        folder,
        ("json-hello-world",),
        peer_settings={"parallel_workers": 1},
    )


def test_custom_json_rest_as_the_readme_sends_it(custom_json: Answers) -> None:
    """The README's REST body (one string, shape [its length]) is 200 on both,
    with the same answer: MLServer hands BYTES data to the model as sent."""
    ours, theirs = custom_json
    assert ours["rest"]["status"] == theirs["rest"]["status"] == 200, (ours, theirs)
    expected = {
        "request": {"echo_request": {"name": "Foo Bar", "message": "Hello from Client (REST)!"}},
        "server_response": GREETING,
    }
    assert ours["rest_decoded"] == theirs["rest_decoded"] == expected
    mine, peer = (without_cloudevents(a["rest"]["body"]) for a in (ours, theirs))
    # no "id" in the request: each server's data plane gives it a fresh UUID
    assert UUID.match(mine.pop("id")) and UUID.match(peer.pop("id")), (mine, peer)
    assert mine == peer, (mine, peer)
    assert mine["outputs"][0]["shape"] == [len(json.dumps(expected))]  # the model's shape, kept


def test_custom_json_grpc_as_the_readme_sends_it(custom_json: Answers) -> None:
    """The README's gRPC request (MLServer's converters and stub): the same reply."""
    ours, theirs = custom_json
    assert "reply" in ours["grpc"], ours
    assert reply_of(ours["grpc"], pb.ModelInferResponse) == reply_of(
        theirs["grpc"], pb.ModelInferResponse
    )
    assert ours["grpc_decoded"] == theirs["grpc_decoded"]
    assert ours["grpc_decoded"]["request"]["echo_request"]["message"] == (
        "Hello from Client (gRPC)!"
    )


def test_custom_json_model_errors_as_mlserver_says_them(custom_json: Answers) -> None:
    """A string that is not JSON: the model's JSONDecodeError, in a parallel
    worker, with MLServer's status and text, over REST and gRPC alike."""
    ours, theirs = custom_json
    assert reply_of(ours["grpc_bad"], pb.ModelInferResponse) == reply_of(
        theirs["grpc_bad"], pb.ModelInferResponse
    )
    code, text = reply_of(ours["grpc_bad"], pb.ModelInferResponse)
    assert code == "INTERNAL" and "JSONDecodeError" in text, text
    assert ours["rest_bad"] == theirs["rest_bad"], (ours["rest_bad"], theirs["rest_bad"])


# -- streaming ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def streaming(tmp_path_factory: pytest.TempPathFactory) -> Answers:
    """The folder as it is (its settings.json: parallel_workers 0, inline), and
    no poolserve setting: stream_messages is left to its default."""
    folder = EXAMPLES / "streaming"
    request = str(folder / "generate-request.json")
    return answers_of(tmp_path_factory, "streaming", folder, ("text-model",), request)


def test_streaming_grpc_as_the_readme_reads_it(streaming: Answers) -> None:
    """The README's gRPC client (MLServer's stubs): the same messages, byte for
    byte, and the tokens (before: KServe's messages, read as empty responses,
    and the client's IndexError)."""
    ours, theirs = streaming
    assert ours["grpc"]["tokens"] == theirs["grpc"]["tokens"] == TOKENS, (ours, theirs)
    assert ours["grpc"] == theirs["grpc"]
    # a model neither has: the stream's NOT_FOUND status on both (MLServer's
    # stubs cannot read an in-stream error); the texts are each server's own
    for answers in (ours, theirs):
        assert answers["grpc_unknown"]["replies"] == [], answers
        assert answers["grpc_unknown"]["status"][0] == "NOT_FOUND"
    assert "no-such-model" in ours["grpc_unknown"]["status"][1]


def test_streaming_rest_as_the_readme_sends_it(streaming: Answers) -> None:
    """The README's REST request, as MLServer's types dump it (``"headers":
    null`` in the input's parameters, ``"id": null``): 200 and the same events
    (before: 400, a null parameter refused)."""
    ours, theirs = streaming
    assert ours["rest"]["status"] == theirs["rest"]["status"] == 200, (ours, theirs)
    assert ours["rest"]["tokens"] == theirs["rest"]["tokens"] == TOKENS
    for answers in (ours, theirs):
        assert answers["rest"]["content_type"].startswith("text/event-stream")
    mine = [without_cloudevents(e) for e in ours["rest"]["events"]]
    peer = [without_cloudevents(e) for e in theirs["rest"]["events"]]
    ids = {e.pop("id") for e in mine}, {e.pop("id") for e in peer}
    assert [len(i) for i in ids] == [1, 1] and all(UUID.match(next(iter(i))) for i in ids)
    assert mine == peer, (mine, peer)


def test_streaming_kserve_messages_when_asked(tmp_path: Path) -> None:
    """``stream_messages: "kserve"`` (here from its POOLSERVE_ variable) keeps
    KServe's messages for the same folder: MLServer's stubs then read empty
    responses, as the README's client did before."""
    repo = shutil.copytree(EXAMPLES / "streaming", tmp_path / "repo")
    env = {"POOLSERVE_STREAM_MESSAGES": "kserve"}
    serving = serve_as_settings_say(repo, tmp_path / "run", ("text-model",), env, WAIT)
    try:
        request = str(repo / "generate-request.json")
        got = run_client(
            "mlserver_readme.py", "streaming", serving.address, http_of(serving), request
        )
    finally:
        serving.__exit__(None, None, None)
    assert got["grpc"]["tokens"] == ["<IndexError>"] * len(TOKENS)
    assert got["rest"]["tokens"] == TOKENS  # REST is not concerned


# -- model-repository ---------------------------------------------------------------


def model_repository(repo: Path) -> Path:
    """The example's folder: two models with version v0.1.0, trained here."""
    digits, iris = load_digits(), load_iris()
    rows = digits.images.reshape(len(digits.images), -1)
    trained = {
        "mnist-svm": SVC(gamma=0.001).fit(rows[::4], digits.target[::4]),
        "mushroom-xgboost": DecisionTreeClassifier().fit(iris.data, iris.target),
    }
    for name, estimator in trained.items():
        settings = {
            "name": name,
            "implementation": "mlserver_sklearn.SKLearnModel",
            "parameters": {"version": "v0.1.0"},
        }
        joblib.dump(estimator, write_model(repo, f"models/{name}", settings) / "model.joblib")
    return repo


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Answers:
    folder = model_repository(tmp_path_factory.mktemp("model-repository-source") / "repo")
    models = ("mnist-svm", "mushroom-xgboost")
    return answers_of(tmp_path_factory, "model-repository", folder, models)


def by_name(index: Any) -> Any:
    return sorted(index, key=lambda m: m["name"]) if isinstance(index, list) else index


def index_of(answer: dict[str, Any], message: Any) -> Any:
    """A gRPC RepositoryIndex answer as sorted (name, version, state, reason)s."""
    reply = reply_of(answer, message)
    if isinstance(reply, tuple):
        return reply
    if not hasattr(reply, "models"):
        return reply.SerializeToString()
    return sorted((m.name, m.version, m.state, m.reason) for m in reply.models)


def test_model_repository_rest_as_the_readme_calls_it(repository: Answers) -> None:
    """The README's calls: index, unload, index (UNAVAILABLE, as the README
    says), load, index; and a model neither has. The same statuses and bodies
    (the index sorted: MLServer lists its models in its registry's order)."""
    ours, theirs = repository
    mine = [(a["status"], by_name(a["body"])) for a in ours["rest"]]
    peer = [(a["status"], by_name(a["body"])) for a in theirs["rest"]]
    assert [m[0] for m in mine[:5]] == [200] * 5, mine
    ready = {"name": "mnist-svm", "version": "v0.1.0", "state": "READY", "reason": ""}
    unloaded = {"name": "mushroom-xgboost", "version": "v0.1.0", "state": "UNAVAILABLE"}
    assert mine[2] == (200, [ready, {**unloaded, "reason": ""}]), mine[2]
    assert mine[:5] == peer[:5], (mine, peer)
    # a model neither server has: 404 on both (the texts: each server's own)
    assert [m[0] for m in mine[5:]] == [m[0] for m in peer[5:]] == [404, 404], (mine, peer)


def test_model_repository_service_as_mlserver_answers_it(repository: Answers) -> None:
    """MLServer's ModelRepositoryService (its generated stub): the same calls
    give the same index, states written as MLServer's gRPC writes them
    ("State.READY"), no reason for an unloaded model, and MLServer's NOT_FOUND
    text for a model it does not have."""
    ours, theirs = repository
    messages = [
        mr.RepositoryIndexResponse,
        mr.RepositoryModelUnloadResponse,
        mr.RepositoryIndexResponse,
        mr.RepositoryIndexResponse,
        mr.RepositoryModelLoadResponse,
        mr.RepositoryIndexResponse,
        mr.RepositoryModelLoadResponse,
        mr.RepositoryModelUnloadResponse,
    ]
    mine = [index_of(a, m) for a, m in zip(ours["grpc"], messages, strict=True)]
    peer = [index_of(a, m) for a, m in zip(theirs["grpc"], messages, strict=True)]
    assert mine == peer, (mine, peer)
    assert mine[2] == [
        ("mnist-svm", "v0.1.0", "State.READY", ""),
        ("mushroom-xgboost", "v0.1.0", "State.UNAVAILABLE", ""),
    ]
    assert mine[6] == ("NOT_FOUND", "Model no-such-model not found")


def test_data_plane_index_keeps_kserve_words(repository: Answers) -> None:
    """The data plane's RepositoryIndex (GRPCInferenceService, which Triton's
    and KServe's clients call too) keeps poolserve's words on purpose: READY
    and UNLOADED with its reason, where MLServer says "State.READY" and
    "State.UNAVAILABLE" there too; the calls themselves answer alike."""
    ours, theirs = repository
    index = pb.RepositoryIndexResponse
    mine = index_of(ours["dataplane"][2], index)
    peer = index_of(theirs["dataplane"][2], index)
    assert mine == [
        ("mnist-svm", "v0.1.0", "READY", ""),
        ("mushroom-xgboost", "v0.1.0", "UNLOADED", "unloaded on request"),
    ]
    assert peer == [
        ("mnist-svm", "v0.1.0", "State.READY", ""),
        ("mushroom-xgboost", "v0.1.0", "State.UNAVAILABLE", ""),
    ]
    assert [a.get("status", ["OK"])[0] for a in ours["dataplane"]] == [
        a.get("status", ["OK"])[0] for a in theirs["dataplane"]
    ]


# -- stream_messages "auto" in a repository of both kinds -----------------------------


async def stream_bytes(address: str, request: bytes) -> tuple[list[bytes], tuple[str, str] | None]:
    """A one-request ModelStreamInfer: the messages' bytes, and its status if not OK."""
    got: list[bytes] = []
    async with grpc.aio.insecure_channel(address) as channel:
        method = channel.stream_stream("/inference.GRPCInferenceService/ModelStreamInfer")
        try:
            async for reply in method(iter([request]), timeout=60):
                got.append(bytes(reply))
        except grpc.aio.AioRpcError as exc:
            return got, (exc.code().name, str(exc.details()))
    return got, None


def test_auto_stream_messages_by_model(tmp_path: Path) -> None:
    """Default ``stream_messages: "auto"``, one tree serving the streaming
    example's MLServer model and a native model: each stream speaks its
    model's messages (MLServer's bare responses and an error as the stream's
    status; KServe's ModelStreamInferResponse and an error in-stream), and a
    model no pool has is KServe's in-stream error, since not every model is
    MLServer's."""
    repo = tmp_path / "repo"
    shutil.copytree(EXAMPLES / "streaming", repo)
    copy_example(repo, "echo")
    serving = serve_as_settings_say(repo, tmp_path / "run", ("text-model", "echo"), None, WAIT)
    try:
        prompt = pb.ModelInferRequest(model_name="text-model", id="t")
        text = prompt.inputs.add(name="prompt", datatype="BYTES", shape=[1])
        text.contents.bytes_contents.append(b"a b")
        echo = pb.ModelInferRequest(model_name="echo", id="e")
        value = echo.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 1])
        value.contents.fp32_contents.append(2.0)
        bad = pb.ModelInferRequest(model_name="text-model", id="bad")  # no input: IndexError
        unknown = pb.ModelInferRequest(model_name="no-such-model")
        calls = [r.SerializeToString() for r in (prompt, echo, bad, unknown)]
        (tokens, ok), (echoed, echo_ok), (none, failed), (answered, unknown_ok) = (
            asyncio.run(stream_bytes(serving.address, call)) for call in calls
        )
    finally:
        serving.__exit__(None, None, None)
    assert ok is None and echo_ok is None and unknown_ok is None
    words = [pb.ModelInferResponse.FromString(t) for t in tokens]  # bare: MLServer's
    assert [list(w.outputs[0].contents.bytes_contents) for w in words] == [[b"a"], [b" b"]]
    assert [w.id for w in words] == ["t", "t"]
    (message,) = (pb.ModelStreamInferResponse.FromString(e) for e in echoed)
    assert message.infer_response.model_name == "echo" and not message.error_message
    assert none == [] and failed == ("INTERNAL", "list index out of range")
    (refused,) = (pb.ModelStreamInferResponse.FromString(a) for a in answered)
    assert refused.error_message.startswith("Request for unknown model: 'no-such-model'")
