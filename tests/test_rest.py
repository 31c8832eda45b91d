"""The HTTP/REST door end to end, through real ``poolserve serve`` trees.

Clients as people use them: tritonclient.http (binary and JSON tensors),
``requests`` with JSON as MLServer's docs write it, and raw sockets where a
client misbehaves on purpose. Each error status of the door is pinned, a
deadline sent as ``Grpc-Timeout``, and a client that closes its connection
takes its queued job out of the pool's queue. Waits are on health Watch
streams; the pool's queue depth, which has no event, is polled.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import os
import random
import select
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import requests
import tritonclient.http as httpclient
from test_mlserver import CUSTOM
from tritonclient.utils import InferenceServerException

from poolserve.service.router.http_connection import INTERIM

from batch_models import ROWS_MODEL
from harness import rss_bytes
from serving import Serving, pool_status, wait_serving
from support import copy_echo_any, copy_example, write_model

pytestmark = pytest.mark.e2e

WAIT = 60.0  # generous: CI is a loaded two-core machine
SCALER = {
    "name": "scaler",
    "implementation": "model.Scaler",
    "parameters": {"extra": {"scale": 2.5}},
}
ROWS = {
    "name": "rows",
    "implementation": "model.RowsModel",
    "max_batch_size": 16,
    "max_batch_time": 5.0,
    "parameters": {"extra": {"preferred_batch_sizes": [4]}},
}
BROKEN = "raise RuntimeError('this model never loads')\n"


def _wait_serving(tree: Serving, service: str = "") -> None:
    async def wait() -> None:
        async with grpc.aio.insecure_channel(tree.address) as channel:
            await wait_serving(channel, service, timeout=WAIT)

    asyncio.run(wait())


def _http(tree: Serving) -> str:
    return (tree.run_dir / "http.addr").read_text().strip()


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Serving]:
    base = tmp_path_factory.mktemp("rest")
    repo = base / "repo"
    repo.mkdir()
    for name in ("echo", "sleep", "wordcount", "simple_sequence", "repeat_int32"):
        copy_example(repo, name)
    copy_echo_any(repo)  # echo declaring nothing: any inputs, any datatypes
    write_model(repo, "scaler", SCALER, CUSTOM)  # an MLServer MLModel, served unchanged
    write_model(repo, "rows", ROWS, ROWS_MODEL)  # batching: 4 rows start a batch
    with Serving(repo, base / "run") as serving:
        _wait_serving(serving)
        yield serving


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Serving]:
    """One worker, a queue of one, a model that never loads, and tight HTTP limits."""
    base = tmp_path_factory.mktemp("rest-small")
    repo = base / "repo"
    repo.mkdir()
    copy_example(repo, "sleep")
    write_model(repo, "broken", {"name": "broken", "implementation": "model.Broken"}, BROKEN)
    settings = {
        "max_queue": 1,
        "http_max_connections": 4,
        "handshake_timeout_s": 2,
        "max_unread_reply_bytes_total": 16 * 1024 * 1024,
    }
    (repo / "settings.json").write_text(json.dumps(settings))
    with Serving(repo, base / "run", workers=1) as serving:
        _wait_serving(serving, "model:sleep")
        yield serving


def _infer_body(data: list[float], **parameters: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "inputs": [{"name": "INPUT0", "shape": [1, len(data)], "datatype": "FP32", "data": data}]
    }
    if parameters:
        body["parameters"] = parameters
    return body


# -- health and metadata ---------------------------------------------------------


def test_health_and_metadata(tree: Serving) -> None:
    url = f"http://{_http(tree)}"
    assert requests.get(f"{url}/v2/health/live", timeout=WAIT).status_code == 200
    assert requests.get(f"{url}/v2/health/ready", timeout=WAIT).json() == {"ready": True}
    server = requests.get(f"{url}/v2", timeout=WAIT).json()
    assert server["name"] == "poolserve" and "model_repository" in server["extensions"]
    meta = requests.get(f"{url}/v2/models/echo", timeout=WAIT).json()
    assert meta["name"] == "echo"
    assert meta["inputs"] == [{"name": "INPUT0", "datatype": "FP32", "shape": [-1, -1]}]
    assert requests.get(f"{url}/v2/models/echo/versions/1", timeout=WAIT).json() == meta
    assert requests.get(f"{url}/v2/models/echo/ready", timeout=WAIT).status_code == 200
    missing = requests.get(f"{url}/v2/models/nope/ready", timeout=WAIT)
    assert missing.status_code == 503 and missing.json()["ready"] is False


def test_tritonclient_http_health_metadata_config(tree: Serving) -> None:
    client = httpclient.InferenceServerClient(_http(tree), network_timeout=WAIT)
    try:
        assert client.is_server_live() and client.is_server_ready()
        assert client.is_model_ready("echo") and not client.is_model_ready("nope")
        assert client.get_server_metadata()["name"] == "poolserve"
        assert client.get_model_metadata("echo")["outputs"][0]["name"] == "OUTPUT0"
        config = client.get_model_config("echo")
        assert config["input"][0] == {"name": "INPUT0", "data_type": "TYPE_FP32", "dims": [-1, -1]}
        stats = client.get_inference_statistics("echo")
        assert stats["model_stats"][0]["name"] == "echo"
    finally:
        client.close()


def test_repository_index_load_unload(tree: Serving) -> None:
    client = httpclient.InferenceServerClient(_http(tree), network_timeout=WAIT)
    try:
        index = {m["name"]: m["state"] for m in client.get_model_repository_index()}
        assert set(index.values()) == {"READY"}
        names = {
            "echo",
            "echo_any",
            "repeat_int32",
            "rows",
            "scaler",
            "simple_sequence",
            "sleep",
            "wordcount",
        }
        assert set(index) == names
        client.unload_model("wordcount")
        assert not client.is_model_ready("wordcount")
        client.load_model("wordcount")
        assert client.is_model_ready("wordcount")
        with pytest.raises(InferenceServerException) as failed:
            client.load_model("nope")
        assert "nope" in str(failed.value)
        stats = requests.get(f"http://{_http(tree)}/v2/models/stats", timeout=WAIT).json()
        assert {m["name"] for m in stats["model_stats"]} == set(index)
    finally:
        client.close()


# -- infer -----------------------------------------------------------------------


@pytest.mark.parametrize("binary_in", [True, False])
@pytest.mark.parametrize("binary_out", [True, False])
def test_tritonclient_http_infer(tree: Serving, binary_in: bool, binary_out: bool) -> None:
    client = httpclient.InferenceServerClient(_http(tree), network_timeout=WAIT)
    try:
        x = np.arange(16, dtype=np.float32).reshape(1, 16)
        h = np.linspace(-2, 2, 8, dtype=np.float16).reshape(2, 4)
        flags = np.array([[True, False, True]])
        big = np.array([[2**62, -(2**62)]], dtype=np.int64)
        inputs = []
        for name, arr, datatype in (
            ("INPUT0", x, "FP32"),
            ("INPUT1", h, "FP16"),
            ("INPUT2", flags, "BOOL"),
            ("INPUT3", big, "INT64"),
        ):
            tensor = httpclient.InferInput(name, list(arr.shape), datatype)
            tensor.set_data_from_numpy(arr, binary_data=binary_in)
            inputs.append(tensor)
        outputs = [
            httpclient.InferRequestedOutput(f"OUTPUT{i}", binary_data=binary_out) for i in range(4)
        ]
        result = client.infer("echo_any", inputs, outputs=outputs, request_id="r-1")
        assert result.get_response()["id"] == "r-1"
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), x)
        np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), h)
        np.testing.assert_array_equal(result.as_numpy("OUTPUT2"), flags)
        np.testing.assert_array_equal(result.as_numpy("OUTPUT3"), big)
        assert result.as_numpy("OUTPUT1").dtype == np.float16
    finally:
        client.close()


@pytest.mark.parametrize(
    ("request_encoding", "reply_encoding"), [("gzip", "deflate"), ("deflate", "gzip")]
)
def test_tritonclient_http_compression(
    tree: Serving, request_encoding: str, reply_encoding: str
) -> None:
    client = httpclient.InferenceServerClient(_http(tree), network_timeout=WAIT)
    try:
        x = np.arange(16, dtype=np.float32).reshape(1, 16)
        for binary in (True, False):
            tensor = httpclient.InferInput("INPUT0", [1, 16], "FP32")
            tensor.set_data_from_numpy(x, binary_data=binary)
            result = client.infer(
                "echo",
                [tensor],
                outputs=[httpclient.InferRequestedOutput("OUTPUT0", binary_data=binary)],
                request_compression_algorithm=request_encoding,
                response_compression_algorithm=reply_encoding,
            )
            np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), x)
    finally:
        client.close()


def test_compressed_bodies_as_curl_sends_them(tree: Serving) -> None:
    body = gzip.compress(json.dumps(_infer_body([1.0, 2.0])).encode())
    reply = _post(
        tree,
        "/v2/models/echo/infer",
        data=body,
        headers={"Content-Encoding": "gzip", "Accept-Encoding": "gzip"},
    )
    assert reply.status_code == 200 and reply.headers["content-encoding"] == "gzip"
    assert reply.json()["outputs"][0]["data"] == [1.0, 2.0]  # requests inflates it
    bomb = gzip.compress(b" " * (80 * 1024 * 1024))  # inflates past max_message_size
    too_big = _post(tree, "/v2/models/echo/infer", data=bomb, headers={"Content-Encoding": "gzip"})
    assert too_big.status_code == 413
    garbage = _post(tree, "/v2/models/echo/infer", data=b"xx", headers={"Content-Encoding": "gzip"})
    assert garbage.status_code == 400
    unknown = _post(tree, "/v2/models/echo/infer", data=body, headers={"Content-Encoding": "br"})
    assert unknown.status_code == 415


def test_large_binary_tensors_through_the_slabs(tree: Serving) -> None:
    client = httpclient.InferenceServerClient(_http(tree), network_timeout=WAIT)
    try:
        x = np.random.default_rng(7).standard_normal((1, 512 * 1024)).astype(np.float32)  # 2 MiB
        tensor = httpclient.InferInput("INPUT0", list(x.shape), "FP32")
        tensor.set_data_from_numpy(x)
        result = client.infer("echo", [tensor])
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), x)
        with pytest.raises(InferenceServerException, match="priority"):
            client.infer("echo", [tensor], priority=3)  # the pool read it from the envelope
    finally:
        client.close()


def test_tritonclient_http_bytes(tree: Serving) -> None:
    client = httpclient.InferenceServerClient(_http(tree), network_timeout=WAIT)
    try:
        for binary in (True, False):
            text = httpclient.InferInput("text", [2], "BYTES")
            text.set_data_from_numpy(
                np.array([b"one two three", b"Four"], dtype=object), binary_data=binary
            )
            out = httpclient.InferRequestedOutput("output-0", binary_data=binary)
            result = client.infer("wordcount", [text], outputs=[out])
            np.testing.assert_array_equal(result.as_numpy("output-0"), [[3], [1]])
        words = httpclient.InferInput("INPUT0", [1, 2], "BYTES")
        words.set_data_from_numpy(np.array([["héllo", "wörld"]], dtype=object), binary_data=False)
        result = client.infer(
            "echo_any",
            [words],
            outputs=[httpclient.InferRequestedOutput("OUTPUT0", binary_data=False)],
        )
        assert result.get_response()["outputs"][0]["data"] == ["héllo", "wörld"]
    finally:
        client.close()


def test_requests_json_as_mlserver_docs_write_it(tree: Serving) -> None:
    url = f"http://{_http(tree)}/v2/models/echo/infer"
    flat = requests.post(url, json=_infer_body([1.0, 2.5, -3.0]), timeout=WAIT)
    assert flat.status_code == 200
    assert flat.headers["content-type"] == "application/json"
    reply = flat.json()
    assert reply["model_name"] == "echo" and reply["model_version"] == "1"
    assert reply["outputs"] == [
        {"name": "OUTPUT0", "datatype": "FP32", "shape": [1, 3], "data": [1.0, 2.5, -3.0]}
    ]
    nested = {
        "inputs": [
            {"name": "INPUT0", "shape": [2, 2], "datatype": "INT32", "data": [[1, 2], [3, 4]]}
        ]
    }
    reply = requests.post(url.replace("/echo/", "/echo_any/"), json=nested, timeout=WAIT).json()
    assert reply["outputs"][0]["data"] == [1, 2, 3, 4]  # flat, row-major, as the peers answer
    binary = requests.post(url, json=_infer_body([1.0], binary_data_output=True), timeout=WAIT)
    assert binary.headers["content-type"] == "application/octet-stream"
    size = int(binary.headers["inference-header-content-length"])
    head = json.loads(binary.content[:size])
    assert head["outputs"][0]["parameters"] == {"binary_data_size": 4}
    assert np.frombuffer(binary.content[size:], np.float32).tolist() == [1.0]


def test_mlserver_model_over_rest_as_its_docs_call_it(tree: Serving) -> None:
    inference_request = {
        "inputs": [
            {"name": "x", "shape": [3], "datatype": "FP32", "data": [1.0, 2.0, 4.0]},
            {
                "name": "tag",
                "shape": [1],
                "datatype": "BYTES",
                "data": ["abc"],
                "parameters": {"content_type": "str"},
            },
        ]
    }
    endpoint = f"http://{_http(tree)}/v2/models/scaler/infer"
    response = requests.post(endpoint, json=inference_request, timeout=WAIT)
    assert response.status_code == 200, response.text
    output = response.json()["outputs"][0]
    assert output["data"] == [1.0 * 2.5 + 3, 2.0 * 2.5 + 3, 4.0 * 2.5 + 3]
    negative = {"inputs": [{**inference_request["inputs"][0], "data": [-1.0, 0, 0]}]}
    negative["inputs"].append(inference_request["inputs"][1])
    refused = requests.post(endpoint, json=negative, timeout=WAIT)
    assert refused.status_code == 400 and "negative input" in refused.json()["error"]
    generate = endpoint.removesuffix("/infer") + "/generate"  # MLServer's alias of infer
    reply = requests.post(generate, json=inference_request, timeout=WAIT)
    assert reply.status_code == 200 and reply.json()["outputs"][0] == output


def test_sequence_parameters_in_the_body_keep_a_sequence_on_its_worker(tree: Serving) -> None:
    client = httpclient.InferenceServerClient(_http(tree), network_timeout=WAIT)
    try:
        sums = []
        for i, value in enumerate((1, 2, 3, 4)):
            x = httpclient.InferInput("INPUT", [1, 1], "INT32")
            x.set_data_from_numpy(np.array([[value]], np.int32), binary_data=i % 2 == 0)
            result = client.infer(
                "simple_sequence",
                [x],
                sequence_id=7007,
                sequence_start=i == 0,
                sequence_end=i == 3,
            )
            sums.append(int(result.as_numpy("OUTPUT")[0, 0]))
        assert sums == [1, 3, 6, 10]  # one worker's running sum: the pool routed by sequence_id
        x = httpclient.InferInput("INPUT", [1, 1], "INT32")
        x.set_data_from_numpy(np.array([[1]], np.int32))
        with pytest.raises(InferenceServerException, match="unknown or expired"):
            client.infer("simple_sequence", [x], sequence_id=7007)  # it ended
    finally:
        client.close()


def test_priority_in_the_body_is_checked_by_the_pool(tree: Serving) -> None:
    reply = _post(tree, "/v2/models/echo/infer", json=_infer_body([1.0], priority=3))
    assert reply.status_code == 400 and "priority" in reply.json()["error"]


# -- errors ------------------------------------------------------------------------


def _post(tree: Serving, path: str, **kwargs: Any) -> requests.Response:
    return requests.post(f"http://{_http(tree)}{path}", timeout=WAIT, **kwargs)


def test_error_statuses(tree: Serving) -> None:
    unknown = _post(tree, "/v2/models/nope/infer", json=_infer_body([1.0]))
    assert unknown.status_code == 404 and "nope" in unknown.json()["error"]
    assert requests.get(f"http://{_http(tree)}/v2/models/nope", timeout=WAIT).status_code == 404
    bad_json = _post(tree, "/v2/models/echo/infer", data=b"{not json")
    assert bad_json.status_code == 400 and "JSON" in bad_json.json()["error"]
    wrong_type = {"inputs": [{"name": "INPUT0", "shape": [1], "datatype": "INT32", "data": ["a"]}]}
    reply = _post(tree, "/v2/models/echo/infer", json=wrong_type)
    assert reply.status_code == 400 and "INT32" in reply.json()["error"]
    wrong_count = {"inputs": [{"name": "INPUT0", "shape": [3], "datatype": "FP32", "data": [1]}]}
    assert _post(tree, "/v2/models/echo/infer", json=wrong_count).status_code == 400
    model_says = _post(tree, "/v2/models/sleep/infer", json=_infer_body([1.0], sleep_ms="x"))
    assert model_says.status_code == 400 and "sleep_ms" in model_says.json()["error"]
    bad_timeout = _post(
        tree, "/v2/models/echo/infer", json=_infer_body([1.0]), headers={"Grpc-Timeout": "soon"}
    )
    assert bad_timeout.status_code == 400 and "Grpc-Timeout" in bad_timeout.json()["error"]
    assert _post(tree, "/v2/nothing/here").status_code == 404


def test_a_path_called_with_another_method_is_405_naming_the_methods_it_takes(
    tree: Serving,
) -> None:
    """RFC 9110: 405 with an Allow header for a path the door serves with
    other methods, 404 for a path it does not serve, HEAD wherever GET goes."""
    base = f"http://{_http(tree)}"
    cases = [
        ("GET", "/v2/models/echo/infer", "POST"),
        ("PUT", "/v2/models/echo/infer", "POST"),
        ("POST", "/v2/models/echo", "GET, HEAD"),
        ("DELETE", "/v2/health/ready", "GET, HEAD"),
        ("GET", "/v2/repository/index", "POST"),
        ("GET", "/v2/systemsharedmemory/region/r/register", "POST"),
        ("POST", "/v2/systemsharedmemory/status", "GET, HEAD"),
        ("GET", "/v1/models/echo:predict", "POST"),
    ]
    for method, path, allow in cases:
        answer = requests.request(method, base + path, timeout=WAIT)
        assert (answer.status_code, answer.headers.get("allow")) == (405, allow), (method, path)
        assert path in answer.json()["error"]
    for method in ("GET", "PUT", "POST"):
        unknown = requests.request(method, base + "/v2/nothing/here", timeout=WAIT)
        assert (unknown.status_code, unknown.headers.get("allow")) == (404, None)
    got = requests.get(base + "/v2/models/echo", timeout=WAIT)
    head = requests.head(base + "/v2/models/echo", timeout=WAIT)
    assert (head.status_code, head.content) == (200, b"")
    assert head.headers["content-length"] == got.headers["content-length"] != "0"
    assert requests.head(base + "/v2/health/live", timeout=WAIT).status_code == 200
    assert requests.head(base + "/v2/models/nope", timeout=WAIT).status_code == 404
    # the connection stays usable after a HEAD: the next answer is whole
    with requests.Session() as session:
        assert session.head(base + "/v2/models/echo", timeout=WAIT).status_code == 200
        assert session.get(base + "/v2/models/echo", timeout=WAIT).json()["name"] == "echo"


def _raw(tree: Serving, request: bytes) -> bytes:
    """One request on a raw connection; everything the server sends until it closes."""
    host, port = _http(tree).rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=WAIT) as sock:
        sock.sendall(request)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def test_limits(tree: Serving) -> None:
    flood = b"x-filler: " + b"a" * 20000 + b"\r\n"
    answer = _raw(tree, b"GET /v2/health/live HTTP/1.1\r\nhost: x\r\n" + flood + b"\r\n")
    assert answer.startswith(b"HTTP/1.1 431 ")
    lying = (
        b"POST /v2/models/echo/infer HTTP/1.1\r\nhost: x\r\ncontent-length: 999999999999\r\n\r\n"
    )
    assert _raw(tree, lying).startswith(b"HTTP/1.1 413 ")
    assert _raw(tree, b"NOT HTTP AT ALL\r\n\r\n").startswith(b"HTTP/1.1 400 ")
    # the router is still there, and serves
    assert _post(tree, "/v2/models/echo/infer", json=_infer_body([1.0])).status_code == 200


def test_deadline_over_http(tree: Serving) -> None:
    reply = _post(
        tree,
        "/v2/models/sleep/infer",
        json=_infer_body([1.0], sleep_ms=10_000),
        headers={"Grpc-Timeout": "300m"},
    )
    assert reply.status_code == 504
    assert "deadline" in reply.json()["error"]


def test_not_ready_model_is_503(small: Serving) -> None:
    reply = _post(small, "/v2/models/broken/infer", json=_infer_body([1.0]))
    assert reply.status_code == 503, reply.text
    assert requests.get(f"http://{_http(small)}/v2/health/ready", timeout=WAIT).status_code == 503
    assert (
        requests.get(f"http://{_http(small)}/v2/models/broken/ready", timeout=WAIT).status_code
        == 503
    )


def _queue_depth(tree: Serving) -> int:
    return asyncio.run(pool_status(tree)).queue_depth


def _worker_busy(tree: Serving) -> bool:
    return any(w.state == "busy" for w in asyncio.run(pool_status(tree)).workers)


def _until(predicate: Any, what: str) -> None:
    end = time.monotonic() + WAIT
    while not predicate():  # the pool's status has no event to wait on
        assert time.monotonic() < end, f"{what} after {WAIT} s"
        time.sleep(0.02)


def _sleep_call(tree: Serving, sleep_ms: int, answers: list[int]) -> threading.Thread:
    def call() -> None:
        reply = _post(tree, "/v2/models/sleep/infer", json=_infer_body([1.0], sleep_ms=sleep_ms))
        answers.append(reply.status_code)

    thread = threading.Thread(target=call)
    thread.start()
    return thread


def test_timeout_parameter_ends_a_queued_call(small: Serving) -> None:
    answers: list[int] = []
    running = _sleep_call(small, 3000, answers)  # the one worker
    _until(lambda: _worker_busy(small), "no busy worker")
    queued = _post(small, "/v2/models/sleep/infer", json=_infer_body([1.0], timeout=200_000))
    assert queued.status_code == 504, queued.text  # Triton's timeout: 200 ms in the queue
    running.join(WAIT)
    assert answers == [200]


def test_full_queue_is_429_and_a_closed_connection_leaves_the_queue(small: Serving) -> None:
    answers: list[int] = []
    running = _sleep_call(small, 3000, answers)  # the one worker
    _until(lambda: _worker_busy(small), "no busy worker")
    # a queued call on a raw connection, then a call the full queue refuses
    host, port = _http(small).rsplit(":", 1)
    body = json.dumps(_infer_body([1.0], sleep_ms=0)).encode()
    queued = socket.create_connection((host, int(port)), timeout=WAIT)
    queued.sendall(
        b"POST /v2/models/sleep/infer HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n" % len(body) + body
    )
    _until(lambda: _queue_depth(small) == 1, "the call is not queued")
    refused = _post(small, "/v2/models/sleep/infer", json=_infer_body([1.0], sleep_ms=0))
    assert refused.status_code == 429, refused.text
    assert "queue" in refused.json()["error"]
    before = _successes(small, "sleep")
    queued.close()  # the client goes away: its job leaves the queue at once
    _until(lambda: _queue_depth(small) == 0, "the closed connection's job is still queued")
    running.join(WAIT)
    assert answers == [200]
    assert _successes(small, "sleep") == before + 1  # the running call's; the closed one never ran


def _successes(tree: Serving, model: str) -> int:
    reply = requests.get(f"http://{_http(tree)}/v2/models/{model}/stats", timeout=WAIT)
    assert reply.status_code == 200, reply.text
    (stats,) = reply.json()["model_stats"]
    return int(stats["inference_stats"]["success"].get("count", 0))  # 0 is left out


def test_a_call_whose_client_closed_while_it_ran_is_cancelled(small: Serving) -> None:
    """A FIN after a whole request, from a client that closed its socket (curl -m):
    the door's interim 100 Continue is reset, and the call is cancelled; the pool
    kills its worker at abandon_grace (the gRPC door's cancel), and serves on."""
    host, port = _http(small).rsplit(":", 1)
    body = json.dumps(_infer_body([1.0], sleep_ms=120_000)).encode()
    gone = socket.create_connection((host, int(port)), timeout=WAIT)
    gone.sendall(_infer_request("sleep", body))
    _until(lambda: _worker_busy(small), "no busy worker")
    before = _successes(small, "sleep")
    gone.close()
    _until(lambda: not _worker_busy(small), "the closed call's worker still runs it")
    assert _post(small, "/v2/models/sleep/infer", json=_infer_body([2.0])).status_code == 200
    assert _successes(small, "sleep") == before + 1


def test_connection_limit_and_silent_connections(small: Serving) -> None:
    host, port = _http(small).rsplit(":", 1)
    idle = [socket.create_connection((host, int(port)), timeout=WAIT) for _ in range(4)]
    try:
        assert _raw(small, b"GET /v2/health/live HTTP/1.1\r\nhost: x\r\n\r\n").startswith(
            b"HTTP/1.1 503 "
        )
        # a connection that sends no request line is closed after handshake_timeout_s
        assert idle[0].recv(65536).startswith(b"HTTP/1.1 408 ")
    finally:
        for sock in idle:
            sock.close()
    live = requests.get(f"http://{_http(small)}/v2/health/live", timeout=WAIT)
    assert live.status_code == 200


def test_rest_calls_are_in_the_metrics(tree: Serving) -> None:
    for _ in range(3):
        assert _post(tree, "/v2/models/echo/infer", json=_infer_body([1.0])).status_code == 200
    metrics = (tree.run_dir / "metrics.addr").read_text().strip()
    text = requests.get(f"http://{metrics}/metrics", timeout=WAIT).text
    counts = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("nv_inference_count{") and 'model="echo"' in line
    ]
    assert counts and counts[0] >= 3, text[:2000]


