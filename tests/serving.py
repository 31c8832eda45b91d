"""Start ``poolserve serve`` as a real process tree for end-to-end tests."""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import time
from pathlib import Path
from types import TracebackType

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from poolserve.protos import control_pb2 as cpb

from support import BIN, descendants, kill_all, pid_alive, wait_until

# The line `poolserve serve` prints once its router listens (models may still load).
LISTENING_PREFIX = "poolserve: listening on "


class Serving:
    """One ``poolserve serve`` tree; kills every PID it saw when it closes."""

    def __init__(
        self,
        repo: Path,
        run_dir: Path,
        *extra: str,
        workers: int = 2,
        env: dict[str, str] | None = None,
        env_replace: dict[str, str] | None = None,
    ) -> None:
        """``env``: added to this process's environment; ``env_replace``: the whole of it."""
        self.repo = repo
        self.env = env
        self.env_replace = env_replace
        self.run_dir = run_dir
        self.log_path = run_dir.parent / f"{run_dir.name}.log"
        self.argv = [
            str(BIN / "poolserve"),
            "serve",
            str(repo),
            "--grpc-port",
            "0",
            "--run-dir",
            str(run_dir),
            "--workers",
            str(workers),
            *extra,
        ]
        self.proc: subprocess.Popen[str] | None = None
        self.address = ""
        self.listening_line = ""
        self.seen: set[int] = set()

    def start(self, timeout: float = 60.0) -> Serving:
        log = open(self.log_path, "w")  # noqa: SIM115 (closed with the process)
        env = None if self.env is None else {**os.environ, **self.env}
        if self.env_replace is not None:
            env = {**self.env_replace, **(self.env or {})}
        self.proc = subprocess.Popen(
            self.argv, stdout=subprocess.PIPE, stderr=log, text=True, bufsize=1, env=env
        )
        log.close()
        self.address = self._read_ready(timeout)
        return self

    def _read_ready(self, timeout: float) -> str:
        assert self.proc is not None and self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            while time.monotonic() < deadline:
                if not sel.select(timeout=max(0.0, deadline - time.monotonic())):
                    break
                line = self.proc.stdout.readline()
                if not line:
                    break
                if line.startswith(LISTENING_PREFIX):
                    self.listening_line = line.strip()
                    return line[len(LISTENING_PREFIX) :].split(" (")[0].strip()
        raise AssertionError(f"poolserve serve did not become ready:\n{self.log()}")

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def tree(self) -> list[int]:
        found = descendants(self.pid)
        self.seen.update(found)
        return found

    def log(self) -> str:
        try:
            return self.log_path.read_text()
        except OSError:
            return ""

    def terminate(self, timeout: float = 30.0) -> int:
        """SIGTERM the supervisor and wait for it; returns its exit code."""
        assert self.proc is not None
        self.tree()
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=timeout)

    def close(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.tree()
            self.proc.kill()
            self.proc.wait(timeout=30)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        kill_all(sorted(self.seen))
        wait_until(lambda: not any(pid_alive(p) for p in self.seen), timeout=10)

    def __enter__(self) -> Serving:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def env_without_notify() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("NOTIFY_SOCKET", None)
    return env


async def pool_status(serving: Serving, gid: str = "default") -> cpb.PoolStatus:
    path = serving.run_dir / f"pool-{gid}.sock"
    async with grpc.aio.insecure_channel(f"unix:{path}") as channel:
        call = channel.unary_unary(
            "/poolserve.control.v1.PoolControl/Status",
            request_serializer=cpb.PoolStatusRequest.SerializeToString,
            response_deserializer=cpb.PoolStatus.FromString,
        )
        status: cpb.PoolStatus = await call(cpb.PoolStatusRequest(), timeout=10)
        return status


async def wait_serving(channel: grpc.aio.Channel, service: str = "", timeout: float = 60) -> None:
    stub = health_pb2_grpc.HealthStub(channel)
    stream = stub.Watch(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
    async for reply in stream:
        if reply.status == health_pb2.HealthCheckResponse.SERVING:
            stream.cancel()
            return
