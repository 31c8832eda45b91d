"""The response cache (issue 44, item 3), end to end through a real tree and
both doors: tritonclient.grpc and tritonclient.http calls to a model with
``parameters.extra.response_cache``, its hits and misses in ModelStatistics
and on /metrics, a hit's reply bytes equal to a computed reply's (with the
request's own id), a model without the setting unaffected, different inputs
or parameters missing, and the cache's bounds kept under 100,000 distinct
requests. The key and the LRU alone: test_response_cache_unit.py."""

from __future__ import annotations

import asyncio
import json
import shutil
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from poolserve.protos import inference_pb2 as pb

from serving import Serving, wait_serving
from support import EXAMPLES, copy_example, infer_request

pytestmark = pytest.mark.e2e

WAIT = 60.0  # generous: CI is a loaded two-core machine
MAX_ENTRIES = 1000
MAX_BYTES = 1024 * 1024
DISTINCT = 100_000
INFER = "/inference.GRPCInferenceService/ModelInfer"


def _cached_echo(repo: Path, name: str, **more: Any) -> None:
    folder = repo / name
    shutil.copytree(EXAMPLES / "echo", folder, ignore=shutil.ignore_patterns("__pycache__"))
    settings = json.loads((folder / "model-settings.json").read_text())
    settings["name"] = name
    extra = {"response_cache": True, **more.pop("extra", {})}
    settings["parameters"] = {**more.pop("parameters", {}), "extra": extra}
    settings.update(more)
    (folder / "model-settings.json").write_text(json.dumps(settings))


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Serving]:
    base = tmp_path_factory.mktemp("cache")
    repo = base / "repo"
    repo.mkdir()
    copy_example(repo, "echo")  # no cache: unaffected
    _cached_echo(repo, "echo_cached")  # on the default pool's workers
    # inline and fast, in a pool of its own: many distinct requests quickly
    _cached_echo(
        repo,
        "echo_bounded",
        parameters={"inference_pool_gid": "bounded"},
        extra={"inline_fast": True},
        parallel_workers=0,
    )
    bounds = {"response_cache_entries": MAX_ENTRIES, "response_cache_bytes": MAX_BYTES}
    (repo / "settings.json").write_text(json.dumps(bounds))
    with Serving(repo, base / "run") as serving:

        async def wait() -> None:
            async with grpc.aio.insecure_channel(serving.address) as channel:
                await wait_serving(channel, timeout=WAIT * 2)

        asyncio.run(wait())
        yield serving


def _http(tree: Serving) -> str:
    return (tree.run_dir / "http.addr").read_text().strip()


def _metrics(tree: Serving) -> dict[str, float]:
    """Every sample of the router's /metrics, by its line's name and labels."""
    address = (tree.run_dir / "metrics.addr").read_text().strip()
    text = requests.get(f"http://{address}/metrics", timeout=WAIT).text
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            samples[key] = float(value)
    return samples


def _model_sample(samples: dict[str, float], family: str, model: str) -> float:
    label = f'model="{model}"'
    found = [v for k, v in samples.items() if k.startswith(family + "{") and label in k]
    assert len(found) == 1, (family, model, sorted(samples)[:50])
    return found[0]


def _stats(client: grpcclient.InferenceServerClient, model: str) -> Any:
    reply = client.get_inference_statistics(model, as_json=True)
    return reply["model_stats"][0]


def _count(stats: dict[str, Any], field: str) -> int:
    return int(stats["inference_stats"].get(field, {}).get("count", 0))


def _request(model: str, data: np.ndarray, ident: str = "", **params: Any) -> bytes:
    return infer_request(model, data.astype(np.float32), ident=ident, **params)


def _raw_infer(tree: Serving, *requests_: bytes) -> list[bytes]:
    async def run() -> list[bytes]:
        async with grpc.aio.insecure_channel(tree.address) as channel:
            call = channel.unary_unary(INFER)
            return [bytes(await call(r, timeout=WAIT)) for r in requests_]

    return asyncio.run(run())


def _tally(tree: Serving, model: str = "echo_cached") -> dict[str, float]:
    """The model's counts in ModelStatistics and on /metrics (each test reads
    what its own calls added: the tree is the module's)."""
    with grpcclient.InferenceServerClient(tree.address) as client:
        stats = _stats(client, model)
    samples = _metrics(tree)
    return {
        "hits": _count(stats, "cache_hit"),
        "misses": _count(stats, "cache_miss"),
        "successes": _count(stats, "success"),
        "computed": _count(stats, "compute_infer"),
        "inferences": int(stats.get("inference_count", 0)),
        "executions": int(stats.get("execution_count", 0)),
        "metric hits": _model_sample(samples, "nv_cache_num_hits_per_model", model),
        "metric misses": _model_sample(samples, "nv_cache_num_misses_per_model", model),
        "metric successes": _model_sample(samples, "nv_inference_request_success", model),
        "metric inferences": _model_sample(samples, "nv_inference_count", model),
    }


