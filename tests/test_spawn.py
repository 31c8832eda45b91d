"""start_method "spawn": workers started as fresh interpreters that load the models.

The escape hatch for a runtime that cannot survive a fork: the same model
whose thread pool, started in load(), makes it hang in every forked worker
(tests/test_native_hangs.py) serves from spawned workers, and the pool keeps
its other promises (self-test, replacement of a dead worker, health).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
from test_native_hangs import DECLARED, HANGS_AFTER_FORK, request

from poolserve.protos import inference_pb2_grpc as pbg
from poolserve.service.contract.repository import ModelSettings
from poolserve.service.contract.settings import ServerSettings, apply_overrides
from poolserve.service.inference.codec import decode_outputs
from poolserve.service.poolserver.server import start_method

from serving import Serving, cmdline, pool_status, wait_serving
from support import copy_example, write_model

WHO_LOADED = """
import os

import numpy as np

from poolserve.service import Model


class WhoLoaded(Model):
    def load(self):
        self.loaded_by = os.getpid()

    def predict(self, inputs, parameters):
        return {"OUTPUT0": np.array([self.loaded_by, os.getpid()], np.int64)}
"""


def parent_of(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[1])


def test_start_method_comes_from_the_pool_or_from_one_of_its_models() -> None:
    settings = apply_overrides(ServerSettings(), {"pools": {"p": {"start_method": "spawn"}}}, "s")
    plain = ModelSettings("a", "m.A", Path("."), Path("x"))
    asks = ModelSettings("b", "m.B", Path("."), Path("x"), extra={"start_method": "spawn"})
    assert start_method(settings, "p", [plain]) == "spawn"
    assert start_method(settings, "default", [plain]) == "fork"
    assert start_method(settings, "default", [plain, asks]) == "spawn"


@pytest.mark.e2e
def test_spawned_workers_load_the_models_themselves_and_serve(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    copy_example(repo, "echo")  # pool "default": forked workers
    spawny = {"inference_pool_gid": "spawny", "extra": {"start_method": "spawn"}}
    write_model(
        repo, "who", {"implementation": "model.WhoLoaded", "parameters": spawny}, WHO_LOADED
    )
    write_model(
        repo,
        "hangs",
        {"implementation": "model.PoolInLoad", "parameters": {"inference_pool_gid": "spawny"}}
        | DECLARED,
        HANGS_AFTER_FORK,
    )
    (repo / "settings.json").write_text(json.dumps({"warmup_timeout_s": 5}))

    async def main() -> None:
        async with grpc.aio.insecure_channel(serving.address) as channel:
            await wait_serving(channel, timeout=120)
            stub = pbg.GRPCInferenceServiceStub(channel)
            status = await pool_status(serving, "spawny")
            workers = {w.pid for w in status.workers}
            assert len(workers) == 2
            for pid in workers:
                assert "poolserve.service.inference.spawned" in cmdline(pid), cmdline(pid)
                assert parent_of(pid) == status.zygote_pid  # reaped by the zygote
            forked = (await pool_status(serving)).workers[0].pid
            assert "poolserve.service.inference.spawned" not in cmdline(forked)

            seen: set[int] = set()
            for _ in range(20):
                reply = await stub.ModelInfer(request("who"), timeout=30)
                loaded_by, served_by = decode_outputs(reply)["OUTPUT0"].tolist()
                assert loaded_by == served_by  # each worker ran load() itself
                assert served_by in workers and served_by != status.zygote_pid
                seen.add(served_by)
            # a model that hangs in every forked worker serves from spawned ones
            for k in range(4):
                reply = await stub.ModelInfer(request("hangs", float(k)), timeout=30)
                assert decode_outputs(reply)["OUTPUT0"].tolist() == [[2.0 * k] * 4]

            victim = next(iter(workers))
            os.kill(victim, signal.SIGKILL)
            end = time.monotonic() + 60
            while True:  # polling the status RPC: no event to wait on
                now = {w.pid: w.state for w in (await pool_status(serving, "spawny")).workers}
                if victim not in now and sorted(now.values()) == ["idle", "idle"]:
                    break
                assert time.monotonic() < end, now
                await asyncio.sleep(0.05)
            reply = await stub.ModelInfer(request("hangs", 5.0), timeout=30)
            assert decode_outputs(reply)["OUTPUT0"].tolist() == [[10.0] * 4]
            reply = await stub.ModelInfer(request("echo", 1.0), timeout=30)
            assert reply.raw_output_contents[0] == np.full((1, 4), 1, np.float32).tobytes()

    with Serving(repo, tmp_path / "run", workers=2) as serving:
        asyncio.run(main())
        assert "pool spawny: workers start by spawn" in serving.log()
