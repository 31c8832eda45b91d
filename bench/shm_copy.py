"""What reading and writing shared-memory tensors costs (issue 28 §2):
``pread``/``pwrite`` of the worker's SharedTensors, in one process and end to
end through ``poolserve serve``.

    .venv/bin/python bench/shm_copy.py            # in one process
    .venv/bin/python bench/shm_copy.py --e2e      # echo through a tree, c1 and c4

Run it with another tree's code first on PYTHONPATH (a namespace folder whose
``poolserve/{service,protos,supervisor}`` link to that tree) to compare.
Prints medians; (in + out) bytes per second end to end.
"""

from __future__ import annotations

import argparse
import asyncio
import mmap
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path

import grpc
import numpy as np

from poolserve.protos import inference_pb2 as pb
from poolserve.protos import inference_pb2_grpc as pbg
from poolserve.service.contract.shm import Region
from poolserve.service.inference import shm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "reliability"))
from harness import Tree, make_repo, wait_serving

MIB = 1024 * 1024


def _object(nbytes: int) -> str:
    """A shared-memory object of 2 x nbytes (input, then output); its name."""
    name = f"poolserve_bench_{uuid.uuid4().hex[:8]}"
    with open(f"/dev/shm/{name}", "wb") as f:
        f.write(np.random.rand(nbytes // 4).astype("<f4").tobytes() * 2)
    return name


def _request(nbytes: int, inp: str, out: str, out_offset: int) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="echo")
    tensor = request.inputs.add(name="INPUT0", datatype="FP32", shape=[1, nbytes // 4])
    tensor.parameters["shared_memory_region"].string_param = inp
    tensor.parameters["shared_memory_byte_size"].int64_param = nbytes
    output = request.outputs.add(name="OUTPUT0")
    output.parameters["shared_memory_region"].string_param = out
    output.parameters["shared_memory_byte_size"].int64_param = nbytes
    if out_offset:
        output.parameters["shared_memory_offset"].int64_param = out_offset
    return request


def in_process(nbytes: int, rounds: int, generation: int) -> tuple[float, float, float]:
    """Medians in ms: SharedTensors.read, .write, and a user-space memcpy of the
    same bytes out of a mapping (the floor of any copy)."""
    try:  # a tree before issue 28 has no limits to raise
        from poolserve.service.contract import worker_limits

        worker_limits.LIMITS.max_message_size = 1 << 30
    except ImportError:
        pass
    name = _object(nbytes)
    try:
        region = Region("r", "/" + name, 0, 2 * nbytes, generation)
        request = _request(nbytes, "r", "r", nbytes)
        shm.SharedTensors({"r": region}).read(request.inputs[0])  # warm
        with open(f"/dev/shm/{name}", "r+b") as f:
            mapped = mmap.mmap(f.fileno(), 2 * nbytes)
        reads, writes, copies = [], [], []
        for _ in range(rounds):
            shared = shm.SharedTensors({"r": region})  # one per request
            t0 = time.perf_counter()
            arr = shared.read(request.inputs[0])
            t1 = time.perf_counter()
            own = np.array(arr)  # the model's own array, as an echo's output
            t2 = time.perf_counter()
            shared.write(request.outputs[0], own, "FP32")
            t3 = time.perf_counter()
            np.frombuffer(mapped, np.uint8, nbytes).copy()
            t4 = time.perf_counter()
            reads.append(t1 - t0)
            writes.append(t3 - t2)
            copies.append(t4 - t3)
            del arr, own
        mapped.close()
        return tuple(float(np.median(x)) * 1e3 for x in (reads, writes, copies))  # type: ignore[return-value]
    finally:
        os.unlink(f"/dev/shm/{name}")


async def end_to_end(address: str, nbytes: int, concurrency: int, seconds: float) -> float:
    """(in + out) bytes per second of echo calls through shared memory."""
    names: list[str] = []
    options = [("grpc.max_receive_message_length", 1 << 30)]
    async with grpc.aio.insecure_channel(address, options=options) as channel:
        await wait_serving(channel)
        stub = pbg.GRPCInferenceServiceStub(channel)
        requests = []
        for c in range(concurrency):
            names.append(name := _object(nbytes))
            for region, offset in ((f"in{c}", 0), (f"out{c}", nbytes)):
                await stub.SystemSharedMemoryRegister(
                    pb.SystemSharedMemoryRegisterRequest(
                        name=region, key="/" + name, offset=offset, byte_size=nbytes
                    )
                )
            requests.append(_request(nbytes, f"in{c}", f"out{c}", 0))
        for request in requests:
            await stub.ModelInfer(request, timeout=60)
        done = 0
        end = time.monotonic() + seconds

        async def loop(request: pb.ModelInferRequest) -> None:
            nonlocal done
            while time.monotonic() < end:
                await stub.ModelInfer(request, timeout=60)
                done += 1

        start = time.monotonic()
        await asyncio.gather(*(loop(r) for r in requests))
        elapsed = time.monotonic() - start
        await stub.SystemSharedMemoryUnregister(pb.SystemSharedMemoryUnregisterRequest())
    for name in names:
        os.unlink(f"/dev/shm/{name}")
    return done * 2 * nbytes / elapsed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--e2e", action="store_true")
    parser.add_argument("--seconds", type=float, default=6.0)
    args = parser.parse_args()
    sizes = (9.2, 32.0)
    if not args.e2e:
        for i, mib in enumerate(sizes):
            nbytes = int(mib * MIB) // 4 * 4
            read, write, floor = in_process(nbytes, 40, 100 + i)
            print(
                f"{mib:5} MiB: read {read:6.2f} ms  write {write:6.2f} ms  memcpy {floor:6.2f} ms"
            )
        return
    root = Path(tempfile.mkdtemp(prefix="poolserve_shm_bench_"))
    repo = make_repo(root / "repo", {"echo": None})
    with Tree(repo, root / "run", workers=2) as tree:
        for mib in sizes:
            nbytes = int(mib * MIB) // 4 * 4
            for concurrency in (1, 4):
                rate = asyncio.run(end_to_end(tree.address, nbytes, concurrency, args.seconds))
                print(f"{mib:5} MiB c{concurrency}: {rate / 1e6:8.0f} MB/s")


if __name__ == "__main__":
    main()
