"""Sequence models end to end, with real workers behind the router: interleaved
sequences from concurrent clients on 2 workers each get their own running sum
(unary and ModelStreamInfer); the sequence controls' errors (no id, unknown,
ended, max_sequences); idle timeout tells the model; worker death ends its
sequences with an error naming them."""

from __future__ import annotations

import asyncio
import os
import random
import signal
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from poolserve.protos import inference_pb2 as pb
from poolserve.protos import inference_pb2_grpc as pbg
from poolserve.service.inference.codec import decode_outputs, encode_inputs

from harness import pid_alive
from serving import Serving, wait_idle_workers, wait_serving
from support import copy_example, wait_until, write_model

INFER = "/inference.GRPCInferenceService/ModelInfer"
STREAM = "/inference.GRPCInferenceService/ModelStreamInfer"

TRACKED = '''
import os
from pathlib import Path

import numpy as np

from poolserve.service import Model


class Tracked(Model):
    """A running sum per sequence that answers its worker's pid, and notes each end."""

    def load(self):
        self.sums = {}

    def predict(self, inputs, parameters):
        value = int(inputs["INPUT"].sum())
        sequence = parameters.get("sequence_id")
        if parameters.get("sequence_start"):
            self.sums[sequence] = 0
        self.sums[sequence] = total = self.sums.get(sequence, 0) + value
        return {"OUTPUT": np.array([[total]], np.int32), "PID": np.array([os.getpid()], np.int64)}

    def sequence_ended(self, sequence_id, reason):
        self.sums.pop(sequence_id, None)
        marks = Path(self.settings.extra["marks"])
        (marks / f"{sequence_id}.{reason}").write_text(str(os.getpid()))
'''


def tracked_repo(tmp_path: Path, **sequence: Any) -> tuple[Path, Path]:
    repo, marks = tmp_path / "repo", tmp_path / "marks"
    marks.mkdir()
    settings = {
        "name": "tracked",
        "implementation": "model.Tracked",
        "parameters": {"extra": {"sequence": sequence, "marks": str(marks)}},
        "inputs": [{"name": "INPUT", "datatype": "INT32", "shape": [-1, 1]}],
        "outputs": [
            {"name": "OUTPUT", "datatype": "INT32", "shape": [-1, 1]},
            {"name": "PID", "datatype": "INT64", "shape": [1]},
        ],
    }
    write_model(repo, "tracked", settings, TRACKED)
    return repo, marks


def step(
    model: str, value: int, sequence: int | str | None, start: bool = False, end: bool = False
) -> bytes:
    req = pb.ModelInferRequest(model_name=model)
    encode_inputs({"INPUT": np.array([[value]], np.int32)}, req, raw=True)
    if isinstance(sequence, str):
        req.parameters["sequence_id"].string_param = sequence
    elif sequence is not None:
        req.parameters["sequence_id"].int64_param = sequence
    if start:
        req.parameters["sequence_start"].bool_param = True
    if end:
        req.parameters["sequence_end"].bool_param = True
    return req.SerializeToString()


def outputs(reply: bytes) -> dict[str, np.ndarray]:
    return decode_outputs(pb.ModelInferResponse.FromString(reply))


def test_interleaved_sequences_on_two_workers_each_keep_their_own_sum(tmp_path: Path) -> None:
    repo, marks = tracked_repo(tmp_path, idle_timeout_s=60, max_sequences=100)
    copy_example(repo, "simple_sequence")

    async def client(channel: grpc.aio.Channel, sequence: int | str, steps: int) -> set[int]:
        infer = channel.unary_unary(INFER)
        rng = random.Random(str(sequence))
        total, pids = 0, set()
        for k in range(steps):
            value = rng.randint(-50, 50)
            total += value
            request = step("tracked", value, sequence, start=k == 0, end=k == steps - 1)
            got = outputs(await infer(request, timeout=60))
            assert int(got["OUTPUT"][0, 0]) == total, (sequence, k)
            pids.add(int(got["PID"][0]))
            await asyncio.sleep(0)  # let the other clients interleave
        assert len(pids) == 1  # every step of a sequence ran on one worker
        return pids

    async def streamed(channel: grpc.aio.Channel, sequence: int | str) -> None:
        """Triton's sequence stream example: a sequence's steps on ModelStreamInfer."""
        values = [11, 7, 5, 3, 2, 0, 1]
        requests = [
            step("simple_sequence", v, sequence, start=k == 0, end=k == len(values) - 1)
            for k, v in enumerate(values)
        ]

        async def send() -> Any:
            for request in requests:
                yield request

        call = channel.stream_stream(STREAM)(send(), timeout=60)
        sums = []
        async for reply in call:
            message = pb.ModelStreamInferResponse.FromString(reply)
            assert not message.error_message, message.error_message
            sums.append(int(decode_outputs(message.infer_response)["OUTPUT"][0, 0]))
        assert sums == list(np.cumsum(values))

    async def main(serving: Serving) -> None:
        async with grpc.aio.insecure_channel(serving.address) as channel:
            await wait_serving(channel)
            await wait_idle_workers(serving, "default", 2)  # both take sequences
            ids: list[int | str] = [*range(1, 9), *(f"session-{k}" for k in range(8))]
            found = await asyncio.gather(*(client(channel, i, 25) for i in ids))
            assert len(set().union(*found)) == 2  # new sequences go to the least loaded
            await asyncio.gather(*(streamed(channel, 1000 + k) for k in range(6)))
            # every sequence ended with its last request: the model was told, on its worker
            assert await asyncio.to_thread(
                wait_until, lambda: all((marks / f"{i}.end").exists() for i in ids), 60
            )

    with Serving(repo, tmp_path / "run", workers=2) as serving:
        asyncio.run(main(serving))


