"""Ensembles (issue 44, item 2): steps run by the router over their models' pools.

The repository checks first (a step naming an unknown model, a cycle, an
unmapped input: clear load errors naming the field), then one real tree with
examples/pipeline (a StandardScaler in pool ``prep`` feeding a classifier in
pool ``classify``), echo models and sleep models in pools of their own,
called through tritonclient.grpc and tritonclient.http: answers equal to
calling the steps by hand, a deadline that expires in the second step, a
client that cancels, a step's pool killed mid-call.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as tc
import tritonclient.http as th
from sklearn.datasets import load_iris

from poolserve.protos import inference_pb2 as pb
from poolserve.service.contract.errors import InvalidInput
from poolserve.service.contract.repository import parse_model_settings, scan
from poolserve.service.contract.settings import ConfigError
from poolserve.service.router.ensemble_tensors import raw_of, request_tensors, values_of

from serving import Serving, pool_status, wait_serving
from support import EXAMPLES, ROOT, copy_example, train_iris, wait_until, write_model

PIPELINE = ROOT / "examples" / "pipeline"
TIMEOUT = 60.0  # seconds per call: CI is a loaded 2-core machine
FP32 = {"datatype": "FP32", "shape": [-1, -1]}


def _echo_as(repo: Path, name: str, gid: str, source: str = "echo") -> None:
    target = repo / name
    shutil.copytree(EXAMPLES / source, target, ignore=shutil.ignore_patterns("__pycache__"))
    path = target / "model-settings.json"
    settings = json.loads(path.read_text())
    settings["name"] = name
    settings.setdefault("parameters", {})["inference_pool_gid"] = gid
    path.write_text(json.dumps(settings))


def _ensemble(repo: Path, name: str, extra: dict[str, Any], **fields: Any) -> None:
    write_model(
        repo, name, {"name": name, "platform": "ensemble", "parameters": {"extra": extra}, **fields}
    )


def _step(model: str, inputs: dict[str, str], outputs: dict[str, str]) -> dict[str, Any]:
    return {"model_name": model, "model_version": -1, "input_map": inputs, "output_map": outputs}


# -- the repository's checks ---------------------------------------------------


def _reason(repo: Path, name: str) -> str:
    found = scan(repo)
    assert name not in {e.name for e in found.ensembles}
    reasons = {bad.name: bad.reason for bad in found.invalid}
    assert name in reasons, reasons
    return reasons[name]


@pytest.fixture
def small_repo(tmp_path: Path) -> Path:
    copy_example(tmp_path, "echo")
    _echo_as(tmp_path, "echo_b", "other")
    return tmp_path


def test_a_step_naming_an_unknown_model_is_a_load_error(small_repo: Path) -> None:
    _ensemble(small_repo, "bad", {"pipeline": ["echo", "no_such_model"]})
    reason = _reason(small_repo, "bad")
    assert "parameters.extra.pipeline[1]" in reason
    assert "step model 'no_such_model' is not a model of this repository" in reason


def test_a_cycle_is_a_load_error(small_repo: Path) -> None:
    steps = [
        _step("echo", {"INPUT0": "b"}, {"OUTPUT0": "a"}),
        _step("echo_b", {"INPUT0": "a"}, {"OUTPUT0": "b"}),
    ]
    _ensemble(
        small_repo,
        "loop",
        {"ensemble_scheduling": {"step": steps}},
        inputs=[{"name": "x", **FP32}],
        outputs=[{"name": "a", **FP32}],
    )
    reason = _reason(small_repo, "loop")
    assert "step 1 ('echo'), step 2 ('echo_b') form a cycle" in reason


def test_an_unmapped_input_is_a_load_error(small_repo: Path) -> None:
    steps = [_step("echo", {}, {"OUTPUT0": "y"})]
    _ensemble(small_repo, "unmapped", {"ensemble_scheduling": {"step": steps}})
    reason = _reason(small_repo, "unmapped")
    assert "input 'INPUT0' of model 'echo' is not mapped to an ensemble tensor" in reason


def test_a_tensor_nobody_produces_is_a_load_error(small_repo: Path) -> None:
    steps = [_step("echo", {"INPUT0": "nowhere"}, {"OUTPUT0": "y"})]
    _ensemble(
        small_repo,
        "orphan",
        {"ensemble_scheduling": {"step": steps}},
        inputs=[{"name": "x", **FP32}],
    )
    reason = _reason(small_repo, "orphan")
    assert "ensemble tensor 'nowhere' is neither an input of the ensemble nor produced" in reason


def test_other_mistakes_name_their_field(small_repo: Path) -> None:
    _ensemble(small_repo, "both", {"pipeline": ["echo"], "ensemble_scheduling": {"step": []}})
    assert "exactly one of 'pipeline'" in _reason(small_repo, "both")
    step = {**_step("echo", {"INPUT0": "x"}, {"OUTPUT0": "y"}), "model_version": 7}
    _ensemble(small_repo, "version", {"ensemble_scheduling": {"step": [step]}})
    assert "model 'echo' has version 1, not 7" in _reason(small_repo, "version")
    _ensemble(small_repo, "typo", {"ensemble_scheduling": {"step": [{"model": "echo"}]}})
    assert "step[0]" in _reason(small_repo, "typo")
    write_model(
        small_repo,
        "impl",
        {"name": "impl", "platform": "ensemble", "implementation": "model.X"},
    )
    settings = small_repo / "impl" / "model-settings.json"
    with pytest.raises(ConfigError, match="an ensemble has no implementation"):
        parse_model_settings(settings)


def test_a_pipeline_is_expanded_into_steps(small_repo: Path) -> None:
    _ensemble(small_repo, "pair", {"pipeline": ["echo", "echo_b"]})
    (plan,) = scan(small_repo).ensembles
    assert [s.model for s in plan.steps] == ["echo", "echo_b"]
    assert plan.steps[0].input_map == (("INPUT0", "INPUT0"),)
    assert plan.steps[1].input_map[0][1] == plan.steps[0].output_map[0][1]
    assert plan.steps[1].output_map == (("OUTPUT0", "OUTPUT0"),)
    assert [s.name for s in plan.inputs] == ["INPUT0"]
    assert [s.name for s in plan.outputs] == ["OUTPUT0"]
    assert plan.levels == ((0,), (1,))


# -- tensors as the router keeps them -------------------------------------------

NUMERIC = {
    "INT8": np.int8, "UINT8": np.uint8, "INT16": np.int16, "UINT16": np.uint16,
    "INT32": np.int32, "UINT32": np.uint32, "INT64": np.int64, "UINT64": np.uint64,
    "FP16": np.float16, "FP32": np.float32, "FP64": np.float64,
}  # fmt: skip


@pytest.mark.parametrize("datatype", sorted(NUMERIC))
def test_values_become_the_raw_bytes_numpy_would_send(datatype: str) -> None:
    array = np.arange(6).reshape(2, 3).astype(NUMERIC[datatype])
    values = array.ravel().tolist()
    raw = raw_of(datatype, [2, 3], values, "input 'x'")
    assert raw == array.tobytes()
    assert values_of(datatype, raw) == values


def test_bool_and_bytes_and_bad_values() -> None:
    assert raw_of("BOOL", [3], [True, False, True], "x") == b"\x01\x00\x01"
    assert values_of("BOOL", b"\x01\x00") == [True, False]
    raw = raw_of("BYTES", [2], ["ab", b"c"], "x")
    assert raw == b"\x02\x00\x00\x00ab\x01\x00\x00\x00c"
    assert values_of("BYTES", raw) == [b"ab", b"c"]
    with pytest.raises(InvalidInput, match="input 'x': 2 values for shape \\[3\\]"):
        raw_of("FP32", [3], [1.0, 2.0], "input 'x'")
    with pytest.raises(InvalidInput, match="INT32 elements are integers"):
        raw_of("INT32", [1], [1.5], "x")
    with pytest.raises(InvalidInput, match="BF16 cannot be sent as values"):
        raw_of("BF16", [1], [1.0], "x")


def test_typed_contents_are_made_raw_and_checked() -> None:
    request = pb.ModelInferRequest(model_name="e")
    tensor = request.inputs.add(name="IN", datatype="INT32", shape=[2])
    tensor.contents.int_contents.extend([7, -1])
    tensors = request_tensors(request, ["IN"])
    assert tensors["IN"].raw == np.array([7, -1], np.int32).tobytes()
    with pytest.raises(InvalidInput, match="expected input 'OTHER' of the ensemble"):
        request_tensors(request, ["IN", "OTHER"])
    with pytest.raises(InvalidInput, match="unexpected inference input 'IN'"):
        request_tensors(request, ["OTHER"])
    raw = pb.ModelInferRequest(model_name="e")
    raw.inputs.add(name="IN", datatype="FP32", shape=[2])
    raw.raw_input_contents.append(b"\x00" * 7)
    with pytest.raises(InvalidInput, match="7 bytes for FP32 shape \\[2\\] \\(8 expected\\)"):
        request_tensors(raw, ["IN"])


# -- one real tree ---------------------------------------------------------------


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Serving]:
    root = tmp_path_factory.mktemp("ensembles")
    repo = root / "repo"
    shutil.copytree(PIPELINE, repo, ignore=shutil.ignore_patterns("__pycache__", "*.joblib"))
    for step in ("iris_scaler", "iris_classifier"):
        train_iris(repo / step)
    copy_example(repo, "echo")
    _echo_as(repo, "echo_b", "other")
    copy_example(repo, "sleep", gid="slow")
    _echo_as(repo, "sleep_victim", "victim", source="sleep")
    steps = [
        _step("echo", {"INPUT0": "INPUT0"}, {"OUTPUT0": "echoed"}),
        _step("sleep", {"INPUT0": "echoed"}, {"OUTPUT0": "OUTPUT0"}),
    ]
    _ensemble(repo, "echo_sleep", {"ensemble_scheduling": {"step": steps}})
    _ensemble(repo, "echo_victim", {"pipeline": ["echo", "sleep_victim"]})
    fan = [
        _step("echo", {"INPUT0": "IN"}, {"OUTPUT0": "A"}),
        _step("echo_b", {"INPUT0": "IN"}, {"OUTPUT0": "B"}),
    ]
    _ensemble(repo, "fanout", {"ensemble_scheduling": {"step": fan}})
    _ensemble(repo, "broken", {"pipeline": ["echo", "no_such_model"]})
    # steps in one pool: each call of these runs in one worker there (contract/chain.py)
    _echo_as(repo, "echo_c", "chain")
    _echo_as(repo, "sleep_c", "chain", source="sleep")
    _echo_as(repo, "echo_cc", "chain")
    cached = repo / "echo_cc" / "model-settings.json"
    settings = json.loads(cached.read_text())
    settings["parameters"].setdefault("extra", {})["response_cache"] = True
    cached.write_text(json.dumps(settings))
    in_one = [
        _step("echo_c", {"INPUT0": "INPUT0"}, {"OUTPUT0": "echoed"}),
        _step("sleep_c", {"INPUT0": "echoed"}, {"OUTPUT0": "OUTPUT0"}),
    ]
    _ensemble(repo, "chain_sleep", {"ensemble_scheduling": {"step": in_one}})
    _ensemble(repo, "chain_cached", {"pipeline": ["echo_c", "echo_cc"]})
    # the router answers a spent deadline well before the client's own timer fires
    (repo / "settings.json").write_text(json.dumps({"deadline_margin_ms": 1000}))
    with Serving(repo, root / "run", workers=2) as serving:
        asyncio.run(_wait_models(serving.address))
        yield serving


STEP_MODELS = ("iris_scaler", "iris_classifier", "echo", "echo_b", "sleep", "sleep_victim")
ENSEMBLES = ("iris_pipeline", "echo_sleep", "echo_victim", "fanout", "chain_sleep", "chain_cached")


async def _wait_models(address: str) -> None:
    async with grpc.aio.insecure_channel(address) as channel:
        for model in (*STEP_MODELS, "echo_c", "sleep_c", "echo_cc"):
            await wait_serving(channel, f"model:{model}", timeout=120)
        # an ensemble's health follows its steps'
        for ensemble in ENSEMBLES:
            await wait_serving(channel, f"model:{ensemble}", timeout=120)


@pytest.fixture
def grpc_client(tree: Serving) -> Iterator[tc.InferenceServerClient]:
    with tc.InferenceServerClient(tree.address) as client:
        yield client


@pytest.fixture
def http_client(tree: Serving) -> Iterator[th.InferenceServerClient]:
    port = int((tree.run_dir / "http.addr").read_text().strip().rsplit(":", 1)[1])
    client = th.InferenceServerClient(f"127.0.0.1:{port}", network_timeout=TIMEOUT)
    yield client
    client.close()


FEATURES = load_iris().data[::7].astype(np.float64)  # rows of every class


def _grpc_input(module: Any, name: str, array: np.ndarray, **kw: Any) -> Any:
    tensor = module.InferInput(
        name, list(array.shape), "FP64" if array.dtype == np.float64 else "FP32"
    )
    tensor.set_data_from_numpy(array, **kw)
    return tensor


def test_the_pipeline_answers_as_its_steps_called_by_hand(
    grpc_client: tc.InferenceServerClient, http_client: th.InferenceServerClient
) -> None:
    scaled = grpc_client.infer(
        "iris_scaler", [_grpc_input(tc, "INPUT0", FEATURES)], client_timeout=TIMEOUT
    ).as_numpy("transform")
    by_hand = grpc_client.infer(
        "iris_classifier", [_grpc_input(tc, "INPUT0", scaled)], client_timeout=TIMEOUT
    ).as_numpy("predict")
    assert sorted(set(by_hand.tolist())) == [0, 1, 2]  # a real classifier, all classes seen

    over_grpc = grpc_client.infer(
        "iris_pipeline", [_grpc_input(tc, "features", FEATURES)], client_timeout=TIMEOUT
    )
    np.testing.assert_array_equal(over_grpc.as_numpy("label"), by_hand)
    assert over_grpc.get_response().model_name == "iris_pipeline"

    binary = http_client.infer("iris_pipeline", [_grpc_input(th, "features", FEATURES)])
    np.testing.assert_array_equal(binary.as_numpy("label"), by_hand)
    as_json = http_client.infer(
        "iris_pipeline",
        [_grpc_input(th, "features", FEATURES, binary_data=False)],
        outputs=[th.InferRequestedOutput("label", binary_data=False)],
    )
    assert as_json.get_response()["outputs"][0]["data"] == by_hand.tolist()


def test_steps_that_need_only_the_inputs_run_together(
    grpc_client: tc.InferenceServerClient, http_client: th.InferenceServerClient
) -> None:
    data = np.arange(12, dtype=np.float32).reshape(3, 4)
    result = grpc_client.infer("fanout", [_grpc_input(tc, "IN", data)], client_timeout=TIMEOUT)
    np.testing.assert_array_equal(result.as_numpy("A"), data)
    np.testing.assert_array_equal(result.as_numpy("B"), data)
    only_b = http_client.infer(
        "fanout", [_grpc_input(th, "IN", data)], outputs=[th.InferRequestedOutput("B")]
    )
    np.testing.assert_array_equal(only_b.as_numpy("B"), data)
    assert only_b.as_numpy("A") is None


def test_metadata_config_readiness_and_statistics(
    grpc_client: tc.InferenceServerClient, http_client: th.InferenceServerClient
) -> None:
    meta = grpc_client.get_model_metadata("iris_pipeline")
    assert meta.platform == "ensemble" and list(meta.versions) == ["1"]
    assert [(t.name, t.datatype, list(t.shape)) for t in meta.inputs] == [
        ("features", "FP64", [-1, 4])
    ]
    assert [(t.name, t.datatype) for t in meta.outputs] == [("label", "INT64")]
    assert http_client.get_model_metadata("iris_pipeline")["platform"] == "ensemble"
    config = grpc_client.get_model_config("iris_pipeline", as_json=True)["config"]
    assert config["platform"] == "ensemble"
    steps = config["ensemble_scheduling"]["step"]
    assert [s["model_name"] for s in steps] == ["iris_scaler", "iris_classifier"]
    assert steps[0]["input_map"] == {"INPUT0": "features"}
    assert steps[1]["output_map"] == {"predict": "label"}
    assert grpc_client.is_model_ready("iris_pipeline")
    assert http_client.is_model_ready("iris_pipeline")
    assert not grpc_client.is_model_ready("iris_pipeline", model_version="9")

    def count() -> int:
        stats = grpc_client.get_inference_statistics("echo_sleep", as_json=True)
        return int(stats["model_stats"][0]["inference_stats"]["success"].get("count", 0))

    before = count()
    data = np.ones((1, 3), dtype=np.float32)
    got = grpc_client.infer(
        "echo_sleep", [_grpc_input(tc, "INPUT0", data)], parameters={"sleep_ms": 1}
    )
    np.testing.assert_array_equal(got.as_numpy("OUTPUT0"), data)
    assert count() == before + 1
    # a client naming no version (perf_analyzer) picks the one whose queue count grew
    inference = grpc_client.get_inference_statistics("echo_sleep", as_json=True)["model_stats"][0][
        "inference_stats"
    ]
    assert inference["queue"]["count"] == inference["success"]["count"] == str(before + 1)
    every = http_client.get_inference_statistics()
    assert "echo_sleep" in {m["name"] for m in every["model_stats"]}

    index = {m["name"]: m for m in http_client.get_model_repository_index()}
    assert index["iris_pipeline"]["state"] == "READY"
    assert index["broken"]["state"] == "UNAVAILABLE"
    assert "no_such_model" in index["broken"]["reason"]
    with pytest.raises(tc.InferenceServerException) as caught:
        grpc_client.infer("broken", [_grpc_input(tc, "INPUT0", data)], client_timeout=TIMEOUT)
    assert "no_such_model" in caught.value.message()


def test_an_ensemble_added_after_start_loads_by_name(
    tree: Serving, grpc_client: tc.InferenceServerClient, http_client: th.InferenceServerClient
) -> None:
    """RepositoryModelLoad reads an ensemble's settings from the repository, as
    Triton reads its config: a new one serves at once, a broken one is a load
    error with the reason, and the ensembles already loaded keep serving."""
    repo = tree.repo
    _ensemble(repo, "late_pair", {"pipeline": ["echo", "echo_b"]})
    grpc_client.load_model("late_pair")
    assert grpc_client.is_model_ready("late_pair")
    data = np.arange(6, dtype=np.float32).reshape(2, 3)
    got = http_client.infer("late_pair", [_grpc_input(th, "INPUT0", data)])
    np.testing.assert_array_equal(got.as_numpy("OUTPUT0"), data)

    steps = [
        _step("echo", {"INPUT0": "b"}, {"OUTPUT0": "a"}),
        _step("echo_b", {"INPUT0": "a"}, {"OUTPUT0": "b"}),
    ]
    _ensemble(repo, "late_loop", {"ensemble_scheduling": {"step": steps}})
    with pytest.raises(tc.InferenceServerException) as caught:
        grpc_client.load_model("late_loop")
    assert caught.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert caught.value.message().startswith("failed to load 'late_loop'")
    assert "form a cycle" in caught.value.message()
    assert not grpc_client.is_model_ready("late_loop")
    assert grpc_client.is_model_ready("iris_pipeline")


def test_bad_requests_are_clear_errors(grpc_client: tc.InferenceServerClient) -> None:
    data = np.ones((1, 4), dtype=np.float64)
    with pytest.raises(tc.InferenceServerException) as caught:
        grpc_client.infer("iris_pipeline", [_grpc_input(tc, "nope", data)], client_timeout=TIMEOUT)
    assert caught.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert "unexpected inference input 'nope'" in caught.value.message()
    # a step's own refusal keeps its code and names the step
    wrong = np.ones((1, 4), dtype=np.float32)
    with pytest.raises(tc.InferenceServerException) as caught:
        grpc_client.infer(
            "iris_pipeline", [_grpc_input(tc, "features", wrong)], client_timeout=TIMEOUT
        )
    assert caught.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert "ensemble 'iris_pipeline' step 1 (model 'iris_scaler')" in caught.value.message()


def test_a_deadline_spent_in_a_slow_step_names_the_step(
    grpc_client: tc.InferenceServerClient, http_client: th.InferenceServerClient
) -> None:
    data = np.ones((1, 2), dtype=np.float32)
    started = time.monotonic()
    with pytest.raises(tc.InferenceServerException) as caught:
        grpc_client.infer(
            "echo_sleep",
            [_grpc_input(tc, "INPUT0", data)],
            parameters={"sleep_ms": 30_000},
            client_timeout=4.0,
        )
    assert caught.value.status() == "StatusCode.DEADLINE_EXCEEDED"
    assert "ensemble 'echo_sleep' step 2 (model 'sleep')" in caught.value.message()
    assert time.monotonic() - started < 25  # the deadline ended it, not the sleep
    with pytest.raises(th.InferenceServerException) as rest:
        http_client.infer(
            "echo_sleep",
            [_grpc_input(th, "INPUT0", data)],
            parameters={"sleep_ms": 30_000},
            headers={"Grpc-Timeout": "3S"},
        )
    assert rest.value.status() == "504"
    assert "ensemble 'echo_sleep' step 2 (model 'sleep')" in rest.value.message()


def _busy(address_tree: Serving, gid: str) -> bool:
    status = asyncio.run(pool_status(address_tree, gid))
    return any(w.state == "busy" for w in status.workers)


def test_a_cancelled_client_cancels_the_step_in_flight(tree: Serving) -> None:
    """Both of pool ``slow``'s workers are held by direct calls; the ensemble's
    second step waits in that pool's queue. The client cancels: the step
    leaves the pool's queue (the lane's CANCEL), while the workers still run."""
    data = np.ones((1, 2), dtype=np.float32)

    async def run() -> None:
        async with grpc.aio.insecure_channel(tree.address) as channel:
            from poolserve.protos import inference_pb2_grpc as pbg

            stub = pbg.GRPCInferenceServiceStub(channel)

            def request(model: str) -> pb.ModelInferRequest:
                req = pb.ModelInferRequest(model_name=model)
                req.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 2])
                req.raw_input_contents.append(data.tobytes())
                req.parameters["sleep_ms"].int64_param = 8_000
                return req

            holders = [stub.ModelInfer(request("sleep"), timeout=TIMEOUT) for _ in range(2)]

            async def slow_status() -> Any:
                return await pool_status(tree, "slow")

            async def until(check: Any) -> None:
                deadline = time.monotonic() + TIMEOUT
                while time.monotonic() < deadline:
                    if check(await slow_status()):
                        return
                    await asyncio.sleep(0.05)
                raise AssertionError("pool 'slow' never got there")

            await until(lambda s: sum(w.state == "busy" for w in s.workers) == 2)
            call = stub.ModelInfer(request("echo_sleep"), timeout=TIMEOUT)
            await until(lambda s: s.queue_depth == 1)
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call
            await until(lambda s: s.queue_depth == 0)
            status = await slow_status()
            assert sum(w.state == "busy" for w in status.workers) == 2  # still sleeping
            for holder in holders:
                await holder

    asyncio.run(run())


def test_a_step_pool_killed_mid_call_fails_the_call_naming_the_step(
    tree: Serving, grpc_client: tc.InferenceServerClient
) -> None:
    """No retry: the step had started in the pool that died, so the call ends
    UNAVAILABLE naming the step (a client may retry; the pool is restarted)."""
    data = np.ones((1, 2), dtype=np.float32)
    caught: list[BaseException] = []

    def call() -> None:
        try:
            grpc_client.infer(
                "echo_victim",
                [_grpc_input(tc, "INPUT0", data)],
                parameters={"sleep_ms": 60_000},
                client_timeout=TIMEOUT,
            )
        except BaseException as exc:  # handed to the test's thread
            caught.append(exc)

    worker = threading.Thread(target=call)
    worker.start()
    assert wait_until(lambda: _busy(tree, "victim"), timeout=TIMEOUT)
    pid = asyncio.run(pool_status(tree, "victim")).pid
    os.kill(pid, signal.SIGKILL)
    worker.join(TIMEOUT)
    assert not worker.is_alive()
    assert caught and isinstance(caught[0], tc.InferenceServerException), caught
    error = caught[0]
    assert error.status() == "StatusCode.UNAVAILABLE"
    assert "ensemble 'echo_victim' step 2 (model 'sleep_victim')" in error.message()
    tree.snapshot()  # the restarted pool's processes are cleaned up with the tree


# -- steps in one pool: one job on one worker ---------------------------------------


def _served(tree: Serving, gid: str) -> int:
    """The jobs pool ``gid``'s workers have run, all told."""
    return sum(w.requests_served for w in asyncio.run(pool_status(tree, gid)).workers)


