"""Inline sequence models (``parallel_workers: 0``, on a thread or declared
fast on the event loop) keep the sequence rules of worker models: no id,
unknown or expired sequence, max_sequences, idle timeout and the
``sequence_ended`` hook; through the router, in a real pool."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest
from test_sequences import INFER, TRACKED, outputs, step

from serving import Serving, wait_serving
from support import wait_until, write_model


@pytest.mark.parametrize("fast", [False, True], ids=["thread", "fast"])
def test_inline_sequence_limits_idle_timeout_and_hook(tmp_path: Path, fast: bool) -> None:
    repo, marks = tmp_path / "repo", tmp_path / "marks"
    marks.mkdir()
    # idle long enough that "two" lives through the max_sequences check on a loaded host
    sequence = {"idle_timeout_s": 4, "max_sequences": 2}
    settings = {
        "name": "tracked",
        "implementation": "model.Tracked",
        "parallel_workers": 0,
        "parameters": {"extra": {"sequence": sequence, "marks": str(marks), "inline_fast": fast}},
        "inputs": [{"name": "INPUT", "datatype": "INT32", "shape": [-1, 1]}],
        "outputs": [
            {"name": "OUTPUT", "datatype": "INT32", "shape": [-1, 1]},
            {"name": "PID", "datatype": "INT64", "shape": [1]},
        ],
    }
    write_model(repo, "tracked", settings, TRACKED)

    async def main(serving: Serving) -> None:
        async with grpc.aio.insecure_channel(serving.address) as channel:
            await wait_serving(channel)
            infer = channel.unary_unary(INFER)

            async def refused(request: bytes) -> tuple[grpc.StatusCode, str]:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await infer(request, timeout=60)
                return info.value.code(), info.value.details() or ""

            code, details = await refused(step("tracked", 1, None))
            assert code == grpc.StatusCode.INVALID_ARGUMENT and "sequence_id" in details
            code, details = await refused(step("tracked", 1, 77))
            assert code == grpc.StatusCode.INVALID_ARGUMENT and "unknown or expired" in details
            first = outputs(await infer(step("tracked", 5, 1, start=True), timeout=60))
            assert int(first["OUTPUT"][0, 0]) == 5
            await infer(step("tracked", 1, "two", start=True), timeout=60)
            code, details = await refused(step("tracked", 1, 3, start=True))
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_sequences" in details
            ended = outputs(await infer(step("tracked", 2, 1, end=True), timeout=60))
            assert int(ended["OUTPUT"][0, 0]) == 7
            assert await asyncio.to_thread(wait_until, (marks / "1.end").exists, 60)
            code, _ = await refused(step("tracked", 1, 1))  # ended: unknown now
            assert code == grpc.StatusCode.INVALID_ARGUMENT
            await infer(step("tracked", 1, 3, start=True), timeout=60)  # room again
            # idle past its timeout: released, the model told
            assert await asyncio.to_thread(wait_until, (marks / "two.timeout").exists, 60)
            code, details = await refused(step("tracked", 1, "two"))
            assert code == grpc.StatusCode.INVALID_ARGUMENT and "unknown or expired" in details

    with Serving(repo, tmp_path / "run", workers=1) as serving:
        asyncio.run(main(serving))
