"""The decoupled part of the bench (issue 19): a decoupled model streaming 100
small responses per request, poolserve (router, pool, 2 workers; the
repeat_int32 example) against a bare grpc.aio streaming server written here
(one process, the same responses built per request, no pool, no router).
Triton's figure is not available here. Responses per second, ``CLIENTS``
concurrent streams, each sending its next request when the previous one's
100 responses are in; the target is poolserve >= 0.5 x the bare server.

    .venv/bin/python bench/decoupled.py [--seconds 10]
    .venv/bin/python bench/run.py --only decoupled
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
RESPONSES = 100
CLIENTS = 8
TARGET = 0.5
STREAM = "/inference.GRPCInferenceService/ModelStreamInfer"


def request() -> bytes:
    import numpy as np

    from poolserve.protos import inference_pb2 as pb
    from poolserve.service.inference.codec import encode_inputs

    req = pb.ModelInferRequest(model_name="repeat_int32")
    values = np.arange(RESPONSES, dtype=np.int32)
    encode_inputs(
        {"IN": values, "DELAY": np.zeros(RESPONSES, np.uint32), "WAIT": np.zeros(1, np.uint32)},
        req,
        raw=True,
    )
    return req.SerializeToString()


async def bare_server() -> None:
    """ModelStreamInfer alone: each request answered with its 100 responses."""
    import grpc
    import numpy as np

    from poolserve.protos import inference_pb2 as pb
    from poolserve.service.inference.codec import decode_inputs, encode_outputs

    async def stream(requests: Any, context: Any) -> Any:
        async for data in requests:
            req = pb.ModelInferRequest.FromString(data)
            values = decode_inputs(req)["IN"]
            for i, value in enumerate(values):
                response = pb.ModelInferResponse(model_name=req.model_name, id=req.id)
                outputs = {"OUT": np.array([value], np.int32), "IDX": np.array([i], np.uint32)}
                encode_outputs(req, outputs, response)
                yield pb.ModelStreamInferResponse(infer_response=response).SerializeToString()

    server = grpc.aio.server()
    handler = grpc.stream_stream_rpc_method_handler(stream)
    server.add_generic_rpc_handlers(
        [grpc.method_handlers_generic_handler("inference.GRPCInferenceService",
                                              {"ModelStreamInfer": handler})]
    )  # fmt: skip
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)  # the parent waits for this line
    await server.wait_for_termination()


async def load(address: str, seconds: float) -> float:
    """Responses per second over ``seconds``, CLIENTS streams."""
    import grpc

    body = request()
    async with grpc.aio.insecure_channel(address) as channel:
        end = 0.0
        counts = [0] * CLIENTS

        async def client(k: int) -> None:
            queue: asyncio.Queue[bytes | None] = asyncio.Queue()

            async def requests() -> Any:
                while (item := await queue.get()) is not None:
                    yield item

            call = channel.stream_stream(STREAM)(requests(), timeout=seconds + 60)
            replies = call.__aiter__()
            while time.monotonic() < end:
                await queue.put(body)
                for _ in range(RESPONSES):
                    await anext(replies)
                counts[k] += RESPONSES
            await queue.put(None)
            call.cancel()

        end = time.monotonic() + 1.0  # warm-up
        await asyncio.gather(*(client(k) for k in range(CLIENTS)))
        counts = [0] * CLIENTS
        began = time.monotonic()
        end = began + seconds
        await asyncio.gather(*(client(k) for k in range(CLIENTS)))
        return sum(counts) / (time.monotonic() - began)


def measure(seconds: float = 10.0) -> dict[str, Any]:
    sys.path.insert(0, str(ROOT / "reliability"))
    from harness import Tree

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        repo = work / "repo"
        repo.mkdir()
        subprocess.run(["cp", "-r", str(ROOT / "examples/models/repeat_int32"), str(repo)],
                       check=True)  # fmt: skip
        bare = subprocess.Popen(
            [sys.executable, __file__, "--bare"], stdout=subprocess.PIPE, text=True
        )
        try:
            assert bare.stdout is not None
            port = int(bare.stdout.readline())  # printed once it listens
            with Tree(repo, work / "run", workers=2) as tree:
                bare_rate = asyncio.run(load(f"127.0.0.1:{port}", seconds))
                pool_rate = asyncio.run(load(tree.address, seconds))
        finally:
            bare.kill()
            bare.wait()
    ratio = pool_rate / bare_rate
    return {
        "responses_per_request": RESPONSES,
        "clients": CLIENTS,
        "seconds": seconds,
        "poolserve_rps": round(pool_rate),
        "bare_grpc_aio_rps": round(bare_rate),
        "ratio": round(ratio, 2),
        "target": TARGET,
        "met": ratio >= TARGET,
    }


def markdown(found: dict[str, Any]) -> str:
    if not found:
        return ""
    return (
        f"| responses/s ({found['clients']} streams, {found['responses_per_request']} per "
        "request) | poolserve | bare grpc.aio | ratio | target |\n|---|---|---|---|---|\n"
        f"| decoupled repeat_int32 | {found['poolserve_rps']} | {found['bare_grpc_aio_rps']} | "
        f"{found['ratio']} | >= {found['target']} ({'met' if found['met'] else 'missed'}) |\n"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--bare", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--seconds", type=float, default=10.0)
    args = parser.parse_args()
    if args.bare:
        asyncio.run(bare_server())
    else:
        found = measure(args.seconds)
        print(json.dumps(found))
        print(markdown(found))