def test_system_shared_memory_over_rest(tree: Serving) -> None:
    import tritonclient.utils.shared_memory as shm

    client = httpclient.InferenceServerClient(_http(tree), network_timeout=WAIT)
    prefix = f"poolserve_rest_{os.getpid()}"
    x = np.arange(16, dtype=np.float32).reshape(1, 16)
    handles = []
    try:
        for name in ("in", "out"):
            handles.append(shm.create_shared_memory_region(name, f"/{prefix}_{name}", x.nbytes))
            client.register_system_shared_memory(name, f"/{prefix}_{name}", x.nbytes)
        shm.set_shared_memory_region(handles[0], [x])
        status = client.get_system_shared_memory_status()
        assert {r["name"] for r in status} == {"in", "out"}
        tensor = httpclient.InferInput("INPUT0", [1, 16], "FP32")
        tensor.set_shared_memory("in", x.nbytes)
        output = httpclient.InferRequestedOutput("OUTPUT0")
        output.set_shared_memory("out", x.nbytes)
        result = client.infer("echo", [tensor], outputs=[output])
        assert result.get_output("OUTPUT0")["parameters"]["shared_memory_region"] == "out"
        got = shm.get_contents_as_numpy(handles[1], np.float32, [1, 16])
        np.testing.assert_array_equal(got, x)
        with pytest.raises(InferenceServerException, match="not supported"):
            client.register_cuda_shared_memory("gpu", b"", 0, 16)
        client.unregister_system_shared_memory()
        assert client.get_system_shared_memory_status() == []
        with pytest.raises(InferenceServerException, match="in") as gone:
            client.infer("echo", [tensor], outputs=[output])
        assert "[400]" in str(gone.value)
    finally:
        client.close()
        for handle in handles:
            shm.destroy_shared_memory_region(handle)


