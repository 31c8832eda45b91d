"""``log_format json`` (issue 28, item 8): every line a tree writes is one JSON
object, through a worker's death, a model whose load fails, output written
outside any log handler, and the stop.

Before the fix, 18 of 48 lines of a plain run failed ``json.loads``: the
supervisor's events were JSON inside an unescaped ``"msg"`` string, and
tracebacks spanned lines.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import grpc
import pytest

from harness import (
    BIN,
    Tree,
    cmdline,
    descendants,
    kill_pids,
    make_repo,
    pid_alive,
    pool_status,
    wait_gone,
    wait_serving,
)
from support import wait_until, write_model

pytestmark = pytest.mark.e2e

FAILS_TO_LOAD = """
from poolserve.service import Model

class M(Model):
    def load(self):
        raise OSError("weights missing")

    def predict(self, inputs, parameters):
        return {}
"""

# Writes past every log handler at load: Python's stderr, stdout, and fd 2
# directly (as a native library or grpc's C core would).
CHATTY = """
import os
import sys

from poolserve.service import Model

class M(Model):
    def load(self):
        print("chatty: print to stdout")
        print('chatty: a "quoted" line\\nand a second line', file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os.write(2, b"chatty: raw bytes on fd 2\\n")

    def predict(self, inputs, parameters):
        return {}
"""


def parse_all(text: str) -> tuple[list[dict[str, Any]], list[str]]:
    """Every line of ``text`` as a JSON object, and the lines that are not."""
    records: list[dict[str, Any]] = []
    bad: list[str] = []
    for line in text.splitlines():
        try:
            value = json.loads(line)
        except ValueError:
            bad.append(line)
            continue
        if isinstance(value, dict):
            records.append(value)
        else:
            bad.append(line)
    return records, bad


def test_every_line_of_a_json_tree_parses(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "repo", {"echo": None})
    write_model(repo, "fails-to-load", {"name": "fails-to-load", "implementation": "model.M"},
                FAILS_TO_LOAD)  # fmt: skip
    write_model(repo, "chatty", {"name": "chatty", "implementation": "model.M"}, CHATTY)
    tree = Tree(repo, tmp_path / "run", workers=2, extra=("--log-format", "json"))
    with tree:

        async def serving_workers() -> list[int]:
            async with grpc.aio.insecure_channel(
                f"unix:{tree.run_dir / 'pool-default.sock'}"
            ) as channel:
                await wait_serving(channel, "model:echo")
            return [w.pid for w in (await pool_status(tree.run_dir)).workers]

        workers = asyncio.run(serving_workers())
        assert workers, "the pool reports no worker"
        victim = workers[0]
        assert victim in tree.snapshot()  # a worker of this tree, by PID
        os.kill(victim, signal.SIGKILL)

        def death_logged() -> bool:
            records, _ = parse_all(tree.log())
            return any(r.get("worker_pid") == victim for r in records)

        assert wait_until(death_logged, timeout=60, interval=0.1), tree.log()[-3000:]
        assert tree.terminate(timeout=90) == 0
    assert tree.leftovers() == []

    text = tree.log()
    records, bad = parse_all(text)
    lines = len(text.splitlines())
    assert bad == [], f"{len(bad)} of {lines} lines are not JSON objects:\n" + "\n".join(bad[:20])
    assert len(records) == lines > 10
    for record in records:
        for key in ("ts", "level", "role", "pid", "msg"):
            assert key in record, (key, record)

    # The worker's death, as fields: which worker, how it died.
    (death,) = [r for r in records if r.get("worker_pid") == victim]
    assert death["role"] == "pool:default" and death["level"] == "WARNING", death
    assert "SIGKILL" in death["worker_status"], death

    # The failed load: one record, its traceback in a field of its own.
    failed = [r for r in records if r.get("model") == "fails-to-load"]
    assert len(failed) == 1, failed
    assert "load failed: OSError: weights missing" in failed[0]["msg"]
    trace = failed[0]["traceback"]
    assert trace.startswith("Traceback (most recent call last)"), trace
    assert 'raise OSError("weights missing")' in trace and "\n" in trace

    # The supervisor's events are objects, not JSON inside a string.
    events = [r["event"] for r in records if isinstance(r.get("event"), dict)]
    names = {e["event"] for e in events}
    assert {"child_started", "child_ready"} <= names, names
    assert any(e["event"] == "child_started" and e["id"] == "router" for e in events), events
    assert not any(r["msg"].lstrip().startswith("{") for r in records)

    # Output past every handler is wrapped, naming the child it came from.
    raw = {r["msg"]: r for r in records if r.get("raw") is True}
    for line in (
        "chatty: print to stdout",
        'chatty: a "quoted" line',
        "and a second line",
        "chatty: raw bytes on fd 2",
    ):
        assert line in raw, (line, sorted(raw))
        assert raw[line]["role"] == "pool:default", raw[line]

    # Every process of the tree wrote its own lines.
    roles = {r["role"] for r in records}
    assert {"supervisor", "router", "pool:default"} <= roles, roles
    assert "Traceback" not in "".join(r["msg"] for r in records)


def test_a_pool_run_alone_wraps_its_own_output(tmp_path: Path) -> None:
    """Under supervisord (deploy/supervisord, json on) no poolserve supervisor
    relays a pool's output: the pool starts a small relay process of its own,
    so a model's print, on stdout or fd 2, is still one JSON object."""
    repo = make_repo(tmp_path / "repo", {"echo": None})
    write_model(repo, "chatty", {"name": "chatty", "implementation": "model.M"}, CHATTY)
    run_dir = tmp_path / "run"
    log_path = tmp_path / "pool.log"
    argv = [str(BIN / "poolserve"), "pool", str(repo), "--gid", "default",
            "--run-dir", str(run_dir), "--workers", "1", "--log-format", "json"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("POOLSERVE_")}
    with open(log_path, "wb") as log:
        pool = subprocess.Popen(argv, stdout=log, stderr=log, env=env)
    started: set[int] = {pool.pid}
    try:

        async def serving() -> None:
            async with grpc.aio.insecure_channel(f"unix:{run_dir / 'pool-default.sock'}") as ch:
                await wait_serving(ch, "model:chatty")

        asyncio.run(serving())
        started.update(descendants(pool.pid))
        relays = [p for p in started if "poolserve.service.lifecycle.logs" in " ".join(cmdline(p))]
        assert len(relays) == 1, [cmdline(p) for p in started]
        pool.send_signal(signal.SIGTERM)
        assert pool.wait(timeout=60) == 0
        # The relay ends by itself once every writer (pool, zygote, workers) is gone.
        assert wait_gone(started, timeout=30), [p for p in started if pid_alive(p)]
    finally:
        if pool.poll() is None:
            pool.kill()
            pool.wait(timeout=30)
        kill_pids(started)
        wait_gone(started, timeout=10)
    records, bad = parse_all(log_path.read_text())
    assert bad == [], bad
    raw = {r["msg"]: r for r in records if r.get("raw") is True}
    for line in ("chatty: print to stdout", 'chatty: a "quoted" line', "chatty: raw bytes on fd 2"):
        assert line in raw, (line, sorted(raw))
        assert raw[line]["role"] == "pool:default" and raw[line]["pid"] == pool.pid, raw[line]
    assert any(r.get("logger", "").endswith("poolserver.server") for r in records), records


def test_wrap_line_keeps_records_and_wraps_everything_else() -> None:
    from poolserve.service.lifecycle.logs import wrap_line

    record = '{"ts": "t", "level": "INFO", "role": "router", "pid": 3, "msg": "m"}'
    assert wrap_line(record, "pool:a", 9) == record
    for text in ('{"a": 1}', "[1, 2]", '{"ts": "half', 'say "hi"\\ \t', "Traceback (most"):
        wrapped = json.loads(wrap_line(text, "pool:a", 9))
        assert wrapped["msg"] == text and wrapped["raw"] is True
        assert (wrapped["role"], wrapped["pid"], wrapped["level"]) == ("pool:a", 9, "WARNING")
    glog = "E1201 14:20:02.510713   17173 chttp2_transport.cc:1376] bind failed"
    assert json.loads(wrap_line(glog, "router", 1))["level"] == "ERROR"
    # a record after output with no newline of its own: two lines, the record kept
    for before in ("loading... no newline", 'half {"a": 1} and {"ts"'):
        first, second = wrap_line(before + record, "zygote:a", 9).split("\n")
        assert json.loads(first)["msg"] == before and json.loads(first)["raw"] is True
        assert second == record


def test_pipe_relay_splits_lines_across_reads_and_flushes_at_eof() -> None:
    from poolserve.supervisor.relay import MAX_LINE, PipeRelay

    got: list[tuple[bytes, int]] = []
    read_fd, write_fd = os.pipe()
    relay = PipeRelay(read_fd, 42, lambda line, pid: got.append((line, pid)))

    def feed(data: bytes) -> None:  # below the pipe's capacity at a time
        while data:
            data = data[os.write(write_fd, data[:32768]) :]
            relay.drain()

    feed(b"one\ntw")
    assert got == [(b"one", 42)]
    feed(b"o\n" + b"x" * (MAX_LINE + 5))
    assert got[1:] == [(b"two", 42), (b"x" * MAX_LINE, 42)]
    os.close(write_fd)
    relay.drain()  # EOF: the rest, without its newline; the pipe is closed
    assert got[3:] == [(b"xxxxx", 42)]
    with pytest.raises(OSError, match="Bad file descriptor"):
        os.fstat(read_fd)


def test_a_configuration_error_is_one_json_object_too(tmp_path: Path) -> None:
    """Before logging is set up (settings.json may be what is broken), an error
    still follows the format asked for by the flag or POOLSERVE_LOG_FORMAT."""
    repo = make_repo(tmp_path / "repo", {"echo": None}, {"max_queue": "big"})
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith("POOLSERVE_")}
    for how, extra in (("flag", ["--log-format", "json"]), ("variable", [])):
        if how == "variable":
            env["POOLSERVE_LOG_FORMAT"] = "json"
        argv = [str(BIN / "poolserve"), "serve", str(repo), "--grpc-port", "0",
                "--run-dir", str(run_dir), *extra]  # fmt: skip
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env)
        assert done.returncode == 2, (how, done.stderr)
        records, bad = parse_all(done.stderr)
        assert bad == [] and len(records) == 1, (how, done.stderr)
        (record,) = records
        assert record["level"] == "ERROR" and record["role"] == "supervisor", record
        assert "max_queue" in record["msg"] and str(repo / "settings.json") in record["msg"]
        assert not run_dir.exists() or not any(run_dir.iterdir())
