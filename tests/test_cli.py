"""The command line as a newcomer meets it: help in plain words, `status`
that says in one sentence why it cannot answer, and output that survives a
reader who stops early (`status --json | head`)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from poolserve.service.contract.rundir import ADDRESS_FILE, HTTP_ADDRESS_FILE
from poolserve.supervisor.status_cli import EXIT_MODELS_NOT_READY, EXIT_UNREACHABLE

from serving import Serving, env_without_notify, pool_status, wait_serving
from support import BIN, copy_example, write_model


def poolserve(*args: str, **kwargs: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "poolserve"), *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        **kwargs,  # type: ignore[call-overload]
    )


@pytest.mark.parametrize(
    "command", [[], ["status"], ["probe"], ["serve"], ["supervisord-config"], ["top"]]
)
def test_help_is_plain_text(command: list[str]) -> None:
    proc = poolserve(*command, "--help")
    assert proc.returncode == 0, proc.stderr
    assert "usage: poolserve" in proc.stdout
    assert "``" not in proc.stdout and ":func:" not in proc.stdout, proc.stdout


def test_status_help_lists_its_exit_codes() -> None:
    proc = poolserve("status", "--help")
    assert "4 no supervisor answers" in " ".join(proc.stdout.split()), proc.stdout


def test_status_without_a_tree_says_so_in_one_sentence(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = poolserve("status", "--run-dir", str(run_dir))
    assert proc.returncode == EXIT_UNREACHABLE
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert f"no poolserve tree is running with run directory {run_dir}" in lines[0]
    assert "poolserve serve" in lines[0]
    assert "FAILED_PRECONDITION" not in proc.stderr and "Traceback" not in proc.stderr


def test_status_in_the_flat_supervisord_layout_explains(tmp_path: Path) -> None:
    """supervisord's flat layout: a router (its address file) but no supervisor."""
    (tmp_path / "router.addr").write_text("127.0.0.1:1\n")
    proc = poolserve("status", "--run-dir", str(tmp_path))
    assert proc.returncode == EXIT_UNREACHABLE
    assert "flat layout" in proc.stderr and "supervisorctl status" in proc.stderr, proc.stderr


def test_status_with_a_stale_control_socket(tmp_path: Path) -> None:
    import socket

    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(tmp_path / "supervisor.sock"))  # bound, never listening: refused
    proc = poolserve("status", "--run-dir", str(tmp_path), "--timeout", "5")
    assert proc.returncode == EXIT_UNREACHABLE
    assert "no supervisor answers on it" in proc.stderr, proc.stderr


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Serving]:
    root = tmp_path_factory.mktemp("cli")
    repo = root / "repo"
    copy_example(repo, "echo")
    with Serving(repo, root / "run", workers=1, env_replace=env_without_notify()) as serving:
        asyncio.run(_serving(serving.address))
        yield serving


async def _serving(address: str, service: str = "") -> None:
    async with grpc.aio.insecure_channel(address) as channel:
        await wait_serving(channel, service, timeout=120)


@pytest.mark.e2e
def test_status_json_to_a_closed_pipe(tree: Serving) -> None:
    """`status --json | head`: the reader left before the first byte; no traceback."""
    read, write = os.pipe()
    os.close(read)  # every write now fails with EPIPE, whatever the timing
    try:
        proc = subprocess.run(
            [str(BIN / "poolserve"), "status", "--run-dir", str(tree.run_dir), "--json"],
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
            check=False,
        )
    finally:
        os.close(write)
    assert proc.returncode == 0, proc.stderr
    assert "BrokenPipeError" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


@pytest.mark.e2e
def test_status_shows_no_systemd_child_outside_systemd(tree: Serving) -> None:
    proc = poolserve("status", "--run-dir", str(tree.run_dir))
    assert proc.returncode == 0, proc.stderr
    assert "systemd" not in proc.stdout, proc.stdout
    assert "router" in proc.stdout and "pool:default" in proc.stdout, proc.stdout
    # where each door listens, from the routers' address files
    rest = (tree.run_dir / HTTP_ADDRESS_FILE).read_text().strip()
    assert f"rest     http://{rest}/v2\n" in proc.stdout, proc.stdout
    grpc_addr = (tree.run_dir / ADDRESS_FILE).read_text().strip()
    assert f"grpc     {grpc_addr}\n" in proc.stdout, proc.stdout


@pytest.mark.e2e
def test_status_exits_1_while_a_model_is_not_ready(tmp_path: Path) -> None:
    """Every node runs, one model's load failed (UNAVAILABLE): status says so
    and exits 1, for scripts and probes."""
    repo = tmp_path / "repo"
    copy_example(repo, "echo")
    broken = {"name": "broken", "implementation": "model.Broken"}
    write_model(repo, "broken", broken, "raise RuntimeError('this model never loads')\n")
    with Serving(repo, tmp_path / "run", workers=1, env_replace=env_without_notify()) as serving:
        asyncio.run(_serving(serving.address, "model:echo"))
        end = time.monotonic() + 120
        while True:  # the pool's status has no event for a failed load
            states = {m.name: m.state for m in asyncio.run(pool_status(serving)).models}
            if states.get("broken") == "UNAVAILABLE":
                break
            assert time.monotonic() < end, states
            time.sleep(0.05)
        proc = poolserve("status", "--run-dir", str(serving.run_dir))
        assert proc.returncode == EXIT_MODELS_NOT_READY == 1, proc.stdout + proc.stderr
        assert "model broken" in proc.stdout and "UNAVAILABLE" in proc.stdout, proc.stdout
        shown = poolserve("status", "--run-dir", str(serving.run_dir), "--json")
        assert shown.returncode == 1, shown.stderr
        pools = json.loads(shown.stdout)["children"][1]["children"]
        models = {m["name"]: m["state"] for m in pools[0]["pool"]["models"]}
        assert models == {"echo": "READY", "broken": "UNAVAILABLE"}
