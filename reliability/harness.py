"""Shared helpers of the reliability suite: real ``poolserve serve`` trees,
their process census, memory, logs, and small gRPC helpers.

Used by ``reliability/stress.py``, ``reliability/chaos.py``,
``reliability/fuzz.py`` and by their short variants in ``tests/``. Everything
runs over loopback against real processes; every PID a :class:`Tree` sees is
killed by PID when it closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from poolserve.protos import control_pb2 as cpb
from poolserve.protos import inference_pb2 as pb
from poolserve.service.inference.codec import encode_inputs

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples" / "models"
BIN = Path(sys.executable).parent
# The line `poolserve serve` prints once its router listens (models may still load).
LISTENING_PREFIX = "poolserve: listening on "
INFER = "/inference.GRPCInferenceService/ModelInfer"

# Process names (comm) that poolserve sets for each role.
ROLES = {
    "poolserve-pool": "pool",
    "poolserve-zyg": "zygote",
    "poolserve-wrk": "worker",
    "poolserve-rtr": "router",
}

# ---------------------------------------------------------------------------
# repositories


def make_repo(
    root: Path,
    models: Mapping[str, str | None],
    settings: Mapping[str, Any] | None = None,
) -> Path:
    """A repository with copies of example models (name -> gid, None: default)."""
    root.mkdir(parents=True, exist_ok=True)
    for name, gid in models.items():
        target = root / name
        shutil.copytree(EXAMPLES / name, target, ignore=shutil.ignore_patterns("__pycache__"))
        if gid is not None:
            path = target / "model-settings.json"
            data = json.loads(path.read_text())
            data.setdefault("parameters", {})["inference_pool_gid"] = gid
            path.write_text(json.dumps(data))
    if settings:
        (root / "settings.json").write_text(json.dumps(dict(settings)))
    return root


def free_port() -> int:
    """A loopback port that was free a moment ago (for trees whose router restarts)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# ---------------------------------------------------------------------------
# /proc


def proc_state(pid: int) -> str:
    """The one-letter state of ``pid`` ('' when it does not exist)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def pid_alive(pid: int) -> bool:
    state = proc_state(pid)
    return bool(state) and state != "Z"


def comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def cmdline(pid: int) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def children_of(pid: int) -> list[int]:
    kids: list[int] = []
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return kids
    for task in tasks:
        with contextlib.suppress(OSError, ValueError):
            kids.extend(int(x) for x in (task / "children").read_text().split())
    return kids


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` now (children first, then theirs)."""
    found: list[int] = []
    stack = [pid]
    while stack:
        for kid in children_of(stack.pop()):
            found.append(kid)
            stack.append(kid)
    return found


def rss_bytes(pid: int) -> int:
    """Resident set size of ``pid`` (0 when it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return 0
    return 0


def pids_with_arg(needle: str) -> list[int]:
    """Every live process whose command line mentions ``needle`` (e.g. a run dir)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        if pid == os.getpid():
            continue
        if any(needle in part for part in cmdline(pid)):
            found.append(pid)
    return found


def kill_pids(pids: Iterable[int], sig: int = signal.SIGKILL) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def wait_gone(pids: Iterable[int], timeout: float) -> bool:
    """Polls /proc (no event exists for another process's death) until all are gone."""
    pending = list(pids)
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        pending = [p for p in pending if pid_alive(p)]
        if not pending:
            return True
        time.sleep(0.02)
    return not any(pid_alive(p) for p in pending)


# ---------------------------------------------------------------------------
# the process census


@dataclass(frozen=True)
class Proc:
    pid: int
    ppid: int
    role: str  # supervisor, router, pool, zygote, worker, or the raw comm
    state: str
    gid: str = ""


@dataclass
class Census:
    """The process tree below a supervisor, checked against what it should be."""

    procs: list[Proc]
    problems: list[str]

    @property
    def ok(self) -> bool:
        return not self.problems

    def counts(self) -> dict[str, int]:
        return dict(Counter(p.role for p in self.procs))

    def pids(self, role: str, gid: str | None = None) -> list[int]:
        return [p.pid for p in self.procs if p.role == role and (gid is None or p.gid == gid)]

    def summary(self) -> str:
        counts = ", ".join(f"{n} {role}" for role, n in sorted(self.counts().items()))
        return counts + ("" if self.ok else "; PROBLEMS: " + "; ".join(self.problems))


def _gid_of(pid: int) -> str:
    argv = cmdline(pid)
    for i, arg in enumerate(argv[:-1]):
        if arg == "--gid":
            return argv[i + 1]
    return ""


