"""The control plane of the root, without pools: reload planning, the
reconciler on a tree of in-process services, the control socket over a real
unix socket, the status rendering, and why spawning stays safe once the root
runs gRPC.

Readiness is observed through events and futures (handshakes), never by
sleeping.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import os
import signal
import socket
import stat
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import grpc
import pytest

from poolserve.protos import control_pb2 as cpb
from poolserve.protos import inference_pb2 as pb
from poolserve.service.contract.repository import scan
from poolserve.service.contract.settings import PoolOverride, ServerSettings, load_server_settings
from poolserve.service.grpcserver.handlers import SERVICE
from poolserve.service.grpcserver.sockets import bind_private_unix
from poolserve.supervisor.control import (
    ROUTER_SERVICE,
    ControlService,
    control_socket_path,
    fetch_tree_status,
    push_routes,
    request_pool,
    request_reload,
    router_control_path,
)
from poolserve.supervisor.events import Event, fan_out
from poolserve.supervisor.notify import SystemdNotifier
from poolserve.supervisor.reconcile import (
    FIXED_SETTINGS,
    PER_POOL_SETTINGS,
    POOL_SETTINGS,
    ROUTER_SETTINGS,
    ChildWatch,
    Desired,
    LiveUpdateUnsupported,
    PoolModelChange,
    Reconciler,
    Routes,
    apply_pool_models,
    plan_reload,
    wait_ready,
)
from poolserve.supervisor.spec import ChildSpec, ChildState, Restart, Service, SupervisorSpec
from poolserve.supervisor.status_cli import (
    EXIT_MODELS_NOT_READY,
    EXIT_NOT_RUNNING,
    EXIT_OK,
    EXIT_UNREACHABLE,
    format_uptime,
    render_tree,
    resolve_run_dir,
    status_main,
    tree_json,
)
from poolserve.supervisor.tree import Supervisor

from support import write_model

WAIT = 60.0  # generous: CI is a loaded two-core machine


def run(main: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(main())


def model(repo: Path, name: str, gid: str, **extra: Any) -> None:
    settings = {
        "name": name,
        "implementation": "model.Fake",
        "parameters": {"inference_pool_gid": gid, "extra": extra},
    }
    write_model(repo, name, settings)


def desired(repo: Path) -> Desired:
    return Desired.load(repo, {})


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    model(root, "a", "g1")
    model(root, "b", "g1")
    model(root, "c", "g2")
    return root


# -- planning ----------------------------------------------------------------


def test_nothing_changed_plans_nothing(repo: Path) -> None:
    assert plan_reload(desired(repo), desired(repo)).empty


def test_a_new_gid_starts_one_pool_and_changes_the_routes(repo: Path) -> None:
    before = desired(repo)
    model(repo, "d", "g3")
    plan = plan_reload(before, desired(repo))
    assert plan.start == ("g3",)
    assert plan.stop == () and plan.restart == () and plan.models == ()
    assert plan.routes_changed and not plan.restart_router


def test_a_gid_without_models_stops(repo: Path) -> None:
    before = desired(repo)
    (repo / "c" / "model-settings.json").unlink()
    plan = plan_reload(before, desired(repo))
    assert plan.stop == ("g2",) and plan.start == ()
    assert plan.routes_changed


def test_models_added_removed_and_changed_in_a_running_pool(repo: Path) -> None:
    before = desired(repo)
    model(repo, "a", "g1", threshold=2)  # settings changed: reload it
    (repo / "b" / "model-settings.json").unlink()
    model(repo, "e", "g1")
    plan = plan_reload(before, desired(repo))
    [change] = plan.models
    assert change.gid == "g1"
    assert set(change.load) == {"a", "e"}
    assert change.unload == ("b",)
    assert [m.name for m in change.models] == ["a", "e"]
    assert plan.start == plan.stop == plan.restart == ()


def test_settings_restart_only_the_children_that_read_them(repo: Path) -> None:
    before = desired(repo)
    more_workers = replace(before.settings, pools={"g2": PoolOverride(workers=5)})
    plan = plan_reload(before, replace(before, settings=more_workers))
    assert plan.restart == ("g2",)
    assert not plan.restart_router and not plan.routes_changed
    router_only = replace(before.settings, host="0.0.0.0")
    plan = plan_reload(before, replace(before, settings=router_only))
    assert plan.restart == () and plan.restart_router
    # the workers a pool keeps from its streams: that pool restarts, alone
    fewer_for_streams = replace(before.settings, pools={"g1": PoolOverride(unary_workers=2)})
    plan = plan_reload(before, replace(before, settings=fewer_for_streams))
    assert plan.restart == ("g1",) and not plan.restart_router
    both = replace(before.settings, max_message_size=1024)
    plan = plan_reload(before, replace(before, settings=both))
    assert plan.restart == ("g1", "g2") and plan.restart_router


def test_every_setting_is_known_to_reload() -> None:
    known = {*POOL_SETTINGS, *ROUTER_SETTINGS, *PER_POOL_SETTINGS, *FIXED_SETTINGS}
    assert {f.name for f in fields(ServerSettings)} == known


def test_an_invalid_model_changes_the_routes_only(repo: Path) -> None:
    before = desired(repo)
    (repo / "broken").mkdir()
    (repo / "broken" / "model-settings.json").write_text("{not json")
    plan = plan_reload(before, desired(repo))
    assert plan.routes_changed
    assert plan.start == plan.stop == plan.restart == ()
    assert plan.models == ()


# -- Supervisor.restart_child ------------------------------------------------


class Idle:
    """An in-process service that is ready at once and runs until cancelled."""

    def __init__(self, name: str, log: list[str]) -> None:
        self.name = name
        self.log = log

    async def serve(self, ready: Callable[[], None]) -> None:
        self.log.append(f"start {self.name}")
        ready()
        try:
            await asyncio.get_running_loop().create_future()
        finally:
            self.log.append(f"stop {self.name}")


def test_restart_child_restarts_in_place_with_a_new_spec() -> None:
    async def main() -> None:
        log: list[str] = []
        watch = ChildWatch()

        def idle(name: str) -> ChildSpec:
            return ChildSpec(name, lambda: Idle(name, log))

        children = [idle(name) for name in ("x", "y", "z")]
        supervisor = Supervisor(SupervisorSpec("s"), children, events=watch)
        ready = asyncio.Event()
        task = asyncio.create_task(supervisor.serve(ready.set))
        await asyncio.wait_for(ready.wait(), WAIT)
        again = watch.expect("s", "y")
        await supervisor.restart_child("y", ChildSpec("y", lambda: Idle("y2", log)))
        assert await wait_ready(again, WAIT) is None
        assert log == ["start x", "start y", "start z", "stop y", "start y2"]
        assert [s.id for s in supervisor.status()] == ["x", "y", "z"]  # its place kept
        assert [s.restarts for s in supervisor.status()] == [0, 1, 0]
        with pytest.raises(KeyError):
            await supervisor.restart_child("ghost")
        with pytest.raises(ValueError, match="spec for"):
            await supervisor.restart_child("x", ChildSpec("other", lambda: Idle("o", log)))
        task.cancel()
        await asyncio.wait({task})

    run(main)


def test_restart_child_starts_a_child_that_failed_for_good() -> None:
    async def main() -> None:
        attempts: list[str] = []

        class FailsOnce:
            async def serve(self, ready: Callable[[], None]) -> None:
                attempts.append("run")
                if len(attempts) == 1:
                    raise RuntimeError("broken model")
                ready()
                await asyncio.get_running_loop().create_future()

        watch = ChildWatch()
        spec = ChildSpec("p", FailsOnce, restart=Restart.TEMPORARY)
        supervisor = Supervisor(SupervisorSpec("s"), events=watch)
        task = asyncio.create_task(supervisor.serve(lambda: None))
        first = watch.expect("s", "p")
        await supervisor.add_child(spec)
        problem = await wait_ready(first, WAIT)
        assert problem is not None and "broken model" in problem
        assert supervisor.status()[0].state is ChildState.FAILED
        second = watch.expect("s", "p")
        await supervisor.restart_child("p")
        assert await wait_ready(second, WAIT) is None
        assert supervisor.status()[0].state is ChildState.RUNNING
        task.cancel()
        await asyncio.wait({task})

    run(main)


# -- the reconciler on a tree of in-process services ---------------------------


class FakeTree:
    """The TreeOps of ``serve`` with in-process services for pools and router."""

    def __init__(self, current: Desired, events: Callable[[Event], None]) -> None:
        self.log: list[str] = []
        self._desired = current
        self._events = events
        self._pools: Supervisor | None = None
        children = [ChildSpec("pools", self._build), *self.router_specs(current.settings)]
        self._root = Supervisor(SupervisorSpec("root"), children, events=events)

    def root(self) -> Supervisor:
        return self._root

    def pools(self) -> Supervisor:
        assert self._pools is not None
        return self._pools

    def pool_spec(self, gid: str, settings: ServerSettings) -> ChildSpec:
        return ChildSpec(f"pool:{gid}", lambda: Idle(f"pool:{gid}", self.log))

    def router_specs(self, settings: ServerSettings) -> list[ChildSpec]:
        return [ChildSpec("router", lambda: Idle("router", self.log))]

    def use(self, desired: Desired) -> None:
        self._desired = desired

    def _build(self) -> Service:
        specs = [self.pool_spec(gid, self._desired.settings) for gid in self._desired.pools]
        self._pools = Supervisor(SupervisorSpec("pools"), specs, events=self._events)
        return self._pools

    def running(self) -> dict[str, str]:
        pools = {s.id: s.state.value for s in self.pools().status()}
        return {**pools, "router": self._root.status()[1].state.value}


class Harness:
    """A FakeTree, a reconciler over it, and a datagram socket standing in for systemd."""

    def __init__(self, repo: Path, run_dir: Path, notify: str) -> None:
        self.repo = repo
        self.watch = ChildWatch()
        self.events: list[Event] = []
        current = desired(repo)
        self.tree = FakeTree(current, fan_out(self.watch, self.events.append))
        self.routes: list[Routes] = []
        self.model_changes: list[PoolModelChange] = []
        self.live_router = True
        self.live_models = True
        self.reconciler = Reconciler(
            repo,
            {},
            current,
            self.tree,
            run_dir=run_dir,
            watch=self.watch,
            notifier=SystemdNotifier(notify),
            update_router=self._update_router,
            update_models=self._update_models,
            start_timeout=WAIT,
        )
        self.task: asyncio.Task[None] | None = None

    async def _update_router(self, routes: Routes, generation: int) -> bool:
        self.routes.append(routes)
        return self.live_router

    async def _update_models(self, socket_path: Path, change: PoolModelChange) -> list[str]:
        if not self.live_models:
            raise LiveUpdateUnsupported("no live load in this pool")
        self.model_changes.append(change)
        return []

    async def __aenter__(self) -> Harness:
        ready = asyncio.Event()
        self.task = asyncio.create_task(self.tree.root().serve(ready.set))
        await asyncio.wait_for(ready.wait(), WAIT)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.task is not None
        self.task.cancel()
        await asyncio.wait({self.task})


@pytest.fixture
def systemd(tmp_path: Path) -> Iterator[tuple[str, socket.socket]]:
    path = tmp_path / "notify.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(path))
        sock.settimeout(WAIT)
        yield str(path), sock


def received(sock: socket.socket) -> list[str]:
    return sock.recv(4096).decode().split("\n")


def test_reload_starts_a_new_pool_and_leaves_the_others_alone(
    repo: Path, tmp_path: Path, systemd: tuple[str, socket.socket]
) -> None:
    address, sock = systemd

    async def main() -> None:
        async with Harness(repo, tmp_path, address) as harness:
            model(repo, "d", "g3")
            report = await harness.reconciler.reload()
            assert report.ok, report.failures
            assert report.started == ["g3"]
            assert report.router_updated and report.restarted == []
            assert harness.tree.running() == {
                "pool:g1": "running",
                "pool:g2": "running",
                "pool:g3": "running",
                "router": "running",
            }
            assert harness.tree.log.count("start pool:g1") == 1  # not restarted
            assert "start pool:g3" in harness.tree.log
            [routes] = harness.routes
            assert routes.pools["g3"] == ("d",)
            assert harness.reconciler.current.pools.keys() == {"g1", "g2", "g3"}

    run(main)
    assert received(sock)[0] == "RELOADING=1"
    ready, status = received(sock)
    assert ready == "READY=1"
    assert status.startswith("STATUS=reloaded: started g3")


def test_reload_stops_a_pool_only_after_the_router_learned_the_routes(
    repo: Path, tmp_path: Path
) -> None:
    async def main() -> None:
        async with Harness(repo, tmp_path, "") as harness:
            (repo / "c" / "model-settings.json").unlink()
            routed: list[list[str]] = []

            async def update_router(routes: Routes, generation: int) -> bool:
                routed.append(list(harness.tree.running()))
                return True

            harness.reconciler._update_router = update_router
            report = await harness.reconciler.reload()
            assert report.stopped == ["g2"]
            assert "pool:g2" in routed[0]  # still running while the router was told
            assert "pool:g2" not in harness.tree.running()
            assert harness.tree.log[-1] == "stop pool:g2"

    run(main)


def test_model_changes_go_live_or_restart_the_pool(repo: Path, tmp_path: Path) -> None:
    async def main() -> None:
        async with Harness(repo, tmp_path, "") as harness:
            model(repo, "e", "g1")
            report = await harness.reconciler.reload()
            assert report.updated == ["g1"] and report.restarted == []
            [change] = harness.model_changes
            assert change.load == ("e",)
            assert harness.tree.log.count("start pool:g1") == 1

            harness.live_models = False
            (repo / "e" / "model-settings.json").unlink()
            report = await harness.reconciler.reload()
            assert report.updated == [] and report.restarted == ["pool:g1"]
            assert harness.tree.log.count("start pool:g1") == 2
            assert harness.tree.log.count("start pool:g2") == 1

    run(main)


def test_a_reload_loads_a_model_again_when_a_file_of_its_folder_changed(
    repo: Path, tmp_path: Path
) -> None:
    """The fix for a model's code is in its folder, not its settings: a reload that
    finds a changed file loads that model again (live, in its pool), and the others
    are left alone; nothing changed, nothing is loaded."""

    async def main() -> None:
        (repo / "a" / "model.py").write_text("FACTOR = 2\n")
        async with Harness(repo, tmp_path, "") as harness:
            report = await harness.reconciler.reload()
            assert report.summary() == "nothing to change" and not harness.model_changes
            code = repo / "a" / "model.py"
            code.write_text("FACTOR = 3\n")
            os.utime(code, ns=(code.stat().st_atime_ns, code.stat().st_mtime_ns + 10**9))
            report = await harness.reconciler.reload()
            assert report.ok and report.updated == ["g1"], report.summary()
            [change] = harness.model_changes
            assert change.gid == "g1" and change.load == ("a",) and not change.unload
            (repo / "a" / "__pycache__").mkdir()  # what an import writes is no change
            (repo / "a" / "__pycache__" / "model.cpython-311.pyc").write_bytes(b"\0")
            report = await harness.reconciler.reload()
            assert report.summary() == "nothing to change"

    run(main)


def test_without_live_routes_the_router_restarts(repo: Path, tmp_path: Path) -> None:
    async def main() -> None:
        async with Harness(repo, tmp_path, "") as harness:
            harness.live_router = False
            model(repo, "d", "g3")
            report = await harness.reconciler.reload()
            assert report.started == ["g3"]
            assert report.restarted == ["router"] and not report.router_updated
            assert harness.tree.log.count("start router") == 2
            assert harness.tree.running()["router"] == "running"

    run(main)


def test_an_invalid_configuration_is_reported_and_changes_nothing(
    repo: Path, tmp_path: Path
) -> None:
    async def main() -> None:
        async with Harness(repo, tmp_path, "") as harness:
            (repo / "settings.json").write_text('{"parallel_workers": "many"}')
            before = list(harness.tree.log)
            report = await harness.reconciler.reload()
            assert not report.ok
            assert "configuration not reloaded" in report.failures[0]
            assert harness.tree.log == before

    run(main)


def test_reload_starts_a_pool_that_had_failed_for_good(repo: Path, tmp_path: Path) -> None:
    async def main() -> None:
        async with Harness(repo, tmp_path, "") as harness:
            pools = harness.tree.pools()
            failed = harness.watch.expect("pools", "pool:g2")
            broken = ChildSpec("pool:g2", _Fails, restart=Restart.TEMPORARY)
            await pools.restart_child("pool:g2", broken)
            assert await wait_ready(failed, WAIT) is not None
            assert harness.tree.running()["pool:g2"] == "failed"
            report = await harness.reconciler.reload()  # nothing changed on disk
            assert report.ok and report.restarted == ["pool:g2"]
            assert harness.tree.running()["pool:g2"] == "running"
            assert harness.tree.log.count("start pool:g1") == 1

    run(main)


def test_reload_requests_are_queued_and_share_a_result(repo: Path, tmp_path: Path) -> None:
    async def main() -> None:
        async with Harness(repo, tmp_path, "") as harness:
            runner = asyncio.create_task(harness.reconciler.run())
            model(repo, "d", "g3")
            first = harness.reconciler.request_reload()
            second = harness.reconciler.request_reload()  # before the first ran: shared
            assert first is second
            report = await asyncio.wait_for(first, WAIT)
            assert report.started == ["g3"]
            runner.cancel()
            await asyncio.wait({runner})

    run(main)


def test_reload_says_routers_are_kept_every_time(repo: Path, tmp_path: Path) -> None:
    """`routers` is fixed at start: a reload asking for another count says so in
    its summary (what `poolserve reload` prints), every time, against the count
    the tree started with; asking for that count again says nothing."""

    async def main() -> None:
        async with Harness(repo, tmp_path, "") as harness:
            (repo / "settings.json").write_text('{"routers": 2}')
            for _ in range(2):
                report = await harness.reconciler.reload()
                assert report.ok
                assert "routers 1 kept until the server restarts (fixed at start; asked: 2)" in (
                    report.summary()
                )
            (repo / "settings.json").write_text('{"routers": 1}')
            report = await harness.reconciler.reload()
            assert "kept" not in report.summary()

    run(main)


def test_ensure_pool(repo: Path, tmp_path: Path) -> None:
    async def main() -> None:
        async with Harness(repo, tmp_path, "") as harness:
            reconciler = harness.reconciler
            running = await reconciler.ensure_pool("g1")
            assert not running.started
            assert running.address == f"unix:{tmp_path / 'pool-g1.sock'}"
            with pytest.raises(LookupError):
                await reconciler.ensure_pool("nobody")
            with pytest.raises(ValueError, match="unsafe"):
                await reconciler.ensure_pool("../etc")
            model(repo, "d", "g3")
            both = await asyncio.gather(reconciler.ensure_pool("g3"), reconciler.ensure_pool("g3"))
            assert sorted(e.started for e in both) == [False, True]  # one pool, not two
            assert harness.tree.log.count("start pool:g3") == 1
            assert "g3" in reconciler.current.pools
            report = await reconciler.reload()  # knows g3 already
            assert report.started == [] and report.summary() == "nothing to change"
            assert harness.tree.log.count("start router") == 1  # EnsurePool never touches it

    run(main)


# -- the control socket ------------------------------------------------------


class FakePoolControl:
    """A pool's PoolControl/Status and its live load, on its unix socket."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.calls: list[str] = []
        self.server: grpc.aio.Server | None = None

    async def status(self, _: cpb.PoolStatusRequest, __: Any) -> cpb.PoolStatus:
        return cpb.PoolStatus(
            gid="g1",
            pid=4242,
            zygote_pid=4243,
            pss_bytes=3 * 1024 * 1024,
            workers=[cpb.WorkerStatus(pid=4244, state="idle", requests_served=7)],
            models=[cpb.ModelState(name="a", version="1", state="READY")],
        )

    async def load(self, request: pb.RepositoryModelLoadRequest, context: Any) -> Any:
        self.calls.append(f"load {request.model_name}")
        if request.model_name == "bad":
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "model 'bad' load failed")
        return pb.RepositoryModelLoadResponse()

    async def unload(self, request: pb.RepositoryModelUnloadRequest, context: Any) -> Any:
        self.calls.append(f"unload {request.model_name}")
        if request.model_name == "ghost":
            await context.abort(grpc.StatusCode.NOT_FOUND, "no such model")
        return pb.RepositoryModelUnloadResponse()

    async def __aenter__(self) -> FakePoolControl:
        self.server = grpc.aio.server()
        handlers = {
            "Status": grpc.unary_unary_rpc_method_handler(
                self.status, cpb.PoolStatusRequest.FromString, cpb.PoolStatus.SerializeToString
            )
        }
        inference: dict[str, grpc.RpcMethodHandler[Any, Any]] = {
            "RepositoryModelLoad": grpc.unary_unary_rpc_method_handler(
                self.load,
                pb.RepositoryModelLoadRequest.FromString,
                pb.RepositoryModelLoadResponse.SerializeToString,
            ),
            "RepositoryModelUnload": grpc.unary_unary_rpc_method_handler(
                self.unload,
                pb.RepositoryModelUnloadRequest.FromString,
                pb.RepositoryModelUnloadResponse.SerializeToString,
            ),
        }
        self.server.add_generic_rpc_handlers(
            (
                grpc.method_handlers_generic_handler("poolserve.control.v1.PoolControl", handlers),
                grpc.method_handlers_generic_handler(SERVICE, inference),
            )
        )
        bind_private_unix(self.server, self.path)
        await self.server.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        await self.server.stop(None)


