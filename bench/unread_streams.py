"""Echo's latency while decoupled streams nobody reads share its pool (issue 42,
item 5): one pool of ``--workers`` workers serving the repeat_int32 example
(decoupled) and echo; ``--streams`` ModelStreamInfer calls each ask for
200,000 responses and read none; then ``--calls`` echo calls one after the
other, each with a ``--timeout`` deadline. Prints how many were answered,
how many within 2 s, and their latencies (a call past its deadline counts
its deadline). ``stream_stall_s`` is the tree's default (10 s) unless
``--stall`` says otherwise; ``--unary-workers`` sets that setting.

    .venv/bin/python bench/unread_streams.py                       # 2 workers, 0 2 4 streams
    .venv/bin/python bench/unread_streams.py --streams 2 --unary-workers 0

Every process it starts is stopped by PID before it exits.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "reliability"))

from harness import Tree, make_repo  # noqa: E402

STREAM = "/inference.GRPCInferenceService/ModelStreamInfer"
RESPONSES = 200_000


def repeat_request() -> bytes:
    import numpy as np

    from poolserve.protos import inference_pb2 as pb
    from poolserve.service.inference.codec import encode_inputs

    req = pb.ModelInferRequest(model_name="repeat_int32")
    inputs = {
        "IN": np.arange(RESPONSES, dtype=np.int32),
        "DELAY": np.zeros(RESPONSES, np.uint32),
        "WAIT": np.zeros(1, np.uint32),
    }
    encode_inputs(inputs, req, raw=True)
    return req.SerializeToString()


async def measure(address: str, streams: int, calls: int, timeout: float) -> list[float]:
    """Echo latencies (seconds; a failed call counts ``timeout``) with
    ``streams`` unread streams open."""
    import grpc
    import numpy as np

    from poolserve.protos import inference_pb2 as pb
    from poolserve.protos import inference_pb2_grpc as pbg
    from poolserve.service.inference.codec import encode_inputs

    async with grpc.aio.insecure_channel(address) as channel:
        stub = pbg.GRPCInferenceServiceStub(channel)
        req = pb.ModelInferRequest(model_name="echo")
        encode_inputs({"INPUT0": np.ones((1, 16), np.float32)}, req, raw=True)
        await stub.ModelInfer(req, timeout=60)  # warm
        body = repeat_request()
        held = asyncio.Event()

        async def one() -> Any:
            yield body
            await held.wait()

        opened: list[Any] = [
            channel.stream_stream(STREAM)(one(), timeout=3600) for _ in range(streams)
        ]
        await asyncio.sleep(1.0)  # the streams reach the pool and fill their windows
        latencies = []
        for _ in range(calls):
            began = time.monotonic()
            try:
                await stub.ModelInfer(req, timeout=timeout)
                latencies.append(time.monotonic() - began)
            except grpc.aio.AioRpcError:
                latencies.append(timeout)
        for call in opened:
            call.cancel()
        held.set()
        return latencies


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--streams", type=int, nargs="+", default=[0, 2, 4])
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--timeout", type=float, default=30.0)
    parser.add_argument("--stall", type=float, default=None)
    parser.add_argument("--unary-workers", type=int, default=None)
    args = parser.parse_args(argv)
    env = {}
    if args.stall is not None:
        env["POOLSERVE_STREAM_STALL_S"] = str(args.stall)
    if args.unary_workers is not None:
        env["POOLSERVE_UNARY_WORKERS"] = str(args.unary_workers)
    work = Path(tempfile.mkdtemp(prefix="unread-streams-"))
    try:
        repo = make_repo(work / "repo", {"repeat_int32": None, "echo": None})
        for streams in args.streams:
            tree = Tree(repo, work / f"run{streams}", workers=args.workers, env=env)
            try:
                tree.start(timeout=300)
                got = asyncio.run(measure(tree.address, streams, args.calls, args.timeout))
            finally:
                tree.close()
            answered = sum(1 for t in got if t < args.timeout)
            quick = sum(1 for t in got if t < 2.0)
            print(
                f"{args.workers} workers, {streams} unread streams: echo {answered}/{len(got)} "
                f"answered, {quick}/{len(got)} within 2 s; first {got[0] * 1000:.1f} ms, "
                f"p50 {statistics.median(got) * 1000:.1f} ms, max {max(got) * 1000:.1f} ms"
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
