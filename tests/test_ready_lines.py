"""What ``poolserve serve`` says on stdout and to systemd (issue 21, section 6):
"listening" once the router listens (with READY=1), then "ready" only once
health turns SERVING, that is once every model is loaded."""

from __future__ import annotations

import asyncio
import json
import queue
import socket
import threading
from contextlib import closing
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from serving import LISTENING_PREFIX, Serving
from support import copy_example, wait_until, write_model

pytestmark = pytest.mark.e2e

WAIT = 60.0  # generous: CI is a loaded two-core machine
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING

# Loads only once the gate file exists, and says when its load has begun.
GATED = """
import os, time
from pathlib import Path
from poolserve.service import Model

class Gated(Model):
    def load(self):
        Path(self.settings.extra["loading"]).write_text(str(os.getpid()))
        while not os.path.exists(self.settings.extra["gate"]):  # the test opens it
            time.sleep(0.01)

    def predict(self, inputs, parameters):
        return {"OUTPUT0": inputs["INPUT0"]}
"""


def lines_of(serving: Serving) -> queue.Queue[str]:
    """The rest of the supervisor's stdout, line by line, read on a thread."""
    assert serving.proc is not None and serving.proc.stdout is not None
    stdout = serving.proc.stdout
    lines: queue.Queue[str] = queue.Queue()

    def read() -> None:
        for line in stdout:
            lines.put(line.rstrip("\n"))

    threading.Thread(target=read, daemon=True).start()
    return lines


async def health_status(address: str) -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        reply = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=WAIT)
        return int(reply.status)


class Notify:
    """A datagram socket standing in for systemd's notify socket (non-blocking reads)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.setblocking(False)
        self.received: list[str] = []

    def text(self) -> str:
        """Everything received so far."""
        while True:
            try:
                self.received.append(self.sock.recv(4096).decode())
            except BlockingIOError:
                return "\n".join(self.received)


def test_listening_comes_first_and_ready_only_once_every_model_is_loaded(
    tmp_path: Path,
) -> None:
    repo = tmp_path / "repo"
    copy_example(repo, "echo")
    loading, gate = tmp_path / "loading", tmp_path / "gate"
    settings = json.loads((repo / "echo" / "model-settings.json").read_text())
    settings |= {
        "name": "gated",
        "implementation": "model.Gated",
        "parameters": {"extra": {"loading": str(loading), "gate": str(gate)}},
    }
    write_model(repo, "gated", settings, GATED)
    notify = Notify(tmp_path / "notify.sock")
    env = {"NOTIFY_SOCKET": str(notify.path)}
    with closing(notify.sock), Serving(repo, tmp_path / "run", workers=1, env=env) as serving:
        assert serving.listening_line == f"{LISTENING_PREFIX}{serving.address} (2 models loading)"
        lines = lines_of(serving)
        assert wait_until(loading.exists, timeout=WAIT), serving.log()
        # The gated model is loading now, so it cannot be ready.
        assert asyncio.run(health_status(serving.address)) == NOT_SERVING
        assert lines.empty(), lines.get_nowait()
        assert "READY=1" in notify.text()  # systemd's READY=1 goes with "listening"
        assert "models serving" not in notify.text()

        gate.write_text("")
        line = lines.get(timeout=WAIT)
        assert line == f"poolserve: ready, 2 models serving on {serving.address}"
        # The line follows health: it says SERVING by now.
        assert asyncio.run(health_status(serving.address)) == SERVING
        status = f"STATUS=ready, 2 models serving on {serving.address}"
        assert wait_until(lambda: status in notify.text(), timeout=WAIT), notify.received
        assert serving.terminate() == 0


def test_a_folder_that_cannot_be_served_is_said_at_start(tmp_path: Path) -> None:
    """An invalid model-settings.json keeps the server from ever being ready (every
    model of the repository must be): the listening line counts it, the log says
    which and why, and health names it."""
    repo = tmp_path / "repo"
    copy_example(repo, "echo")
    (repo / "bad").mkdir()
    (repo / "bad" / "model-settings.json").write_text(
        json.dumps({"name": "bad", "implementation": "model.X", "max_batch_size": "lots"})
    )
    with Serving(repo, tmp_path / "run", workers=1) as serving:
        assert serving.listening_line == (
            f"{LISTENING_PREFIX}{serving.address} (1 model loading; 1 not served, see the log)"
        )
        log = serving.log()
        (line,) = [x for x in log.splitlines() if "model bad is not served" in x]
        assert " ERROR " in line and "max_batch_size" in line, line
        assert asyncio.run(health_status(serving.address)) == NOT_SERVING
        assert serving.terminate() == 0
