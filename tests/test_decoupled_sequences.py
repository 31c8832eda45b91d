"""A decoupled model that is also a sequence model: each request of a sequence
streams many responses, all on the worker holding the sequence's state
(real workers behind the router, on ModelStreamInfer)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import grpc
from test_sequences import outputs, step

from poolserve.protos import inference_pb2 as pb

from serving import Serving, wait_idle_workers, wait_serving
from support import wait_until, write_model

STREAM = "/inference.GRPCInferenceService/ModelStreamInfer"

RUNNING = '''
import os
from pathlib import Path

import numpy as np

from poolserve.service import Model


class Running(Model):
    """A running sum per sequence; each request streams 3 responses: the sum
    before it, then +1 and +2 of the new sum's way, with the worker's pid."""

    def load(self):
        self.sums = {}

    def predict_stream(self, inputs, parameters):
        ident = parameters["sequence_id"]
        if parameters.get("sequence_start"):
            self.sums[ident] = 0
        value = int(inputs["INPUT"].sum())
        total = self.sums[ident] + value
        self.sums[ident] = total
        for k in range(3):
            yield {
                "OUTPUT": np.array([[total * 10 + k]], np.int32),
                "PID": np.array([os.getpid()], np.int64),
                "START": inputs["START"].astype(np.int32),
            }

    def sequence_ended(self, sequence_id, reason):
        self.sums.pop(sequence_id, None)
        (Path(self.settings.extra["marks"]) / f"{sequence_id}.{reason}").write_text("")
'''


def test_a_decoupled_sequence_model_streams_each_step_on_its_sequences_worker(
    tmp_path: Path,
) -> None:
    repo, marks = tmp_path / "repo", tmp_path / "marks"
    marks.mkdir()
    settings = {
        "name": "running",
        "implementation": "model.Running",
        "parameters": {
            "extra": {
                "decoupled": True,
                "sequence": {"idle_timeout_s": 60, "control_inputs": {"START": "START"}},
                "marks": str(marks),
            }
        },
        "inputs": [{"name": "INPUT", "datatype": "INT32", "shape": [-1, 1]}],
        "outputs": [{"name": "OUTPUT", "datatype": "INT32", "shape": [-1, 1]}],
    }
    write_model(repo, "running", settings, RUNNING)

    async def sequence(channel: grpc.aio.Channel, ident: int | str, values: list[int]) -> int:
        queue: asyncio.Queue[bytes | None] = asyncio.Queue()

        async def requests() -> Any:
            while (item := await queue.get()) is not None:
                yield item

        call = channel.stream_stream(STREAM)(requests(), timeout=60)
        replies = call.__aiter__()
        total, pids = 0, set()
        for k, value in enumerate(values):
            last = k == len(values) - 1
            await queue.put(step("running", value, ident, start=k == 0, end=last))
            total += value
            for j in range(3):
                reply = pb.ModelStreamInferResponse.FromString(await anext(replies))
                assert not reply.error_message, reply.error_message
                got = outputs(reply.infer_response.SerializeToString())
                assert int(got["OUTPUT"][0, 0]) == total * 10 + j, (ident, k, j)
                assert got["START"].tolist() == [int(k == 0)]
                pids.add(int(got["PID"][0]))
            await asyncio.sleep(0)  # let the other sequences interleave
        await queue.put(None)
        assert await anext(replies, None) is None
        assert len(pids) == 1  # every step of the sequence ran on one worker
        return pids.pop()

    async def main(serving: Serving) -> None:
        async with grpc.aio.insecure_channel(serving.address) as channel:
            await wait_serving(channel)
            await wait_idle_workers(serving, "default", 2)
            idents: list[int | str] = [11, 12, "s13", "s14"]
            pids = await asyncio.gather(
                *(sequence(channel, i, [n + 1, -n, 2 * n, 5]) for n, i in enumerate(idents))
            )
            assert len(set(pids)) == 2  # sequences spread over both workers
            for ident in idents:
                mark = marks / f"{ident}.end"
                assert await asyncio.to_thread(wait_until, mark.exists, 60)
            # an ended sequence is unknown: its error in the stream
            call = channel.stream_stream(STREAM)(iter([step("running", 1, 11)]), timeout=60)
            replies = [pb.ModelStreamInferResponse.FromString(r) async for r in call]
            assert len(replies) == 1
            assert replies[0].error_message.startswith("INVALID_ARGUMENT")
            assert "unknown or expired" in replies[0].error_message

    with Serving(repo, tmp_path / "run", workers=2) as serving:
        asyncio.run(main(serving))