def take_census(
    supervisor: int, expected: Mapping[str, int], run_dir: Path, routers: int = 1
) -> Census:
    """Walks the tree below ``supervisor`` and compares it with ``expected``
    (gid -> workers): exactly ``routers`` routers, and per gid one pool with one
    zygote with that many workers; no zombie, no orphan, no duplicate, nothing
    else: 1 + routers + G x (2 + W) processes."""
    procs: list[Proc] = []
    problems: list[str] = []
    stack = [(supervisor, 0, "")]
    while stack:
        pid, ppid, gid = stack.pop()
        state = proc_state(pid)
        if not state:
            continue
        role = "supervisor" if pid == supervisor else ROLES.get(comm(pid), comm(pid) or "?")
        if role == "pool":
            gid = _gid_of(pid)
        procs.append(Proc(pid, ppid, role, state, gid))
        if state == "Z":
            problems.append(f"zombie {role} {pid}")
        stack.extend((kid, pid, gid) for kid in children_of(pid))
    by_pid = {p.pid: p for p in procs}
    live = [p for p in procs if p.state != "Z"]
    live_routers = [p for p in live if p.role == "router"]
    if len(live_routers) != routers:
        problems.append(f"{len(live_routers)} routers, expected {routers}")
    for p in live:
        parent = by_pid.get(p.ppid)
        want_parent = {"router": "supervisor", "pool": "supervisor", "zygote": "pool"}
        want_parent["worker"] = "zygote"
        if p.role == "supervisor":
            continue
        if p.role not in want_parent:
            problems.append(f"unexpected process {p.pid} ({p.role})")
        elif parent is None or parent.role != want_parent[p.role]:
            problems.append(f"{p.role} {p.pid} under {parent.role if parent else '?'}")
    for gid, workers in expected.items():
        pools = [p for p in live if p.role == "pool" and p.gid == gid]
        if len(pools) != 1:
            problems.append(f"{len(pools)} pool processes for gid {gid!r}")
            continue
        zygotes = [p for p in live if p.role == "zygote" and p.ppid == pools[0].pid]
        if len(zygotes) != 1:
            problems.append(f"{len(zygotes)} zygotes in pool {gid!r}")
            continue
        kids = [p for p in live if p.role == "worker" and p.ppid == zygotes[0].pid]
        if len(kids) != workers:
            problems.append(f"{len(kids)} workers in pool {gid!r}, expected {workers}")
    unknown = {p.gid for p in live if p.role == "pool"} - set(expected)
    problems.extend(f"pool for unknown gid {gid!r}" for gid in sorted(unknown))
    mine = {p.pid for p in procs}
    orphans = [pid for pid in pids_with_arg(str(run_dir)) if pid not in mine]
    problems.extend(f"orphan {pid} ({comm(pid)}) outside the tree" for pid in orphans)
    return Census(procs, problems)


# ---------------------------------------------------------------------------
# a tree


