"""The router fleet (setting ``routers``): N router processes share the gRPC and
REST ports (SO_REUSEPORT) and serve as one door.

The end-to-end tests run one real tree with ``--routers 2`` on loopback. Which
router a connection landed on is read from /proc: the server side of each TCP
connection is a socket of one router process. Every test makes its calls over
many connections and checks that both routers carried some, so that what it
asserts (replies, sequences, shared memory, metrics) held across routers.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import re
import shutil
import signal
import socket
import threading
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from test_sequences import TRACKED, step

from poolserve.protos import inference_pb2 as pb
from poolserve.protos import inference_pb2_grpc as pbg
from poolserve.service.contract.errors import AlreadyExists
from poolserve.service.contract.settings import (
    ConfigError,
    ServerSettings,
    load_server_settings,
    router_count,
)
from poolserve.service.grpcserver.shm_store import SharedStore
from poolserve.service.inference.codec import decode_outputs, encode_inputs
from poolserve.supervisor.control import fetch_tree_status, walk
from poolserve.supervisor.fleet import hold_shared_ports
from poolserve.supervisor.top_cli import _tree_processes

from harness import Tree, wait_gone
from support import EXAMPLES, wait_until, write_model

ROUTERS = 2
WORKERS = 2
CONNECTIONS = 16
LOCAL_POOL = (("grpc.use_local_subchannel_pool", 1),)  # each channel its own connection


# -- the setting ----------------------------------------------------------------


def test_routers_setting_parses_counts_and_auto(tmp_path: Path) -> None:
    assert router_count(ServerSettings(), 8) == 1
    auto = load_server_settings(tmp_path, environ={"POOLSERVE_ROUTERS": "auto"})
    assert auto.routers == "auto"
    assert [router_count(auto, cores) for cores in (1, 3, 4, 8, 16, 32)] == [1, 1, 1, 2, 4, 8]
    assert router_count(load_server_settings(tmp_path, environ={}, flags={"routers": "3"}), 1) == 3
    (tmp_path / "settings.json").write_text(json.dumps({"routers": 2}))
    assert load_server_settings(tmp_path, environ={}).routers == 2
    for bad in ("0", "-1", "many", "65", "2.5"):
        with pytest.raises(ConfigError, match="routers") as caught:
            load_server_settings(tmp_path, environ={"POOLSERVE_ROUTERS": bad})
        assert str(caught.value).startswith("POOLSERVE_ROUTERS: field 'routers'")
    (tmp_path / "settings.json").write_text(json.dumps({"routers": True}))
    with pytest.raises(ConfigError, match="'auto'"):
        load_server_settings(tmp_path, environ={})


def test_the_supervisor_holds_a_fleets_ports_against_other_programs() -> None:
    settings = ServerSettings(grpc_port=0, http_port=-1, metrics_port=0)
    with hold_shared_ports(settings, ()) as hold:
        port = hold.ports["grpc_port"]
        assert port > 0 and "http_port" not in hold.ports
        assert hold.ports["metrics_port"] not in (0, port)  # resolved once, for every router
        with socket.socket() as plain, pytest.raises(OSError, match="in use"):
            plain.bind(("127.0.0.1", port))  # another program: refused while held
        with socket.socket() as router:  # a router of the fleet: shares it
            router.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            router.bind(("127.0.0.1", port))
    with socket.socket() as foreign:  # something already listens: a configuration error
        foreign.bind(("127.0.0.1", 0))
        foreign.listen()
        taken = ServerSettings(grpc_port=foreign.getsockname()[1], http_port=-1, metrics_port=-1)
        with pytest.raises(ConfigError, match=r"grpc_port.*in use"):
            hold_shared_ports(taken, ("grpc_port",))


def test_the_shared_memory_store_agrees_between_routers(tmp_path: Path) -> None:
    key = f"psfleet-unit-{os.getpid()}"
    shm = Path("/dev/shm") / key
    shm.write_bytes(bytes(64))
    try:
        one, two = SharedStore(tmp_path / "shm.json"), SharedStore(tmp_path / "shm.json")
        made = one.register("r", "/" + key, 0, 64)
        assert two.lookup("r") == made  # the same generation: the same worker mapping
        with pytest.raises(AlreadyExists):
            two.register("r", "/" + key, 0, 32)
        two.unregister("r")
        assert one.lookup("r") is None and one.status("") == []
    finally:
        shm.unlink()


# -- a tree of two routers --------------------------------------------------------


def fleet_repo(root: Path) -> Path:
    repo = root / "repo"
    shutil.copytree(EXAMPLES / "echo", repo / "echo")
    spare = shutil.copytree(EXAMPLES / "echo", repo / "spare")
    settings = json.loads((spare / "model-settings.json").read_text())
    (spare / "model-settings.json").write_text(json.dumps({**settings, "name": "spare"}))
    marks = root / "marks"
    marks.mkdir()
    tracked = {
        "name": "tracked",
        "implementation": "model.Tracked",
        "parameters": {"extra": {"sequence": {"idle_timeout_s": 60}, "marks": str(marks)}},
        "inputs": [{"name": "INPUT", "datatype": "INT32", "shape": [-1, 1]}],
        "outputs": [
            {"name": "OUTPUT", "datatype": "INT32", "shape": [-1, 1]},
            {"name": "PID", "datatype": "INT64", "shape": [1]},
        ],
    }
    write_model(repo, "tracked", tracked, TRACKED)
    return repo


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Tree]:
    root = tmp_path_factory.mktemp("fleet")
    tree = Tree(fleet_repo(root), root / "run", workers=WORKERS, extra=("--routers", str(ROUTERS)))
    with tree:
        yield tree
        assert tree.terminate() == 0
        wait_gone(sorted(tree.seen), timeout=30)


def router_pids(tree: Tree) -> list[int]:
    return tree.census({"default": WORKERS}, routers=ROUTERS).pids("router")


def live_routers(tree: Tree) -> set[int]:
    census = tree.census({"default": WORKERS}, routers=ROUTERS)
    return {p.pid for p in census.procs if p.role == "router" and p.state != "Z"}


def restarted(tree: Tree, victim: int) -> bool:
    """Every router serves again (ready to its supervisor), the one killed not among them."""
    status = asyncio.run(fetch_tree_status(tree.run_dir, 30, skip_pools=True))
    nodes = [n for n in walk(status.root) if n.id.startswith("router-")]
    ready = {n.pid for n in nodes if n.state == "running"}
    return len(ready) == ROUTERS and victim not in ready and ready == live_routers(tree)


def _tcp() -> list[tuple[int, int, str, int]]:
    """(local port, remote port, state, inode) of every TCP socket here."""
    rows = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                cells = line.split()
                local, remote = cells[1].rsplit(":", 1)[1], cells[2].rsplit(":", 1)[1]
                rows.append((int(local, 16), int(remote, 16), cells[3], int(cells[9])))
    return rows


def _inodes(pid: int) -> set[int]:
    found = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        match = re.fullmatch(r"socket:\[(\d+)\]", link)
        if match:
            found.add(int(match.group(1)))
    return found


ESTABLISHED = "01"


def server_of(client_port: int, port: int, routers: list[int]) -> int | None:
    """The router whose socket is the server side of the connection from ``client_port``."""
    inodes = {
        inode
        for local, remote, state, inode in _tcp()
        if local == port and remote == client_port and state == ESTABLISHED
    }
    for pid in routers:
        if inodes & _inodes(pid):
            return pid
    return None


def _own_ports(port: int) -> set[int]:
    mine = _inodes(os.getpid())
    return {
        local
        for local, remote, state, inode in _tcp()
        if remote == port and state == ESTABLISHED and inode in mine
    }


class Located:
    """A gRPC channel of its own connection, and the router that serves it."""

    def __init__(self, address: str, port: int, routers: list[int]) -> None:
        before = _own_ports(port)
        self.channel = grpc.insecure_channel(address, options=LOCAL_POOL)
        self.stub = pbg.GRPCInferenceServiceStub(self.channel)
        assert self.stub.ServerReady(pb.ServerReadyRequest(), timeout=60).ready
        (self.client_port,) = _own_ports(port) - before
        self.router = server_of(self.client_port, port, routers)
        assert self.router in routers

    def close(self) -> None:
        self.channel.close()


def located(tree: Tree, count: int = CONNECTIONS) -> list[Located]:
    port = int(tree.address.rsplit(":", 1)[1])
    routers = router_pids(tree)
    channels = [Located(tree.address, port, routers) for _ in range(count)]
    assert {c.router for c in channels} == set(routers), "every router serves some connections"
    return channels


def echo_request(values: np.ndarray, model: str = "echo") -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name=model)
    encode_inputs({"INPUT0": values}, request, raw=True)
    return request


def echoed(reply: pb.ModelInferResponse) -> np.ndarray:
    return decode_outputs(reply)["OUTPUT0"]


def test_the_census_and_status_have_every_router(fleet: Tree) -> None:
    census = fleet.census({"default": WORKERS}, routers=ROUTERS)
    assert census.ok, census.summary()
    assert len(census.procs) == 1 + ROUTERS + 1 * (2 + WORKERS)
    status = asyncio.run(fetch_tree_status(fleet.run_dir, 30, skip_pools=True))
    ids = [child.id for child in status.root.children]
    assert ids == ["control", "pools", *(f"router-{i}" for i in range(ROUTERS))]
    assert {n.pid for n in status.root.children if n.id.startswith("router-")} == set(
        census.pids("router")
    )
    problems: list[str] = []
    rows = _tree_processes(fleet.run_dir, 30, problems)  # what `poolserve top` lists
    assert not problems
    assert {pid for pid, kind, _ in rows if kind.startswith("router-")} == set(
        census.pids("router")
    )


def test_calls_over_many_connections_are_served_by_both_routers(fleet: Tree) -> None:
    channels = located(fleet)
    try:
        for k, c in enumerate(channels):
            values = np.full((1, 4), k, np.float32)
            assert np.array_equal(
                echoed(c.stub.ModelInfer(echo_request(values), timeout=60)), values
            )
    finally:
        for c in channels:
            c.close()
    http_address = (fleet.run_dir / "http.addr").read_text().strip()
    host, port = http_address.rsplit(":", 1)
    routers = router_pids(fleet)
    served = set()
    for k in range(CONNECTIONS):
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        body = {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 1], "data": [k]}]}
        conn.request("POST", "/v2/models/echo/infer", json.dumps(body))
        reply = json.loads(conn.getresponse().read())
        assert reply["outputs"][0]["data"] == [k]
        served.add(server_of(conn.sock.getsockname()[1], int(port), routers))
        conn.close()
    assert served == set(routers), "both routers served REST connections"


def test_no_reply_is_mixed_up_under_a_concurrent_mix(fleet: Tree) -> None:
    channels = located(fleet)

    def calls(index: int) -> int:
        c = channels[index % len(channels)]
        rng = np.random.default_rng(index)
        for _ in range(20):
            values = rng.random((1, 1 + index % 7), dtype=np.float32)
            got = echoed(c.stub.ModelInfer(echo_request(values), timeout=60))
            assert np.array_equal(got, values), index
        return index

    try:
        with ThreadPoolExecutor(32) as pool:
            assert sorted(pool.map(calls, range(64))) == list(range(64))
    finally:
        for c in channels:
            c.close()


def test_a_sequence_stays_on_one_worker_across_routers(fleet: Tree) -> None:
    channels = located(fleet)
    infer = [c.channel.unary_unary("/inference.GRPCInferenceService/ModelInfer") for c in channels]
    try:
        for sequence in (101, 102, 103):
            pids, total = set(), 0
            for k in range(2 * CONNECTIONS):  # every step through another connection
                total += k
                request = step("tracked", k, sequence, start=k == 0, end=k == 2 * CONNECTIONS - 1)
                reply = decode_outputs(
                    pb.ModelInferResponse.FromString(infer[k % len(infer)](request, timeout=60))
                )
                assert int(reply["OUTPUT"][0, 0]) == total
                pids.add(int(reply["PID"][0]))
            assert len(pids) == 1, pids
    finally:
        for c in channels:
            c.close()


def test_shared_memory_registered_through_one_router_serves_through_all(fleet: Tree) -> None:
    channels = located(fleet)
    key = f"psfleet-{os.getpid()}"
    shm = Path("/dev/shm") / key
    values = np.arange(16, dtype=np.float32).reshape(1, 16)
    shm.write_bytes(values.tobytes())
    os.chmod(shm, 0o600)
    first = channels[0]
    other = next(c for c in channels if c.router != first.router)

    def by_region(c: Located) -> Any:
        request = pb.ModelInferRequest(model_name="echo")
        tensor = request.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 16])
        tensor.parameters["shared_memory_region"].string_param = "fleet"
        tensor.parameters["shared_memory_byte_size"].int64_param = 64
        return c.stub.ModelInfer(request, timeout=60)

    try:
        first.stub.SystemSharedMemoryRegister(
            pb.SystemSharedMemoryRegisterRequest(name="fleet", key="/" + key, byte_size=64),
            timeout=60,
        )
        for c in channels:
            status = c.stub.SystemSharedMemoryStatus(pb.SystemSharedMemoryStatusRequest())
            assert list(status.regions) == ["fleet"]
            assert np.array_equal(echoed(by_region(c)), values)
        with pytest.raises(grpc.RpcError) as taken:
            other.stub.SystemSharedMemoryRegister(
                pb.SystemSharedMemoryRegisterRequest(name="fleet", key="/" + key, byte_size=8)
            )
        assert taken.value.code() == grpc.StatusCode.ALREADY_EXISTS
        other.stub.SystemSharedMemoryUnregister(
            pb.SystemSharedMemoryUnregisterRequest(name="fleet")
        )
        for c in channels:
            status = c.stub.SystemSharedMemoryStatus(pb.SystemSharedMemoryStatusRequest())
            assert not status.regions
            with pytest.raises(grpc.RpcError) as gone:
                by_region(c)
            assert gone.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "not registered" in str(gone.value.details())
    finally:
        shm.unlink()
        for c in channels:
            c.close()


def test_model_control_through_any_router(fleet: Tree) -> None:
    channels = located(fleet)
    one = channels[0]
    two = next(c for c in channels if c.router != one.router)
    try:
        one.stub.RepositoryModelUnload(pb.RepositoryModelUnloadRequest(model_name="spare"))
        ready = pb.ModelReadyRequest(name="spare")
        assert not two.stub.ModelReady(ready, timeout=60).ready
        two.stub.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name="spare"))
        assert one.stub.ModelReady(ready, timeout=60).ready
        # a model added after start, loaded through one router, served by the other
        late = shutil.copytree(EXAMPLES / "echo", fleet.repo / "late")
        settings = json.loads((late / "model-settings.json").read_text())
        (late / "model-settings.json").write_text(json.dumps({**settings, "name": "late"}))
        one.stub.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name="late"), timeout=60)
        values = np.ones((1, 3), np.float32)
        for c in (one, two):
            assert np.array_equal(
                echoed(c.stub.ModelInfer(echo_request(values, "late"), timeout=60)), values
            )
    finally:
        for c in channels:
            c.close()


def _scrape(tree: Tree) -> str:
    address = (tree.run_dir / "metrics.addr").read_text().strip()
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=30) as reply:
        text: str = reply.read().decode()
    return text


def _sample(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_metrics_count_every_call_whichever_router_took_it(fleet: Tree) -> None:
    before = _sample(_scrape(fleet), "nv_inference_request_success", model="echo")
    channels = located(fleet)
    calls = 0
    try:
        for _ in range(3):
            for c in channels:
                c.stub.ModelInfer(echo_request(np.zeros((1, 1), np.float32)), timeout=60)
                calls += 1
    finally:
        for c in channels:
            c.close()
    text = _scrape(fleet)
    assert _sample(text, "nv_inference_request_success", model="echo") - before == calls
    assert _sample(text, "poolserve_processes", kind="router") == ROUTERS


def test_metrics_count_each_routers_calls_apart(fleet: Tree) -> None:
    """poolserve_router_requests_total{router="i"}: the calls router i took (the
    kernel's spread), summing to the calls made; the totals unchanged."""
    status = asyncio.run(fetch_tree_status(fleet.run_dir, 30, skip_pools=True))
    index = {n.pid: n.id.removeprefix("router-") for n in walk(status.root)}
    index = {pid: i for pid, i in index.items() if i.isdigit()}
    assert sorted(index.values()) == [str(i) for i in range(ROUTERS)]
    text = _scrape(fleet)
    per_router = {
        i: _sample(text, "poolserve_router_requests_total", router=i) for i in index.values()
    }
    success = _sample(text, "nv_inference_request_success", model="echo")
    channels = located(fleet)
    took = dict.fromkeys(index.values(), 0)
    try:
        for _ in range(3):
            for c in channels:
                c.stub.ModelInfer(echo_request(np.zeros((1, 1), np.float32)), timeout=60)
                assert c.router is not None
                took[index[c.router]] += 1
    finally:
        for c in channels:
            c.close()
    text = _scrape(fleet)
    for i, before in per_router.items():
        assert _sample(text, "poolserve_router_requests_total", router=i) - before == took[i], i
    assert all(took.values()), took  # both routers took some
    calls = sum(took.values())
    assert _sample(text, "nv_inference_request_success", model="echo") - success == calls


def test_a_killed_router_restarts_while_the_other_serves(fleet: Tree) -> None:
    channels = located(fleet)
    victim = channels[0].router
    assert victim is not None
    survivors = [c for c in channels if c.router != victim]
    failures: list[BaseException] = []
    served = [0]
    stop = threading.Event()

    def load(c: Located) -> None:
        while not stop.is_set():
            values = np.full((1, 2), served[0], np.float32)
            try:
                got = echoed(c.stub.ModelInfer(echo_request(values), timeout=60))
                assert np.array_equal(got, values)
                served[0] += 1
            except BaseException as exc:
                failures.append(exc)

    threads = [threading.Thread(target=load, args=(c,)) for c in survivors]
    try:
        for t in threads:
            t.start()
        os.kill(victim, signal.SIGKILL)
        assert wait_until(lambda: restarted(fleet, victim), timeout=60)
        mark = served[0]
        assert wait_until(lambda: served[0] > mark + 10, timeout=60)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)
        for c in channels:
            c.close()
    assert not failures, failures[:3]
    census = fleet.census({"default": WORKERS}, routers=ROUTERS)
    assert census.ok, census.summary()
    again = located(fleet)  # the new router takes connections again
    for c in again:
        c.close()


