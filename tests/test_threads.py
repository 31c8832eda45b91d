"""threads_per_worker: the runtimes' thread variables, set before model code loads."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from poolserve.protos import inference_pb2 as pb
from poolserve.protos import inference_pb2_grpc as pbg
from poolserve.service.contract.settings import ConfigError, ServerSettings, apply_overrides
from poolserve.service.inference.codec import decode_outputs
from poolserve.service.poolcore.threads import (
    THREAD_VARIABLES,
    limit_native_threads,
    thread_environment,
)

from serving import Serving, wait_serving
from support import write_model


def test_thread_environment_sets_every_variable_but_keeps_the_users() -> None:
    env = {"OMP_NUM_THREADS": "4", "PATH": "/bin"}
    kept = thread_environment(1, env)
    assert kept == {"OMP_NUM_THREADS": "4"}
    assert env["OMP_NUM_THREADS"] == "4"
    for name in THREAD_VARIABLES[1:]:
        assert env[name] == "1"


def test_a_variable_the_user_set_wins_with_a_log_line(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    for name in THREAD_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MKL_NUM_THREADS", "3")
    with caplog.at_level(logging.INFO, logger="poolserve.service.poolcore.threads"):
        limit_native_threads(2, "pool test")
    assert os.environ["OMP_NUM_THREADS"] == "2"
    assert os.environ["MKL_NUM_THREADS"] == "3"
    assert "MKL_NUM_THREADS=3 from the environment wins over threads_per_worker=2" in caplog.text


CHECK_EARLY_NUMPY = """
import json, os
import numpy  # OpenBLAS starts its threads now, as numpy reads OPENBLAS_NUM_THREADS=2
from threadpoolctl import threadpool_info
del os.environ["OPENBLAS_NUM_THREADS"]  # as if numpy came first, with no variable set
before = [i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"]
from poolserve.service.poolcore.threads import limit_native_threads
limit_native_threads(1, "test")
after = [i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"]
print(json.dumps({"before": before, "after": after, "env": os.environ["OPENBLAS_NUM_THREADS"]}))
"""


def test_blas_loaded_before_the_variables_is_limited_through_its_setter() -> None:
    env = {k: v for k, v in os.environ.items() if k not in THREAD_VARIABLES}
    env["OPENBLAS_NUM_THREADS"] = "2"
    proc = subprocess.run(
        [sys.executable, "-c", CHECK_EARLY_NUMPY],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["before"] == [2], seen
    assert seen["after"] == [1], seen
    assert seen["env"] == "1"


def test_threads_per_worker_settings_are_checked() -> None:
    settings = apply_overrides(
        ServerSettings(),
        {"threads_per_worker": 2, "pools": {"heavy": {"threads_per_worker": 4}}},
        "settings.json",
    )
    assert settings.threads_for("heavy") == 4
    assert settings.threads_for("default") == 2
    with pytest.raises(ConfigError, match="threads_per_worker"):
        apply_overrides(ServerSettings(), {"threads_per_worker": 0}, "settings.json")
    with pytest.raises(ConfigError, match=r"pools\.x\.threads_per_worker"):
        apply_overrides(ServerSettings(), {"pools": {"x": {"threads_per_worker": "2"}}}, "s")
    with pytest.raises(ConfigError, match="start_method"):
        apply_overrides(ServerSettings(), {"start_method": "forkserver"}, "settings.json")


THREADS_MODEL = """
import os

import numpy as np
from threadpoolctl import threadpool_info

from poolserve.service import Model


class Threads(Model):
    def predict(self, inputs, parameters):
        blas = [i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"]
        return {"OUTPUT0": np.array([int(os.environ["OMP_NUM_THREADS"]), *blas], np.int64)}
"""


@pytest.mark.e2e
def test_workers_and_inline_models_run_with_the_pools_thread_count(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    (repo).mkdir()
    (repo / "settings.json").write_text(json.dumps({"pools": {"p": {"threads_per_worker": 2}}}))
    for name, extra in (("forked", {}), ("inline", {"parallel_workers": 0})):
        params = {"inference_pool_gid": "p"}
        write_model(repo, name, {"implementation": "model.Threads", "parameters": params, **extra},
                    THREADS_MODEL)  # fmt: skip
    write_model(repo, "other", {"implementation": "model.Threads"}, THREADS_MODEL)
    env = {k: v for k, v in os.environ.items() if k not in THREAD_VARIABLES}

    async def main() -> dict[str, list[int]]:
        async with grpc.aio.insecure_channel(serving.address) as channel:
            await wait_serving(channel)
            stub = pbg.GRPCInferenceServiceStub(channel)
            seen = {}
            for name in ("forked", "inline", "other"):
                reply = await stub.ModelInfer(pb.ModelInferRequest(model_name=name), timeout=30)
                seen[name] = decode_outputs(reply)["OUTPUT0"].tolist()
            return seen

    with Serving(repo, tmp_path / "run", workers=1, env_replace=env) as serving:
        seen = asyncio.run(main())
    # OMP_NUM_THREADS, then numpy's OpenBLAS threads: the pool's setting, the default elsewhere
    assert seen == {"forked": [2, 2], "inline": [2, 2], "other": [1, 1]}


# Issue 28, item 12: threads_per_worker 512 on 2 cores was accepted without a word.


def test_threads_far_above_the_cores_are_warned_about_naming_the_setting(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from poolserve.supervisor.serve import warn_oversubscribed

    settings = apply_overrides(ServerSettings(), {"threads_per_worker": 512}, "test")
    with caplog.at_level(logging.WARNING, logger="poolserve.serve"):
        warnings = warn_oversubscribed(settings, ["default"], cores=2)
    assert len(warnings) == 1
    (record,) = [r for r in caplog.records if r.name == "poolserve.serve"]
    assert record.levelno == logging.WARNING
    text = record.getMessage()
    for words in ("threads_per_worker 512", "2 worker(s) x 512", "1024 native threads",
                  "2 usable core(s)", "'default'"):  # fmt: skip
        assert words in text, (words, text)
    assert record.__dict__["setting"] == "threads_per_worker"


def test_the_warning_rule_more_than_4_threads_per_core() -> None:
    from poolserve.supervisor.serve import THREADS_PER_CORE_WARNING, warn_oversubscribed

    assert THREADS_PER_CORE_WARNING == 4

    def warned(values: dict[str, object], cores: int, gids: tuple[str, ...] = ("default",)) -> int:
        settings = apply_overrides(ServerSettings(), values, "test")
        return len(warn_oversubscribed(settings, gids, cores=cores))

    assert warned({}, cores=1) == 0  # the defaults, even on one core
    assert warned({"parallel_workers": 16}, cores=1) == 0  # workers alone: not this setting
    assert warned({"threads_per_worker": 4}, cores=2) == 0  # 2 x 4 = 8: 4 per core
    assert warned({"threads_per_worker": 5}, cores=2) == 1  # 2 x 5 = 10
    assert warned({"threads_per_worker": 16, "parallel_workers": 0}, cores=2) == 1  # inline
    assert warned({"threads_per_worker": 16}, cores=8) == 0
    heavy = {"pools": {"heavy": {"threads_per_worker": 64}}}
    assert warned(heavy, cores=2, gids=("default", "heavy")) == 1


def test_usable_cores_is_the_affinity_without_a_cgroup_quota(tmp_path: Path) -> None:
    from poolserve.service.lifecycle.cpus import usable_cores

    proc = tmp_path / "cgroup"
    proc.write_text("0::/\n")
    (tmp_path / "cpu.max").write_text("max 100000\n")  # max: no quota
    assert usable_cores(tmp_path, proc) == len(os.sched_getaffinity(0))
    assert usable_cores(tmp_path / "none", proc) == len(os.sched_getaffinity(0))  # no cgroup v2


def test_a_cgroup_cpu_quota_bounds_the_usable_cores(tmp_path: Path) -> None:
    """cgroup v2 cpu.max (QUOTA PERIOD): the smallest along the process's cgroup
    and its ancestors, rounded up, and never above the affinity."""
    from poolserve.service.lifecycle.cpus import cgroup_cpu_quota, parse_cpu_max, usable_cores

    assert parse_cpu_max("max 100000") is None
    assert parse_cpu_max("150000 100000") == 1.5
    assert parse_cpu_max("50000") == 0.5  # the default period
    assert parse_cpu_max("garbage") is None and parse_cpu_max("") is None
    proc = tmp_path / "cgroup"
    proc.write_text("1:cpu:/\n0::/kubepods/pod1/ctr\n")
    (tmp_path / "kubepods").mkdir()
    (tmp_path / "kubepods" / "pod1" / "ctr").mkdir(parents=True)
    (tmp_path / "kubepods" / "cpu.max").write_text("max 100000\n")
    (tmp_path / "kubepods" / "pod1" / "cpu.max").write_text("150000 100000\n")
    (tmp_path / "kubepods" / "pod1" / "ctr" / "cpu.max").write_text("400000 100000\n")
    assert cgroup_cpu_quota(tmp_path, proc) == 1.5  # the pod's, smaller than the container's
    affinity = len(os.sched_getaffinity(0))
    assert usable_cores(tmp_path, proc) == min(affinity, 2)
    (tmp_path / "kubepods" / "pod1" / "cpu.max").write_text("10000 100000\n")
    assert usable_cores(tmp_path, proc) == 1  # a tenth of a core: still one
    # in a container with its own cgroup namespace: /sys/fs/cgroup/cpu.max is its own
    proc.write_text("0::/\n")
    (tmp_path / "cpu.max").write_text("100000 100000\n")
    assert usable_cores(tmp_path, proc) == 1


def test_routers_auto_and_the_threads_warning_count_the_quota(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from poolserve.service.contract.settings import router_count
    from poolserve.service.lifecycle import cpus
    from poolserve.supervisor.serve import warn_oversubscribed

    proc = tmp_path / "cgroup"
    proc.write_text("0::/\n")
    (tmp_path / "cpu.max").write_text("100000 100000\n")  # one core of quota
    monkeypatch.setattr(cpus, "CGROUP_ROOT", tmp_path)
    monkeypatch.setattr(cpus, "PROC_CGROUP", proc)
    monkeypatch.setattr(cpus, "affinity_cores", lambda: 64)
    assert cpus.usable_cores() == 1
    settings = apply_overrides(ServerSettings(), {"threads_per_worker": 4}, "test")
    (text,) = warn_oversubscribed(settings, ["default"])  # 2 x 4 on one core
    assert "on 1 usable core(s)" in text, text
    auto = apply_overrides(ServerSettings(), {"routers": "auto"}, "test")
    assert router_count(auto, cpus.usable_cores()) == 1
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert router_count(auto, cpus.usable_cores()) == 16  # 64 cores, no quota
