"""MLServer 1.7.1 itself (``mlserver start``, from this environment: the
``[mlserver]`` extra puts it in .venv) serving a folder, for the side-by-side
tests that send the same calls to MLServer and to poolserve.

It runs in a session of its own; on exit the whole session is stopped, by
the PID of the process started here (its process group), and waited for.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc

from poolserve.protos import inference_pb2 as pb
from poolserve.protos import inference_pb2_grpc as pbg

from harness import free_port
from support import wait_until

MLSERVER = Path(sys.executable).parent / "mlserver"
WAIT = 120.0
PEER_HTTP: dict[str, str] = {}  # a running peer's REST address, by its gRPC address


@contextlib.contextmanager
def mlserver_serving(repo: Path, log_path: Path, *models: str) -> Iterator[str]:
    """``mlserver start repo`` on free loopback ports (its ``settings.json``
    kept, with host and ports set over it); yields its gRPC address once
    ServerReady (and every model of ``models`` ModelReady) says true."""
    settings_path = repo / "settings.json"
    settings = json.loads(settings_path.read_text()) if settings_path.exists() else {}
    port = free_port()
    settings.update(
        {
            "host": "127.0.0.1",
            "grpc_port": port,
            "http_port": free_port(),
            "metrics_port": free_port(),
        }
    )
    settings.setdefault("parallel_workers", 0)
    settings_path.write_text(json.dumps(settings))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLSERVER", "PYTHON"))}
    log = log_path.open("w")
    process = subprocess.Popen(
        [str(MLSERVER), "start", str(repo)],
        cwd=log_path.parent,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    address = f"127.0.0.1:{port}"
    PEER_HTTP[address] = f"127.0.0.1:{settings['http_port']}"
    try:

        def ready() -> bool:
            assert process.poll() is None, log_path.read_text()[-3000:]

            async def ask() -> bool:
                async with grpc.aio.insecure_channel(address) as channel:
                    stub = pbg.GRPCInferenceServiceStub(channel)
                    try:
                        if not (await stub.ServerReady(pb.ServerReadyRequest(), timeout=2)).ready:
                            return False
                        for name in models:
                            request = pb.ModelReadyRequest(name=name)
                            if not (await stub.ModelReady(request, timeout=2)).ready:
                                return False
                    except grpc.aio.AioRpcError:
                        return False
                    return True

            return asyncio.run(ask())

        # MLServer has no readiness event to wait on: its ServerReady is polled
        assert wait_until(ready, WAIT, interval=0.5), log_path.read_text()[-3000:]
        yield address
    finally:
        os.killpg(process.pid, signal.SIGTERM)  # its own session: MLServer and its children
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)
        log.close()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # its children leave the group too
            try:
                os.killpg(process.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
