"""Large ModelInfer bodies through the router's slabs (issue 20 §4), with real
processes: ``poolserve serve`` (router, pool, 2 workers) and gRPC clients.

A body over slab.THRESHOLD goes router -> worker through a memfd of the
router (contract/slab.py); these check that every caller gets its own bytes
back whatever happens around it: sizes around the threshold, many clients at
once, deadlines and cancels while a worker still reads a slab, a worker
SIGKILLed mid-request, two trees side by side.
"""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import grpc
import numpy as np
import pytest

from poolserve.protos import inference_pb2 as pb
from poolserve.protos import inference_pb2_grpc as pbg
from poolserve.service.contract import slab
from poolserve.service.inference.codec import decode_outputs, encode_inputs

from serving import Serving, comm, wait_idle_workers, wait_serving
from support import wait_until, write_model

pytestmark = pytest.mark.e2e

CLIENT = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]

# Echoes INPUT0 (``repeat`` times end to end); with ``sleep_ms`` it sleeps between
# two checksums of its input and notes in mismatch.log any change: the input's
# slab was given to another request while this one still read it.
CHECK = """
import hashlib, time
from pathlib import Path
import numpy as np
from poolserve.service import Model

LOG = Path(__file__).with_name("mismatch.log")

def digest(value):
    if value.dtype == object:
        return hashlib.sha256(b"|".join(bytes(v) for v in value.ravel())).hexdigest()
    return hashlib.sha256(np.ascontiguousarray(value).tobytes()).hexdigest()

class Check(Model):
    def predict(self, inputs, parameters):
        value = inputs["INPUT0"]
        before = digest(value)
        time.sleep(int(parameters.get("sleep_ms", 0)) / 1000)
        after = digest(value)
        if after != before:
            with LOG.open("a") as log:
                log.write(f"{before} -> {after}\\n")
        if value.ndim == 2:  # a batching model: how many rows came in this predict
            with LOG.with_name("rows.log").open("a") as rows:
                rows.write(f"{value.shape[0]}\\n")
        repeat = int(parameters.get("repeat", 1))
        return {"OUTPUT0": np.concatenate([value] * repeat) if repeat > 1 else value}
"""


def check_repo(root: Path) -> Path:
    repo = root / "repo"
    for name, datatype in (("check", "FP32"), ("check_bytes", "BYTES")):
        write_model(
            repo,
            name,
            {
                "name": name,
                "implementation": "model.Check",
                "inputs": [{"name": "INPUT0", "datatype": datatype, "shape": [-1]}],
                "outputs": [{"name": "OUTPUT0", "datatype": datatype, "shape": [-1]}],
            },
            CHECK,
        )
    return repo


def mismatches(repo: Path) -> str:
    found = ""
    for name in ("check", "check_bytes"):
        log = repo / name / "mismatch.log"
        if log.exists():
            found += log.read_text()
    return found


def request(model: str, array: np.ndarray, **params: int) -> pb.ModelInferRequest:
    message = pb.ModelInferRequest(model_name=model)
    encode_inputs({"INPUT0": array}, message, raw=True)
    for key, value in params.items():
        message.parameters[key].int64_param = value
    return message


