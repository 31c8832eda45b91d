"""Model versions end to end: a real tree, tritonclient.grpc and tritonclient.http.

Each version of ``examples/versions/scale`` multiplies its input by its own
folder's factor (the version number) and answers ``VERSION``, so every
answer says which version made it. The policies (latest, all, specific)
each serve their set, an empty version is the highest, ready, metadata and
statistics answer per version, the index lists every version with its own
state, ensembles pick a step's version, and live loads add a version while
the others serve (and take one away once its calls are done) with no call
failed.
"""

from __future__ import annotations

import asyncio
import json
import queue
import shutil
import threading
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as tc
import tritonclient.http as th
from tritonclient.utils import InferenceServerException

from serving import Serving, pool_status, wait_serving
from support import wait_until

pytestmark = pytest.mark.e2e

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "versions"
WAIT = 120.0  # a loaded 2-core CI host starts trees slowly
X = np.array([[1.0, 2.0, 3.0]], np.float32)


def add_scale(repo: Path, name: str, versions: list[int], policy: object = None) -> Path:
    """A copy of the example's ``scale`` named ``name`` with these version folders."""
    target = repo / name
    target.mkdir(parents=True)
    for file in ("model.py", "model-settings.json"):
        shutil.copy(EXAMPLE / "scale" / file, target / file)
    settings = json.loads((target / "model-settings.json").read_text())
    settings["name"] = name
    settings.pop("version_policy")
    if policy is not None:
        settings["version_policy"] = policy
    (target / "model-settings.json").write_text(json.dumps(settings))
    for number in versions:
        add_version(target, number)
    return target


def add_version(folder: Path, number: int) -> None:
    (folder / str(number)).mkdir()
    (folder / str(number) / "scale.txt").write_text(f"{number}\n")


def wait_tree(tree: Serving, *services: str) -> str:
    """Until the tree and these health services say SERVING; its REST address."""

    async def wait() -> None:
        async with grpc.aio.insecure_channel(tree.address) as channel:
            await wait_serving(channel, timeout=WAIT)
            for service in services:
                await wait_serving(channel, service, timeout=WAIT)

    asyncio.run(wait())
    return (tree.run_dir / "http.addr").read_text().strip()


def grpc_infer(
    client: tc.InferenceServerClient, model: str, version: str = "", **params: Any
) -> int:
    """One call; the version that answered (its output checked against it)."""
    tensor = tc.InferInput("INPUT0", list(X.shape), "FP32")
    tensor.set_data_from_numpy(X)
    result = client.infer(
        model, [tensor], model_version=version, parameters=params or None, client_timeout=WAIT
    )
    answered = int(result.as_numpy("VERSION")[0])
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), X * answered)
    assert result.get_response().model_version == str(answered)
    return answered


def http_infer(client: th.InferenceServerClient, model: str, version: str = "") -> int:
    tensor = th.InferInput("INPUT0", list(X.shape), "FP32")
    tensor.set_data_from_numpy(X, binary_data=False)
    result = client.infer(model, [tensor], model_version=version)
    answered = int(result.as_numpy("VERSION")[0])
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), X * answered)
    assert result.get_response()["model_version"] == str(answered)
    return answered


def refused(
    call: Callable[..., object], *args: object, **kwargs: object
) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as caught:
        call(*args, **kwargs)
    return caught.value


def index(client: tc.InferenceServerClient) -> dict[tuple[str, str], str]:
    models = client.get_model_repository_index(as_json=True).get("models", [])
    return {(m["name"], m.get("version", "")): m.get("state", "") for m in models}


# -- one tree, every policy ---------------------------------------------------------


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Serving, str]]:
    root = tmp_path_factory.mktemp("versions")
    repo = root / "repo"
    shutil.copytree(EXAMPLE, repo, ignore=shutil.ignore_patterns("__pycache__", "*.md"))
    add_scale(repo, "latest", [1, 2, 3])  # no policy: Triton's default, the latest one
    add_scale(repo, "every", [1, 2, 3], {"all": {}})
    add_scale(repo, "some", [1, 2, 3], {"specific": {"versions": [1, 3]}})
    inline = add_scale(repo, "inline", [1, 2], {"all": {}})  # run in the pool server
    settings = json.loads((inline / "model-settings.json").read_text())
    (inline / "model-settings.json").write_text(json.dumps({**settings, "parallel_workers": 0}))
    shutil.copytree(
        Path(__file__).resolve().parent.parent / "examples" / "models" / "echo", repo / "echo"
    )
    (repo / "scale_default").mkdir()
    pinned = json.loads((repo / "scale_pinned" / "model-settings.json").read_text())
    pinned["name"] = "scale_default"
    step = pinned["parameters"]["extra"]["ensemble_scheduling"]["step"][0]
    step["model_version"] = -1
    (repo / "scale_default" / "model-settings.json").write_text(json.dumps(pinned))
    with Serving(repo, root / "run", workers=2) as serving:
        rest = wait_tree(serving, "model:scale_pinned", "model:scale_default")
        yield serving, rest


