"""End to end: a live tree's /metrics scraped by a real Prometheus server
(Debian's ``prometheus`` package), through worker and pool SIGKILLs; and
``poolserve top --once`` on a live tree."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from harness import (
    BIN,
    INFER,
    free_port,
    infer_bytes,
    make_repo,
    payload,
)
from serving import Serving, pool_status, wait_idle_workers, wait_serving
from support import ROOT

pytestmark = pytest.mark.e2e
WAIT_S = 90.0


def two_pool_repo(root: Path) -> Path:
    """``echo`` in pool a, a copy named ``echo_b`` in pool b."""
    repo = make_repo(root / "repo", {"echo": "a"})
    make_repo(root / "src", {"echo": "b"})
    shutil.move(str(root / "src" / "echo"), repo / "echo_b")
    settings = repo / "echo_b" / "model-settings.json"
    settings.write_text(settings.read_text().replace('"echo"', '"echo_b"'))
    return repo


def prometheus_binary() -> str:
    found = shutil.which("prometheus")
    if found:
        return found
    if shutil.which("apt-get") is None or os.geteuid() != 0:
        pytest.skip(
            "needs a Prometheus server: the binary `prometheus` is not on PATH and apt-get "
            "(as root) is not available to install the Debian package `prometheus`"
        )
    subprocess.run(
        ["apt-get", "install", "-y", "-qq", "--no-install-recommends", "prometheus"],
        capture_output=True,
        timeout=100,
        check=False,
    )
    found = shutil.which("prometheus")
    assert found, "apt-get install prometheus did not install the binary"
    return found


class Prometheus:
    """One Prometheus on loopback, a free port, its own storage; killed by PID."""

    def __init__(self, binary: str, work: Path, target: str) -> None:
        self.port = free_port()
        work.mkdir(parents=True)
        config = work / "prometheus.yml"
        config.write_text(
            "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n"
            "scrape_configs:\n  - job_name: poolserve\n"
            f"    static_configs:\n      - targets: ['{target}']\n"
        )
        self.log = work / "prometheus.log"
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                [
                    binary,
                    f"--config.file={config}",
                    f"--storage.tsdb.path={work / 'data'}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                    "--log.level=warn",
                ],
                stdout=log,
                stderr=log,
            )

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def wait_ready(self, timeout: float = WAIT_S) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:  # Prometheus says ready only through this endpoint
            assert self.proc.poll() is None, self.log.read_text()[-3000:]
            try:
                with urllib.request.urlopen(self.url("/-/ready"), timeout=5) as reply:
                    if reply.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.2)
        raise AssertionError(f"prometheus not ready in {timeout} s: {self.log.read_text()[-3000:]}")

    def query(self, promql: str) -> dict[str, float]:
        """An instant vector by its ``pool`` label."""
        url = self.url("/api/v1/query?" + urllib.parse.urlencode({"query": promql}))
        with urllib.request.urlopen(url, timeout=10) as reply:
            answer = json.load(reply)
        assert answer["status"] == "success", answer
        return {r["metric"].get("pool", ""): float(r["value"][1]) for r in answer["data"]["result"]}

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)


@pytest.fixture
def prometheus_bin() -> str:
    return prometheus_binary()


def wait_counts(prom: Prometheus, expected: dict[str, float]) -> None:
    """Until Prometheus' latest request counts are ``expected``; never above them."""
    promql = "sum by (pool) (nv_inference_request_success)"
    end = time.monotonic() + WAIT_S
    seen: dict[str, float] = {}
    while time.monotonic() < end:  # Prometheus scrapes on its own clock: poll its API
        seen = prom.query(promql)
        for gid, value in seen.items():
            assert value <= expected.get(gid, 0), f"counted more than was sent: {seen} {expected}"
        if seen == expected:
            return
        time.sleep(0.3)
    raise AssertionError(f"Prometheus shows {seen}, the test made {expected}")


async def calls(address: str, model: str, count: int) -> int:
    """``count`` successful calls (retried while a restarted pool comes back)."""
    done = 0
    async with grpc.aio.insecure_channel(address) as channel:
        call = channel.unary_unary(INFER)
        for key in range(count):
            for attempt in range(50):
                try:
                    await call(infer_bytes(model, payload(key)), timeout=30, wait_for_ready=True)
                    done += 1
                    break
                except grpc.aio.AioRpcError as exc:
                    if exc.code() != grpc.StatusCode.UNAVAILABLE or attempt == 49:
                        raise
                    await asyncio.sleep(0.1)  # back-off while the pool restarts
    return done


async def wait_new_pool(serving: Serving, gid: str, old_pid: int, workers: int) -> None:
    end = time.monotonic() + WAIT_S
    while True:  # the pool's socket: down, then answered by the new process
        try:
            status = await pool_status(serving, gid)
            if status.pid != old_pid:
                break
        except grpc.aio.AioRpcError:
            pass
        assert time.monotonic() < end, f"pool {gid} did not come back"
        await asyncio.sleep(0.1)
    await wait_idle_workers(serving, gid, workers, timeout=WAIT_S)