HOSTILE = [
    b"GET\r\n\r\n",
    b"GET / HTTP/9.9\r\n\r\n",
    b"POST /v2/models/echo/infer HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n",
    b"POST /v2/models/echo/infer HTTP/1.1\r\nhost: x\r\ncontent-length: -5\r\n\r\n",
    b"POST /v2/models/echo/infer HTTP/1.1\r\ncontent-length: 1\r\ncontent-length: 2\r\n\r\n",
    b"\x00\x01\x02\x03" * 64,
    b"GET /v2/health/live HTTP/1.1\r\n" + b"x-a: b\r\n" * 3000 + b"\r\n",  # 431
]


@pytest.mark.parametrize("request_bytes", HOSTILE)
def test_hostile_requests_get_a_4xx_and_the_router_serves_on(
    tree: Serving, request_bytes: bytes
) -> None:
    answer = _raw(tree, request_bytes)
    assert answer == b"" or answer[9:10] == b"4", answer[:200]
    assert _post(tree, "/v2/models/echo/infer", json=_infer_body([1.0])).status_code == 200


def test_json_bombs_and_wrong_types_are_400(tree: Serving) -> None:
    deep = "[" * 100_000 + "]" * 100_000
    body = (
        '{"inputs": [{"name": "INPUT0", "shape": [1], "datatype": "FP32", "data": ' + deep + "}]}"
    )
    reply = _post(tree, "/v2/models/echo/infer", data=body.encode())
    assert reply.status_code == 400
    huge = {"inputs": [{"name": "INPUT0", "shape": [1], "datatype": "FP32", "data": [0] * 500_000}]}
    assert _post(tree, "/v2/models/echo/infer", json=huge).status_code == 400
    for bad in ({"inputs": "x"}, [], {"inputs": [{"name": 1}]}, {"inputs": [None]}):
        assert _post(tree, "/v2/models/echo/infer", json=bad).status_code == 400, bad