def test_the_control_socket_end_to_end(repo: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)

    async def main() -> None:
        async with Harness(repo, run_dir, "") as harness:
            control = ControlService(run_dir, harness.tree.root, harness.reconciler, started_at=0.0)
            ready = asyncio.Event()
            task = asyncio.create_task(control.serve(ready.set))
            await asyncio.wait_for(ready.wait(), WAIT)
            path = control_socket_path(run_dir)
            assert stat.S_IMODE(path.stat().st_mode) == 0o600
            async with FakePoolControl(run_dir / "pool-g1.sock"):
                status = await fetch_tree_status(run_dir, WAIT)
            root = status.root
            assert root.id == "root" and root.pid == os.getpid()
            assert [c.id for c in root.children] == ["pools", "router"]
            pools = root.children[0]
            assert [c.id for c in pools.children] == ["pool:g1", "pool:g2"]
            # In-process pools have no pid: nobody is asked for a pool status.
            assert not pools.children[0].HasField("pool")

            model(repo, "d", "g3")
            response = await request_reload(run_dir, WAIT)
            assert response.ok and list(response.started) == ["g3"]
            assert response.router_updated

            model(repo, "e", "g4")
            ensured = await request_pool(run_dir, "g4", WAIT)
            assert ensured.started and ensured.address.endswith("pool-g4.sock")
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await request_pool(run_dir, "nobody", WAIT)
            assert info.value.code() is grpc.StatusCode.NOT_FOUND
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await request_pool(run_dir, "a/b", WAIT)
            assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT

            task.cancel()
            await asyncio.wait({task})
            assert not path.exists()

    run(main)


