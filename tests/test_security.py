"""Security (issue 9.6): private run directory and sockets, a loopback router by
default, no path tricks through model names, and no request that imports code.

Real trees over loopback. Markers written by modules at import time prove
what was (and was not) imported.
"""

from __future__ import annotations

import asyncio
import os
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from poolserve.protos import inference_pb2 as pb

from harness import (
    BIN,
    Tree,
    infer_bytes,
    kill_pids,
    make_repo,
    payload,
    pids_with_arg,
    wait_gone,
    wait_serving,
)

pytestmark = pytest.mark.e2e

SERVICE = "inference.GRPCInferenceService"
REFUSED = {"NOT_FOUND", "INVALID_ARGUMENT"}


def marker_module(marker: Path, with_model: bool = True) -> str:
    """A module that leaves a trace when imported, and a model class."""
    code = f"import os\nopen({str(marker)!r}, 'a').write(str(os.getpid()) + '\\n')\n"
    if with_model:
        code += (
            "from poolserve.service import Model\n\n"
            "class M(Model):\n"
            "    def predict(self, inputs, parameters):\n"
            "        return {}\n"
        )
    return code


def add_model(folder: Path, name: str, marker: Path) -> None:
    folder.mkdir(parents=True)
    (folder / "model-settings.json").write_text(
        f'{{"name": "{name}", "implementation": "model.M"}}'
    )
    (folder / "model.py").write_text(marker_module(marker))


async def status_of(channel: grpc.aio.Channel, method: str, request: bytes) -> tuple[str, str]:
    try:
        await channel.unary_unary(f"/{SERVICE}/{method}")(request, timeout=30)
    except grpc.aio.AioRpcError as exc:
        return exc.code().name, exc.details() or ""
    return "OK", ""


# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Tree, Path]]:
    """A tree over a repository with echo, plus traps around it."""
    root = tmp_path_factory.mktemp("security")
    repo = make_repo(root / "repo", {"echo": None})
    markers = root / "markers"
    markers.mkdir()
    add_model(root / "outside", "outside", markers / "outside")  # beside the repository
    (repo / "evil.py").write_text(marker_module(markers / "evil", with_model=False))
    (root / "evil2.py").write_text(marker_module(markers / "evil2", with_model=False))
    with Tree(repo, root / "run", workers=1) as tree:

        async def ready() -> None:
            async with grpc.aio.insecure_channel(tree.address) as channel:
                await wait_serving(channel)

        asyncio.run(ready())
        yield tree, markers


def test_run_dir_is_0700_and_every_socket_0600(site: tuple[Tree, Path]) -> None:
    tree, _ = site
    info = tree.run_dir.stat()
    assert stat.S_IMODE(info.st_mode) == 0o700
    assert info.st_uid == os.getuid()
    sockets = [p for p in tree.run_dir.iterdir() if stat.S_ISSOCK(p.stat().st_mode)]
    assert {p.name for p in sockets} >= {"pool-default.sock", "supervisor.sock"}
    for path in sockets:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    for path in tree.run_dir.iterdir():
        assert not path.stat().st_mode & (stat.S_IWGRP | stat.S_IWOTH), path


