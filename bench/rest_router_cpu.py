"""Router CPU per request through each door, against one real tree serving
``echo`` (issue 29: "router CPU per REST request, beside the gRPC figure").

    .venv/bin/python bench/rest_router_cpu.py [--rounds 3] [--connections 8] [--requests 500]

gRPC: raw ModelInfer bytes (a [1, 16] FP32 tensor in raw_input_contents) on one
channel per connection. REST: the same tensor as JSON, and as Triton's binary
extension, on keep-alive connections (raw asyncio streams). The router's CPU
time (utime + stime of the poolserve-rtr process, /proc, all its threads) over
the measured requests, divided by their count; the doors take turns.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path

import grpc
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "reliability")]

from http_library import cpu_s  # noqa: E402

from poolserve.protos import inference_pb2 as pb  # noqa: E402

from serving import Serving, wait_idle_workers, wait_serving  # noqa: E402
from support import copy_example  # noqa: E402

X = np.arange(16, dtype=np.float32).reshape(1, 16)
TENSOR = {"name": "INPUT0", "shape": [1, 16], "datatype": "FP32"}
JSON_BODY = json.dumps({"inputs": [{**TENSOR, "data": X.ravel().tolist()}]}).encode()
HEAD = json.dumps(
    {
        "inputs": [{**TENSOR, "parameters": {"binary_data_size": X.nbytes}}],
        "outputs": [{"name": "OUTPUT0", "parameters": {"binary_data": True}}],
    }
).encode()
GRPC_BODY = pb.ModelInferRequest(
    model_name="echo",
    inputs=[pb.ModelInferRequest.InferInputTensor(**TENSOR)],
    raw_input_contents=[X.tobytes()],
).SerializeToString()


def rest_request(body: bytes, extra: bytes = b"") -> bytes:
    return (
        b"POST /v2/models/echo/infer HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n" % len(body)
        + extra
        + b"\r\n"
        + body
    )


async def rest_connection(address: str, request: bytes, count: int) -> None:
    host, port = address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    for _ in range(count):
        writer.write(request)
        head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200"), head
        length = next(
            int(line.split(b":")[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        )
        await reader.readexactly(length)
    writer.close()


async def grpc_connection(address: str, count: int) -> None:
    async with grpc.aio.insecure_channel(address) as channel:
        call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
        for _ in range(count):
            await call(GRPC_BODY, timeout=30)


async def measure(kind: str, tree: Serving, pid: int, connections: int, count: int) -> float:
    http = (tree.run_dir / "http.addr").read_text().strip()
    binary = b"Inference-Header-Content-Length: %d\r\n" % len(HEAD)
    requests = {
        "rest-json": rest_request(JSON_BODY),
        "rest-binary": rest_request(HEAD + X.tobytes(), binary),
    }

    def jobs(n: int) -> list[object]:
        if kind == "grpc":
            return [grpc_connection(tree.address, n) for _ in range(connections)]
        return [rest_connection(http, requests[kind], n) for _ in range(connections)]

    await asyncio.gather(*jobs(50))  # type: ignore[arg-type]
    before = cpu_s(pid)
    await asyncio.gather(*jobs(count))  # type: ignore[arg-type]
    return 1e6 * (cpu_s(pid) - before) / (connections * count)


def router_pid(tree: Serving) -> int:
    for pid in tree.snapshot():
        try:
            if Path(f"/proc/{pid}/comm").read_text().strip() == "poolserve-rtr":
                return pid
        except OSError:
            continue
    raise RuntimeError("no router process in the tree")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--connections", type=int, default=8)
    parser.add_argument("--requests", type=int, default=500)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp) / "repo"
        copy_example(repo, "echo")
        with Serving(repo, Path(tmp) / "run") as tree:

            async def ready() -> None:
                async with grpc.aio.insecure_channel(tree.address) as channel:
                    await wait_serving(channel)
                await wait_idle_workers(tree, "default", 2)

            asyncio.run(ready())
            pid = router_pid(tree)
            figures: dict[str, list[float]] = {"grpc": [], "rest-json": [], "rest-binary": []}
            for _ in range(args.rounds):
                for kind, values in figures.items():
                    us = asyncio.run(measure(kind, tree, pid, args.connections, args.requests))
                    values.append(us)
                    print(f"{kind}: {us:.1f} us of router CPU per request", flush=True)
            for kind, values in figures.items():
                median = sorted(values)[len(values) // 2]
                print(f"{kind}: median {median:.1f} us/request over {[round(v) for v in values]}")


if __name__ == "__main__":
    main()