class Tree:
    """One ``poolserve serve`` tree. Kills every PID it saw (by PID) on close.

    The one start-and-wait helper of the reliability suite and of the tests
    (tests/serving.py's ``Serving`` is this class with the tests' calling
    convention). ``env`` is added to this process's environment, ``env_replace``
    replaces all of it; ``NOTIFY_SOCKET`` is dropped unless ``keep_notify_socket``.
    """

    def __init__(
        self,
        repo: Path,
        run_dir: Path,
        *,
        workers: int = 2,
        port: int = 0,
        extra: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        env_replace: Mapping[str, str] | None = None,
        keep_notify_socket: bool = False,
        log_path: Path | None = None,
    ) -> None:
        self.repo = repo
        self.run_dir = run_dir
        self.workers = workers
        self.env = env
        self.env_replace = env_replace
        self.keep_notify_socket = keep_notify_socket
        self.log_path = log_path or run_dir.parent / f"{run_dir.name}.log"
        self.argv = [
            str(BIN / "poolserve"),
            "serve",
            str(repo),
            "--grpc-port",
            str(port),
            "--run-dir",
            str(run_dir),
            "--workers",
            str(workers),
            "--metrics-port",  # a free port: trees side by side never share 8082
            "0",
            "--http-port",  # the same for the HTTP door's 8080
            "0",
            *extra,  # after: an explicit --metrics-port wins
        ]
        self.proc: subprocess.Popen[str] | None = None
        self.address = ""
        self.listening_line = ""
        self.seen: set[int] = set()

    # -- lifecycle -----------------------------------------------------------

    def start(self, timeout: float = 60.0) -> Tree:
        env = dict(os.environ if self.env_replace is None else self.env_replace)
        env.update(self.env or {})
        if not self.keep_notify_socket:
            env.pop("NOTIFY_SOCKET", None)
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                self.argv, stdout=subprocess.PIPE, stderr=log, text=True, bufsize=1, env=env
            )
        self.address = self._read_ready(timeout)
        self.snapshot()
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
        raise RuntimeError(f"poolserve serve did not become ready:\n{self.log()[-4000:]}")

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def snapshot(self) -> list[int]:
        """The supervisor's descendants now; remembers them for the final kill."""
        found = descendants(self.pid)
        self.seen.update(found)
        return found

    def census(self, expected: Mapping[str, int], routers: int = 1) -> Census:
        found = take_census(self.pid, expected, self.run_dir, routers)
        self.seen.update(p.pid for p in found.procs if p.pid != self.pid)
        return found

    def terminate(self, timeout: float = 60.0) -> int:
        """SIGTERM to the supervisor; returns its exit code."""
        assert self.proc is not None
        self.snapshot()
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=timeout)

    def leftovers(self) -> list[int]:
        """Processes of this tree still alive (after the supervisor exited)."""
        alive = {p for p in self.seen if pid_alive(p)}
        alive.update(pids_with_arg(str(self.run_dir)))
        return sorted(alive)

    def close(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.snapshot()
            self.proc.kill()
            self.proc.wait(timeout=30)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        stray = self.leftovers()
        kill_pids(stray)
        wait_gone(stray, timeout=10)

    def __enter__(self) -> Tree:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- logs ----------------------------------------------------------------

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def tracebacks(self) -> list[str]:
        """Each 'Traceback' in the tree's log, with the line before it and a few after."""
        lines = self.log().splitlines()
        return [
            "\n".join(lines[max(0, i - 1) : i + 12])
            for i, line in enumerate(lines)
            if "Traceback" in line
        ]


# ---------------------------------------------------------------------------
# gRPC helpers


def channel_options(*, local: bool = True, fast_reconnect: bool = False) -> list[tuple[str, Any]]:
    options: list[tuple[str, Any]] = [
        ("grpc.max_send_message_length", 256 * 1024 * 1024),
        ("grpc.max_receive_message_length", 256 * 1024 * 1024),
    ]
    if local:  # one TCP connection per channel, not one shared subchannel
        options.append(("grpc.use_local_subchannel_pool", 1))
    if fast_reconnect:  # chaos: the router comes back within a second or two
        options += [
            ("grpc.initial_reconnect_backoff_ms", 50),
            ("grpc.min_reconnect_backoff_ms", 50),
            ("grpc.max_reconnect_backoff_ms", 250),
        ]
    return options


async def wait_serving(channel: grpc.aio.Channel, service: str = "", timeout: float = 60) -> None:
    """Waits on the health Watch stream until ``service`` is SERVING."""
    stub = health_pb2_grpc.HealthStub(channel)
    stream = stub.Watch(
        health_pb2.HealthCheckRequest(service=service), timeout=timeout, wait_for_ready=True
    )
    async for reply in stream:
        if reply.status == health_pb2.HealthCheckResponse.SERVING:
            stream.cancel()
            return
    raise RuntimeError(f"health of {service!r} ended without SERVING")


async def health_check(channel: grpc.aio.Channel, timeout: float = 2.0) -> bool:
    stub = health_pb2_grpc.HealthStub(channel)
    try:
        reply = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout)
    except grpc.aio.AioRpcError:
        return False
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


async def pool_status(run_dir: Path, gid: str = "default", timeout: float = 10) -> cpb.PoolStatus:
    path = run_dir / f"pool-{gid}.sock"
    async with grpc.aio.insecure_channel(f"unix:{path}") as channel:
        call = channel.unary_unary(
            "/poolserve.control.v1.PoolControl/Status",
            request_serializer=cpb.PoolStatusRequest.SerializeToString,
            response_deserializer=cpb.PoolStatus.FromString,
        )
        status: cpb.PoolStatus = await call(cpb.PoolStatusRequest(), timeout=timeout)
        return status


def payload(key: int, extra: float = 0.0) -> np.ndarray:
    """A [1, 16] FP32 tensor unique to ``key`` (exact in float32 below 2**24)."""
    row = np.arange(16, dtype=np.float32) + np.float32(extra)
    row[0] = np.float32(key % (1 << 24))
    row[1] = np.float32(key >> 24)
    return row.reshape(1, 16)


def infer_bytes(model: str, array: np.ndarray, **int_params: int) -> bytes:
    request = pb.ModelInferRequest(model_name=model)
    encode_inputs({"INPUT0": array}, request, raw=True)
    for key, value in int_params.items():
        request.parameters[key].int64_param = value
    return request.SerializeToString()


def output_bytes(reply: bytes) -> bytes:
    """The raw OUTPUT0 bytes of a serialized ModelInferResponse."""
    response = pb.ModelInferResponse.FromString(reply)
    return bytes(response.raw_output_contents[0]) if response.raw_output_contents else b""


async def probe_ok(channel: grpc.aio.Channel, model: str, key: int, timeout: float = 2.0) -> bool:
    """One call to ``model`` that must come back OK with its own payload."""
    array = payload(key)
    params = {"sleep_ms": 1} if model == "sleep" else {}
    call = channel.unary_unary(INFER)
    try:
        reply = await call(infer_bytes(model, array, **params), timeout=timeout)
    except grpc.aio.AioRpcError:
        return False
    return output_bytes(reply) == array.tobytes()


def percentiles(
    values: Sequence[float], points: Sequence[float] = (50, 90, 99, 99.9, 100)
) -> dict[str, float]:
    if not values:
        return {}
    arr = np.asarray(values, dtype=np.float64)
    return {f"p{p:g}": float(np.percentile(arr, p)) for p in points}


def run_async(coro: Any) -> Any:
    return asyncio.run(coro)