def test_a_body_shorter_than_its_length_ends_at_the_deadline(tree: Serving) -> None:
    host, port = _http(tree).rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=WAIT) as sock:
        sock.sendall(
            b"POST /v2/models/echo/infer HTTP/1.1\r\nhost: x\r\ngrpc-timeout: 500m\r\n"
            b"content-length: 1000\r\n\r\n{"
        )
        answer = sock.recv(65536)
    assert answer.startswith(b"HTTP/1.1 504 "), answer[:200]


def _half_closed(tree: Serving, request: bytes) -> bytes:
    """``request`` on a raw connection, then the write side shut (``nc -N``);
    everything the server sends until it closes."""
    host, port = _http(tree).rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=WAIT) as sock:
        sock.sendall(request)
        sock.shutdown(socket.SHUT_WR)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def _final(answer: bytes) -> bytes:
    """An answer without the interim 100 Continue the door sends when the EOF
    came before it (an HTTP/1.1 client reads past any 1xx)."""
    return answer.removeprefix(INTERIM)


def _infer_request(model: str, body: bytes, length: int | None = None) -> bytes:
    return (
        b"POST /v2/models/%s/infer HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n" % (model.encode(), len(body) if length is None else length)
    ) + body


@pytest.mark.parametrize(("model", "parameters"), [("echo", {}), ("sleep", {"sleep_ms": 300})])
def test_a_whole_request_then_a_half_close_is_answered(
    tree: Serving, model: str, parameters: dict[str, Any]
) -> None:
    """A client that shuts its write side after a whole request gets its answer,
    then the connection closes (nginx's behaviour); the sleep model's call is
    in the pool when the EOF comes."""
    values = [1.0, 2.0, 3.0]
    body = json.dumps(_infer_body(values, **parameters)).encode()
    answer = _half_closed(tree, _infer_request(model, body))
    if parameters:  # the EOF came while the call ran: an interim answer went first
        assert answer.startswith(INTERIM), answer[:300]
    head, _, rest = _final(answer).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 "), answer[:300]
    if parameters:  # the answer says it closes
        assert b"connection: close" in head.lower(), head
    assert json.loads(rest)["outputs"][0]["data"] == values