def _settled(tree: Serving, gid: str) -> None:
    """Until no worker of pool ``gid`` is busy: a call whose deadline passed may
    still run there (the deadline test's sleeps for 15 s), and would count."""
    assert wait_until(lambda: not _busy(tree, gid), timeout=TIMEOUT)


def _success(client: tc.InferenceServerClient, model: str) -> int:
    stats = client.get_inference_statistics(model, as_json=True)["model_stats"][0]
    return int(stats["inference_stats"]["success"].get("count", 0))


def test_steps_in_one_pool_run_as_one_job_and_answer_as_the_steps_by_hand(
    tree: Serving, grpc_client: tc.InferenceServerClient, http_client: th.InferenceServerClient
) -> None:
    data = np.arange(6, dtype=np.float32).reshape(2, 3)
    echoed = grpc_client.infer("echo_c", [_grpc_input(tc, "INPUT0", data)]).as_numpy("OUTPUT0")
    by_hand = grpc_client.infer(
        "sleep_c", [_grpc_input(tc, "INPUT0", echoed)], parameters={"sleep_ms": 1}
    ).as_numpy("OUTPUT0")
    _settled(tree, "chain")
    before = {m: _success(grpc_client, m) for m in ("echo_c", "sleep_c", "chain_sleep")}
    jobs = _served(tree, "chain")
    got = grpc_client.infer(
        "chain_sleep", [_grpc_input(tc, "INPUT0", data)], parameters={"sleep_ms": 1}
    )
    np.testing.assert_array_equal(got.as_numpy("OUTPUT0"), by_hand)
    assert got.get_response().model_name == "chain_sleep"
    assert _served(tree, "chain") == jobs + 1  # both steps in one job
    rest = http_client.infer(
        "chain_sleep", [_grpc_input(th, "INPUT0", data)], parameters={"sleep_ms": 1}
    )
    np.testing.assert_array_equal(rest.as_numpy("OUTPUT0"), by_hand)
    assert _served(tree, "chain") == jobs + 2
    # each step's model counts the ensemble's calls, as Triton's composing models do
    after = {m: _success(grpc_client, m) for m in before}
    assert after == {m: n + 2 for m, n in before.items()}
    # the request's own mistakes are the router's words, a step's names the step
    with pytest.raises(tc.InferenceServerException) as caught:
        grpc_client.infer("chain_sleep", [_grpc_input(tc, "nope", data)], client_timeout=TIMEOUT)
    assert caught.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert "unexpected inference input 'nope'" in caught.value.message()
    with pytest.raises(tc.InferenceServerException) as caught:
        grpc_client.infer(
            "chain_sleep",
            [_grpc_input(tc, "INPUT0", data)],
            parameters={"sleep_ms": -1},
            client_timeout=TIMEOUT,
        )
    assert caught.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert "ensemble 'chain_sleep' step 2 (model 'sleep_c')" in caught.value.message()
    assert "sleep_ms must be a non-negative" in caught.value.message()