def _router_index(tree: Tree) -> dict[int, str]:
    """pid -> index of every router, from the tree's status."""
    status = asyncio.run(fetch_tree_status(tree.run_dir, 30, skip_pools=True))
    index = {n.pid: n.id.removeprefix("router-") for n in walk(status.root)}
    return {pid: i for pid, i in index.items() if i.isdigit()}


def _scrape_located(tree: Tree, routers: list[int]) -> tuple[int | None, str]:
    """One scrape over a connection of its own: the router that took it, and its answer."""
    host, port = (tree.run_dir / "metrics.addr").read_text().strip().rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.connect()
        assert conn.sock is not None
        client_port = conn.sock.getsockname()[1]
        found: list[int | None] = [None]

        def accepted() -> bool:
            found[0] = server_of(client_port, int(port), routers)
            return found[0] is not None

        wait_until(accepted, timeout=30)
        conn.request("GET", "/metrics")
        reply = conn.getresponse()
        assert reply.status == 200, reply.status
        return found[0], reply.read().decode()
    finally:
        conn.close()


def test_every_router_answers_scrapes_with_the_fleets_counts(fleet: Tree) -> None:
    """The metrics port is shared like the others: whichever router the kernel
    picks for a scrape answers it, summed over the fleet (router-0 alone did)."""
    routers = router_pids(fleet)
    answered: dict[int, str] = {}
    for _ in range(64):  # 2^-63 that the kernel's hash put every one on one router
        router, text = _scrape_located(fleet, routers)
        assert router is not None
        answered[router] = text
        if len(answered) == ROUTERS:
            break
    assert set(answered) == set(routers)
    for text in answered.values():
        assert _sample(text, "poolserve_processes", kind="router") == ROUTERS
        assert {line.split("{")[0] for line in text.splitlines()} >= {
            "nv_inference_request_success",
            "poolserve_router_requests_total",
        }