def test_pipelined_requests_then_a_half_close_are_all_answered(tree: Serving) -> None:
    slow = json.dumps(_infer_body([1.0], sleep_ms=200)).encode()
    fast = json.dumps(_infer_body([2.0])).encode()
    answer = _final(
        _half_closed(tree, _infer_request("sleep", slow) + _infer_request("echo", fast))
    )
    assert answer.count(b"HTTP/1.1 200 ") == 2, answer[:600]
    assert b'"data":[1.0]' in answer and b'"data":[2.0]' in answer


def test_a_half_close_in_the_middle_of_a_body_drops_the_call(tree: Serving) -> None:
    body = json.dumps(_infer_body([1.0])).encode()
    answer = _half_closed(tree, _infer_request("echo", body[:10], length=len(body)))
    assert not answer.startswith(b"HTTP/1.1 200 "), answer[:300]
    assert _post(tree, "/v2/models/echo/infer", json=_infer_body([1.0])).status_code == 200


def test_kserve_v1_predict_and_model_readiness(tree: Serving) -> None:
    url = f"http://{_http(tree)}/v1/models"
    reply = requests.post(f"{url}/echo:predict", json={"instances": [[1, 2], [3, 4]]}, timeout=WAIT)
    assert reply.status_code == 200, reply.text
    assert reply.json() == {"predictions": [[1.0, 2.0], [3.0, 4.0]]}
    words = requests.post(
        f"{url}/wordcount:predict", json={"instances": ["one two", "three"]}, timeout=WAIT
    )
    assert words.json() == {"predictions": [[2], [1]]}
    assert requests.get(f"{url}/echo", timeout=WAIT).json() == {"name": "echo", "ready": True}
    assert requests.get(f"{url}/nope", timeout=WAIT).status_code == 503
    assert (
        requests.post(f"{url}/nope:predict", json={"instances": [1]}, timeout=WAIT).status_code
        == 404
    )
    empty = requests.post(f"{url}/echo:predict", json={"instances": []}, timeout=WAIT)
    assert empty.status_code == 400 and "instances" in empty.json()["error"]