@pytest.fixture
def tree(tmp_path: Path) -> Iterator[Serving]:
    with Serving(two_pool_repo(tmp_path), tmp_path / "run", "--metrics-port", "0") as serving:
        yield serving


def test_prometheus_counts_match_calls_through_worker_and_pool_kills(
    prometheus_bin: str, tree: Serving, tmp_path: Path
) -> None:
    target = (tree.run_dir / "metrics.addr").read_text().strip()
    prom = Prometheus(prometheus_bin, tmp_path / "prom", target)
    try:
        prom.wait_ready()

        async def main() -> None:
            async with grpc.aio.insecure_channel(tree.address) as channel:
                await wait_serving(channel, "model:echo", WAIT_S)
                await wait_serving(channel, "model:echo_b", WAIT_S)
            await wait_idle_workers(tree, "a", 2, WAIT_S)
            await wait_idle_workers(tree, "b", 2, WAIT_S)
            sent = {"a": await calls(tree.address, "echo", 7)}
            sent["b"] = await calls(tree.address, "echo_b", 5)
            await asyncio.to_thread(wait_counts, prom, sent)

            # A worker of pool a, SIGKILLed while idle: the pool keeps its counts.
            worker = (await pool_status(tree, "a")).workers[0].pid
            os.kill(worker, signal.SIGKILL)
            end = time.monotonic() + WAIT_S
            while worker in {w.pid for w in (await pool_status(tree, "a")).workers}:
                assert time.monotonic() < end
                await asyncio.sleep(0.05)  # the pool's status has no event to wait on
            await wait_idle_workers(tree, "a", 2, WAIT_S)
            sent["a"] += await calls(tree.address, "echo", 4)
            await asyncio.to_thread(wait_counts, prom, sent)
            restarts = prom.query('poolserve_worker_restarts_total{cause="signal"}')
            assert restarts == {"a": 1.0, "b": 0.0}

            # Pool b's server process, SIGKILLed: its successor counts from zero,
            # the router's base carries the old counts.
            old = (await pool_status(tree, "b")).pid
            os.kill(old, signal.SIGKILL)
            await wait_new_pool(tree, "b", old, 2)
            sent["b"] += await calls(tree.address, "echo_b", 6)
            sent["a"] += await calls(tree.address, "echo", 1)
            await asyncio.to_thread(wait_counts, prom, sent)
            assert prom.query("poolserve_pool_restarts_total") == {"a": 0.0, "b": 1.0}
            assert prom.query("sum by (pool) (nv_inference_request_failure)") == {
                "a": 0.0,
                "b": 0.0,
            }
            ready = prom.query("poolserve_pool_up")
            assert ready == {"a": 1.0, "b": 1.0}
            # The Grafana dashboard's queries are PromQL this Prometheus accepts.
            dashboard = json.loads((ROOT / "deploy/grafana/poolserve-dashboard.json").read_text())
            for panel in dashboard["panels"]:
                for target in panel["targets"]:
                    expr = target["expr"].replace("$__rate_interval", "1m").replace("$pool", ".*")
                    prom.query(expr)  # asserts status success

        asyncio.run(main())
    finally:
        prom.close()


def test_top_once_on_a_live_tree(tree: Serving) -> None:
    async def main() -> list[int]:
        async with grpc.aio.insecure_channel(tree.address) as channel:
            await wait_serving(channel, "model:echo", WAIT_S)
            await wait_serving(channel, "model:echo_b", WAIT_S)
        await wait_idle_workers(tree, "a", 2, WAIT_S)
        await calls(tree.address, "echo", 3)
        status = await pool_status(tree, "a")
        return [status.pid, status.zygote_pid, *(w.pid for w in status.workers)]

    pids = asyncio.run(main())
    done = subprocess.run(
        [str(BIN / "poolserve"), "top", "--run-dir", str(tree.run_dir), "--once"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    text = done.stdout
    assert "\x1b[" not in text  # no screen control codes without a terminal
    rows = {int(line.split()[0]): line for line in text.splitlines() if line.strip()[:1].isdigit()}
    assert set(pids) <= set(rows), text
    assert "pool a" in rows[pids[0]] and "zygote a" in rows[pids[1]]
    assert "worker a" in rows[pids[2]]
    models = {
        line.split()[0]: line.split() for line in text.splitlines() if line.startswith("echo")
    }
    assert set(models) == {"echo:1", "echo_b:1"}, text
    # MODEL POOL REQ/S P50 P99 QUEUE BUSY ERRORS: p50 known after 3 calls, no errors
    assert models["echo:1"][1] == "a" and models["echo:1"][3] != "-"
    assert models["echo:1"][7] == "0"
    assert models["echo_b:1"][1] == "b"
