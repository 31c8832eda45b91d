"""examples/fastapi_app under a real uvicorn: the pool starts in the lifespan of a
host that already runs an event loop, scores on forked workers, and leaves no
process behind when uvicorn stops.

uvicorn serves on a loopback socket the test binds and passes as ``--fd``;
readiness is uvicorn's "Application startup complete." line, never a sleep.
"""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import os
import selectors
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from harness import descendants, kill_pids, pid_alive
from support import BIN, ROOT, wait_until

pytest.importorskip("fastapi", reason="the example needs fastapi (test extra)")
pytest.importorskip("uvicorn", reason="the example needs uvicorn (test extra)")

pytestmark = pytest.mark.e2e

APP_DIR = ROOT / "examples" / "fastapi_app"
READY = "Application startup complete."


class Uvicorn:
    def __init__(self, proc: subprocess.Popen[str], port: int) -> None:
        self.proc = proc
        self.port = port
        self.lines: list[str] = []
        self.seen: set[int] = set()

    def tree(self) -> set[int]:
        found = set(descendants(self.proc.pid))
        self.seen |= found
        return found

    def request(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        try:
            data = None if body is None else json.dumps(body)
            headers = {"content-type": "application/json"} if body is not None else {}
            conn.request(method, path, body=data, headers=headers)
            response = conn.getresponse()
            return response.status, json.loads(response.read() or b"null")
        finally:
            conn.close()

    def read_until(self, marker: str, timeout: float) -> None:
        assert self.proc.stderr is not None
        deadline = time.monotonic() + timeout
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stderr, selectors.EVENT_READ)
            while time.monotonic() < deadline:
                if not sel.select(timeout=max(0.0, deadline - time.monotonic())):
                    break
                line = self.proc.stderr.readline()
                if not line:
                    break
                self.lines.append(line)
                if marker in line:
                    return
        raise AssertionError(f"uvicorn never logged {marker!r}:\n{''.join(self.lines)}")

    def rest_of_log(self) -> str:
        assert self.proc.stderr is not None
        self.lines.append(self.proc.stderr.read())
        return "".join(self.lines)


@contextmanager
def uvicorn(workers: int = 2) -> Iterator[Uvicorn]:
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    port = listener.getsockname()[1]
    argv = [
        str(BIN / "uvicorn"),
        "app:app",
        "--app-dir",
        str(APP_DIR),
        "--fd",
        str(listener.fileno()),
        "--log-level",
        "info",
    ]
    proc = subprocess.Popen(
        argv,
        pass_fds=(listener.fileno(),),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "WORKERS": str(workers)},
    )
    listener.close()
    server = Uvicorn(proc, port)
    try:
        server.read_until(READY, timeout=120)
        yield server
    finally:
        server.tree()
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
        if proc.stderr is not None:
            proc.stderr.close()
        kill_pids(sorted(server.seen))
        wait_until(lambda: not any(pid_alive(p) for p in server.seen), timeout=30)


def test_fastapi_app_scores_on_the_pool_and_stops_cleanly() -> None:
    with uvicorn(workers=2) as server:
        tree = server.tree()
        status, health = server.request("GET", "/healthz")
        assert (status, health) == (200, {"status": "serving"})
        status, stats = server.request("GET", "/stats")
        zygote, workers = stats["zygote_pid"], set(stats["workers"])
        assert len(workers) == 2 and {zygote, *workers} <= tree
        cmdline = Path(f"/proc/{zygote}/cmdline").read_bytes().split(b"\0")
        assert b"poolserve.service.workerpool.scoring" in cmdline, (
            "the zygote is an exec, not a fork"
        )

        body = {"features": [0.5, 1.5, 2.5], "work": 20_000}
        assert server.request("POST", "/predict", body) == server.request(
            "POST", "/predict-inline", body
        )
        with concurrent.futures.ThreadPoolExecutor(8) as clients:
            answers = list(
                clients.map(lambda _: server.request("POST", "/predict", body), range(16))
            )
        assert {status for status, _ in answers} == {200}
        assert len({json.dumps(answer) for _, answer in answers}) == 1

        status, error = server.request("POST", "/predict", {"features": [1.0], "timeout": 1e-9})
        assert status == 504 and "deadline" in error["detail"]
        status, error = server.request("POST", "/predict", {"features": []})
        assert status == 422  # refused by the app before it reaches the pool

        status, stats = server.request("GET", "/stats")
        burn = stats["models"]["burn"]
        assert burn["succeeded"] == 17 and burn["deadline_exceeded"] == 1
        assert burn["compute_ns"] > 0

        server.proc.send_signal(signal.SIGTERM)  # graceful: the lifespan closes the pool
        # uvicorn shuts down gracefully, then re-raises the signal it caught
        assert server.proc.wait(timeout=60) in (0, -signal.SIGTERM)
        log = server.rest_of_log()
        assert "Application shutdown complete." in log
        assert wait_until(lambda: not any(pid_alive(p) for p in server.seen), timeout=30)