def test_tritonclient_http_aio(tree: Serving) -> None:
    import tritonclient.http.aio as aioclient

    async def calls() -> None:
        client = aioclient.InferenceServerClient(_http(tree), conn_timeout=WAIT)
        try:
            assert await client.is_server_ready()
            x = np.arange(16, dtype=np.float32).reshape(1, 16)
            results = []
            for binary in (True, False):
                tensor = aioclient.InferInput("INPUT0", [1, 16], "FP32")
                tensor.set_data_from_numpy(x, binary_data=binary)
                out = aioclient.InferRequestedOutput("OUTPUT0", binary_data=binary)
                results.append(client.infer("echo", [tensor], outputs=[out]))
            for result in await asyncio.gather(*results):
                np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), x)
        finally:
            await client.close()

    asyncio.run(calls())


def test_rest_calls_share_a_batch(tree: Serving) -> None:
    def call(value: float, binary: bool) -> dict[str, Any]:
        client = httpclient.InferenceServerClient(_http(tree), network_timeout=WAIT)
        try:
            x = httpclient.InferInput("INPUT0", [1, 2], "FP32")
            x.set_data_from_numpy(np.array([[value, 1.0]], np.float32), binary_data=binary)
            outputs = [
                httpclient.InferRequestedOutput(name, binary_data=binary)
                for name in ("DOUBLE", "BATCH", "NAME")
            ]
            result = client.infer("rows", [x], outputs=outputs)
            return {
                "double": result.as_numpy("DOUBLE").tolist(),
                "batch": int(result.as_numpy("BATCH")[0]),
                "name": result.as_numpy("NAME")[0],
            }
        finally:
            client.close()

    answers: dict[float, dict[str, Any]] = {}

    def run(value: float) -> None:
        answers[value] = call(value, binary=value % 2 == 0)

    busy: list[int] = []
    blockers = [_sleep_call(tree, 5000, busy) for _ in range(2)]  # both workers
    _until(lambda: all(w.state == "busy" for w in asyncio.run(pool_status(tree)).workers), "idle")
    threads = [threading.Thread(target=run, args=(float(v),)) for v in range(4)]
    for thread in threads:
        thread.start()
    _until(lambda: _queue_depth(tree) == 4, "the calls are not queued")
    for thread in [*threads, *blockers]:
        thread.join(WAIT)
    assert busy == [200, 200]
    assert sorted(answers) == [0.0, 1.0, 2.0, 3.0]
    for value, answer in answers.items():
        assert answer["double"] == [[2 * value, 2.0]]  # each caller its own rows
        assert answer["name"] in (f"row {value:g}", f"row {value:g}".encode())
    # queued behind busy workers, REST calls share a batch as gRPC calls do
    assert max(answer["batch"] for answer in answers.values()) > 1


def _events(reply: requests.Response) -> list[dict[str, Any]]:
    assert reply.headers["content-type"] == "text/event-stream"
    return [
        json.loads(line[len(b"data: ") :])
        for line in reply.content.split(b"\n\n")
        if line.startswith(b"data: ")
    ]


def test_generate_stream_sends_a_decoupled_models_responses_as_events(tree: Serving) -> None:
    body = {
        "inputs": [
            {"name": "IN", "shape": [3], "datatype": "INT32", "data": [4, 5, 6]},
            {"name": "DELAY", "shape": [3], "datatype": "UINT32", "data": [0, 0, 0]},
            {"name": "WAIT", "shape": [1], "datatype": "UINT32", "data": [0]},
        ]
    }
    reply = _post(tree, "/v2/models/repeat_int32/generate_stream", json=body)
    assert reply.status_code == 200, reply.text
    events = _events(reply)
    assert [e["outputs"][0]["data"] for e in events] == [[4], [5], [6]]
    assert [e["outputs"][1]["data"] for e in events] == [[0], [1], [2]]
    unary = _post(tree, "/v2/models/echo/generate_stream", json=_infer_body([2.0]))
    assert [e["outputs"][0]["data"] for e in _events(unary)] == [[2.0]]  # one response
    refused = _post(tree, "/v2/models/repeat_int32/infer", json=body)
    assert refused.status_code >= 400  # a decoupled model streams only
    missing = _post(tree, "/v2/models/nope/generate_stream", json=body)
    assert missing.status_code == 404
    bad = _post(tree, "/v2/models/repeat_int32/generate_stream", json={"inputs": []})
    assert bad.status_code == 400 and "inputs" in bad.json()["error"]  # before any event


