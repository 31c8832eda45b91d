"""N workers cost about one copy of the model: copy-on-write after the zygote's load."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import numpy as np
import pytest

from poolserve.protos import inference_pb2 as pb
from poolserve.protos import inference_pb2_grpc as pbg
from poolserve.service.inference.codec import encode_inputs

from serving import Serving, pool_status, wait_serving
from support import write_model

pytestmark = pytest.mark.e2e

BIG = """
import numpy as np
from poolserve.service import Model

class Big(Model):
    def load(self):
        megabytes = int(self.settings.extra["megabytes"])
        self.table = np.ones(megabytes * 1024 * 1024 // 8, dtype=np.float64)

    def predict(self, inputs, parameters):
        # reads the whole table: reading shared pages must not copy them
        return {"OUTPUT0": inputs["INPUT0"] * float(self.table.sum())}
"""

MIB = 1024 * 1024


def test_four_workers_share_one_400mb_model(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    write_model(
        repo,
        "big",
        {"implementation": "model.Big", "parameters": {"extra": {"megabytes": 400}}},
        BIG,
    )

    async def main(serving: Serving) -> float:
        async with grpc.aio.insecure_channel(serving.address) as channel:
            await wait_serving(channel)
            stub = pbg.GRPCInferenceServiceStub(channel)
            request = pb.ModelInferRequest(model_name="big")
            encode_inputs({"INPUT0": np.ones((1, 4), np.float32)}, request, raw=True)
            for _ in range(3000):  # all four forked and connected (polled: no event)
                status = await pool_status(serving)
                if sum(w.state in ("idle", "busy") for w in status.workers) == 4:
                    break
                await asyncio.sleep(0.01)
            # every worker runs predict at least once before we measure
            await asyncio.gather(*(stub.ModelInfer(request, timeout=60) for _ in range(16)))
            status = await pool_status(serving)
            assert len(status.workers) == 4
            assert all(w.requests_served > 0 for w in status.workers), status.workers
            return status.pss_bytes / MIB

    with Serving(repo, tmp_path / "run", workers=4) as serving:
        pss_mib = asyncio.run(main(serving))
    print(f"pool PSS with 4 workers over a 400 MiB array: {pss_mib:.0f} MiB")
    assert pss_mib <= 1.3 * 400, f"{pss_mib:.0f} MiB"