def _listening(pid: int) -> list[str]:
    """Local addresses of the TCP sockets ``pid`` listens on (hex, as /proc says)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            cols = line.split()
            if cols[3] == "0A" and cols[9] in inodes:  # 0A: LISTEN
                found.append(cols[1])
    return found


def test_router_listens_on_loopback_only_and_nothing_else_listens(site: tuple[Tree, Path]) -> None:
    tree, _ = site
    census = tree.census({"default": 1})
    (router,) = census.pids("router")
    addresses = _listening(router)
    assert addresses, "the router listens on no TCP socket?"
    loopback = (
        "0100007F:",
        "00000000000000000000000001000000:",
        "0000000000000000FFFF00000100007F:",
    )
    assert all(a.startswith(loopback) for a in addresses), addresses
    assert tree.address.startswith("127.0.0.1:")
    for proc in census.procs:
        if proc.role != "router":
            assert _listening(proc.pid) == [], f"{proc.role} {proc.pid} listens on TCP"


NAMES = [
    "../outside", "../../outside", "outside", "echo/../outside", "./echo", "../echo", "..",
    ".", "/etc/passwd", "echo\x00", "%2e%2e/outside", "echo/../../etc", "evil", "evil2",
    "os", "subprocess", "poolserve.service.runtimes", "model", "model.M",
]  # fmt: skip


def test_model_names_cannot_reach_outside_the_repository(site: tuple[Tree, Path]) -> None:
    tree, markers = site
    before = sorted(p.name for p in tree.run_dir.iterdir())

    async def main() -> None:
        async with grpc.aio.insecure_channel(tree.address) as channel:
            for name in NAMES:
                infer = infer_bytes(name, payload(1))
                for method, body in (
                    ("ModelInfer", infer),
                    ("ModelReady", pb.ModelReadyRequest(name=name).SerializeToString()),
                    ("ModelMetadata", pb.ModelMetadataRequest(name=name).SerializeToString()),
                    ("ModelStatistics", pb.ModelStatisticsRequest(name=name).SerializeToString()),
                    ("RepositoryModelLoad",
                     pb.RepositoryModelLoadRequest(model_name=name).SerializeToString()),
                    ("RepositoryModelUnload",
                     pb.RepositoryModelUnloadRequest(model_name=name).SerializeToString()),
                ):  # fmt: skip
                    code, details = await status_of(channel, method, body)
                    if method == "ModelReady" and code == "OK":
                        continue  # answers ready=false for unknown names? must not be true
                    assert code in {"NOT_FOUND", "INVALID_ARGUMENT"}, (name, method, code, details)
            # and the tree still serves
            assert (await status_of(channel, "ModelInfer", infer_bytes("echo", payload(2))))[
                0
            ] == "OK"

    asyncio.run(main())
    assert sorted(p.name for p in markers.iterdir()) == [], "a request imported a module"
    assert sorted(p.name for p in tree.run_dir.iterdir()) == before


def test_model_ready_is_never_true_for_path_tricks(site: tuple[Tree, Path]) -> None:
    tree, _ = site

    async def main() -> dict[str, str]:
        async with grpc.aio.insecure_channel(tree.address) as channel:
            call = channel.unary_unary(
                f"/{SERVICE}/ModelReady",
                request_serializer=pb.ModelReadyRequest.SerializeToString,
                response_deserializer=pb.ModelReadyResponse.FromString,
            )
            # The control: the same call says ready for a model that is.
            assert (await call(pb.ModelReadyRequest(name="echo"), timeout=30)).ready
            answers: dict[str, str] = {}
            for name in NAMES:
                try:
                    reply = await call(pb.ModelReadyRequest(name=name), timeout=30)
                except grpc.aio.AioRpcError as exc:
                    answers[name] = exc.code().name
                    continue
                assert not reply.ready, name
                answers[name] = "not ready"
            assert set(answers) == set(NAMES)
            return answers

    answers = asyncio.run(main())
    # Refusing a name is fine; failing otherwise (UNAVAILABLE, INTERNAL, a
    # deadline) is no answer, and an error no longer skips the name.
    assert set(answers.values()) <= REFUSED | {"not ready"}, answers
    assert "not ready" in answers.values(), answers


def test_a_model_added_later_loads_from_the_repository(site: tuple[Tree, Path]) -> None:
    """The positive control: the markers do work, and loading is by repository name."""
    tree, markers = site
    (zygote,) = tree.census({"default": 1}).pids("zygote")
    add_model(tree.repo / "late", "late", markers / "late")

    async def main() -> None:
        async with grpc.aio.insecure_channel(tree.address) as channel:
            body = pb.RepositoryModelLoadRequest(model_name="late").SerializeToString()
            assert await status_of(channel, "RepositoryModelLoad", body) == ("OK", "")

    asyncio.run(main())
    assert (markers / "late").exists()
    # Imported once, by the pool's zygote (workers fork from it), which still
    # serves: not by the router, the pool server or a process that is gone.
    pids = [int(x) for x in (markers / "late").read_text().split()]
    assert pids == [zygote], (pids, zygote)
    assert tree.census({"default": 1}).pids("zygote") == [zygote]


def test_model_control_false_refuses_load_and_unload(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "repo", {"echo": None}, {"model_control": False})
    markers = tmp_path / "markers"
    markers.mkdir()

    async def main(tree: Tree) -> None:
        add_model(repo / "late", "late", markers / "late")
        async with grpc.aio.insecure_channel(tree.address) as channel:
            await wait_serving(channel)
            for method, name in (
                ("RepositoryModelLoad", "late"),
                ("RepositoryModelLoad", "echo"),
                ("RepositoryModelUnload", "echo"),
            ):
                request_type = (
                    pb.RepositoryModelLoadRequest
                    if method == "RepositoryModelLoad"
                    else pb.RepositoryModelUnloadRequest
                )
                code, details = await status_of(
                    channel, method, request_type(model_name=name).SerializeToString()
                )
                assert code == "FAILED_PRECONDITION", (method, name, code, details)
                assert "model_control" in details
            assert (await status_of(channel, "ModelInfer", infer_bytes("echo", payload(3))))[
                0
            ] == "OK"

    with Tree(repo, tmp_path / "run", workers=1) as tree:
        asyncio.run(main(tree))
    assert not (markers / "late").exists()


def test_a_loose_run_dir_is_refused_not_chmod_ed(tmp_path: Path) -> None:
    """Others could have prepared what is in it: refused like ssh-agent does,
    rather than made private (issue 21, section 5)."""
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o755)
    run_dir.chmod(0o777)
    repo = make_repo(tmp_path / "repo", {"echo": None})
    argv = [
        str(BIN / "poolserve"),
        "serve",
        str(repo),
        "--grpc-port",
        "0",
        "--run-dir",
        str(run_dir),
    ]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    finally:
        stray = pids_with_arg(str(run_dir))
        kill_pids(stray)
        wait_gone(stray, 10)
    assert done.returncode == 2, done.stderr
    assert str(run_dir) in done.stderr and "0777" in done.stderr
    assert stat.S_IMODE(run_dir.stat().st_mode) == 0o777
    assert list(run_dir.iterdir()) == []


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to make a directory someone else's")
def test_a_run_dir_owned_by_someone_else_is_refused(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    os.chown(run_dir, 65534, 65534)
    repo = make_repo(tmp_path / "repo", {"echo": None})
    argv = [
        str(BIN / "poolserve"),
        "serve",
        str(repo),
        "--grpc-port",
        "0",
        "--run-dir",
        str(run_dir),
    ]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    finally:
        stray = pids_with_arg(str(run_dir))
        kill_pids(stray)
        wait_gone(stray, 10)
    assert done.returncode == 2, done.stderr
    assert str(run_dir) in done.stderr and "owned by another user" in done.stderr
    assert list(run_dir.iterdir()) == []