def test_pool_status_fills_pool_nodes(tmp_path: Path) -> None:
    from poolserve.supervisor.control import fill_pool_status

    async def main() -> None:
        root = cpb.TreeNode(
            id="root",
            children=[
                cpb.TreeNode(
                    id="pools",
                    children=[
                        cpb.TreeNode(id="pool:g1", pid=4242, state="running"),
                        cpb.TreeNode(id="pool:g9", pid=4343, state="running"),
                    ],
                )
            ],
        )
        async with FakePoolControl(tmp_path / "pool-g1.sock"):
            await fill_pool_status(root, tmp_path)
        answered, silent = root.children[0].children
        assert answered.pool.workers[0].requests_served == 7
        assert silent.pool_error.startswith("UNAVAILABLE")

    run(main)


def test_apply_pool_models_over_the_pool_socket(tmp_path: Path) -> None:
    async def main() -> None:
        path = tmp_path / "pool-g1.sock"
        change = PoolModelChange("g1", load=("a", "bad"), unload=("ghost", "b"), models=())
        async with FakePoolControl(path) as pool:
            failures = await apply_pool_models(path, change, timeout=WAIT)
        assert pool.calls == ["unload ghost", "unload b", "load a", "load bad"]
        assert failures == ["pool g1: model bad: model 'bad' load failed"]

    run(main)


