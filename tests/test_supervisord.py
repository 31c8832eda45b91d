"""poolserve under the real supervisord and supervisorctl of this environment.

Two ways, each on a temporary configuration (socket, logs, run directory
all under tmp_path):

- deploy/supervisord/poolserve.conf: one program, `poolserve serve`;
- `poolserve supervisord-config`: one program per pool and one for the router.

For both: the service comes up and answers ModelInfer, `supervisorctl status`
shows RUNNING, `supervisorctl stop` leaves no process of ours (checked by
PID in /proc), and `kill -9` of a program's main process leaves no orphan
worker (PR_SET_PDEATHSIG). Every PID seen is killed at the end.
"""

from __future__ import annotations

import configparser
import contextlib
import os
import re
import shlex
import signal
import subprocess
from pathlib import Path
from types import TracebackType
from typing import Any

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from poolserve.protos import inference_pb2 as pb
from poolserve.protos import inference_pb2_grpc as pbg
from poolserve.service.inference.codec import decode_outputs, encode_inputs
from poolserve.supervisor.cli import build_parser
from poolserve.supervisor.supervisord_config import (
    POOL_PRIORITY,
    ROUTER_PRIORITY,
    ROUTER_PROGRAM,
    build_programs,
    pool_program_name,
    render_config,
)

from harness import descendants, kill_pids, pid_alive
from serving import comm, env_without_notify
from support import BIN, ROOT, copy_example, wait_until

pytestmark = pytest.mark.e2e

SINGLE_CONF = ROOT / "deploy" / "supervisord" / "poolserve.conf"
TIMEOUT = 120.0  # CI is a loaded 2-core machine: bounds, never speeds


def header(root: Path) -> str:
    """The supervisord and supervisorctl sections, every path under ``root``."""
    return f"""[unix_http_server]
file={root}/supervisor.sock
chmod=0700

[supervisord]
logfile={root}/supervisord.log
pidfile={root}/supervisord.pid
childlogdir={root}
nodaemon=true
silent=true
minfds=1024
minprocs=200

[rpcinterface:supervisor]
supervisor.rpcinterface_factory = supervisor.rpcinterface:make_main_rpcinterface

[supervisorctl]
serverurl=unix://{root}/supervisor.sock
"""


class Supervisord:
    """One real supervisord; kills every PID it saw when it closes."""

    def __init__(self, root: Path, programs: str, *, complete: bool = False) -> None:
        self.root = root
        self.conf = root / "supervisord.conf"
        self.conf.write_text(programs if complete else header(root) + "\n" + programs)
        self.proc: subprocess.Popen[bytes] | None = None
        self.seen: set[int] = set()

    def __enter__(self) -> Supervisord:
        self.proc = subprocess.Popen(
            [str(BIN / "supervisord"), "-n", "-c", str(self.conf)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=env_without_notify(),
            cwd=self.root,
        )
        return self

    def ctl(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(BIN / "supervisorctl"), "-c", str(self.conf), *args],
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
            check=False,
        )

    def status(self) -> dict[str, tuple[str, int | None]]:
        """program -> (state, pid) from `supervisorctl status`."""
        states: dict[str, tuple[str, int | None]] = {}
        for line in self.ctl("status").stdout.splitlines():
            match = re.match(r"^(\S+)\s+([A-Z]+)\s*(?:pid (\d+))?", line)
            if match:
                pid = int(match[3]) if match[3] else None
                states[match[1]] = (match[2], pid)
        return states

    def wait_for(self, programs: list[str], state: str) -> dict[str, int | None]:
        """Polls `supervisorctl status` (supervisord has no event to wait on)."""

        def reached() -> bool:
            current = self.status()
            return all(current.get(p, ("", None))[0] == state for p in programs)

        assert wait_until(reached, timeout=TIMEOUT, interval=0.5), (
            f"not all {state}: {self.status()}\n{self.log()}"
        )
        pids = {p: self.status()[p][1] for p in programs}
        self.tree()
        return pids

    def tree(self) -> list[int]:
        assert self.proc is not None
        found = descendants(self.proc.pid)
        self.seen.update(found)
        return found

    def log(self) -> str:
        chunks = []
        for path in sorted(self.root.glob("*.log")):
            with contextlib.suppress(OSError):
                chunks.append(f"--- {path.name}\n{path.read_text()[-4000:]}")
        return "\n".join(chunks)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.tree()
            self.proc.send_signal(signal.SIGTERM)  # stops every program, then exits
            try:
                self.proc.wait(timeout=TIMEOUT)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
        kill_pids(sorted(self.seen))
        wait_until(lambda: not any(pid_alive(p) for p in self.seen), timeout=30)