@pytest.fixture
def grpc_client(tree: tuple[Serving, str]) -> Iterator[tc.InferenceServerClient]:
    with tc.InferenceServerClient(tree[0].address) as client:
        yield client


@pytest.fixture
def http_client(tree: tuple[Serving, str]) -> Iterator[th.InferenceServerClient]:
    client = th.InferenceServerClient(tree[1], network_timeout=WAIT)
    yield client
    client.close()


SERVED = {"latest": [3], "every": [1, 2, 3], "some": [1, 3], "scale": [2, 3], "inline": [1, 2]}


def test_each_policy_serves_its_versions_and_an_empty_one_is_the_highest(
    grpc_client: tc.InferenceServerClient, http_client: th.InferenceServerClient
) -> None:
    for model, versions in SERVED.items():
        for version in versions:
            assert grpc_infer(grpc_client, model, str(version)) == version
            assert http_infer(http_client, model, str(version)) == version
        assert grpc_infer(grpc_client, model) == max(versions)
        assert http_infer(http_client, model) == max(versions)
        for version in sorted({1, 2, 3, 4} - set(versions)):
            error = refused(grpc_infer, grpc_client, model, str(version))
            assert error.status() == "StatusCode.NOT_FOUND"
            assert f"'{model}' version {version} is not found" in error.message()
            error = refused(http_infer, http_client, model, str(version))
            assert error.status() == "404"
            assert f"'{model}' version {version} is not found" in error.message()


def test_ready_and_metadata_per_version(
    grpc_client: tc.InferenceServerClient, http_client: th.InferenceServerClient
) -> None:
    for model, versions in SERVED.items():
        for version in (1, 2, 3):
            expected = version in versions
            assert grpc_client.is_model_ready(model, str(version)) is expected
            assert http_client.is_model_ready(model, str(version)) is expected
        assert grpc_client.is_model_ready(model)
        served = [str(v) for v in versions]
        assert list(grpc_client.get_model_metadata(model).versions) == served
        assert http_client.get_model_metadata(model)["versions"] == served
        last = served[-1]
        assert list(grpc_client.get_model_metadata(model, last).versions) == [last]
        assert http_client.get_model_metadata(model, last)["versions"] == [last]
        assert grpc_client.get_model_config(model, last).config.name == model
        assert http_client.get_model_config(model, last)["name"] == model
    error = refused(grpc_client.get_model_metadata, "some", "2")
    assert error.status() == "StatusCode.NOT_FOUND"


def test_a_stream_picks_each_requests_version(grpc_client: tc.InferenceServerClient) -> None:
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    grpc_client.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        for version in ("1", "", "2"):
            tensor = tc.InferInput("INPUT0", list(X.shape), "FP32")
            tensor.set_data_from_numpy(X)
            grpc_client.async_stream_infer("every", [tensor], model_version=version)
        got = []
        for _ in range(3):
            result, error = answers.get(timeout=WAIT)
            assert error is None
            got.append(int(result.as_numpy("VERSION")[0]))
        assert got == [1, 3, 2]
    finally:
        grpc_client.stop_stream()


def _successes(client: tc.InferenceServerClient, model: str, version: str = "") -> dict[str, int]:
    stats = client.get_inference_statistics(model, version, as_json=True)["model_stats"]
    return {s["version"]: int(s["inference_stats"]["success"].get("count", 0)) for s in stats}


