"""Would the ``h2`` library (python-hyper) serve the router's gRPC port as
cheaply as its own HTTP/2 (service/router/http2)? Server CPU per unary call,
side by side (issue 42 item 3; figures in docs/protocol.md).

    .venv/bin/pip install h2   # not a dependency of poolserve
    .venv/bin/python bench/h2_library.py [--rounds 3] [--concurrency 16] [--calls 20000]

Each server runs in a process of its own and serves one generic handler,
``/bench.Echo/Unary`` (``async def echo(request, context): return request``,
bytes in and out, no serializer), on a plain asyncio loop:

* ``poolserve``: the router's :class:`GrpcServer` with the default settings;
* ``h2``: a minimal gRPC server on ``h2.connection.H2Connection`` in an
  ``asyncio.Protocol`` (a prototype of the port on h2: headers, one message
  per call, trailers, flow control by h2; each call's handler in a task of
  its own, as ours does; no deadlines, metadata, compression or limits, so
  it does less per call than a full port would);
* ``grpcio``: ``grpc.aio.server`` with the same handler, for reference.

One grpc.aio client (C-core, this process) makes ``--calls`` unary calls of a
100-byte message, ``--concurrency`` at a time on one channel; the server's CPU
time (utime + stime of its process, /proc) over them, divided by their
count. The servers take turns, ``--rounds`` times. Scratch measurement: the
figures are as quiet as the host; compare the ratios of one run.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import grpc

ROOT = Path(__file__).resolve().parent
sys.path[:0] = [str(ROOT)]

from http_library import cpu_s  # noqa: E402

METHOD = "/bench.Echo/Unary"
MESSAGE = bytes(range(100))
ENGINES = ("poolserve", "h2", "grpcio")


async def echo(request: bytes, context: Any) -> bytes:
    return request


def handlers() -> list[grpc.GenericRpcHandler]:
    methods = {"Unary": grpc.unary_unary_rpc_method_handler(echo)}
    return [grpc.method_handlers_generic_handler("bench.Echo", methods)]


# -- the h2 prototype -----------------------------------------------------------------


class H2Grpc(asyncio.Protocol):
    """Unary gRPC calls over h2's H2Connection (the prototype of the port on h2)."""

    RESPONSE = ((b":status", b"200"), (b"content-type", b"application/grpc"))
    OK = ((b"grpc-status", b"0"),)
    UNKNOWN = ((b":status", b"200"), (b"content-type", b"application/grpc"),
               (b"grpc-status", b"12"))  # fmt: skip

    def __init__(self, methods: dict[bytes, Any]) -> None:
        from h2.config import H2Configuration
        from h2.connection import H2Connection

        config = H2Configuration(client_side=False, header_encoding=None)
        self.conn = H2Connection(config=config)
        self.methods = methods
        self.requests: dict[int, tuple[bytes, bytearray]] = {}
        self.tasks: set[asyncio.Task[None]] = set()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        from h2.settings import SettingCodes

        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.conn.local_settings.initial_window_size = 4 << 20  # as the router advertises
        self.conn.local_settings.max_frame_size = 1 << 20
        self.conn.local_settings[SettingCodes.ENABLE_PUSH] = 0
        self.conn.initiate_connection()
        self.conn.increment_flow_control_window((16 << 20) - 65_535)
        transport.write(self.conn.data_to_send())

    def data_received(self, data: bytes) -> None:
        from h2 import events

        for event in self.conn.receive_data(data):
            if isinstance(event, events.RequestReceived):
                path = dict(event.headers).get(b":path", b"")
                self.requests[event.stream_id] = (path, bytearray())
            elif isinstance(event, events.DataReceived):
                self.requests[event.stream_id][1].extend(event.data)
                self.conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            elif isinstance(event, events.StreamEnded):
                path, body = self.requests.pop(event.stream_id)
                task = asyncio.get_running_loop().create_task(
                    self.answer(event.stream_id, path, bytes(body[5:]))
                )
                self.tasks.add(task)
                task.add_done_callback(self.tasks.discard)
            elif isinstance(event, events.StreamReset):
                self.requests.pop(event.stream_id, None)
        self.flush()

    async def answer(self, stream: int, path: bytes, message: bytes) -> None:
        method = self.methods.get(path)
        if method is None:
            self.conn.send_headers(stream, self.UNKNOWN, end_stream=True)
        else:
            reply = await method.unary_unary(message, None)
            self.conn.send_headers(stream, self.RESPONSE)
            self.conn.send_data(stream, len(reply).to_bytes(5, "big") + reply)
            self.conn.send_headers(stream, self.OK, end_stream=True)
        self.flush()

    def flush(self) -> None:
        out = self.conn.data_to_send()
        if out and self.transport is not None:
            self.transport.write(out)


# -- serving, in the child -----------------------------------------------------------------


async def serve(engine: str) -> None:
    from poolserve.service.contract.settings import ServerSettings
    from poolserve.service.router.http2.server import GrpcServer

    loop = asyncio.get_running_loop()
    if engine == "poolserve":
        own = GrpcServer(ServerSettings(), handlers())
        port = await own.bind("127.0.0.1", 0)
        await own.start()
    elif engine == "h2":
        details = type("Details", (), {"method": METHOD, "invocation_metadata": ()})()
        method = handlers()[0].service(details)  # type: ignore[arg-type]
        server = await loop.create_server(lambda: H2Grpc({METHOD.encode(): method}), "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
    else:
        aio = grpc.aio.server()
        aio.add_generic_rpc_handlers(handlers())
        port = aio.add_insecure_port("127.0.0.1:0")
        await aio.start()
    print(port, flush=True)
    await loop.run_in_executor(None, sys.stdin.read)  # until the driver closes our stdin


# -- the driver ------------------------------------------------------------------------------


async def measure(port: int, pid: int, concurrency: int, calls: int) -> float:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        unary = channel.unary_unary(METHOD)

        async def worker(count: int) -> None:
            for _ in range(count):
                assert await unary(MESSAGE, timeout=30) == MESSAGE

        await asyncio.gather(*(worker(100) for _ in range(concurrency)))  # warm
        before = cpu_s(pid)
        await asyncio.gather(*(worker(calls // concurrency) for _ in range(concurrency)))
        return 1e6 * (cpu_s(pid) - before) / (concurrency * (calls // concurrency))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--calls", type=int, default=20_000)
    parser.add_argument("--engines", default=",".join(ENGINES))
    parser.add_argument("--serve", choices=ENGINES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        asyncio.run(serve(args.serve))
        return
    engines = args.engines.split(",")
    figures: dict[str, list[float]] = {engine: [] for engine in engines}
    for _ in range(args.rounds):
        for engine in engines:
            child = subprocess.Popen(
                [sys.executable, __file__, "--serve", engine],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            try:
                assert child.stdout is not None
                port = int(child.stdout.readline())
                started = time.perf_counter()
                us = asyncio.run(measure(port, child.pid, args.concurrency, args.calls))
                took = time.perf_counter() - started
                print(f"{engine}: {us:.1f} us of server CPU per call ({took:.1f} s)", flush=True)
                figures[engine].append(us)
            finally:
                child.kill()
                child.wait()
    medians = {engine: sorted(values)[len(values) // 2] for engine, values in figures.items()}
    base = medians.get("poolserve")
    for engine, values in figures.items():
        ratio = f", {medians[engine] / base:.2f}x poolserve" if base else ""
        print(f"{engine}: median {medians[engine]:.1f} us/call over {values}{ratio}")


if __name__ == "__main__":
    main()
