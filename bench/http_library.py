"""Which HTTP server library the router's REST door runs on: server CPU per
request of a trivial echo, uvicorn's httptools protocol as a bare ASGI app vs
aiohttp's low-level server, each on a plain asyncio loop (as the router's),
measured in turns (issue 29's choice; figures in the issue note).

    .venv/bin/python bench/http_library.py [--rounds 3] [--connections 16] [--requests 2500]

Each server runs in its own process; a keep-alive client (one process, raw
asyncio streams) posts a 105-byte JSON body on every connection in turn; the
server's CPU time (utime + stime, /proc) over the measured requests is divided
by their count. Scratch measurement: the figures are only as quiet as the host.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import time
from typing import Any

BODY = (
    b'{"inputs":[{"name":"INPUT0","shape":[1,16],"datatype":"FP32",'
    b'"data":[1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16]}]}'
)
REQUEST = (
    b"POST /v2/models/echo/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    b"Content-Length: %d\r\n\r\n" % len(BODY)
) + BODY


async def serve(kind: str, sock: socket.socket) -> None:
    loop = asyncio.get_running_loop()
    if kind == "uvicorn":
        from uvicorn.config import Config
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
        from uvicorn.server import ServerState

        async def app(scope: Any, receive: Any, send: Any) -> None:
            body, more = b"", True
            while more:
                message = await receive()
                body += message.get("body", b"")
                more = message.get("more_body", False)
            headers = [
                (b"content-type", b"application/json"),
                (b"content-length", b"%d" % len(body)),
            ]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            await send({"type": "http.response.body", "body": body})

        config = Config(
            app,
            http="httptools",
            lifespan="off",
            interface="asgi3",
            log_config=None,
            access_log=False,
            proxy_headers=False,
            server_header=False,
            date_header=False,
        )
        config.load()
        state = ServerState()
        await loop.create_server(
            lambda: HttpToolsProtocol(config=config, server_state=state, app_state={}), sock=sock
        )
    else:
        from aiohttp import web, web_server

        async def handler(request: web.BaseRequest) -> web.Response:
            return web.Response(body=await request.read(), content_type="application/json")

        await loop.create_server(web_server.Server(handler, access_log=None), sock=sock)
    await asyncio.Event().wait()


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def connection(port: int, count: int) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    for _ in range(count):
        writer.write(REQUEST)
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(
            int(line.split(b":")[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        )
        await reader.readexactly(length)
    writer.close()


async def measure(port: int, pid: int, connections: int, requests: int) -> float:
    await asyncio.gather(*(connection(port, 50) for _ in range(connections)))  # warm
    before = cpu_s(pid)
    await asyncio.gather(*(connection(port, requests) for _ in range(connections)))
    return 1e6 * (cpu_s(pid) - before) / (connections * requests)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--connections", type=int, default=16)
    parser.add_argument("--requests", type=int, default=2500)
    parser.add_argument("--serve", choices=("uvicorn", "aiohttp"), help=argparse.SUPPRESS)
    parser.add_argument("--fd", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        asyncio.run(serve(args.serve, socket.socket(fileno=args.fd)))
        return
    figures: dict[str, list[float]] = {"uvicorn": [], "aiohttp": []}
    for _ in range(args.rounds):
        for kind in figures:
            sock = socket.create_server(("127.0.0.1", 0))  # listening before the child starts
            port = sock.getsockname()[1]
            child = subprocess.Popen(
                [sys.executable, __file__, "--serve", kind, "--fd", str(sock.fileno())],
                pass_fds=(sock.fileno(),),
            )
            sock.close()
            try:
                started = time.perf_counter()
                us = asyncio.run(measure(port, child.pid, args.connections, args.requests))
                print(
                    f"{kind}: {us:.1f} us of server CPU per request "
                    f"({time.perf_counter() - started:.1f} s)",
                    flush=True,
                )
                figures[kind].append(us)
            finally:
                child.kill()
                child.wait()
    for kind, values in figures.items():
        print(f"{kind}: median {sorted(values)[len(values) // 2]:.1f} us/request over {values}")


if __name__ == "__main__":
    main()