def test_apply_pool_models_without_live_load_says_so(tmp_path: Path) -> None:
    async def main() -> None:
        path = tmp_path / "pool-g1.sock"
        server = grpc.aio.server()  # serves nothing: every method is UNIMPLEMENTED
        bind_private_unix(server, path)
        await server.start()
        try:
            change = PoolModelChange("g1", load=("a",), unload=(), models=())
            with pytest.raises(LiveUpdateUnsupported):
                await apply_pool_models(path, change, timeout=WAIT)
        finally:
            await server.stop(None)

    run(main)


def test_push_routes(tmp_path: Path) -> None:
    routes = Routes({"g1": ("a", "b")}, {"broken": "invalid JSON"})

    async def main() -> None:
        assert not await push_routes(tmp_path, routes, 1, WAIT)  # no router socket
        tables: list[cpb.RouteTable] = []

        async def set_routes(table: cpb.RouteTable, _: Any) -> cpb.SetRoutesResponse:
            tables.append(table)
            return cpb.SetRoutesResponse(generation=table.generation)

        server = grpc.aio.server()
        handler = grpc.unary_unary_rpc_method_handler(
            set_routes, cpb.RouteTable.FromString, cpb.SetRoutesResponse.SerializeToString
        )
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(ROUTER_SERVICE, {"SetRoutes": handler}),)
        )
        bind_private_unix(server, router_control_path(tmp_path))
        await server.start()
        try:
            assert await push_routes(tmp_path, routes, 7, WAIT)
        finally:
            await server.stop(None)
        [table] = tables
        assert table.generation == 7
        assert [(p.gid, list(p.models)) for p in table.pools] == [("g1", ["a", "b"])]
        assert table.pools[0].address == f"unix:{tmp_path / 'pool-g1.sock'}"
        assert [(i.name, i.reason) for i in table.invalid] == [("broken", "invalid JSON")]
        router_control_path(tmp_path).unlink(missing_ok=True)  # grpc may have removed it
        # A socket nobody serves: not live, so the reconciler restarts the router.
        with socket.socket(socket.AF_UNIX) as stale:
            stale.bind(str(router_control_path(tmp_path)))
            assert not await push_routes(tmp_path, routes, 8, WAIT)

    run(main)