def test_sequence_controls_errors_and_idle_timeout(tmp_path: Path) -> None:
    repo, marks = tracked_repo(tmp_path, idle_timeout_s=0.5, max_sequences=2)

    async def main(serving: Serving) -> None:
        async with grpc.aio.insecure_channel(serving.address) as channel:
            await wait_serving(channel)
            infer = channel.unary_unary(INFER)

            async def refused(request: bytes) -> grpc.aio.AioRpcError:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await infer(request, timeout=60)
                return info.value

            error = await refused(step("tracked", 1, None))
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "sequence_id" in (error.details() or "")
            error = await refused(step("tracked", 1, 77))
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "sequence 77" in (error.details() or "") and "unknown or expired" in (
                error.details() or ""
            )
            # max_sequences: 2 live, a third start is refused until one ends
            await infer(step("tracked", 1, 1, start=True), timeout=60)
            await infer(step("tracked", 1, "two", start=True), timeout=60)
            error = await refused(step("tracked", 1, 3, start=True))
            assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "max_sequences" in (error.details() or "")
            await infer(step("tracked", 1, 1, end=True), timeout=60)
            error = await refused(step("tracked", 1, 1))  # ended: unknown now
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
            await infer(step("tracked", 1, 3, start=True), timeout=60)
            # idle past its timeout: released, the model told
            assert await asyncio.to_thread(wait_until, (marks / "two.timeout").exists, 60)
            error = await refused(step("tracked", 1, "two"))
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "unknown or expired" in (error.details() or "")

    with Serving(repo, tmp_path / "run", workers=2) as serving:
        asyncio.run(main(serving))


def test_worker_death_ends_its_sequences_with_an_error_naming_them(tmp_path: Path) -> None:
    repo, _ = tracked_repo(tmp_path, idle_timeout_s=60, max_sequences=100)

    async def main(serving: Serving) -> None:
        async with grpc.aio.insecure_channel(serving.address) as channel:
            await wait_serving(channel)
            await wait_idle_workers(serving, "default", 2)
            infer = channel.unary_unary(INFER)
            first = outputs(await infer(step("tracked", 5, 41, start=True), timeout=60))
            pid = int(first["PID"][0])
            other = outputs(await infer(step("tracked", 7, 42, start=True), timeout=60))
            assert int(other["PID"][0]) != pid  # the least loaded worker took it
            os.kill(pid, signal.SIGKILL)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await infer(step("tracked", 1, 41), timeout=60)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            details = info.value.details() or ""
            assert "sequence 41" in details and "lost" in details, details
            # the other worker's sequence goes on; the lost one may start again
            again = outputs(await infer(step("tracked", 1, 42), timeout=60))
            assert int(again["OUTPUT"][0, 0]) == 8
            restarted = outputs(await infer(step("tracked", 2, 41, start=True), timeout=60))
            assert int(restarted["OUTPUT"][0, 0]) == 2

    with Serving(repo, tmp_path / "run", workers=2) as serving:
        asyncio.run(main(serving))


def test_sequence_settings_are_validated() -> None:
    from poolserve.service.contract.sequence import SequencePolicy, sequence_policy
    from poolserve.service.contract.settings import ConfigError

    assert sequence_policy("m", {}) is None
    assert sequence_policy("m", {"sequence": {"idle_timeout_s": 2}}) == SequencePolicy(2.0, 1000)
    for bad in ({"idle_timeout_s": 0}, {"max_sequences": 0}, {"idle": 1}, [1]):
        with pytest.raises(ConfigError):
            sequence_policy("m", {"sequence": bad})


def test_rolling_reload_keeps_a_live_sequence_on_its_worker_until_it_ends(
    tmp_path: Path,
) -> None:
    repo, _ = tracked_repo(tmp_path, idle_timeout_s=60, max_sequences=100)

    async def main(serving: Serving) -> None:
        async with grpc.aio.insecure_channel(serving.address) as channel:
            await wait_serving(channel)
            infer = channel.unary_unary(INFER)
            first = outputs(await infer(step("tracked", 5, 9, start=True), timeout=60))
            old = int(first["PID"][0])
            code = repo / "tracked" / "model.py"
            code.write_text(code.read_text() + "\n# a new version\n")
            await pbg.GRPCInferenceServiceStub(channel).RepositoryModelLoad(
                pb.RepositoryModelLoadRequest(model_name="tracked"), timeout=90
            )
            # the reload rolled the workers; the live sequence stays where its state is
            again = outputs(await infer(step("tracked", 3, 9), timeout=60))
            assert (int(again["OUTPUT"][0, 0]), int(again["PID"][0])) == (8, old)
            fresh = outputs(await infer(step("tracked", 1, 10, start=True), timeout=60))
            assert int(fresh["PID"][0]) != old  # a new sequence goes to a fresh worker
            last = outputs(await infer(step("tracked", 2, 9, end=True), timeout=60))
            assert (int(last["OUTPUT"][0, 0]), int(last["PID"][0])) == (10, old)
            # its last sequence ended: the retired worker exits
            assert await asyncio.to_thread(wait_until, lambda: not pid_alive(old), 60)

    with Serving(repo, tmp_path / "run", workers=1) as serving:
        asyncio.run(main(serving))