def test_statistics_per_version(
    grpc_client: tc.InferenceServerClient, http_client: th.InferenceServerClient
) -> None:
    before = _successes(grpc_client, "every")
    assert set(before) == {"1", "2", "3"}  # as Triton: no version, every version
    for _ in range(3):
        grpc_infer(grpc_client, "every", "1")
    grpc_infer(grpc_client, "every")  # the highest: 3
    after = _successes(grpc_client, "every")
    assert after["1"] - before["1"] == 3
    assert after["2"] == before["2"]
    assert after["3"] - before["3"] == 1
    assert _successes(grpc_client, "every", "1") == {"1": after["1"]}
    stats = http_client.get_inference_statistics("every", "1")["model_stats"]
    assert [(s["version"], s["inference_stats"]["success"]["count"]) for s in stats] == [
        ("1", after["1"])
    ]
    error = refused(grpc_client.get_inference_statistics, "some", "2")
    assert error.status() == "StatusCode.NOT_FOUND"


def test_metrics_carry_each_version(
    tree: tuple[Serving, str], grpc_client: tc.InferenceServerClient
) -> None:
    grpc_infer(grpc_client, "every", "2")
    target = (tree[0].run_dir / "metrics.addr").read_text().strip()
    with urllib.request.urlopen(f"http://{target}/metrics", timeout=WAIT) as reply:
        text = reply.read().decode()
    for version in ("1", "2", "3"):
        series = f'nv_inference_request_success{{model="every",pool="default",version="{version}"}}'
        assert series in text


def test_the_index_lists_every_version_with_its_state(
    grpc_client: tc.InferenceServerClient,
) -> None:
    listed = index(grpc_client)
    for model, versions in SERVED.items():
        assert sorted(v for (name, v) in listed if name == model) == [str(v) for v in versions]
        assert all(listed[(model, str(v))] == "READY" for v in versions)
    assert listed[("echo", "1")] == "READY"


def test_ensemble_steps_get_the_version_they_name(
    grpc_client: tc.InferenceServerClient, http_client: th.InferenceServerClient
) -> None:
    for client, module in ((grpc_client, tc), (http_client, th)):
        for ensemble, version in (("scale_pinned", 2), ("scale_default", 3)):
            tensor = module.InferInput("IN", list(X.shape), "FP32")
            tensor.set_data_from_numpy(X)
            result = client.infer(ensemble, [tensor])
            assert int(result.as_numpy("VERSION")[0]) == version
            np.testing.assert_array_equal(result.as_numpy("OUT"), X * version)


def test_versions_share_the_pools_workers(tree: tuple[Serving, str]) -> None:
    status = asyncio.run(pool_status(tree[0]))
    assert len(status.workers) == 2  # one pool of 2 workers serves every version
    states = {(m.name, m.version): m.state for m in status.models}
    assert {v for (name, v) in states if name == "every"} == {"1", "2", "3"}
    log = tree[0].log()
    for version in ("1", "2", "3"):  # the zygote loaded each version once, before forking
        assert log.count(f"model every:{version} loaded") == 1, version


def test_a_model_without_version_folders_is_as_before(
    grpc_client: tc.InferenceServerClient,
) -> None:
    tensor = tc.InferInput("INPUT0", [1, 2], "FP32")
    tensor.set_data_from_numpy(np.ones((1, 2), np.float32))
    assert grpc_client.infer("echo", [tensor]).get_response().model_version == "1"
    assert (
        grpc_client.infer("echo", [tensor], model_version="1").get_response().model_version == "1"
    )
    error = refused(grpc_client.infer, "echo", [tensor], model_version="2")
    assert error.status() == "StatusCode.NOT_FOUND"
    assert list(grpc_client.get_model_metadata("echo").versions) == ["1"]


# -- live loads under a load loop -----------------------------------------------------


class Loop:
    """Calls from threads until stopped, over both doors; every failure kept."""

    def __init__(self, tree: Serving, rest: str, model: str, versions: list[str]) -> None:
        self.stop = threading.Event()
        self.failures: list[str] = []
        self.answers: dict[str, set[int]] = {v: set() for v in versions}
        self.calls = 0
        self._lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._run, args=(door, tree, rest, model, version))
            for version in versions
            for door in ("grpc", "http")
        ]

    def __enter__(self) -> Loop:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        for thread in self._threads:
            thread.join(timeout=WAIT)

    def _run(self, door: str, tree: Serving, rest: str, model: str, version: str) -> None:
        client: Any = (
            tc.InferenceServerClient(tree.address)
            if door == "grpc"
            else th.InferenceServerClient(rest, network_timeout=WAIT)
        )
        call = grpc_infer if door == "grpc" else http_infer
        try:
            while not self.stop.is_set():
                try:
                    answered = call(client, model, version)
                except Exception as exc:  # every failure counts, whatever its kind
                    with self._lock:
                        self.failures.append(f"{door} version {version!r}: {exc}")
                    continue
                with self._lock:
                    self.answers[version].add(answered)
                    self.calls += 1
        finally:
            client.close()

    def saw(self, version: str, answer: int) -> bool:
        with self._lock:
            return answer in self.answers[version]