def test_a_deadline_spent_in_one_worker_ends_the_call_naming_the_ensemble(
    grpc_client: tc.InferenceServerClient,
) -> None:
    data = np.ones((1, 2), dtype=np.float32)
    started = time.monotonic()
    with pytest.raises(tc.InferenceServerException) as caught:
        grpc_client.infer(
            "chain_sleep",
            [_grpc_input(tc, "INPUT0", data)],
            parameters={"sleep_ms": 15_000},
            client_timeout=4.0,
        )
    assert caught.value.status() == "StatusCode.DEADLINE_EXCEEDED"
    assert "ensemble 'chain_sleep'" in caught.value.message()
    assert "in one worker of pool 'chain'" in caught.value.message()
    assert time.monotonic() - started < 12  # the deadline ended it, not the sleep


def test_a_worker_killed_mid_chain_is_retried_on_another(
    tree: Serving, grpc_client: tc.InferenceServerClient
) -> None:
    """The chain is one job: a worker's death retries it whole on another
    worker (the pool core's rule for an idempotent call), and it answers."""
    data = np.full((1, 2), 7, dtype=np.float32)
    got: list[Any] = []

    def call() -> None:
        try:
            got.append(
                grpc_client.infer(
                    "chain_sleep",
                    [_grpc_input(tc, "INPUT0", data)],
                    parameters={"sleep_ms": 3_000},
                    client_timeout=TIMEOUT,
                )
            )
        except BaseException as exc:  # handed to the test's thread
            got.append(exc)

    def busy() -> set[int]:
        workers = asyncio.run(pool_status(tree, "chain")).workers
        return {w.pid for w in workers if w.state == "busy"}

    _settled(tree, "chain")
    caller = threading.Thread(target=call)
    caller.start()
    try:
        assert wait_until(lambda: bool(busy()), timeout=TIMEOUT)
        (ours,) = busy()
        os.kill(ours, signal.SIGKILL)
    finally:
        caller.join(TIMEOUT)
    assert not caller.is_alive()
    assert len(got) == 1 and not isinstance(got[0], BaseException), got
    np.testing.assert_array_equal(got[0].as_numpy("OUTPUT0"), data)


def test_a_pool_that_will_not_chain_has_the_router_run_the_steps(
    tree: Serving, grpc_client: tc.InferenceServerClient
) -> None:
    """``echo_cc`` caches its replies: its pool refuses the chain, and the
    router runs both steps (two jobs), the answer the same."""
    data = np.arange(4, dtype=np.float32).reshape(1, 4)
    _settled(tree, "chain")
    for _ in range(2):
        jobs = _served(tree, "chain")
        got = grpc_client.infer("chain_cached", [_grpc_input(tc, "INPUT0", data + _)])
        np.testing.assert_array_equal(got.as_numpy("OUTPUT0"), data + _)
        assert _served(tree, "chain") == jobs + 2  # echo_c, then echo_cc (a miss): two jobs