# -- status on the command line ------------------------------------------------


def sample_tree() -> cpb.TreeStatus:
    pool = cpb.PoolStatus(
        gid="a",
        pid=12,
        zygote_pid=13,
        pss_bytes=50 * 1024 * 1024,
        workers=[
            cpb.WorkerStatus(pid=14, state="idle", requests_served=3),
            cpb.WorkerStatus(pid=15, state="busy", requests_served=4),
        ],
        models=[cpb.ModelState(name="echo", version="1", state="READY")],
    )
    return cpb.TreeStatus(
        root=cpb.TreeNode(
            id="root",
            pid=10,
            state="running",
            uptime_s=3725,
            children=[
                cpb.TreeNode(id="control", state="running", uptime_s=3725),
                cpb.TreeNode(
                    id="pools",
                    state="running",
                    uptime_s=3725,
                    children=[
                        cpb.TreeNode(id="pool:a", pid=12, state="running", uptime_s=60, pool=pool),
                        cpb.TreeNode(
                            id="pool:b", state="failed", restarts=2, last_exit="exited with code 3"
                        ),
                    ],
                ),
                cpb.TreeNode(id="router", pid=20, state="running", uptime_s=90000),
            ],
        )
    )


def test_render_tree() -> None:
    text = render_tree(sample_tree().root)
    lines = text.splitlines()
    assert lines[0].startswith("root ")
    assert "pid 10" in lines[0] and "uptime 1:02:05" in lines[0]
    assert any(line.startswith("│   ├── pool:a ") and "pss 50.0 MiB" in line for line in lines)
    assert any(line.startswith("│   │   ├── worker 14") and "served 3" in line for line in lines)
    assert any(line.startswith("│   │   └── model echo:1") for line in lines)
    failed = next(line for line in lines if "pool:b" in line)
    assert "failed" in failed and "last exit: exited with code 3" in failed
    assert lines[-1].startswith("└── router") and "uptime 1 day, 1:00:00" in lines[-1]
    assert format_uptime(2 * 86400 + 1) == "2 days, 0:00:01"