def floats(count: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(count).astype(np.float32)


def strings(total: int, seed: int) -> np.ndarray:
    """A BYTES tensor of about ``total`` bytes in elements of varied lengths."""
    rng = np.random.default_rng(seed)
    items: list[bytes] = []
    size = 0
    while size < total:
        item = rng.bytes(int(rng.integers(0, 3000)))
        items.append(item)
        size += len(item) + 4
    return np.array(items, dtype=object)


async def echo(
    stub: pbg.GRPCInferenceServiceStub, model: str, array: np.ndarray, **params: int
) -> np.ndarray:
    reply = await stub.ModelInfer(request(model, array, **params), timeout=90)
    return decode_outputs(reply)["OUTPUT0"]


def same(got: np.ndarray, sent: np.ndarray) -> bool:
    if sent.dtype == object:
        return [bytes(v) for v in got.ravel()] == [bytes(v) for v in sent.ravel()]
    return got.dtype == sent.dtype and np.array_equal(got.ravel(), sent.ravel())


def router_of(serving: Serving) -> int:
    routers = [pid for pid in serving.tree() if comm(pid) == "poolserve-rtr"]
    assert len(routers) == 1, routers
    return routers[0]


def workers_of(serving: Serving) -> list[int]:
    return [pid for pid in serving.tree() if comm(pid) == "poolserve-wrk"]


def slabs_held(pid: int) -> set[str]:
    """The names of the slabs a process holds open (the router's arena)."""
    names: set[str] = set()
    fds = Path(f"/proc/{pid}/fd")
    for fd in fds.iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith(f"/memfd:{slab.PREFIX}"):
            names.add(target.removeprefix("/memfd:").removesuffix(" (deleted)"))
    return names


def slabs_mapped(pid: int) -> set[str]:
    """The names of the slabs a process has mapped (a worker's)."""
    try:
        text = Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return set()
    return {
        line.split("/memfd:", 1)[1].removesuffix(" (deleted)")
        for line in text.splitlines()
        if f"/memfd:{slab.PREFIX}" in line
    }


def test_echo_is_exact_around_the_threshold_and_far_above_it_fp32_and_bytes(
    tmp_path: Path,
) -> None:
    repo = check_repo(tmp_path)

    async def main(serving: Serving) -> None:
        async with grpc.aio.insecure_channel(serving.address, options=CLIENT) as channel:
            await wait_serving(channel)
            stub = pbg.GRPCInferenceServiceStub(channel)
            sizes = []
            for target in (slab.THRESHOLD - 64, slab.THRESHOLD, slab.THRESHOLD + 64):
                for count in range(target // 4 - 20, target // 4 + 5):  # serialized around it
                    sizes.append(count)
            sizes += [1 << 18, 2_408_448]  # 1 MiB, [16,3,224,224] / 4
            for i, count in enumerate(sizes):
                sent = floats(count, i)
                assert same(await echo(stub, "check", sent), sent), count
            body = len(request("check", floats(slab.THRESHOLD // 4 + 5, 0)).SerializeToString())
            assert body > slab.THRESHOLD  # the path under test was taken
            assert slabs_held(router_of(serving)), "no slab in the router"
            for i, total in enumerate((slab.THRESHOLD - 3000, slab.THRESHOLD + 3000, 3 << 20)):
                sent = strings(total, 100 + i)
                assert same(await echo(stub, "check_bytes", sent), sent), total
            held = slabs_held(router_of(serving))
            sent = floats(slab.MAX_BODY // 4 + 1000, 9)  # over MAX_BODY: inline, no slab
            assert same(await echo(stub, "check", sent), sent)
            assert slabs_held(router_of(serving)) == held
            # a reply larger than the reply area goes inline, the next one fits
            for _ in range(2):
                sent = floats(1 << 18, 7)
                got = await echo(stub, "check", sent, repeat=3)
                assert same(got, np.concatenate([sent] * 3))

    with Serving(repo, tmp_path / "run") as serving:
        asyncio.run(main(serving))
    assert mismatches(repo) == ""


def test_an_inline_model_reads_a_large_request_from_its_slab(tmp_path: Path) -> None:
    """A pool of 0 workers runs its models in the pool process: it maps the
    slab there and answers inline."""
    repo = check_repo(tmp_path)

    async def main(serving: Serving) -> None:
        async with grpc.aio.insecure_channel(serving.address, options=CLIENT) as channel:
            await wait_serving(channel)
            stub = pbg.GRPCInferenceServiceStub(channel)
            for i, count in enumerate((slab.THRESHOLD // 4 + 10, 1 << 20)):
                sent = floats(count, i)
                assert same(await echo(stub, "check", sent), sent), count
            sent = strings(1 << 20, 5)
            assert same(await echo(stub, "check_bytes", sent), sent)
            pools = [pid for pid in serving.tree() if comm(pid) == "poolserve-pool"]
            assert any(slabs_mapped(pid) for pid in pools), pools

    with Serving(repo, tmp_path / "run", workers=0) as serving:
        asyncio.run(main(serving))


def test_large_requests_batched_together_each_get_their_own_rows(tmp_path: Path) -> None:
    repo = check_repo(tmp_path)
    write_model(
        repo,
        "check_batched",
        {
            "name": "check_batched",
            "implementation": "model.Check",
            "max_batch_size": 8,
            "max_batch_time": 0.2,
            "inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [-1, 100_000]}],
            "outputs": [{"name": "OUTPUT0", "datatype": "FP32", "shape": [-1, 100_000]}],
        },
        CHECK,
    )

    async def main(serving: Serving) -> None:
        async with grpc.aio.insecure_channel(serving.address, options=CLIENT) as channel:
            await wait_serving(channel)
            stub = pbg.GRPCInferenceServiceStub(channel)
            for round_ in range(3):
                arrays = [floats(100_000, 10 * round_ + i).reshape(1, -1) for i in range(8)]
                got = await asyncio.gather(*(echo(stub, "check_batched", a) for a in arrays))
                assert all(same(g, a) for g, a in zip(got, arrays, strict=True)), round_

    with Serving(repo, tmp_path / "run", workers=1) as serving:
        asyncio.run(main(serving))
    rows = [int(n) for n in (repo / "check_batched" / "rows.log").read_text().split()]
    assert sum(rows) >= 24 and max(rows) > 1, rows  # some ran as batches (+ the warm-up)


def test_many_clients_at_once_each_get_their_own_bytes(tmp_path: Path) -> None:
    repo = check_repo(tmp_path)

    async def client(address: str, index: int) -> list[bool]:
        async with grpc.aio.insecure_channel(address, options=CLIENT) as channel:
            stub = pbg.GRPCInferenceServiceStub(channel)
            results = []
            for turn in range(4):
                seed = index * 100 + turn
                sent = floats(100_000 + 4099 * seed % 300_000, seed)
                results.append(same(await echo(stub, "check", sent), sent))
            return results

    async def main(serving: Serving) -> None:
        async with grpc.aio.insecure_channel(serving.address, options=CLIENT) as channel:
            await wait_serving(channel)
        done = await asyncio.gather(*(client(serving.address, i) for i in range(12)))
        assert all(all(turns) for turns in done), done

    with Serving(repo, tmp_path / "run") as serving:
        asyncio.run(main(serving))
    assert mismatches(repo) == ""


def test_no_slab_is_reused_while_a_worker_still_reads_it_after_deadlines_and_cancels(
    tmp_path: Path,
) -> None:
    """Requests whose deadline passes (the pool answers at once) or whose caller
    cancels, while their worker sleeps on the input; many other large requests
    meanwhile. The model checks its input did not change under it."""
    repo = check_repo(tmp_path)

    async def main(serving: Serving) -> None:
        async with grpc.aio.insecure_channel(serving.address, options=CLIENT) as channel:
            await wait_serving(channel)
            stub = pbg.GRPCInferenceServiceStub(channel)
            slow = [
                stub.ModelInfer(
                    request("check", floats(200_000, 1000 + i), sleep_ms=1500), timeout=0.5
                )
                for i in range(2)
            ]
            cancelled = [
                asyncio.ensure_future(
                    stub.ModelInfer(
                        request("check", floats(200_000, 2000 + i), sleep_ms=1500), timeout=60
                    )
                )
                for i in range(2)
            ]
            for call in slow:
                with pytest.raises(grpc.aio.AioRpcError) as late:
                    await call
                assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            for task in cancelled:
                task.cancel()
            for round_ in range(5):  # the workers still sleep on the slabs above
                # at once: every idle slab is leased again (the free list is LIFO)
                arrays = [floats(200_000, 8 * round_ + i) for i in range(8)]
                got = await asyncio.gather(*(echo(stub, "check", a) for a in arrays))
                assert all(same(g, a) for g, a in zip(got, arrays, strict=True)), round_
        await wait_idle_workers(serving, "default", 2, timeout=60)  # the sleepers checked

    with Serving(repo, tmp_path / "run") as serving:
        asyncio.run(main(serving))
    assert mismatches(repo) == ""


def test_a_worker_sigkilled_mid_request_fails_that_call_and_its_slab_is_retired(
    tmp_path: Path,
) -> None:
    repo = check_repo(tmp_path)

    async def main(serving: Serving) -> None:
        async with grpc.aio.insecure_channel(serving.address, options=CLIENT) as channel:
            await wait_serving(channel)
            stub = pbg.GRPCInferenceServiceStub(channel)
            router = router_of(serving)
            call = stub.ModelInfer(
                request("check", floats(300_000, 2), sleep_ms=30_000, idempotent=0), timeout=90
            )
            victim: list[tuple[int, set[str]]] = []

            def mapped() -> bool:
                victim[:] = [(p, slabs_mapped(p)) for p in workers_of(serving)]
                victim[:] = [(p, names) for p, names in victim if names]
                return len(victim) == 1 and len(slabs_held(router)) >= 1

            task = asyncio.ensure_future(call)
            assert await asyncio.to_thread(wait_until, mapped, 60), victim
            # the sleeping worker maps the slab of its request
            pid, names = victim[0]
            held = slabs_held(router)
            in_use = names & held
            assert in_use, (names, held)
            os.kill(pid, signal.SIGKILL)
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                await task
            # README, Deadlines...: a worker that dies answers its request (not
            # retried: idempotent 0) UNAVAILABLE with the worker's exit status
            assert failed.value.code() == grpc.StatusCode.UNAVAILABLE, failed.value
            assert "died while running the request" in (failed.value.details() or ""), failed.value
            for i in range(20):  # reuse goes on, never of the retired slab
                sent = floats(300_000, 10 + i)
                assert same(await echo(stub, "check", sent), sent)
            after = slabs_held(router)
            assert not (in_use & after), (in_use, after)
            assert len(after) <= 2, after  # retired ones are closed: no leak

    with Serving(repo, tmp_path / "run") as serving:
        asyncio.run(main(serving))


def test_two_trees_side_by_side_never_cross(
    tmp_path: Path,
) -> None:
    repos = [check_repo(tmp_path / "a"), check_repo(tmp_path / "b")]

    async def load(address: str, base: int) -> list[bool]:
        async with grpc.aio.insecure_channel(address, options=CLIENT) as channel:
            await wait_serving(channel)
            stub = pbg.GRPCInferenceServiceStub(channel)
            arrays = [floats(150_000 + 1000 * i, base + i) for i in range(16)]
            got = await asyncio.gather(*(echo(stub, "check", a) for a in arrays))
            return [same(g, a) for g, a in zip(got, arrays, strict=True)]

    async def main(first: Serving, second: Serving) -> None:
        results = await asyncio.gather(load(first.address, 0), load(second.address, 500))
        assert all(all(r) for r in results), results

    with (
        Serving(repos[0], tmp_path / "a" / "run") as first,
        Serving(repos[1], tmp_path / "b" / "run") as second,
    ):
        asyncio.run(main(first, second))
        assert slabs_held(router_of(first)) and slabs_held(router_of(second))
        assert second.terminate() == 0  # a stop with slabs in the arena is clean
    assert mismatches(repos[0]) == mismatches(repos[1]) == ""