def _router_pid(tree: Serving) -> int:
    for pid in tree.snapshot():
        with contextlib.suppress(OSError):
            if Path(f"/proc/{pid}/comm").read_text().strip() == "poolserve-rtr":
                return pid
    raise AssertionError("no router process")


def _garbage(rng: random.Random) -> bytes:
    """One malformed or hostile request, chosen at random."""
    body = json.dumps(_infer_body([rng.random()])).encode()
    choices = [
        lambda: rng.randbytes(rng.randint(1, 300)),
        lambda: (
            b"POST /v2/models/echo/infer HTTP/1.1\r\ncontent-length: %d\r\n\r\n" % 10**6
            + rng.randbytes(100)
        ),
        lambda: (
            b"POST /v2/models/echo/infer HTTP/1.1\r\ncontent-length: %d\r\n\r\n%s"
            % (len(body), body[: rng.randint(0, len(body))].replace(b"[", b"{"))
        ),
        lambda: b"GET /v2/" + b"x" * rng.randint(1, 20000) + b" HTTP/1.1\r\n\r\n",
        lambda: (
            b"POST /v2/models/echo/infer HTTP/1.1\r\ntransfer-encoding: chunked\r\n\r\n"
            + rng.randbytes(50)
        ),
        lambda: (
            b"POST /v2/models/echo/infer HTTP/1.1\r\ninference-header-content-length: 99"
            b"\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
        ),
    ]
    return rng.choice(choices)()


def test_the_router_survives_garbage_and_its_memory_stays_flat(tree: Serving) -> None:
    host, port = _http(tree).rsplit(":", 1)
    pid = _router_pid(tree)
    rng = random.Random(29)

    def round_(count: int) -> None:
        for _ in range(count):
            with socket.create_connection((host, int(port)), timeout=WAIT) as sock:
                sock.sendall(_garbage(rng))
                sock.shutdown(socket.SHUT_WR)  # the client is done: the router answers or closes
                while sock.recv(65536):
                    pass

    round_(100)  # warm: the router's caches and arenas reach their size
    before = rss_bytes(pid)
    round_(400)
    grown = rss_bytes(pid) - before
    assert grown < 32 * 1024 * 1024, f"the router grew {grown} bytes over 400 bad requests"
    assert _router_pid(tree) == pid  # the same router: it never died
    assert _post(tree, "/v2/models/echo/infer", json=_infer_body([1.0])).status_code == 200


def _binary_request(values: np.ndarray, **parameters: Any) -> tuple[int, bytes]:
    """(Inference-Header-Content-Length, body) of a binary-extension call."""
    head = json.dumps(
        {
            "inputs": [
                {
                    "name": "INPUT0",
                    "shape": list(values.shape),
                    "datatype": "FP32",
                    "parameters": {"binary_data_size": values.nbytes},
                }
            ],
            "parameters": {"binary_data_output": True, **parameters},
        }
    ).encode()
    return len(head), head + values.tobytes()


def _post_binary(tree: Serving, values: np.ndarray, **parameters: Any) -> requests.Response:
    length, body = _binary_request(values, **parameters)
    headers = {"Inference-Header-Content-Length": str(length)}
    return _post(tree, "/v2/models/sleep/infer", data=body, headers=headers)  # sleep echoes


def test_a_client_that_does_not_read_is_bounded_by_the_reply_budget(small: Serving) -> None:
    host, port = _http(small).rsplit(":", 1)
    big = np.ones((1, 8 * 1024 * 1024), np.float32)  # a 32 MiB reply
    length, body = _binary_request(big, sleep_ms=0)
    with socket.create_connection((host, int(port)), timeout=WAIT) as silent:
        silent.sendall(
            b"POST /v2/models/sleep/infer HTTP/1.1\r\nhost: x\r\n"
            b"inference-header-content-length: %d\r\ncontent-length: %d\r\n\r\n"
            % (length, len(body))
            + body
        )
        # its reply has begun: the rest waits in the router, counted
        assert select.select([silent], [], [], WAIT)[0], "no reply began"
        refused = _post_binary(small, big, sleep_ms=0)
        assert refused.status_code == 429, refused.text
        assert "max_unread_reply_bytes_total" in refused.json()["error"]
    # the silent client left: its reply is released, and large replies go out again
    medium = np.ones((1, 256 * 1024), np.float32)
    _until(
        lambda: _post_binary(small, medium, sleep_ms=0).status_code == 200,
        "large replies are still refused after the silent client left",
    )


# -- the REST wrapper's fields are the HTTP door's own -----------------------------------


def _forged_wrapper() -> bytes:
    """What the HTTP door would send a pool for an echo call: a ModelInferRequest
    of fields 1 and 4095 (the body), as a gRPC client could write it."""
    from poolserve.service.contract.rest import RestHead, wrap_head

    body = json.dumps(_infer_body([1.0, 2.0])).encode()
    return wrap_head("echo", "", len(body), RestHead()) + body


def test_grpc_requests_carrying_the_rest_fields_are_refused(tree: Serving) -> None:
    from poolserve.protos import inference_pb2 as pb

    forged = _forged_wrapper()
    with grpc.insecure_channel(tree.address) as channel:
        infer = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
        with pytest.raises(grpc.RpcError) as refused:
            infer(forged, timeout=WAIT)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "field 4095 is reserved" in (refused.value.details() or "")
        # a well-formed request that also carries one (priority's place taken by 4089)
        plain = pb.ModelInferRequest(model_name="echo")
        tensor = plain.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 1])
        tensor.contents.fp32_contents.append(1.0)
        with pytest.raises(grpc.RpcError) as refused:
            infer(plain.SerializeToString() + b"\xc8\xff\x01\x01", timeout=WAIT)  # field 4089
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "field 4089 is reserved" in (refused.value.details() or "")
        assert pb.ModelInferResponse.FromString(infer(plain.SerializeToString(), timeout=WAIT))
        # in a stream: first or later, each is answered with the error, the stream goes on
        stream = channel.stream_stream("/inference.GRPCInferenceService/ModelStreamInfer")
        answers = [
            pb.ModelStreamInferResponse.FromString(reply)
            for reply in stream(iter([forged, plain.SerializeToString(), forged]), timeout=WAIT)
        ]
    assert len(answers) == 3
    assert "field 4095 is reserved" in answers[0].error_message
    assert not answers[1].error_message and answers[1].infer_response.model_name == "echo"
    assert "field 4095 is reserved" in answers[2].error_message