def test_tree_json() -> None:
    data = tree_json(sample_tree().root)
    assert json.loads(json.dumps(data)) == data
    pools = data["children"][1]
    pool_a = pools["children"][0]
    assert pool_a["pid"] == 12
    assert [w["pid"] for w in pool_a["pool"]["workers"]] == [14, 15]
    assert pool_a["pool"]["pss_bytes"] == 50 * 1024 * 1024
    assert pools["children"][1]["pool"] is None
    assert pools["children"][1]["last_exit"] == "exited with code 3"
    assert data["children"][0]["pid"] is None


def test_status_exit_codes(repo: Path, tmp_path: Path) -> None:
    nobody = argparse.Namespace(
        run_dir=str(tmp_path / "nobody"), grpc_port=None, timeout=WAIT, json=False
    )
    assert status_main(nobody, io.StringIO()) == EXIT_UNREACHABLE
    args = argparse.Namespace(**{**vars(nobody), "run_dir": str(tmp_path)})

    async def main() -> None:
        async with Harness(repo, tmp_path, "") as harness, control_served(harness, tmp_path):
            out = io.StringIO()
            code = await asyncio.to_thread(status_main, args, out)
            assert code == EXIT_OK, out.getvalue()
            assert "pool:g1" in out.getvalue()
            await harness.tree.pools().remove_child("pool:g2")
            await harness.tree.pools().add_child(
                ChildSpec("pool:g2", lambda: Idle("x", []), restart=Restart.TEMPORARY)
            )
            await harness.tree.pools().remove_child("pool:g2")
            broken = ChildSpec("pool:g5", _Fails, restart=Restart.TEMPORARY)
            failed = harness.watch.expect("pools", "pool:g5")
            await harness.tree.pools().add_child(broken)
            assert await wait_ready(failed, WAIT) is not None
            json_args = argparse.Namespace(**{**vars(args), "json": True})
            out = io.StringIO()
            assert await asyncio.to_thread(status_main, json_args, out) == EXIT_NOT_RUNNING
            nodes = json.loads(out.getvalue())["children"][0]["children"]
            assert {n["id"]: n["state"] for n in nodes}["pool:g5"] == "failed"

    run(main)


