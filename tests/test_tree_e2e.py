"""The supervision tree end to end: real ``poolserve serve`` trees, real
signals, real sockets; plus the process-level guarantees on small trees of
real processes.

Waits are on readiness signals (health Watch streams, the notify socket,
pidfds, the control socket); /proc is polled only where the kernel offers no
event. Every PID a test sees is killed by PID at the end.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from poolserve.protos import control_pb2 as cpb
from poolserve.protos import inference_pb2 as pb
from poolserve.protos import inference_pb2_grpc as pbg
from poolserve.service.inference.codec import encode_inputs
from poolserve.supervisor.control import (
    fetch_tree_status,
    request_pool,
    router_control_path,
    walk,
)
from poolserve.supervisor.events import ChildExited, ChildStarted, Event
from poolserve.supervisor.notify import SystemdNotifier, watchdog_loop
from poolserve.supervisor.process import process_child
from poolserve.supervisor.spec import SupervisorSpec
from poolserve.supervisor.tree import Supervisor

from harness import children_of, kill_pids, pid_alive
from serving import Serving, cmdline, pool_status, wait_serving
from support import BIN, copy_example, wait_until, write_model

pytestmark = pytest.mark.e2e

WAIT = 60.0  # generous: CI is a loaded two-core machine
Stub = pbg.GRPCInferenceServiceStub

# Loads only once the gate file exists: the test decides when a pool is back.
GATED = """
import os, time
from poolserve.service import Model

class Gated(Model):
    def load(self):
        gate = self.settings.extra["gate"]
        while not os.path.exists(gate):   # the test opens the gate; no timing involved
            time.sleep(0.01)

    def predict(self, inputs, parameters):
        return {"OUTPUT0": inputs["INPUT0"]}
"""


def infer_request(model: str, value: float = 1.0) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name=model)
    encode_inputs({"INPUT0": np.full((1, 16), value, np.float32)}, request, raw=True)
    return request


def add_model_copy(repo: Path, source: str, name: str, gid: str) -> None:
    """A copy of an example model under a new name, in pool ``gid``."""
    target = repo / name
    shutil.copytree(repo / source, target, ignore=shutil.ignore_patterns("__pycache__"))
    settings = json.loads((target / "model-settings.json").read_text())
    settings["name"] = name
    settings.setdefault("parameters", {})["inference_pool_gid"] = gid
    (target / "model-settings.json").write_text(json.dumps(settings))


def node(status: cpb.TreeStatus, node_id: str) -> cpb.TreeNode:
    return next(each for each in walk(status.root) if each.id == node_id)


def pool_ids(status: cpb.TreeStatus) -> list[str]:
    return [child.id for child in node(status, "pools").children]


def router_address(serving: Serving) -> str:
    return (serving.run_dir / "router.addr").read_text().strip()


async def pool_pids(serving: Serving, gid: str) -> set[int]:
    """The pool server, its zygote and its workers."""
    status = await pool_status(serving, gid)
    return {status.pid, status.zygote_pid, *(w.pid for w in status.workers)}


def wait_exit(pid: int, timeout: float = WAIT) -> bool:
    """Waits until ``pid`` has exited, through a pidfd; True if it has."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        readable, _, _ = select.select([fd], [], [], timeout)
        return bool(readable)
    finally:
        os.close(fd)