def live_tree(tmp_path: Path, versions: list[int], policy: object = None) -> tuple[Serving, Path]:
    repo = tmp_path / "repo"
    folder = add_scale(repo, "m", versions, policy)
    return Serving(repo, tmp_path / "run", workers=2), folder


async def _busy_worker(tree: Serving) -> bool:
    return any(w.state == "busy" for w in (await pool_status(tree)).workers)


def test_loading_version_3_under_latest_1_drops_no_call(tmp_path: Path) -> None:
    serving, folder = live_tree(tmp_path, [1, 2])  # latest 1: version 2 serves
    with serving as tree:
        rest = wait_tree(tree, "model:m")
        with tc.InferenceServerClient(tree.address) as client:
            assert grpc_infer(client, "m") == 2
            # a slow call to version 2, running on a worker before the load starts:
            # version 2 unloads only once it has finished
            slow: dict[str, object] = {}

            def call_slowly() -> None:
                with tc.InferenceServerClient(tree.address) as own:
                    try:
                        slow["answer"] = grpc_infer(own, "m", "2", sleep_ms=4000)
                    except Exception as exc:
                        slow["error"] = exc

            slow_call = threading.Thread(target=call_slowly)
            slow_call.start()
            assert wait_until(lambda: asyncio.run(_busy_worker(tree)), WAIT)
            with Loop(tree, rest, "m", [""]) as loop:
                assert wait_until(lambda: loop.calls > 0, WAIT)
                add_version(folder, 3)
                client.load_model("m", client_timeout=WAIT)
                assert wait_until(lambda: loop.saw("", 3), WAIT)
            slow_call.join(timeout=WAIT)
            assert slow == {"answer": 2}
            assert loop.failures == []
            assert loop.answers[""] <= {2, 3}
            listed = index(client)
            assert listed[("m", "3")] == "READY"
            assert listed[("m", "2")] == "UNLOADED"
            assert not client.is_model_ready("m", "2")
            error = refused(grpc_infer, client, "m", "2")
            assert error.status() == "StatusCode.NOT_FOUND"
            assert grpc_infer(client, "m") == 3
            assert client.is_server_ready()
    assert serving.log().count("model m:3 loaded live") == 1


def test_unloading_one_version_keeps_the_others_serving(tmp_path: Path) -> None:
    serving, _ = live_tree(tmp_path, [1, 2, 3], {"all": {}})
    with serving as tree:
        rest = wait_tree(tree, "model:m")
        with tc.InferenceServerClient(tree.address) as client:
            http = th.InferenceServerClient(rest, network_timeout=WAIT)
            with Loop(tree, rest, "m", ["", "3"]) as loop:
                assert wait_until(lambda: loop.calls > 0, WAIT)
                # a narrower policy for this load: versions 1 and 2 go, 3 serves on
                narrow = json.dumps({"version_policy": {"specific": {"versions": [3]}}})
                client.load_model("m", config=narrow, client_timeout=WAIT)
                listed = index(client)
                assert (listed[("m", "1")], listed[("m", "2")]) == ("UNLOADED", "UNLOADED")
                assert listed[("m", "3")] == "READY"
                assert not http.is_model_ready("m", "1")
                error = refused(http_infer, http, "m", "1")
                assert error.status() == "404"
                # REST's repository load, without a config: back to the file's policy,
                # 1 and 2 load again while 3 serves
                http.load_model("m")
                assert all(state == "READY" for state in index(client).values())
                assert grpc_infer(client, "m", "1") == 1
            assert loop.failures == []
            assert loop.answers == {"": {3}, "3": {3}}
            assert loop.calls > 0
            # Triton's unload: the whole model, every version
            client.unload_model("m")
            assert set(index(client).values()) == {"UNLOADED"}
            assert not client.is_model_ready("m")
            error = refused(grpc_infer, client, "m")
            assert error.status() == "StatusCode.UNAVAILABLE"
            http.close()