def tree_of(pid: int) -> list[int]:
    return [pid, *descendants(pid)]


def wait_router(run_dir: Path) -> str:
    """The router's address (router.addr: it binds port 0), once SERVING."""
    path = run_dir / "router.addr"
    assert wait_until(path.exists, timeout=TIMEOUT, interval=0.05), f"no {path}"
    address = path.read_text().strip()
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        request = health_pb2.HealthCheckRequest(service="")
        for reply in stub.Watch(request, timeout=TIMEOUT, wait_for_ready=True):
            if reply.status == health_pb2.HealthCheckResponse.SERVING:
                break
    return address


def infer_echo(address: str) -> None:
    payload = np.arange(16, dtype=np.float32).reshape(1, 16)
    request = pb.ModelInferRequest(model_name="echo")
    encode_inputs({"INPUT0": payload}, request, raw=True)
    with grpc.insecure_channel(address) as channel:
        reply = pbg.GRPCInferenceServiceStub(channel).ModelInfer(
            request, timeout=TIMEOUT, wait_for_ready=True
        )
    np.testing.assert_array_equal(decode_outputs(reply)["OUTPUT0"], payload)


def full_tree(pid: int, workers: int, pools: int) -> bool:
    """Workers fork once models load; /proc has no event, so this is polled."""
    named = [comm(p) for p in descendants(pid)]
    return named.count("poolserve-wrk") == workers * pools and named.count("poolserve-zyg") == pools


def all_gone(pids: list[int]) -> bool:
    return not any(pid_alive(p) for p in pids)


# -- one program: poolserve serve --------------------------------------------------


def single_program(repo: Path, run_dir: Path, root: Path) -> str:
    """deploy/supervisord/poolserve.conf with its paths moved under tmp_path."""
    parser = configparser.RawConfigParser()
    parser.read_string(SINGLE_CONF.read_text())
    program = parser["program:poolserve"]
    argv = shlex.split(program["command"])
    assert argv[:2] == ["/opt/poolserve/bin/poolserve", "serve"]
    args = build_parser().parse_args(argv[1:])
    argv[0] = str(BIN / "poolserve")
    argv[2] = str(repo)
    argv[argv.index("--host") + 1] = "127.0.0.1"
    argv[argv.index("--grpc-port") + 1] = "0"  # the router writes the port it bound
    argv[argv.index("--run-dir") + 1] = str(run_dir)
    assert args.run_dir == "/run/poolserve"
    program["command"] = shlex.join([*argv, "--workers", "2"])
    program.pop("user")  # the test runs as whoever runs it
    program["stdout_logfile"] = str(root / "poolserve.log")
    program["directory"] = str(root)
    lines = ["[program:poolserve]"] + [f"{k}={v}" for k, v in program.items()]
    return "\n".join(lines) + "\n"


