"""The bytes of a reply's header blocks per call, for both engines of the gRPC
port side by side (issue 42 item 2: response headers that index in HPACK).

    .venv/bin/python bench/reply_headers.py [--calls 100]

One tree serving ``echo`` per engine (``grpc_engine`` poolserve, then
grpcio); on one raw HTTP/2 connection, ``--calls`` ModelInfer calls one after
another, then as many ModelInfer for a model that does not exist (an error
status with a message). For each engine: the fields of the first reply's
header blocks as sent (grpc-accept-encoding among them), the bytes of its
HEADERS blocks (response headers + trailers) for the first call and per call
after it, and what HPACK saved: 1 - bytes sent / bytes of the fields' names
and values. With h2load on the PATH (Debian's nghttp2-client), also its own
figure for the same calls on one connection: "headers (space savings ...)".
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "reliability"), str(ROOT / "bench")]

from http2_fuzzing import call_frames, handshake  # noqa: E402
from rest_router_cpu import GRPC_BODY  # noqa: E402

from poolserve.protos import inference_pb2 as pb  # noqa: E402
from poolserve.service.router.http2.frames import HEADER, Kind, ping, window_update  # noqa: E402
from poolserve.service.router.http2.hpack import Decoder  # noqa: E402

from serving import Serving, wait_idle_workers, wait_serving  # noqa: E402
from support import copy_example  # noqa: E402

MISSING = pb.ModelInferRequest(model_name="no-such-model").SerializeToString()


Figures = list[tuple[int, int, list[object], list[bytes]]]


async def calls(address: str, body: bytes, count: int) -> Figures:
    """Per call: bytes of its HEADERS blocks, bytes of their fields, the fields,
    the blocks."""
    host, port = address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(handshake())
    decoder = Decoder()
    out = []
    for i in range(count):
        stream = 2 * i + 1
        writer.write(call_frames(stream, body))
        sent = plain = 0
        fields: list[object] = []
        blocks: list[bytes] = []
        while True:
            high, low, kind, flags, got = HEADER.unpack(await reader.readexactly(9))
            payload = await reader.readexactly(high << 16 | low)
            if kind == Kind.SETTINGS and not flags & 1:
                writer.write(struct.pack(">BHBBI", 0, 0, Kind.SETTINGS, 1, 0))
            elif kind == Kind.PING and not flags & 1:
                writer.write(ping(payload, ack=True))
            elif kind == Kind.DATA and payload:  # the connection's window back
                writer.write(window_update(0, len(payload)))
            if kind != Kind.HEADERS or got != stream & 0x7FFFFFFF:
                continue
            decoded = decoder.decode(payload)  # (no padding nor priority from either)
            sent += len(payload)
            plain += sum(len(n) + len(v) for n, v in decoded)
            fields.append(decoded)
            blocks.append(payload)
            if flags & 1:  # END_STREAM: the trailers
                break
        out.append((sent, plain, fields, blocks))
    writer.close()
    return out


def report(engine: str, what: str, figures: Figures) -> None:
    first = figures[0]
    rest = figures[1:]
    per_call = sum(f[0] for f in rest) / len(rest)
    saved = 1 - sum(f[0] for f in figures) / sum(f[1] for f in figures)
    print(f"{engine:9s} {what:9s} first call {first[0]:3d} B, then {per_call:5.1f} B per call,")
    print(f"{'':19s} saved {100 * saved:.1f}% over {len(figures)} calls")
    print(f"{'':19s} the second call's blocks: {[b.hex(' ') for b in figures[1][3]]}")


def h2load(address: str, calls: int, tmp: str) -> str:
    """h2load's line about header bytes, for ``calls`` ModelInfer on one connection."""
    body = Path(tmp) / "body"
    body.write_bytes(b"\0" + struct.pack(">I", len(GRPC_BODY)) + GRPC_BODY)
    url = f"http://{address}/inference.GRPCInferenceService/ModelInfer"
    argv = ["h2load", "-n", str(calls), "-c", "1", "-m", "1", "-d", str(body)]
    argv += ["-H", "content-type: application/grpc", "-H", "te: trailers", url]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False).stdout
    return next((line.strip() for line in out.splitlines() if "space savings" in line), out)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=100)
    args = parser.parse_args()
    for engine in ("poolserve", "grpcio"):
        with tempfile.TemporaryDirectory() as tmp:
            repo = Path(tmp) / "repo"
            copy_example(repo, "echo")
            (repo / "settings.json").write_text(json.dumps({"grpc_engine": engine}))
            with Serving(repo, Path(tmp) / "run") as tree:

                async def run(engine: str = engine) -> None:
                    async with grpc.aio.insecure_channel(tree.address) as channel:
                        await wait_serving(channel)
                    await wait_idle_workers(tree, "default", 2)
                    ok = await calls(tree.address, GRPC_BODY, args.calls)
                    print(f"{engine}: the first reply's header blocks: {ok[0][2]}")
                    report(engine, "OK", ok)
                    errors = await calls(tree.address, MISSING, args.calls)
                    print(f"{engine}: an error's: {errors[0][2]}")
                    report(engine, "an error", errors)
                    if shutil.which("h2load"):
                        print(f"{engine}: h2load: {h2load(tree.address, args.calls, tmp)}")

                asyncio.run(run())


if __name__ == "__main__":
    main()