def test_status_lists_a_model_the_repository_cannot_serve_and_exits_1(
    repo: Path, tmp_path: Path
) -> None:
    """An invalid model-settings.json is in no pool, so no pool lists it: the tree's
    status names it with its reason (text and JSON), and exits 1 as for a failed load."""
    bad = repo / "bad"
    bad.mkdir()
    (bad / "model-settings.json").write_text(
        '{"name": "bad", "implementation": "model.Fake", "max_batch_size": "lots"}'
    )
    args = argparse.Namespace(run_dir=str(tmp_path), grpc_port=None, timeout=WAIT, json=False)

    async def main() -> None:
        async with Harness(repo, tmp_path, "") as harness, control_served(harness, tmp_path):
            out = io.StringIO()
            assert await asyncio.to_thread(status_main, args, out) == EXIT_MODELS_NOT_READY
            (line,) = [x for x in out.getvalue().splitlines() if "model bad " in x]
            assert "UNAVAILABLE" in line and "max_batch_size" in line, out.getvalue()
            out = io.StringIO()
            json_args = argparse.Namespace(**{**vars(args), "json": True})
            assert await asyncio.to_thread(status_main, json_args, out) == EXIT_MODELS_NOT_READY
            (entry,) = json.loads(out.getvalue())["invalid_models"]
            assert entry["name"] == "bad" and "max_batch_size" in entry["reason"]
            # fixed: a reload takes it, and status is clean again
            (bad / "model-settings.json").write_text(
                json.dumps({"name": "bad", "implementation": "model.Fake"})
            )
            assert (await harness.reconciler.reload()).ok
            out = io.StringIO()
            assert await asyncio.to_thread(status_main, args, out) == EXIT_OK, out.getvalue()
            assert "not served" not in out.getvalue()

    run(main)


def test_a_reload_that_finds_an_invalid_model_reports_it(repo: Path, tmp_path: Path) -> None:
    """`poolserve reload` exits 1 on problems: a folder it cannot serve is one, with
    its reason, every time until it is fixed; the rest of the reload still happens."""

    async def main() -> None:
        async with Harness(repo, tmp_path, "") as harness:
            model(repo, "d", "g3")
            bad = repo / "bad"
            bad.mkdir()
            (bad / "model-settings.json").write_text("{not json")
            report = await harness.reconciler.reload()
            assert report.started == ["g3"]
            assert not report.ok
            (failure,) = report.failures
            assert failure.startswith("model bad: "), failure
            assert failure in report.summary()
            again = await harness.reconciler.reload()
            assert again.failures == report.failures

    run(main)