@pytest.mark.timeout(600)  # a whole life cycle on a loaded 2-core CI machine
def test_single_program_config(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    copy_example(repo, "echo")
    run_dir = tmp_path / "run"
    with Supervisord(tmp_path, single_program(repo, run_dir, tmp_path)) as sd:
        pids = sd.wait_for(["poolserve"], "RUNNING")
        main = pids["poolserve"]
        assert main is not None
        address = wait_router(run_dir)
        infer_echo(address)
        assert wait_until(lambda: full_tree(main, workers=2, pools=1), timeout=TIMEOUT)
        tree = tree_of(main)
        sd.seen.update(tree)
        assert sd.status()["poolserve"][0] == "RUNNING"

        # supervisorctl stop: SIGTERM to the group, poolserve stops its tree.
        stopped = sd.ctl("stop", "poolserve")
        assert stopped.returncode == 0, stopped.stdout + stopped.stderr
        assert sd.status()["poolserve"][0] == "STOPPED"
        log = (tmp_path / "supervisord.log").read_text()
        assert "stopped: poolserve (exit status 0)" in log, "a clean stop exits 0"
        assert wait_until(lambda: all_gone(tree), timeout=TIMEOUT), [
            (p, comm(p)) for p in tree if pid_alive(p)
        ]

        # kill -9 of the main process: its children die with it, supervisord restarts it.
        started = sd.ctl("start", "poolserve")
        assert started.returncode == 0, started.stdout + started.stderr
        main = sd.wait_for(["poolserve"], "RUNNING")["poolserve"]
        assert main is not None
        infer_echo(wait_router(run_dir))
        assert wait_until(lambda: full_tree(main, workers=2, pools=1), timeout=TIMEOUT)
        tree = tree_of(main)
        sd.seen.update(tree)
        os.kill(main, signal.SIGKILL)
        assert wait_until(lambda: all_gone(tree), timeout=TIMEOUT), [
            (p, comm(p)) for p in tree if pid_alive(p)
        ]
        restarted = sd.wait_for(["poolserve"], "RUNNING")["poolserve"]
        assert restarted not in (None, main)


# -- the flat configuration: one program per pool, one router ----------------------


def flat_repo(root: Path) -> Path:
    repo = root / "repo"
    copy_example(repo, "echo")
    copy_example(repo, "sleep", gid="other")
    return repo


def generate(repo: Path, run_dir: Path) -> str:
    """The real command line, as an operator runs it."""
    proc = subprocess.run(
        [str(BIN / "poolserve"), "supervisord-config", str(repo), "--run-dir", str(run_dir),
         "--grpc-port", "0", "--workers", "1"],
        capture_output=True, text=True, timeout=TIMEOUT, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.mark.timeout(600)  # a whole life cycle on a loaded 2-core CI machine
def test_flat_config(tmp_path: Path) -> None:
    repo = flat_repo(tmp_path)
    run_dir = tmp_path / "run"
    log_path = tmp_path / "supervisord.log"
    programs = [pool_program_name("default"), pool_program_name("other"), ROUTER_PROGRAM]
    with Supervisord(tmp_path, generate(repo, run_dir)) as sd:
        assert sd.proc is not None
        supervisord = sd.proc.pid
        sd.wait_for(programs, "RUNNING")
        infer_echo(wait_router(run_dir))
        spawned = [log_path.read_text().index(f"spawned: '{p}'") for p in programs]
        assert spawned[2] > max(spawned[:2]), "the pools start before the router"

        # kill -9 of one pool server: its zygote and worker die with it; the
        # pool comes back and the router serves again.
        assert wait_until(lambda: full_tree(supervisord, workers=1, pools=2), timeout=TIMEOUT)
        pool = sd.status()[pool_program_name("default")][1]
        assert pool is not None
        pool_tree = tree_of(pool)
        sd.seen.update(pool_tree)
        os.kill(pool, signal.SIGKILL)
        assert wait_until(lambda: all_gone(pool_tree), timeout=TIMEOUT), [
            (p, comm(p)) for p in pool_tree if pid_alive(p)
        ]
        sd.wait_for([pool_program_name("default")], "RUNNING")
        infer_echo(wait_router(run_dir))

        # supervisorctl stop all (every program at once) leaves nothing of ours.
        assert wait_until(lambda: full_tree(supervisord, workers=1, pools=2), timeout=TIMEOUT)
        everything = sd.tree()
        already = len(log_path.read_text())
        stopped = sd.ctl("stop", "all")
        assert stopped.returncode == 0, stopped.stdout + stopped.stderr
        assert all(state == "STOPPED" for state, _ in sd.status().values()), sd.status()
        stop_log = log_path.read_text()[already:]
        for program in programs:
            assert f"stopped: {program} (exit status 0)" in stop_log, stop_log
        assert wait_until(lambda: all_gone(everything), timeout=TIMEOUT), [
            (p, comm(p)) for p in everything if pid_alive(p)
        ]

        # supervisord's own shutdown (what systemd or docker stop sends) goes
        # by priority: the router stops and drains, then the pools stop.
        started = sd.ctl("start", "all")
        assert started.returncode == 0, started.stdout + started.stderr
        sd.wait_for(programs, "RUNNING")
        infer_echo(wait_router(run_dir))
        assert wait_until(lambda: full_tree(supervisord, workers=1, pools=2), timeout=TIMEOUT)
        everything = sd.tree()
        already = len(log_path.read_text())
        sd.proc.send_signal(signal.SIGTERM)
        assert sd.proc.wait(timeout=TIMEOUT) == 0
        assert wait_until(lambda: all_gone(everything), timeout=TIMEOUT), [
            (p, comm(p)) for p in everything if pid_alive(p)
        ]
        shutdown = log_path.read_text()[already:]
        stops = [shutdown.index(f"stopped: {p} (exit status 0)") for p in programs]
        assert stops[2] < min(stops[:2]), "the router stops (drains) before the pools"


@pytest.mark.timeout(300)
def test_standalone_config_runs_as_printed(tmp_path: Path) -> None:
    """`supervisord-config --standalone DIR` is a whole supervisord.conf: supervisord
    and supervisorctl run from it with nothing added, and the tree serves."""
    repo = flat_repo(tmp_path)
    run_dir = tmp_path / "run"
    home = tmp_path / "sd"
    home.mkdir()
    proc = subprocess.run(
        [str(BIN / "poolserve"), "supervisord-config", str(repo), "--run-dir", str(run_dir),
         "--grpc-port", "0", "--workers", "1", "--standalone", str(home)],
        capture_output=True, text=True, timeout=TIMEOUT, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    sections = configparser.ConfigParser(interpolation=None)
    sections.read_string(proc.stdout)
    for name in ("unix_http_server", "supervisord", "rpcinterface:supervisor", "supervisorctl"):
        assert sections.has_section(name), name
    assert sections["unix_http_server"]["file"].startswith(str(home.resolve()))
    programs = [pool_program_name("default"), pool_program_name("other"), ROUTER_PROGRAM]
    with Supervisord(home, proc.stdout, complete=True) as sd:
        sd.wait_for(programs, "RUNNING")
        infer_echo(wait_router(run_dir))
    assert (home / "supervisord.log").exists()


# -- the generated configuration, read by supervisord's own parser -----------------


def read_with_supervisord(config: str, root: Path) -> dict[str, Any]:
    from supervisor.options import ServerOptions

    path = root / "supervisord.conf"
    path.write_text(header(root) + "\n" + config)
    options = ServerOptions()
    options.configfile = str(path)
    options.process_config(do_usage=False)
    found: dict[str, Any] = {}
    for group in options.process_group_configs:
        for process in group.process_configs:
            found[process.name] = process
    return found


def test_generated_config_as_supervisord_reads_it(tmp_path: Path) -> None:
    repo = flat_repo(tmp_path / "odd dir 100%")
    run_dir = tmp_path / "run"
    programs = build_programs(
        repo, {"grpc_port": 9000, "run_dir": str(run_dir)}, executable=["/opt/ps/bin/poolserve"]
    )
    processes = read_with_supervisord(render_config(repo, programs), tmp_path)
    assert list(processes) == [
        pool_program_name("default"),
        pool_program_name("other"),
        ROUTER_PROGRAM,
    ]
    argvs = {name: shlex.split(p.command) for name, p in processes.items()}
    for gid in ("default", "other"):
        argv = argvs[pool_program_name(gid)]
        assert argv[:3] == ["/opt/ps/bin/poolserve", "pool", str(repo.resolve())]
        args = build_parser().parse_args(argv[1:])
        assert (args.gid, args.grpc_port, args.run_dir) == (gid, 9000, str(run_dir))
    router = build_parser().parse_args(argvs[ROUTER_PROGRAM][1:])
    assert (router.command, router.grpc_port, router.run_dir) == ("router", 9000, str(run_dir))
    for name, process in processes.items():
        is_router = name == ROUTER_PROGRAM
        assert process.priority == (ROUTER_PRIORITY if is_router else POOL_PRIORITY)
        assert process.killasgroup
        # SIGTERM to the pool server alone: it drains, then stops its zygote and workers.
        assert process.stopasgroup == is_router
        assert process.stopwaitsecs > 10
        assert process.startsecs > 0
        assert 2 in process.exitcodes
        # A pool that cannot work (exit 3: its socket is another live pool's) is not restarted.
        assert (3 in process.exitcodes) == (not is_router)
    assert POOL_PRIORITY < ROUTER_PRIORITY, "pools start first; the router stops first"


def test_generated_config_rejects_an_empty_repository(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    proc = subprocess.run(
        [str(BIN / "poolserve"), "supervisord-config", str(tmp_path / "empty")],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=False,
    )
    assert proc.returncode == 2, proc.stderr
    assert "no valid model" in proc.stderr


def test_generated_config_says_it_runs_one_router(tmp_path: Path) -> None:
    """`--routers 2` is not dropped silently: the flat layout runs one router
    (--routers 1 in its command), and stderr says so; exit 0."""
    repo = tmp_path / "models"
    copy_example(repo, "echo")
    proc = subprocess.run(
        [str(BIN / "poolserve"), "supervisord-config", str(repo), "--routers", "2"],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "--routers 1" in proc.stdout
    assert "routers 2: this layout runs one router" in proc.stderr
