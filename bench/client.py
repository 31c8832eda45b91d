"""The bench's own gRPC client, run as a subprocess: readiness, warm-up, overload, statistics.

It speaks to every server with the same hand-encoded requests (see
peers/pbwire.py), so no generated ``inference`` package is imported here.
Each command prints one JSON line on stdout.

  client.py ready ADDR --models echo,burn [--timeout S] [--warm N]
  client.py overload ADDR --model burn --rate R --duration S --deadline S
  client.py closed ADDR --model burn --concurrency C --duration S
  client.py stats ADDR --model burn
"""

from __future__ import annotations

import argparse
import asyncio
import json
import struct
import sys
import time
from pathlib import Path
from typing import Any

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent / "peers"))
import pbwire

METHOD = "/" + pbwire.SERVICE + "/"
PAYLOAD_SHAPE = (1, 16)
PAYLOAD_SHAPES = {"xgb": (1, 20), "boosted": (1, 20)}  # xgb and boosted: 20 features


def payload(model: str) -> bytes:
    """The one request body every server gets: FP32 [1,16] (xgb: [1,20]) as raw_input_contents."""
    shape = PAYLOAD_SHAPES.get(model, PAYLOAD_SHAPE)
    raw = struct.pack(f"<{shape[1]}f", *(float(i) for i in range(shape[1])))
    return pbwire.infer_request(model, "INPUT0", "FP32", shape, raw)


class Stub:
    def __init__(self, channel: grpc.aio.Channel) -> None:
        self._channel = channel

    async def call(self, method: str, body: bytes, timeout: float) -> bytes:
        rpc: grpc.aio.UnaryUnaryMultiCallable[bytes, bytes] = self._channel.unary_unary(
            METHOD + method
        )
        result = await rpc(body, timeout=timeout)
        assert isinstance(result, bytes)
        return result


async def wait_ready(address: str, models: list[str], timeout: float, warm: int) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    async with grpc.aio.insecure_channel(address) as channel:
        stub = Stub(channel)
        last = ""
        while True:
            try:
                ready = pbwire.parse_bool_response(await stub.call("ServerReady", b"", 2.0))
                for name in models:
                    body = pbwire.name_request(name)
                    ready = ready and pbwire.parse_bool_response(
                        await stub.call("ModelReady", body, 2.0)
                    )
                if ready:
                    break
                last = "not ready yet"
            except grpc.aio.AioRpcError as exc:
                last = f"{exc.code().name}: {exc.details()}"
            if time.monotonic() > deadline:
                return {"ready": False, "error": last}
            await asyncio.sleep(0.2)
        waited = timeout - (deadline - time.monotonic())
        for name in models:  # warm every worker: several rounds of 8 concurrent calls
            body = payload(name)
            for _ in range(warm):
                await asyncio.gather(*(stub.call("ModelInfer", body, 30.0) for _ in range(8)))
    return {"ready": True, "waited_s": round(waited, 3)}


async def overload(
    address: str, model: str, rate: float, duration: float, deadline: float
) -> dict[str, Any]:
    """Open-loop load: requests at fixed intervals, whatever the replies do."""
    body = payload(model)
    codes: dict[str, int] = {}
    ok_latencies: list[float] = []
    async with grpc.aio.insecure_channel(address) as channel:
        rpc: grpc.aio.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary(
            METHOD + "ModelInfer"
        )
        loop = asyncio.get_running_loop()

        async def one() -> None:
            began = loop.time()
            try:
                await rpc(body, timeout=deadline)
                code = "OK"
            except grpc.aio.AioRpcError as exc:
                code = exc.code().name
            if code == "OK":
                ok_latencies.append(loop.time() - began)
            codes[code] = codes.get(code, 0) + 1

        total = int(rate * duration)
        start = loop.time() + 0.05
        tasks = []
        lag = 0.0
        for i in range(total):
            delay = start + i / rate - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            else:
                lag = max(lag, -delay)
            tasks.append(asyncio.create_task(one()))
        sent_s = loop.time() - start
        await asyncio.gather(*tasks)
    ok_latencies.sort()
    in_deadline = sum(1 for x in ok_latencies if x <= deadline)
    return {
        "sent": total,
        "send_s": round(sent_s, 3),
        "max_send_lag_s": round(lag, 4),
        "codes": codes,
        "ok": len(ok_latencies),
        "ok_in_deadline": in_deadline,
        "ok_p50_ms": round(1000 * ok_latencies[len(ok_latencies) // 2], 2) if ok_latencies else 0,
        "ok_p99_ms": (
            round(1000 * ok_latencies[int(len(ok_latencies) * 0.99)], 2) if ok_latencies else 0
        ),
    }


async def closed(address: str, model: str, concurrency: int, duration: float) -> dict[str, Any]:
    """Closed-loop load: ``concurrency`` callers, each sending its next call on a reply;
    the throughput of the second half of ``duration`` (the first half warms up)."""
    body = payload(model)
    async with grpc.aio.insecure_channel(address) as channel:
        rpc: grpc.aio.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary(
            METHOD + "ModelInfer"
        )
        loop = asyncio.get_running_loop()
        start = loop.time()
        window = (start + duration / 2, start + duration)
        done = [0]

        async def caller() -> None:
            while loop.time() < window[1]:
                await rpc(body, timeout=30.0)
                if window[0] <= loop.time() <= window[1]:
                    done[0] += 1

        await asyncio.gather(*(caller() for _ in range(concurrency)))
    return {"throughput": done[0] / (window[1] - window[0]), "concurrency": concurrency}


async def statistics(address: str, model: str) -> dict[str, Any]:
    async with grpc.aio.insecure_channel(address) as channel:
        body = await Stub(channel).call("ModelStatistics", pbwire.name_request(model), 5.0)
    return {"stats": [s.__dict__ for s in pbwire.parse_model_statistics(body)]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    ready = commands.add_parser("ready")
    ready.add_argument("address")
    ready.add_argument("--models", required=True)
    ready.add_argument("--timeout", type=float, default=120.0)
    ready.add_argument("--warm", type=int, default=3)
    load = commands.add_parser("overload")
    load.add_argument("address")
    load.add_argument("--model", required=True)
    load.add_argument("--rate", type=float, required=True)
    load.add_argument("--duration", type=float, required=True)
    load.add_argument("--deadline", type=float, required=True)
    closed_loop = commands.add_parser("closed")
    closed_loop.add_argument("address")
    closed_loop.add_argument("--model", required=True)
    closed_loop.add_argument("--concurrency", type=int, default=16)
    closed_loop.add_argument("--duration", type=float, required=True)
    stats = commands.add_parser("stats")
    stats.add_argument("address")
    stats.add_argument("--model", required=True)
    args = parser.parse_args(argv)
    result: dict[str, Any]
    if args.command == "ready":
        models = [m for m in args.models.split(",") if m]
        result = asyncio.run(wait_ready(args.address, models, args.timeout, args.warm))
    elif args.command == "overload":
        result = asyncio.run(
            overload(args.address, args.model, args.rate, args.duration, args.deadline)
        )
    elif args.command == "closed":
        result = asyncio.run(closed(args.address, args.model, args.concurrency, args.duration))
    else:
        result = asyncio.run(statistics(args.address, args.model))
    print(json.dumps(result), flush=True)
    return 0 if result.get("ready", True) else 1


if __name__ == "__main__":
    sys.exit(main())