def test_metrics_answer_while_router_0_is_down(fleet: Tree) -> None:
    index = _router_index(fleet)
    (first,) = [pid for pid, i in index.items() if i == "0"]
    before = _sample(_scrape(fleet), "nv_inference_request_success", model="echo")
    os.kill(first, signal.SIGKILL)
    # Its sockets close as it exits: from then on the kernel gives every scrape to the other.
    assert wait_until(lambda: _gone_or_zombie(first), timeout=30)
    text = _scrape(fleet)  # router-0's restart takes longer than this (a fresh interpreter)
    assert _sample(text, "nv_inference_request_success", model="echo") == before
    assert _sample(text, "poolserve_processes", kind="router") >= 1
    assert wait_until(lambda: restarted(fleet, first), timeout=60)
    assert _sample(_scrape(fleet), "poolserve_processes", kind="router") == ROUTERS


def _gone_or_zombie(pid: int) -> bool:
    """Every thread of ``pid`` has exited, so its sockets are closed. A killed
    process's main thread turns zombie while its other threads still exit, and the
    sockets they share close with the last one (a connection queued on the
    listening socket meanwhile is reset)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            zombie = f.read().rsplit(")", 1)[1].split()[0] == "Z"
        return zombie and os.listdir(f"/proc/{pid}/task") == [str(pid)]
    except FileNotFoundError:
        return True
