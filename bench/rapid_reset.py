"""What resets cost the router, and how many a connection is let make
(issue 42 item 2: rapid reset, CVE-2023-44487, dodged by pairing each reset
with an instantly answered stream).

    .venv/bin/python bench/rapid_reset.py [--streams 2000] [--pairs 40000]

Against one real tree serving ``echo`` over raw HTTP/2 frames (the client
reads everything the router sends): the router's CPU (utime + stime of the
poolserve-rtr process, /proc) per stream of each kind (unknown method; a
ModelInfer whose headers came and was reset; one whole and reset in the same
write, its handler made but not run; one reset once it reached the pool; one
answered), each batch of 100 on a new connection; the calls reset at the
pool are to ``sleep`` (100 ms, in a pool of its own), the others to echo. Then the attack: pairs of
a ModelInfer reset at once and an unknown-method stream (answered at once),
on one connection, until the router sends GOAWAY or ``--pairs`` were sent;
and the same with each reset coming once the call reached the pool.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import struct
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "reliability"), str(ROOT / "bench")]

from http2_fuzzing import block, call_frames, handshake, request_headers  # noqa: E402
from http_library import cpu_s  # noqa: E402
from rest_router_cpu import GRPC_BODY, router_pid  # noqa: E402

from poolserve.protos import inference_pb2 as pb  # noqa: E402
from poolserve.service.router.http2.frames import (  # noqa: E402
    END_HEADERS,
    END_STREAM,
    HEADER,
    ErrorCode,
    Kind,
    frame,
    rst_stream,
)

from serving import Serving, wait_idle_workers, wait_serving  # noqa: E402
from support import copy_example  # noqa: E402

BATCH = 100
_SLEEP = pb.ModelInferRequest.FromString(GRPC_BODY)
_SLEEP.model_name = "sleep"  # 100 ms in another pool: still there when reset
SLEEP_BODY = _SLEEP.SerializeToString()
UNKNOWN = frame(
    Kind.HEADERS, END_HEADERS | END_STREAM, 0, block(request_headers(b"/no.Such/Method"))
)


def unknown(stream: int) -> bytes:
    return UNKNOWN[:5] + struct.pack(">I", stream) + UNKNOWN[9:]


def reset(stream: int) -> bytes:
    return rst_stream(stream, ErrorCode.CANCEL)


class Client:
    """One raw connection whose reader takes every frame (GOAWAY noted)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.goaway: int | None = None  # the last stream the router's GOAWAY named
        self.pongs = 0
        self.why = ""
        self.task = asyncio.get_running_loop().create_task(self._read())

    @classmethod
    async def open(cls, address: str) -> Client:
        host, port = address.rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(handshake())
        return cls(reader, writer)

    async def _read(self) -> None:
        try:
            while True:
                high, low, kind, flags, _ = HEADER.unpack(await self.reader.readexactly(9))
                payload = await self.reader.readexactly(high << 16 | low)
                if kind == Kind.GOAWAY and self.goaway is None:  # the first says why
                    self.goaway = struct.unpack(">I", payload[:4])[0]
                    code = ErrorCode(struct.unpack(">I", payload[4:8])[0])
                    self.why = f"{code.name} {payload[8:]!r}"
                elif kind == Kind.PING and flags & 1:
                    self.pongs += 1
        except (asyncio.IncompleteReadError, ConnectionError):
            return

    async def sync(self) -> None:
        """Returns once the router has read all that was sent (its PING ack)."""
        pongs = self.pongs
        self.writer.write(frame(Kind.PING, 0, 0, b"benchsyn"))
        await self.writer.drain()
        for _ in range(3000):
            if self.pongs > pongs or self.task.done():
                return
            await asyncio.sleep(0.002)

    async def close(self) -> None:
        self.writer.close()
        self.task.cancel()