def test_scheduling_parameters_of_compressed_and_large_bodies(tree: Serving) -> None:
    """A gzip body's priority is checked by the pool as a plain one's; one in a
    JSON too large for the pool to read is refused, not ignored."""
    compressed = gzip.compress(json.dumps(_infer_body([1.0], priority=3)).encode())
    reply = _post(
        tree,
        "/v2/models/echo/infer",
        data=compressed,
        headers={"Content-Encoding": "gzip", "Content-Type": "application/json"},
    )
    assert reply.status_code == 400 and "priority" in reply.json()["error"]
    large = _infer_body([0.5] * 20_000, priority=1)
    reply = _post(tree, "/v2/models/echo/infer", json=large)
    assert (
        reply.status_code == 400 and "'priority' is in a JSON of more than" in reply.json()["error"]
    )
    del large["parameters"]
    assert _post(tree, "/v2/models/echo/infer", json=large).status_code == 200


def test_kserve_inference_rest_client_calls(tree: Serving) -> None:
    """The calls of KServe's ``InferenceRESTClient`` (kserve 0.21, inference_client.py),
    made as it makes them: an httpx.AsyncClient, orjson bodies, JSON or binary
    tensors (Inference-Header-Content-Length, application/octet-stream), the reply
    split at that header, errors read from ``{"error"}`` when the content type is
    exactly application/json. (The kserve package is not in the test extra:
    see pyproject.toml.)"""
    import httpx
    import orjson

    base = f"http://{_http(tree)}"
    values = np.array([[1.5, -2.0, 3.25]], np.float32)

    async def calls() -> None:
        async with httpx.AsyncClient(timeout=WAIT) as client:
            ready = await client.get(f"{base}/v2/health/ready")
            assert ready.is_success and ready.json().get("ready") is True
            live = await client.get(f"{base}/v2/health/live")
            assert live.json().get("live") is True
            model = await client.get(f"{base}/v2/models/echo/ready")
            assert model.is_success
            # JSON tensors
            doc = {
                "id": "k1",
                "inputs": [
                    {
                        "name": "INPUT0",
                        "shape": [1, 3],
                        "datatype": "FP32",
                        "data": values.ravel().tolist(),
                    }
                ],
            }
            reply = await client.post(
                f"{base}/v2/models/echo/infer",
                content=orjson.dumps(doc),
                headers={"content-type": "application/json"},
            )
            assert reply.is_success
            length = int(reply.headers.get("inference-header-content-length", len(reply.content)))
            out = orjson.loads(reply.content[:length])
            assert out["id"] == "k1" and out["outputs"][0]["data"] == values.ravel().tolist()
            # binary tensors both ways, as InferRequest.to_rest() writes them
            doc = {
                "id": "k2",
                "inputs": [
                    {
                        "name": "INPUT0",
                        "shape": [1, 3],
                        "datatype": "FP32",
                        "parameters": {"binary_data_size": values.nbytes},
                    }
                ],
                "outputs": [{"name": "OUTPUT0", "parameters": {"binary_data": True}}],
            }
            text = orjson.dumps(doc)
            reply = await client.post(
                f"{base}/v2/models/echo/infer",
                content=text + values.tobytes(),
                headers={
                    "inference-header-content-length": str(len(text)),
                    "content-type": "application/octet-stream",
                },
            )
            assert reply.is_success
            length = int(reply.headers["inference-header-content-length"])
            head = orjson.loads(reply.content[:length])
            size = head["outputs"][0]["parameters"]["binary_data_size"]
            got = np.frombuffer(reply.content[length : length + size], np.float32)
            assert got.tolist() == values.ravel().tolist()
            # V1, and an error as the client reads it
            v1 = await client.post(
                f"{base}/v1/models/echo:predict",
                content=orjson.dumps({"instances": values.tolist()}),
                headers={"content-type": "application/json"},
            )
            assert v1.is_success and v1.json()["predictions"] == values.tolist()
            missing = await client.post(
                f"{base}/v2/models/nope/infer",
                content=orjson.dumps(doc),
                headers={"content-type": "application/json"},
            )
            assert missing.status_code == 404
            assert missing.headers["content-type"] == "application/json"
            assert "nope" in missing.json()["error"]

    asyncio.run(calls())


def test_a_body_in_chunks_over_several_reads_is_forwarded_whole(tree: Serving) -> None:
    """The door keeps a body's chunks as they come (chunked encoding, split over
    reads, the handler waiting for the rest) and forwards them joined."""
    host, port = _http(tree).rsplit(":", 1)
    values = [float(i) for i in range(300)]
    body = json.dumps(_infer_body(values)).encode()
    with socket.create_connection((host, int(port)), timeout=WAIT) as sock:
        sock.sendall(
            b"POST /v2/models/echo/infer HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n"
        )
        for start in range(0, len(body), 700):
            piece = body[start : start + 700]
            sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
            select.select([], [], [], 0.01)  # separate reads at the router, not a handshake
        sock.sendall(b"0\r\n\r\n")
        answer = b""
        while b"\r\n\r\n" not in answer:
            answer += sock.recv(65536)
        head, _, rest = answer.partition(b"\r\n\r\n")
        length = int(
            next(
                line for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")
            ).split(b":")[1]
        )
        while len(rest) < length:
            rest += sock.recv(65536)
    assert head.startswith(b"HTTP/1.1 200 ")
    assert json.loads(rest)["outputs"][0]["data"] == values


def test_corked_writes_go_out_as_one() -> None:
    import asyncio as aio

    from poolserve.service.router.http_io import Corked

    class Transport(aio.Transport):
        def __init__(self) -> None:
            super().__init__()
            self.writes: list[bytes] = []
            self.closed = False

        def write(self, data: Any) -> None:
            self.writes.append(bytes(data))

        def close(self) -> None:
            self.closed = True

        def is_closing(self) -> bool:
            return self.closed

    inner = Transport()
    corked = Corked(inner)
    corked.write(b"a")
    corked.cork()
    corked.write(b"head")
    corked.write(memoryview(b"body"))
    assert inner.writes == [b"a"]
    corked.uncork()
    assert inner.writes == [b"a", b"headbody"]
    corked.cork()
    corked.write(b"last")
    corked.close()  # what is gathered goes before the close
    assert inner.writes[-1] == b"last" and inner.closed
    corked.end()
    corked.write(b"x")
    assert inner.writes[-1] == b"last"