def state_of(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return ""


def owned_fds() -> int:
    """Open pipes and pidfds (what a ProcessService opens); gRPC's sockets and
    event fds, closed lazily on its own threads, are left out."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            count += target.startswith("pipe:") or target == "anon_inode:[pidfd]"
    return count


def zombie_children(pid: int) -> list[int]:
    return [kid for kid in children_of(pid) if state_of(kid) == "Z"]


def poolserve(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "poolserve"), *args], capture_output=True, text=True, timeout=WAIT, check=False
    )


class Systemd:
    """A datagram socket standing in for systemd's notify socket."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.messages: list[list[str]] = []

    def receive(self, timeout: float = WAIT) -> list[str]:
        self.sock.settimeout(timeout)
        message = self.sock.recv(4096).decode().split("\n")
        self.messages.append(message)
        return message

    def until(self, line: str, timeout: float = WAIT) -> list[list[str]]:
        """Receives messages up to and including the first one with ``line``."""
        seen: list[list[str]] = []
        deadline = time.monotonic() + timeout
        while True:
            message = self.receive(max(0.001, deadline - time.monotonic()))
            seen.append(message)
            if line in message:
                return seen

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def systemd(tmp_path: Path) -> Iterator[Systemd]:
    listener = Systemd(tmp_path / "notify.sock")
    yield listener
    listener.close()


# -- one pool dies ---------------------------------------------------------------


def test_sigkill_of_one_pool_restarts_only_that_pool(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    copy_example(repo, "echo")
    gate = tmp_path / "gate"
    gate.touch()
    settings = {
        "implementation": "model.Gated",
        "parameters": {"inference_pool_gid": "gated", "extra": {"gate": str(gate)}},
    }
    write_model(repo, "gated", settings, GATED)

    async def main(serving: Serving) -> None:
        async with grpc.aio.insecure_channel(serving.address) as channel:
            await wait_serving(channel)
            stub = Stub(channel)
            shown = await asyncio.to_thread(
                poolserve, "status", "--run-dir", str(serving.run_dir), "--json"
            )
            assert shown.returncode == 0, shown.stderr
            tree = json.loads(shown.stdout)
            assert tree["pid"] == serving.pid
            # Not started by systemd (no NOTIFY_SOCKET): no systemd child to show.
            assert [c["id"] for c in tree["children"]] == ["control", "pools", "router"]
            pools = {c["id"]: c for c in tree["children"][1]["children"]}
            assert sorted(pools) == ["pool:default", "pool:gated"]
            default = pools["pool:default"]["pool"]
            assert default["pid"] == pools["pool:default"]["pid"]
            zygote_kids = set(children_of(default["zygote_pid"]))
            assert {w["pid"] for w in default["workers"]} == zygote_kids
            assert len(zygote_kids) == 2
            assert default["pss_bytes"] > 0
            text = await asyncio.to_thread(poolserve, "status", "--run-dir", str(serving.run_dir))
            assert text.returncode == 0 and "pool:gated" in text.stdout
            assert f"worker {default['workers'][0]['pid']}" in text.stdout

            before = await fetch_tree_status(serving.run_dir, WAIT)
            gated_pid = node(before, "pool:gated").pid
            default_pids = await pool_pids(serving, "default")
            serving.tree()

            stop = asyncio.Event()
            failures: list[str] = []
            served = 0

            async def echo_load() -> None:
                nonlocal served
                while not stop.is_set():
                    try:
                        await stub.ModelInfer(infer_request("echo"), timeout=WAIT)
                        served += 1
                    except grpc.aio.AioRpcError as error:
                        failures.append(f"{error.code()}: {error.details()}")

            loaders = [asyncio.ensure_future(echo_load()) for _ in range(4)]
            gate.unlink()  # the restarted pool will hang in load until the gate opens
            os.kill(gated_pid, signal.SIGKILL)
            assert await asyncio.to_thread(wait_exit, gated_pid)
            for _ in range(3):
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await stub.ModelInfer(infer_request("gated"), timeout=WAIT)
                assert info.value.code() is grpc.StatusCode.UNAVAILABLE, info.value.details()
            gate.touch()
            await wait_serving(channel, "model:gated")
            reply = await stub.ModelInfer(infer_request("gated"), timeout=WAIT)
            assert reply.outputs[0].name == "OUTPUT0"
            stop.set()
            await asyncio.gather(*loaders)
            assert failures == []
            assert served > 0

            after = await fetch_tree_status(serving.run_dir, WAIT)
            serving.tree()
            restarted = node(after, "pool:gated")
            assert restarted.pid not in (0, gated_pid)
            assert restarted.restarts == 1
            for kept in ("pool:default", "router", "pools"):
                assert node(after, kept).pid == node(before, kept).pid, kept
                assert node(after, kept).restarts == 0, kept
            assert await pool_pids(serving, "default") == default_pids
            assert zombie_children(serving.pid) == []

    with Serving(repo, tmp_path / "run") as serving:
        asyncio.run(main(serving))


# Marks that predict started, then never returns: a call that is in flight for sure.
MARKED = """
import os, time
from poolserve.service import Model

class Marked(Model):
    def predict(self, inputs, parameters):
        open(self.settings.extra["mark"], "w").close()
        time.sleep(3600)
        return {"OUTPUT0": inputs["INPUT0"]}
"""


def test_a_pool_killed_under_a_call_fails_it_unavailable_and_its_lane_reconnects(
    tmp_path: Path,
) -> None:
    """The router's lane to a pool: the call in flight when the pool dies is
    answered UNAVAILABLE at once (not left to its 120 s deadline), and the
    restarted pool serves through a new lane connection."""
    repo = tmp_path / "repo"
    copy_example(repo, "echo")
    mark = tmp_path / "predict-started"
    settings = {"implementation": "model.Marked", "parameters": {"extra": {"mark": str(mark)}}}
    write_model(repo, "stuck", settings, MARKED)

    async def main(serving: Serving) -> None:
        async with grpc.aio.insecure_channel(serving.address) as channel:
            await wait_serving(channel)
            stub = Stub(channel)
            before = await fetch_tree_status(serving.run_dir, WAIT)
            pool_pid = node(before, "pool:default").pid
            serving.tree()
            call = stub.ModelInfer(infer_request("stuck"), timeout=2 * WAIT)
            assert await asyncio.to_thread(wait_until, mark.exists, WAIT)
            os.kill(pool_pid, signal.SIGKILL)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await call
            assert info.value.code() is grpc.StatusCode.UNAVAILABLE, info.value.details()
            assert "pool 'default' closed its lane" in (info.value.details() or "")
            end = time.monotonic() + WAIT
            reply = None
            while reply is None:  # the supervisor restarts the pool; the router reconnects
                try:
                    reply = await stub.ModelInfer(infer_request("echo", 7.0), timeout=WAIT)
                except grpc.aio.AioRpcError as error:
                    refused = error.code(), error.details()
                else:
                    break
                assert refused[0] is grpc.StatusCode.UNAVAILABLE, refused
                assert time.monotonic() < end, "the restarted pool never served"
                await wait_serving(channel, "model:echo")
            assert np.frombuffer(reply.raw_output_contents[0], np.float32).tolist() == [7.0] * 16
            after = await fetch_tree_status(serving.run_dir, WAIT)
            serving.tree()
            assert node(after, "pool:default").pid != pool_pid
            assert node(after, "router").pid == node(before, "router").pid

    with Serving(repo, tmp_path / "run") as serving:
        asyncio.run(main(serving))


# -- the root dies ----------------------------------------------------------------


def test_sigkill_of_the_root_leaves_no_process_behind(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    copy_example(repo, "echo")
    copy_example(repo, "sleep", gid="other")
    with Serving(repo, tmp_path / "run") as serving:

        async def ready() -> None:
            async with grpc.aio.insecure_channel(serving.address) as channel:
                await wait_serving(channel)

        asyncio.run(ready())
        expected = 1 + 2 * (2 + 2)  # router; per pool: server, zygote, two workers
        assert wait_until(lambda: len(serving.tree()) == expected, timeout=WAIT), serving.tree()
        tree = serving.tree()
        assert serving.proc is not None
        serving.proc.kill()
        serving.proc.wait(timeout=WAIT)
        # PR_SET_PDEATHSIG down the chain: root -> pools and router -> zygotes -> workers.
        gone = wait_until(lambda: not any(pid_alive(p) for p in tree), timeout=15)
        assert gone, [(p, state_of(p)) for p in tree if pid_alive(p)]


# -- reload ------------------------------------------------------------------------


def test_sighup_after_adding_a_model_with_a_new_gid(tmp_path: Path, systemd: Systemd) -> None:
    repo = tmp_path / "repo"
    copy_example(repo, "echo")
    copy_example(repo, "sleep", gid="other")
    env = {"NOTIFY_SOCKET": str(systemd.path)}

    async def sighup_starts_one_pool(serving: Serving) -> None:
        before = await fetch_tree_status(serving.run_dir, WAIT)
        kept = {gid: await pool_pids(serving, gid) for gid in ("default", "other")}
        # The router takes routes live (RouterControl.SetRoutes on a private socket).
        assert router_control_path(serving.run_dir).exists()
        add_model_copy(repo, "echo", "echo3", "fresh")
        os.kill(serving.pid, signal.SIGHUP)
        await asyncio.to_thread(systemd.until, "RELOADING=1")
        [*_, done] = await asyncio.to_thread(systemd.until, "READY=1")
        status_line = next(line for line in done if line.startswith("STATUS="))
        assert status_line.startswith("STATUS=reloaded: started fresh"), done

        after = await fetch_tree_status(serving.run_dir, WAIT)
        serving.tree()
        assert pool_ids(after) == ["pool:default", "pool:other", "pool:fresh"]
        assert node(after, "pool:fresh").pid not in (0, serving.pid)
        for gid in ("default", "other"):
            assert node(after, f"pool:{gid}").pid == node(before, f"pool:{gid}").pid
            assert await pool_pids(serving, gid) == kept[gid]
        router_before, router_after = node(before, "router"), node(after, "router")
        assert router_after.pid == router_before.pid
        assert router_after.restarts == 0
        async with grpc.aio.insecure_channel(router_address(serving)) as channel:
            await wait_serving(channel)
            stub = Stub(channel)
            reply = await stub.ModelInfer(infer_request("echo3", 3.0), timeout=WAIT)
            assert reply.model_name == "echo3"
            assert (await stub.ModelInfer(infer_request("echo"), timeout=WAIT)).outputs

    async def reload_stops_a_pool(serving: Serving) -> None:
        before = await fetch_tree_status(serving.run_dir, WAIT)
        fresh_pid = node(before, "pool:fresh").pid
        shutil.rmtree(repo / "echo3")
        shown = await asyncio.to_thread(
            poolserve, "reload", "--run-dir", str(serving.run_dir), "--json"
        )
        assert shown.returncode == 0, shown.stdout + shown.stderr
        report = json.loads(shown.stdout)
        assert report["stopped"] == ["fresh"] and report["started"] == []
        after = await fetch_tree_status(serving.run_dir, WAIT)
        serving.tree()
        assert pool_ids(after) == ["pool:default", "pool:other"]
        assert await asyncio.to_thread(wait_exit, fresh_pid)
        for gid in ("default", "other"):
            assert node(after, f"pool:{gid}").pid == node(before, f"pool:{gid}").pid
        assert not (serving.run_dir / "pool-fresh.sock").exists()
        async with grpc.aio.insecure_channel(router_address(serving)) as channel:
            await wait_serving(channel)  # ready again: no route to a pool that is gone

    async def ensure_pool_starts_one_pool(serving: Serving) -> None:
        before = await fetch_tree_status(serving.run_dir, WAIT)
        add_model_copy(repo, "echo", "echo4", "ondemand")
        first = await request_pool(serving.run_dir, "ondemand", WAIT)
        assert first.started
        assert first.address == f"unix:{serving.run_dir / 'pool-ondemand.sock'}"
        again = await request_pool(serving.run_dir, "ondemand", WAIT)
        assert not again.started and again.address == first.address
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await request_pool(serving.run_dir, "nobody", WAIT)
        assert info.value.code() is grpc.StatusCode.NOT_FOUND
        after = await fetch_tree_status(serving.run_dir, WAIT)
        serving.tree()
        assert pool_ids(after) == ["pool:default", "pool:other", "pool:ondemand"]
        assert node(after, "router").pid == node(before, "router").pid  # not its business
        status = await pool_status(serving, "ondemand")
        assert [m.name for m in status.models] == ["echo4"]

    async def reload_loads_a_model_live(serving: Serving) -> None:
        before = await fetch_tree_status(serving.run_dir, WAIT)
        pool_before = await pool_status(serving, "default")
        other = await pool_pids(serving, "other")
        add_model_copy(repo, "echo", "echo5", "default")
        shown = await asyncio.to_thread(
            poolserve, "reload", "--run-dir", str(serving.run_dir), "--json"
        )
        assert shown.returncode == 0, shown.stdout + shown.stderr
        report = json.loads(shown.stdout)
        assert report["updated"] == ["default"] and report["started"] == []
        assert "pool:default" not in report["restarted"]
        pool_after = await pool_status(serving, "default")
        # Same pool server and zygote; the pool rolls its workers onto the new models.
        assert (pool_after.pid, pool_after.zygote_pid) == (pool_before.pid, pool_before.zygote_pid)
        assert "echo5" in {m.name for m in pool_after.models}
        assert await pool_pids(serving, "other") == other
        after = await fetch_tree_status(serving.run_dir, WAIT)
        serving.tree()
        assert node(after, "pool:default").restarts == node(before, "pool:default").restarts
        async with grpc.aio.insecure_channel(router_address(serving)) as channel:
            await wait_serving(channel)
            reply = await Stub(channel).ModelInfer(infer_request("echo5"), timeout=WAIT)
            assert reply.model_name == "echo5"

    async def reload_unloads_a_removed_model(serving: Serving) -> None:
        """A model whose folder left is unloaded and no longer listed; one unloaded
        through the API is still in the repository, listed UNLOADED."""
        shutil.rmtree(repo / "echo5")
        shown = await asyncio.to_thread(
            poolserve, "reload", "--run-dir", str(serving.run_dir), "--json"
        )
        assert shown.returncode == 0, shown.stdout + shown.stderr
        assert json.loads(shown.stdout)["updated"] == ["default"]
        async with grpc.aio.insecure_channel(router_address(serving)) as channel:
            stub = Stub(channel)
            await stub.RepositoryModelUnload(
                pb.RepositoryModelUnloadRequest(model_name="echo"), timeout=WAIT
            )
            index = await stub.RepositoryIndex(pb.RepositoryIndexRequest(), timeout=WAIT)
            states = {m.name: m.state for m in index.models}
            assert "echo5" not in states and states["echo"] == "UNLOADED", states
            await stub.RepositoryModelLoad(
                pb.RepositoryModelLoadRequest(model_name="echo"), timeout=WAIT
            )

    with Serving(repo, tmp_path / "run", env=env) as serving:
        systemd.until("READY=1")
        asyncio.run(sighup_starts_one_pool(serving))
        asyncio.run(reload_stops_a_pool(serving))
        asyncio.run(reload_loads_a_model_live(serving))
        asyncio.run(reload_unloads_a_removed_model(serving))
        asyncio.run(ensure_pool_starts_one_pool(serving))
        assert serving.terminate() == 0, serving.log()
        assert "Traceback" not in serving.log(), serving.log()


# -- systemd -------------------------------------------------------------------------


def test_ready_only_once_the_router_serves_then_watchdog_and_stopping(
    tmp_path: Path, systemd: Systemd
) -> None:
    repo = tmp_path / "repo"
    copy_example(repo, "echo")
    run_dir = tmp_path / "run"
    env = {"NOTIFY_SOCKET": str(systemd.path), "WATCHDOG_USEC": "1000000"}
    seen: dict[str, Any] = {}

    def listen() -> None:
        """Catches READY=1 the moment it arrives, and asks the router then."""
        try:
            before = systemd.until("READY=1")
            seen["before"] = before
            address = (run_dir / "router.addr").read_text().strip()
            with grpc.insecure_channel(address) as channel:
                live = channel.unary_unary(
                    "/inference.GRPCInferenceService/ServerLive",
                    request_serializer=pb.ServerLiveRequest.SerializeToString,
                    response_deserializer=pb.ServerLiveResponse.FromString,
                )
                seen["live"] = live(pb.ServerLiveRequest(), timeout=10).live  # fail-fast
        except Exception as error:  # reported by the test below
            seen["error"] = repr(error)

    listener = threading.Thread(target=listen)
    listener.start()
    try:
        with Serving(repo, run_dir, env=env) as serving:
            listener.join(WAIT)
            assert "error" not in seen, seen
            assert seen["live"] is True
            messages = seen["before"]
            assert sum("READY=1" in m for m in messages) == 1
            statuses = [line for m in messages for line in m if line.startswith("STATUS=")]
            assert "STATUS=router ready" in statuses  # the router was ready before READY=1
            systemd.until("WATCHDOG=1")  # from the root's loop, every half WATCHDOG_USEC
            systemd.until("WATCHDOG=1")
            assert serving.terminate() == 0, serving.log()
            systemd.until("STOPPING=1")
    finally:
        listener.join(WAIT)


def test_watchdog_pings_stop_while_the_loop_is_blocked(systemd: Systemd) -> None:
    interval = 0.05
    notifier = SystemdNotifier(str(systemd.path), watchdog_usec=int(interval * 2 * 1_000_000))
    blocked = threading.Event()
    release = threading.Event()
    silence: dict[str, Any] = {}

    def watch_while_blocked() -> None:
        blocked.wait(WAIT)
        with contextlib.suppress(TimeoutError):  # drain what was sent before the block
            while True:
                systemd.receive(timeout=0.001)
        try:
            systemd.receive(timeout=interval * 20)
            silence["ping"] = "a ping while the loop was blocked"
        except TimeoutError:
            silence["ok"] = True
        release.set()

    def block() -> None:
        blocked.set()
        release.wait(WAIT)  # the event loop is stuck here, as with a blocking call

    async def main() -> None:
        pinger = asyncio.create_task(watchdog_loop(notifier))
        for _ in range(2):
            assert await asyncio.to_thread(systemd.receive) == ["WATCHDOG=1"]
        asyncio.get_running_loop().call_soon(block)
        await asyncio.sleep(0)  # let block() run
        assert await asyncio.to_thread(systemd.receive) == ["WATCHDOG=1"]  # resumes after
        pinger.cancel()
        await asyncio.wait({pinger})

    watcher = threading.Thread(target=watch_while_blocked)
    watcher.start()
    try:
        asyncio.run(main())
    finally:
        release.set()
        watcher.join(WAIT)
    assert silence == {"ok": True}


# -- process-level guarantees -------------------------------------------------------

# Writes its pid and its grandchild's, reports SIGTERM (and ignores it), and so
# does the grandchild in the same process group.
STUBBORN = textwrap.dedent(
    """
    import os, signal, subprocess, sys, time
    from poolserve.service.lifecycle.child import die_with_parent, notify_ready
    die_with_parent()
    out = sys.argv[1]
    def noted(name):
        def handler(*_):
            with open(out + "." + name, "w") as f:
                f.write("term")
        return handler
    signal.signal(signal.SIGTERM, noted("child"))
    grandchild = subprocess.Popen([sys.executable, "-c",
        "import signal, sys, time\\n"
        "mark = sys.argv[1] + '.grandchild'\\n"
        "signal.signal(signal.SIGTERM, lambda *_: open(mark, 'w').close())\\n"
        "print('up', flush=True)\\n"
        "time.sleep(600)", out], stdout=subprocess.PIPE)
    assert grandchild.stdout.readline() == b"up\\n"
    with open(out, "w") as f:
        f.write(f"{os.getpid()} {grandchild.pid}")
    notify_ready()
    while True:
        time.sleep(600)
    """
)


def test_a_child_that_ignores_sigterm_is_killed_with_its_group(tmp_path: Path) -> None:
    out = tmp_path / "pids"
    stop_timeout = 1.0

    async def main() -> float:
        child = process_child(
            "stubborn", [sys.executable, "-P", "-c", STUBBORN, str(out)], stop_timeout=stop_timeout
        )
        supervisor = Supervisor(SupervisorSpec("sup"), [child], events=lambda _: None)
        ready = asyncio.Event()
        task = asyncio.create_task(supervisor.serve(ready.set))
        await asyncio.wait_for(ready.wait(), WAIT)
        began = time.monotonic()
        task.cancel()
        await asyncio.wait({task})
        return time.monotonic() - began

    try:
        took = asyncio.run(main())
        pids = [int(p) for p in out.read_text().split()]
        assert all(wait_exit(pid) for pid in pids)
        assert not any(pid_alive(pid) for pid in pids)
        # SIGTERM reached the whole group first, SIGKILL only after the stop timeout.
        assert (tmp_path / "pids.child").exists()
        assert (tmp_path / "pids.grandchild").exists()
        assert took >= stop_timeout
    finally:
        if out.exists():  # only what is still ours: a pid that died may be reused
            kill_pids([p for p in map(int, out.read_text().split()) if str(out) in cmdline(p)])


def test_a_hundred_crashes_leave_no_zombie() -> None:
    crashes = 100
    events: list[Event] = []

    async def main() -> None:
        done = asyncio.Event()

        def hook(event: Event) -> None:
            events.append(event)
            if sum(isinstance(e, ChildExited) for e in events) >= crashes:
                done.set()

        spec = SupervisorSpec("sup", backoff_base=0.001, backoff_max=0.002, failure_threshold=1e9)
        child = process_child("crash", ["/bin/sh", "-c", "exit 1"])
        supervisor = Supervisor(spec, [child], events=hook)
        task = asyncio.create_task(supervisor.serve(lambda: None))
        await asyncio.wait_for(done.wait(), WAIT * 4)
        task.cancel()
        await asyncio.wait({task})

    fds_before = owned_fds()
    asyncio.run(main())  # every child is reaped by its ProcessService before this returns
    pids = [e.pid for e in events if isinstance(e, ChildStarted) and e.pid is not None]
    assert len(pids) >= crashes
    exits = [e.outcome for e in events if isinstance(e, ChildExited)]
    assert all("exited with code 1" in text for text in exits[:crashes])
    assert zombie_children(os.getpid()) == []
    assert owned_fds() == fds_before  # no pipe or pidfd left open