def _added(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {key: after[key] - before[key] for key in after}


def _cache_counts(hits: int, misses: int) -> dict[str, float]:
    """What ``hits`` hits and ``misses`` computed calls add, as Triton counts them."""
    calls = hits + misses
    return {
        "hits": hits,
        "misses": misses,
        "successes": calls,
        "computed": misses,
        "inferences": misses,  # hits are not inferences, nor executions (Triton)
        "executions": misses,
        "metric hits": hits,
        "metric misses": misses,
        "metric successes": calls,
        "metric inferences": misses,
    }


def test_grpc_hits_are_counted_and_the_same_bytes(tree: Serving) -> None:
    x = np.arange(16, dtype=np.float32).reshape(1, 16)
    before = _tally(tree)
    computed, again, other_id = _raw_infer(
        tree,
        _request("echo_cached", x, "first"),
        _request("echo_cached", x, "first"),
        _request("echo_cached", x, "an-id-of-another-length"),
    )
    assert again == computed  # the hit: the computed reply's bytes
    reply = pb.ModelInferResponse.FromString(computed)
    assert reply.SerializeToString() == computed  # (protobuf writes what the worker did)
    reply.id = "an-id-of-another-length"
    assert other_id == reply.SerializeToString()  # the request's own id, as computed
    no_id = _raw_infer(tree, _request("echo_cached", x))[0]
    reply.id = ""
    assert no_id == reply.SerializeToString()

    with grpcclient.InferenceServerClient(tree.address) as client:
        tensor = grpcclient.InferInput("INPUT0", [1, 16], "FP32")
        tensor.set_data_from_numpy(x)
        result = client.infer("echo_cached", [tensor], request_id="triton", client_timeout=WAIT)
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), x)
        assert result.get_response().id == "triton"
        assert int(_stats(client, "echo_cached")["inference_stats"]["cache_hit"]["ns"]) > 0
    # one computed (the first), four answered from the cache
    assert _added(before, _tally(tree)) == _cache_counts(hits=4, misses=1)
    assert _metrics(tree)['nv_cache_num_entries{pool="default"}'] >= 1


def test_different_inputs_or_parameters_miss(tree: Serving) -> None:
    x = np.full((1, 4), 7.0, dtype=np.float32)
    before = _tally(tree)
    first, *rest = _raw_infer(
        tree,
        _request("echo_cached", x),
        _request("echo_cached", x + 1),  # other bytes
        _request("echo_cached", x.reshape(2, 2)),  # another shape
        _request("echo_cached", x, mode="a"),  # a parameter
        _request("echo_cached", x, mode="b"),  # another value of it
        _request("echo_cached", x, mode="b"),  # the same again: a hit
        _request("echo_cached", x, ident="x"),  # only the id differs: a hit
    )
    assert rest[-1] == _with_id(first, "x")
    assert _added(before, _tally(tree)) == _cache_counts(hits=2, misses=5)


def _with_id(reply: bytes, ident: str) -> bytes:
    message = pb.ModelInferResponse.FromString(reply)
    message.id = ident
    return message.SerializeToString()


def _post(url: str, doc: Any, encoding: str = "identity") -> tuple[bytes, bytes]:
    """The reply's body as it came (not inflated), and inflated."""
    data = doc if isinstance(doc, bytes) else json.dumps(doc).encode()
    headers = {"Accept-Encoding": encoding, "Content-Type": "application/json"}
    with requests.post(url, data=data, headers=headers, timeout=WAIT, stream=True) as reply:
        assert reply.status_code == 200, reply.text
        raw = reply.raw.read(decode_content=False)
    inflated = raw if encoding == "identity" else zlib.decompress(raw, wbits=47)
    return raw, inflated


def test_rest_hits_are_the_same_bytes(tree: Serving) -> None:
    url = f"http://{_http(tree)}/v2/models/echo_cached/infer"
    before = _tally(tree)
    body = {"inputs": [{"name": "INPUT0", "shape": [1, 3], "datatype": "FP32", "data": [1, 2, 3]}]}
    computed, _ = _post(url, {**body, "id": "r1"})
    hit, _ = _post(url, {**body, "id": "r1"})
    assert hit == computed
    # the same document written otherwise (key order, spaces): the same entry
    reordered = json.dumps({"id": "r2", **body}, indent=2).encode()
    other, _ = _post(url, reordered)
    assert other == computed.replace(b'"id":"r1"', b'"id":"r2"')
    assert json.loads(other)["id"] == "r2"
    bare, _ = _post(url, body)
    assert bare == computed.replace(b',"id":"r1"', b"")
    # a compressed reply: another entry, compressed again on a hit as computed
    zipped, inflated = _post(url, {**body, "id": "r1"}, "gzip")
    assert zipped != inflated and inflated == computed
    assert _post(url, {**body, "id": "r1"}, "gzip")[0] == zipped
    assert _post(url, {**body, "id": "r3"}, "gzip")[1] == computed.replace(b"r1", b"r3")

    client = httpclient.InferenceServerClient(_http(tree), network_timeout=WAIT)
    try:
        x = np.array([[1, 2, 3]], dtype=np.float32)
        for binary in (True, True, False):  # binary outputs: another reply, another entry
            tensor = httpclient.InferInput("INPUT0", [1, 3], "FP32")
            tensor.set_data_from_numpy(x, binary_data=True)
            out = httpclient.InferRequestedOutput("OUTPUT0", binary_data=binary)
            result = client.infer("echo_cached", [tensor], outputs=[out], request_id="h")
            np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), x)
            assert result.get_response()["id"] == "h"
        stats = client.get_inference_statistics("echo_cached")["model_stats"][0]
    finally:
        client.close()
    # r1 computed, then r1, r2 and the bare one hit; gzip: computed once, hit
    # twice; tritonclient's binary body and its two reply kinds: computed
    # twice, hit once
    added = _added(before, _tally(tree))
    assert added == _cache_counts(hits=3 + 2 + 1, misses=1 + 1 + 2)
    # the REST door's statistics say what the gRPC door's do
    assert int(stats["inference_stats"]["cache_hit"]["count"]) == before["hits"] + added["hits"]


