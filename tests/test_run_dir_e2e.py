"""One run_dir, one live tree (issue 21, sections 1 and 5), with real processes.

A second ``poolserve serve`` on a run_dir that a live tree holds exits 2
naming the holder's pid and touches nothing, whatever else is wrong with it
(another repository, a taken port). ``poolserve pool`` and ``router`` started
alone (supervisord's flat layout) never remove a socket that a live process
serves. Run directories that cannot be trusted, and settings that would
break serving, stop ``serve`` with exit code 2 before anything starts.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import stat
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from poolserve.protos import inference_pb2 as pb
from poolserve.service.contract.rundir import LOCK_FILE, MAX_UNIX_PATH

from harness import descendants, kill_pids, pid_alive
from serving import LISTENING_PREFIX, Serving, wait_serving
from support import BIN, EXAMPLES, copy_example, infer_request, wait_until, write_model

pytestmark = pytest.mark.e2e

WAIT = 60.0  # generous: CI is a loaded two-core machine
INFER = "/inference.GRPCInferenceService/ModelInfer"
OTHER_UID = 65534  # nobody

NEGATING_ECHO = """
from poolserve.service import Model

class Negate(Model):
    def predict(self, inputs, parameters):
        return {"OUTPUT0": -inputs["INPUT0"]}
"""


def echo_repo(root: Path) -> Path:
    copy_example(root, "echo")
    return root


def negating_repo(root: Path) -> Path:
    """Another repository with a model of the same name that answers -x."""
    settings = json.loads((EXAMPLES / "echo" / "model-settings.json").read_text())
    settings["implementation"] = "model.Negate"
    write_model(root, "echo", settings, NEGATING_ECHO)
    return root


def run_to_exit(
    argv: Sequence[str], timeout: float = WAIT, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Runs a command that must exit by itself; a process tree still running at
    ``timeout`` is killed by PID and fails the test."""
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=None if env is None else {**os.environ, **env},
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kids = descendants(proc.pid)
        proc.kill()
        kill_pids(kids)
        out, err = proc.communicate()
        raise AssertionError(f"{argv[1]} still running after {timeout} s:\n{err[-3000:]}") from None
    return subprocess.CompletedProcess(list(argv), proc.returncode, out, err)


def snapshot(run_dir: Path) -> dict[str, int]:
    """Each entry of the run_dir and its inode: what a second tree must leave alone."""
    return {entry.name: entry.lstat().st_ino for entry in run_dir.iterdir()}


async def echo_of(address: str, value: float) -> np.ndarray:
    async with grpc.aio.insecure_channel(address) as channel:
        request = infer_request("echo", np.full((1, 16), value, np.float32))
        reply = await channel.unary_unary(INFER)(request, timeout=WAIT)
    out = pb.ModelInferResponse.FromString(reply).raw_output_contents[0]
    return np.frombuffer(out, np.float32)


def serve_argv(repo: Path, *extra: str) -> list[str]:
    return [str(BIN / "poolserve"), "serve", str(repo), "--workers", "1", *extra]


# -- section 1: two trees, one run_dir ---------------------------------------------


@pytest.mark.parametrize("second", ["another repository", "the same port"])
def test_a_second_tree_on_a_held_run_dir_exits_2_and_the_first_keeps_serving(
    tmp_path: Path, second: str
) -> None:
    run_dir = tmp_path / "run"
    with Serving(echo_repo(tmp_path / "first"), run_dir, workers=1) as first:

        async def ready() -> None:
            async with grpc.aio.insecure_channel(first.address) as channel:
                await wait_serving(channel, timeout=WAIT)

        asyncio.run(ready())
        before = snapshot(run_dir)
        if second == "another repository":
            argv = serve_argv(negating_repo(tmp_path / "second"), "--grpc-port", "0")
        else:
            port = first.address.rsplit(":", 1)[1]
            argv = serve_argv(tmp_path / "first", "--grpc-port", port)
        done = run_to_exit([*argv, "--run-dir", str(run_dir)])
        assert done.returncode == 2, done.stderr
        assert str(run_dir) in done.stderr and f"pid {first.pid}" in done.stderr, done.stderr
        assert "Traceback" not in done.stderr
        assert LISTENING_PREFIX not in done.stdout
        assert snapshot(run_dir) == before  # not one socket replaced or removed
        # The first tree answers with its own model, through its router.
        assert np.array_equal(asyncio.run(echo_of(first.address, 3.0)), np.full(16, 3.0))
        assert first.proc is not None and first.proc.poll() is None


def lock_fds(pid: int, lock: Path) -> list[str]:
    found = []
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            if os.readlink(fd) == str(lock):
                found.append(fd.name)
        except OSError:
            continue
    return found