@contextlib.asynccontextmanager
async def control_served(harness: Harness, run_dir: Path) -> AsyncIterator[None]:
    """The tree's control socket served in ``run_dir`` (what status and reload ask)."""
    control = ControlService(run_dir, harness.tree.root, harness.reconciler, started_at=0.0)
    ready = asyncio.Event()
    task = asyncio.create_task(control.serve(ready.set))
    try:
        await asyncio.wait_for(ready.wait(), WAIT)
        yield
    finally:
        task.cancel()
        await asyncio.wait({task})


class _Fails:
    async def serve(self, ready: Callable[[], None]) -> None:
        raise RuntimeError("cannot load")


def test_resolve_run_dir(monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_run_dir("/x/run", 5) == Path("/x/run")
    assert resolve_run_dir(None, None, {"POOLSERVE_RUN_DIR": "/y"}) == Path("/y")
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/run/user/7")
    expected = Path(f"/run/user/7/poolserve-{os.getuid()}-9000")
    assert resolve_run_dir(None, 9000, {}) == expected
    assert resolve_run_dir(None, None, {"POOLSERVE_GRPC_PORT": "9000"}) == expected
    assert resolve_run_dir(None, None, {}) == ServerSettings().resolved_run_dir()


def test_desired_loads_settings_and_models(repo: Path) -> None:
    (repo / "settings.json").write_text('{"parallel_workers": 3}')
    loaded = desired(repo)
    assert loaded.settings == load_server_settings(repo)
    assert {gid: [m.name for m in ms] for gid, ms in loaded.pools.items()} == {
        "g1": ["a", "b"],
        "g2": ["c"],
    }
    assert loaded == Desired.from_repository(load_server_settings(repo), scan(repo))


# -- spawning from a root that runs gRPC ---------------------------------------

# With gRPC's own fork handlers switched on, a pre-exec hook (a real fork()
# running Python in a copy of a threaded process) hangs; the vfork+exec spawn
# with the PDEATHSIG trampoline does not. Each child checks its own PDEATHSIG.
SPAWN_UNDER_GRPC = textwrap.dedent(
    """
    import asyncio, sys
    import grpc
    from poolserve.supervisor.process import ProcessService

    CHECK = [sys.executable, "-c",
             "import ctypes, sys; s = ctypes.c_int(); "
             "ctypes.CDLL(None).prctl(2, ctypes.byref(s), 0, 0, 0); "
             "sys.exit(0 if s.value == 9 else 1)"]

    async def main():
        server = grpc.aio.server()
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            await channel.channel_ready()
            for _ in range(20):
                await ProcessService(CHECK).serve(lambda: None)  # exit 0: returns
        await server.stop(None)
        print("spawned 20")

    asyncio.run(main())
    """
)


def test_the_trampoline_leaves_no_signal_ignored_or_blocked(tmp_path: Path) -> None:
    """Python ignores SIGPIPE and SIGXFSZ; a root started in a shell's background
    ignores SIGINT, under nohup SIGHUP; a parent may block signals: the program
    exec'd after the trampoline starts with none of that (as systemd starts one)."""
    from poolserve.supervisor.process import ProcessService

    out = tmp_path / "sigign"
    # exec: the shell becomes grep, which reads its own status (a shell that
    # forked grep could be inside its own brief block-all around the fork)
    script = f"exec grep -E 'SigIgn|SigBlk' /proc/self/status > {out}"
    inherited = (signal.SIGINT, signal.SIGHUP, signal.SIGTERM)
    previous = {number: signal.signal(number, signal.SIG_IGN) for number in inherited}
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR2})
    try:
        run(lambda: ProcessService(["/bin/sh", "-c", script]).serve(lambda: None))
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        for number, handler in previous.items():
            signal.signal(number, handler)
    fields = dict(line.split(":") for line in out.read_text().splitlines())
    ignored = int(fields["SigIgn"], 16)
    for number in (signal.SIGPIPE, signal.SIGXFSZ, *inherited):
        assert not ignored & (1 << (number - 1)), number
    assert int(fields["SigBlk"], 16) == 0


def test_spawning_stays_safe_once_the_root_runs_grpc() -> None:
    env = {**os.environ, "GRPC_ENABLE_FORK_SUPPORT": "1"}
    result = subprocess.run(
        [sys.executable, "-P", "-c", SPAWN_UNDER_GRPC],
        env=env,
        capture_output=True,
        text=True,
        timeout=WAIT * 2,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "spawned 20"