def test_a_load_of_the_model_drops_its_replies(tree: Serving) -> None:
    x = np.full((1, 2), 3.0, dtype=np.float32)
    request = _request("echo_cached", x, "before")
    first, hit = _raw_infer(tree, request, request)
    assert hit == first
    with grpcclient.InferenceServerClient(tree.address) as client:
        before = _stats(client, "echo_cached")
        # a load that really loads (a config override): the replies of the load before go
        config = {"parameters": {"note": {"string_value": "loaded again"}}}
        client.load_model("echo_cached", config=json.dumps(config), client_timeout=WAIT * 2)
        again = _raw_infer(tree, request)[0]
        assert again == first  # computed again by the new load: the same bytes
        after = _stats(client, "echo_cached")
    # the request after the load was computed: one more miss, no more hits
    assert _count(after, "cache_miss") == _count(before, "cache_miss") + 1
    assert _count(after, "cache_hit") == _count(before, "cache_hit")
    assert _raw_infer(tree, request)[0] == first  # and kept again: a hit
    with grpcclient.InferenceServerClient(tree.address) as client:
        assert _count(_stats(client, "echo_cached"), "cache_hit") == _count(after, "cache_hit") + 1


def test_a_model_without_the_setting_is_unaffected(tree: Serving) -> None:
    x = np.arange(4, dtype=np.float32).reshape(1, 4)
    first, second = _raw_infer(tree, _request("echo", x, "a"), _request("echo", x, "a"))
    assert first == second
    with grpcclient.InferenceServerClient(tree.address) as client:
        stats = _stats(client, "echo")
    assert _count(stats, "cache_hit") == _count(stats, "cache_miss") == 0
    assert int(stats["inference_count"]) == 2  # both computed
    samples = _metrics(tree)
    assert _model_sample(samples, "nv_cache_num_hits_per_model", "echo") == 0
    assert _model_sample(samples, "nv_inference_count", "echo") == 2


def test_the_bounds_hold_under_100000_distinct_requests(tree: Serving) -> None:
    template = pb.ModelInferRequest(model_name="echo_bounded")
    template.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 1])
    head = template.SerializeToString() + b"\x3a\x04"  # raw_input_contents: 4 bytes follow

    async def run() -> int:
        async with grpc.aio.insecure_channel(tree.address) as channel:
            call = channel.unary_unary(INFER)
            sent = 0

            async def sender(start: int) -> None:
                nonlocal sent
                for i in range(start, DISTINCT, 64):
                    await call(head + struct.pack("<I", i), timeout=WAIT)
                    sent += 1

            async with asyncio.TaskGroup() as group:
                for start in range(64):
                    group.create_task(sender(start))
            # the first one again: evicted long ago, computed again
            await call(head + struct.pack("<I", 0), timeout=WAIT)
            # the last one again: still there
            await call(head + struct.pack("<I", DISTINCT - 1), timeout=WAIT)
            return sent

    assert asyncio.run(run()) == DISTINCT
    samples = _metrics(tree)
    entries = samples['nv_cache_num_entries{pool="bounded"}']
    held = samples['poolserve_cache_bytes{pool="bounded"}']
    assert 0 < entries <= MAX_ENTRIES
    assert 0 < held <= MAX_BYTES
    assert samples['poolserve_cache_max_entries{pool="bounded"}'] == MAX_ENTRIES
    assert samples['poolserve_cache_max_bytes{pool="bounded"}'] == MAX_BYTES
    assert samples['nv_cache_num_evictions{pool="bounded"}'] >= DISTINCT + 1 - MAX_ENTRIES
    assert 0 < samples['nv_cache_util{pool="bounded"}'] <= 1
    assert _model_sample(samples, "nv_cache_num_misses_per_model", "echo_bounded") == DISTINCT + 1
    assert _model_sample(samples, "nv_cache_num_hits_per_model", "echo_bounded") == 1