def test_only_the_supervisor_holds_the_run_dir_lock(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    with Serving(echo_repo(tmp_path / "repo"), run_dir, workers=2) as serving:

        async def ready() -> None:
            async with grpc.aio.insecure_channel(serving.address) as channel:
                await wait_serving(channel, timeout=WAIT)

        asyncio.run(ready())
        lock = run_dir / LOCK_FILE
        assert lock.read_text().strip() == str(serving.pid)
        assert len(lock_fds(serving.pid, lock)) == 1
        tree = serving.tree()
        assert len(tree) >= 5  # pool, zygote, 2 workers, router
        for pid in tree:
            assert lock_fds(pid, lock) == [], (pid, (Path(f"/proc/{pid}/comm").read_text()))


# -- section 1: supervisord's flat layout ------------------------------------------


class Standalone:
    """``poolserve pool`` / ``router`` as supervisord runs them; killed by PID at the end."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, *args: str) -> subprocess.Popen[bytes]:
        log = open(self.tmp_path / f"{args[0]}-{len(self.procs)}.log", "wb")  # noqa: SIM115
        proc = subprocess.Popen([str(BIN / "poolserve"), *args], stdout=log, stderr=log)
        log.close()
        self.procs.append(proc)
        return proc

    def close(self) -> None:
        pids = []
        for proc in self.procs:
            pids += [proc.pid, *descendants(proc.pid)]
        kill_pids(pids)
        for proc in self.procs:
            proc.wait(timeout=30)
        wait_until(lambda: not any(pid_alive(p) for p in pids), timeout=10)


@pytest.fixture
def standalone(tmp_path: Path) -> Iterator[Standalone]:
    procs = Standalone(tmp_path)
    yield procs
    procs.close()


async def pool_serving(target: str) -> None:
    """Waits for a pool started alone: its socket may not exist yet."""
    async with grpc.aio.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        request = health_pb2.HealthCheckRequest(service="")
        async for reply in stub.Watch(request, timeout=WAIT, wait_for_ready=True):
            if reply.status == health_pb2.HealthCheckResponse.SERVING:
                return


async def health(target: str) -> int:
    async with grpc.aio.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        reply = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=WAIT)
        return int(reply.status)


def test_processes_started_alone_never_take_a_live_socket(
    tmp_path: Path, standalone: Standalone
) -> None:
    repo = echo_repo(tmp_path / "repo")
    run_dir = tmp_path / "run"
    common = ["--run-dir", str(run_dir), "--workers", "1"]
    pool = standalone.start("pool", str(repo), "--gid", "default", *common)
    router = standalone.start("router", str(repo), "--grpc-port", "0", *common)
    address_file = run_dir / "router.addr"
    # No readiness pipe outside a tree: the file the router writes once it listens.
    assert wait_until(address_file.exists, timeout=WAIT), "the router never listened"
    address = address_file.read_text().strip()

    async def serving() -> None:
        async with grpc.aio.insecure_channel(address) as channel:
            await wait_serving(channel, timeout=WAIT)

    asyncio.run(serving())
    before = snapshot(run_dir)

    again = run_to_exit([str(BIN / "poolserve"), "pool", str(repo), "--gid", "default", *common])
    assert again.returncode == 3, again.stderr  # this pool cannot work here
    assert str(run_dir / "pool-default.sock") in again.stderr and "live" in again.stderr
    router_again = run_to_exit(
        [str(BIN / "poolserve"), "router", str(repo), "--grpc-port", "0", *common]
    )
    assert router_again.returncode == 2, router_again.stderr
    assert "router-control.sock" in router_again.stderr, router_again.stderr
    # And a tree cannot take a run_dir that processes started alone use.
    tree = run_to_exit(serve_argv(repo, "--grpc-port", "0", "--run-dir", str(run_dir)))
    assert tree.returncode == 2, tree.stderr
    assert f"pid {pool.pid}" in tree.stderr and f"{router.pid}" in tree.stderr, tree.stderr

    assert snapshot(run_dir) == before
    assert asyncio.run(health(f"unix:{run_dir / 'pool-default.sock'}")) == 1  # SERVING
    assert np.array_equal(asyncio.run(echo_of(address, 5.0)), np.full(16, 5.0))
    assert pool.poll() is None and router.poll() is None


def test_a_pool_started_alone_cleans_a_stale_socket(tmp_path: Path, standalone: Standalone) -> None:
    repo = echo_repo(tmp_path / "repo")
    run_dir = tmp_path / "run"
    common = ["--run-dir", str(run_dir), "--workers", "1"]
    pool = standalone.start("pool", str(repo), "--gid", "default", *common)
    target = f"unix:{run_dir / 'pool-default.sock'}"
    asyncio.run(pool_serving(target))
    kids = descendants(pool.pid)
    pool.send_signal(signal.SIGKILL)  # leaves its sockets behind
    pool.wait(timeout=WAIT)
    kill_pids(kids)
    assert stat.S_ISSOCK((run_dir / "pool-default.sock").lstat().st_mode)
    standalone.start("pool", str(repo), "--gid", "default", *common)
    asyncio.run(pool_serving(target))


# -- section 5: run directories and settings that cannot work -----------------------


def _too_long(tmp_path: Path) -> Path:
    room = MAX_UNIX_PATH - len(os.fsencode(tmp_path)) - len("//pool-default.sock") + 1
    return tmp_path / ("r" * room)


def _a_file(tmp_path: Path) -> Path:
    (tmp_path / "run").write_text("a file")
    return tmp_path / "run"


def _under_a_file(tmp_path: Path) -> Path:
    (tmp_path / "file").write_text("a file")
    return tmp_path / "file" / "run"


def _a_symlink(tmp_path: Path) -> Path:
    (tmp_path / "elsewhere").mkdir(mode=0o755)
    (tmp_path / "elsewhere").chmod(0o755)
    (tmp_path / "run").symlink_to(tmp_path / "elsewhere")
    return tmp_path / "run"


def _open_to_others(tmp_path: Path) -> Path:
    (tmp_path / "run").mkdir()
    (tmp_path / "run").chmod(0o777)
    return tmp_path / "run"


RUN_DIRS = {
    "too long for a unix socket": (_too_long, "longer than the 107"),
    "a regular file": (_a_file, "not a directory"),
    "under a regular file": (_under_a_file, "cannot create it"),
    "a symbolic link": (_a_symlink, "symbolic link"),
    "open to other users": (_open_to_others, "0777"),
}


@pytest.mark.parametrize("case", sorted(RUN_DIRS))
def test_a_run_dir_that_cannot_be_trusted_stops_serve_with_2(tmp_path: Path, case: str) -> None:
    make, words = RUN_DIRS[case]
    run_dir = make(tmp_path)
    repo = echo_repo(tmp_path / "repo")
    done = run_to_exit(serve_argv(repo, "--grpc-port", "0", "--run-dir", str(run_dir)))
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert str(run_dir) in done.stderr and "'run_dir'" in done.stderr, done.stderr
    assert words in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
    assert LISTENING_PREFIX not in done.stdout
    if case == "a symbolic link":  # not followed, so neither filled nor chmod-ed
        assert stat.S_IMODE((tmp_path / "elsewhere").stat().st_mode) == 0o755
        assert list((tmp_path / "elsewhere").iterdir()) == []
    if case == "open to other users":
        assert stat.S_IMODE(run_dir.stat().st_mode) == 0o777
        assert list(run_dir.iterdir()) == []


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to make a directory someone else's")
def test_another_user_cannot_capture_the_default_run_dir(tmp_path: Path) -> None:
    runtime = tmp_path / "xdg"
    runtime.mkdir()
    port = 18931  # never bound: serve must stop before its router
    trap = runtime / f"poolserve-{os.getuid()}-{port}"  # the default run_dir's name
    trap.mkdir()
    trap.chmod(0o777)
    os.chown(trap, OTHER_UID, OTHER_UID)
    repo = echo_repo(tmp_path / "repo")
    done = run_to_exit(
        serve_argv(repo, "--grpc-port", str(port)), env={"XDG_RUNTIME_DIR": str(runtime)}
    )
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert str(trap) in done.stderr and "owned by another user" in done.stderr, done.stderr
    info = trap.stat()
    assert (info.st_uid, stat.S_IMODE(info.st_mode)) == (OTHER_UID, 0o777)
    assert list(trap.iterdir()) == []


def test_zero_workers_serves_the_pool_inline(tmp_path: Path) -> None:
    """``--workers 0`` for a pool of worker models: its models run inline, as with
    MLServer's parallel_workers 0 (it used to never turn ready)."""
    repo = echo_repo(tmp_path / "repo")
    with Serving(repo, tmp_path / "run", workers=0) as serving:

        async def check() -> None:
            async with grpc.aio.insecure_channel(serving.address) as channel:
                await wait_serving(channel, timeout=WAIT)

        asyncio.run(check())
        assert np.array_equal(asyncio.run(echo_of(serving.address, 7.0)), np.full(16, 7.0))
        comms = sorted(Path(f"/proc/{pid}/comm").read_text().strip() for pid in serving.tree())
        assert "poolserve-wrk" not in comms and "poolserve-pool" in comms, comms