async def batch(address: str, kind: str, streams: list[int]) -> None:
    client = await Client.open(address)
    if kind == "unknown method":
        client.writer.write(b"".join(unknown(s) for s in streams))
    elif kind == "headers, reset":
        client.writer.write(
            b"".join(call_frames(s, GRPC_BODY)[: -len(GRPC_BODY) - 14] + reset(s) for s in streams)
        )
    elif kind == "whole, reset at once":
        client.writer.write(b"".join(call_frames(s, GRPC_BODY) + reset(s) for s in streams))
    elif kind == "whole, reset at the pool":
        client.writer.write(b"".join(call_frames(s, SLEEP_BODY) for s in streams))
        await client.sync()
        await asyncio.sleep(0.02)  # forwarded: waiting for the pool's answer
        client.writer.write(b"".join(reset(s) for s in streams))
    else:  # answered
        client.writer.write(b"".join(call_frames(s, GRPC_BODY) for s in streams))
    await client.sync()
    await asyncio.sleep(0.05)  # the answers leave
    await client.close()


KINDS = (
    "unknown method",
    "headers, reset",
    "whole, reset at once",
    "whole, reset at the pool",
    "answered",
)


async def per_stream(address: str, pid: int, kind: str, count: int) -> float:
    streams = list(range(1, 2 * BATCH, 2))
    before = cpu_s(pid)
    for _ in range(count // BATCH):
        await batch(address, kind, streams)
    return 1e6 * (cpu_s(pid) - before) / count


async def attack(address: str, pid: int, pairs: int, at_the_pool: bool) -> tuple[int, float, bool]:
    """Pairs of a reset ModelInfer and an unknown method on one connection:
    (pairs the router took, its CPU in seconds, whether it sent GOAWAY)."""
    client = await Client.open(address)
    before = cpu_s(pid)
    sent = 0
    stream = 1
    chunk: Callable[[int], bytes]
    while sent < pairs and client.goaway is None and not client.task.done():
        streams = list(range(stream, stream + 4 * BATCH, 4))
        stream += 4 * BATCH
        try:
            if at_the_pool:
                client.writer.write(
                    b"".join(call_frames(s, SLEEP_BODY) + unknown(s + 2) for s in streams)
                )
                await client.sync()
                await asyncio.sleep(0.005)
                client.writer.write(b"".join(reset(s) for s in streams))
            else:
                chunk = lambda s: call_frames(s, GRPC_BODY) + reset(s) + unknown(s + 2)  # noqa: E731
                client.writer.write(b"".join(chunk(s) for s in streams))
            await client.sync()
        except ConnectionError:
            break
        sent += len(streams)
    with contextlib.suppress(ConnectionError):
        await client.sync()
    used = cpu_s(pid) - before
    taken = sent if client.goaway is None else (client.goaway + 3) // 4
    await client.close()
    if client.why:
        print("GOAWAY:", client.why)
    return taken, used, client.goaway is not None


def repository(tmp: Path) -> Path:
    """echo, and sleep in a pool of its own."""
    copy_example(tmp / "repo", "echo")
    copy_example(tmp / "repo", "sleep", gid="other")
    return tmp / "repo"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--streams", type=int, default=2000)
    parser.add_argument("--pairs", type=int, default=40_000)
    args = parser.parse_args()
    with (
        tempfile.TemporaryDirectory() as tmp,
        Serving(repository(Path(tmp)), Path(tmp) / "run") as tree,
    ):

        async def run() -> None:
            async with grpc.aio.insecure_channel(tree.address) as channel:
                await wait_serving(channel)
            await wait_idle_workers(tree, "default", 2)
            pid = router_pid(tree)
            for kind in KINDS if args.streams else ():
                us = await per_stream(tree.address, pid, kind, args.streams)
                print(f"{kind:26s} {us:7.1f} us of router CPU per stream", flush=True)
            for at_the_pool in (False, True):
                taken, used, goaway = await attack(tree.address, pid, args.pairs, at_the_pool)
                how = "at the pool" if at_the_pool else "at once"
                end = "GOAWAY" if goaway else "no GOAWAY"
                print(
                    f"pairs (reset {how} + unknown method): {taken} taken, {end}, "
                    f"{used:.2f} s of router CPU",
                    flush=True,
                )

        asyncio.run(run())


if __name__ == "__main__":
    main()
