"""The servers the bench compares: how each is configured, started, watched and stopped.

A server is one :class:`ServerSpec` in :data:`SERVERS`: a key, a label, the
virtual environment it runs from, its worker count, the models it serves and
a function that writes its model repository and returns its command line.
Adding a peer is one more entry in :data:`SERVERS`, its runtime module under
peers/ and, if it needs its own environment, one entry in
``install.PEER_VENVS``; the rounds, tables and chart pick it up (KServe came
in that way; its targets are in report.py).

Every server gets the same models (peers/workload.py holds the one copy of
their code) and the same calibrated iteration count, as configuration: a
temporary model repository for poolserve, MLServer and KServe, flags for the
bare server. Processes are tracked by PID: the root we spawned plus every
descendant seen in /proc, and stopped TERM -> grace -> KILL, PID by PID.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
PEER_CODE = BENCH / "peers"
PROJECT_PYTHON = ROOT / ".venv" / "bin" / "python"
POOLSERVE = ROOT / ".venv" / "bin" / "poolserve"

TENSOR = {"name": "INPUT0", "datatype": "FP32", "shape": [1, 16]}
OUTPUT = {"name": "OUTPUT0", "datatype": "FP32", "shape": [1, 16]}
# The XGBoost model (issue 22): 20 features in, MLServer's runtime's output name out.
XGB_TENSOR = {"name": "INPUT0", "datatype": "FP32", "shape": [1, 20]}
XGB_OUTPUT = {"name": "predict", "datatype": "FP32", "shape": [1]}
# Every server gets the same gRPC message limit (issue 20): gRPC's default 4 MiB and
# KServe's 8 MiB refuse the large-tensor bench's 9.2 MiB tensors; poolserve's default is 64 MiB.
MESSAGE_LIMIT = 64 * 1024 * 1024
MLSERVER_DEBUG = False  # MLServer's default True adds an access-log interceptor to every call


@dataclass(frozen=True)
class Workload:
    """What the bench passes to every server: calibrated once per run."""

    iterations: int
    counter: Path  # burn appends one byte here per execution
    array_mib: int = 400
    xgb_model: Path | None = None  # the XGBoost model file, trained once per run


@dataclass(frozen=True)
class Layout:
    """Which models a server holds, in which pools, with how many workers per pool."""

    models: tuple[str, ...] = ("echo", "burn")
    separate_gids: bool = False
    workers: int | None = None  # None: the spec's own worker count
    shape: tuple[int, ...] | None = None  # echo's tensor shape (large tensors); None: [1, 16]

    def gid(self, model: str) -> str | None:
        return model if self.separate_gids else None

    def extra(self, model: str, workload: Workload) -> dict[str, object]:
        if model == "burn":
            return {"iterations": workload.iterations, "counter": str(workload.counter)}
        if model == "big":
            return {"array_mib": workload.array_mib}
        if model == "xgb":
            return {"model_file": str(workload.xgb_model)}
        if model == "echo_cached":  # bench/cache.py: echo, answered from the response cache
            return {"response_cache": True}
        return {}


@dataclass(frozen=True)
class Launch:
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    ready_line: str = ""  # a line the server prints on stdout once it serves
    cleanup: tuple[Path, ...] = ()  # folders to remove after it stopped


@dataclass(frozen=True)
class Context:
    workdir: Path  # private to this server instance
    port: int
    workload: Workload
    layout: Layout
    venvs: dict[str, Path]  # peer venv name -> python
    http_port: int = 0  # the REST port (0: a free one chosen by the builder)

    def rest_port(self) -> int:
        return self.http_port or free_port()


Builder = Callable[["ServerSpec", Context], Launch]


BOTH = ("echo", "burn")
WITH_XGB = (*BOTH, "xgb")  # the servers in the XGBoost comparison (issue 22)


@dataclass(frozen=True)
class ServerSpec:
    key: str
    label: str
    workers: int
    build: Builder
    venv: str = ""  # "" = the project's .venv
    note: str = ""
    models: tuple[str, ...] = BOTH  # what it serves in the perf_analyzer rounds
    inline: bool = False  # poolserve: "parallel_workers": 0 and extra.inline_fast in every model
    routers: int = 1  # poolserve: the routers setting (bench/fleet.py)

    def workers_for(self, layout: Layout) -> int:
        return self.workers if layout.workers is None else layout.workers


# -- poolserve ------------------------------------------------------------------

POOLSERVE_CLASSES = {
    "echo": "EchoModel",
    "echo_cached": "EchoModel",
    "burn": "BurnModel",
    "big": "BigModel",
    "xgb": "XGBoostModel",
}


def write_model_settings(
    folder: Path,
    model: str,
    implementation: str,
    ctx: Context,
    extra: Mapping[str, object] | None = None,
    uri: str | None = None,
    **more: object,
) -> None:
    """The model-settings.json every repository-based server gets (same fields, same extra)."""
    parameters: dict[str, object] = {"extra": {**ctx.layout.extra(model, ctx.workload),
                                               **(extra or {})}}  # fmt: skip
    gid = ctx.layout.gid(model)
    if gid:
        parameters["inference_pool_gid"] = gid
    if uri is not None:
        parameters["uri"] = uri
    xgb = model == "xgb"
    shape = {"shape": list(ctx.layout.shape)} if ctx.layout.shape else {}
    settings: dict[str, object] = {
        "name": model,
        "implementation": implementation,
        "parameters": parameters,
        "inputs": [XGB_TENSOR if xgb else {**TENSOR, **shape}],
        "outputs": [XGB_OUTPUT if xgb else {**OUTPUT, **shape}],
        **more,
    }
    folder.mkdir(parents=True, exist_ok=True)
    write_json(folder / "model-settings.json", settings)


def build_poolserve(spec: ServerSpec, ctx: Context) -> Launch:
    repo = ctx.workdir / "repo"
    for model in ctx.layout.models:
        folder = repo / model
        folder.mkdir(parents=True)
        shutil.copy(PEER_CODE / "poolserve_models.py", folder / "model.py")
        shutil.copy(PEER_CODE / "workload.py", folder / "workload.py")
        implementation = f"model.{POOLSERVE_CLASSES[model]}"
        if spec.inline:  # runs in the pool server process, on its event loop: no worker hop
            write_model_settings(folder, model, implementation, ctx, {"inline_fast": True},
                                 parallel_workers=0)  # fmt: skip
        else:
            write_model_settings(folder, model, implementation, ctx)
    # max_message_size: its default. Every other setting at its default too: the
    # unread-reply budget lets perf_analyzer's 8 concurrent 9.2 MiB echoes on one
    # connection wait while it reads them (issue 28 §11), it no longer refuses them.
    limits = {"max_message_size": MESSAGE_LIMIT}
    write_json(repo / "settings.json", limits)
    run_dir = Path(os.environ.get("XDG_RUNTIME_DIR") or "/tmp") / f"psb-{os.getpid()}-{ctx.port}"
    argv = [str(POOLSERVE), "serve", str(repo), "--grpc-port", str(ctx.port), "--metrics-port", "0"]
    argv += ["--http-port", str(ctx.http_port)]  # 0: any free port (two trees at once)
    argv += ["--run-dir", str(run_dir), "--workers", str(spec.workers_for(ctx.layout))]
    if spec.routers != 1:
        argv += ["--routers", str(spec.routers)]
    return Launch(argv, ready_line="poolserve: ready", cleanup=(run_dir,))


# -- MLServer ---------------------------------------------------------------------

MLSERVER_CLASSES = {"echo": "EchoRuntime", "burn": "BurnRuntime", "big": "BigRuntime"}
MLSERVER_XGBOOST = "mlserver_xgboost.XGBoostModel"  # MLServer's own XGBoost runtime


def build_mlserver(spec: ServerSpec, ctx: Context) -> Launch:
    repo = ctx.workdir / "repo"
    repo.mkdir(parents=True)
    # Only the worker count and where to listen (loopback, free ports): defaults otherwise.
    write_json(
        repo / "settings.json",
        {
            "parallel_workers": spec.workers_for(ctx.layout),
            "host": "127.0.0.1",
            "grpc_port": ctx.port,
            "http_port": ctx.rest_port(),
            "metrics_port": free_port(),
            "debug": MLSERVER_DEBUG,
            "grpc_max_message_length": MESSAGE_LIMIT,
        },
    )
    for model in ctx.layout.models:
        if model == "xgb":  # MLServer's runtime, loading the model file from parameters.uri
            uri = str(ctx.workload.xgb_model)
            write_model_settings(repo / model, model, MLSERVER_XGBOOST, ctx, uri=uri)
            continue
        write_model_settings(repo / model, model, f"mlserver_models.{MLSERVER_CLASSES[model]}", ctx)
    python = ctx.venvs[spec.venv]
    argv = [str(python), str(PEER_CODE / "mlserver_addon.py"), "start", str(repo)]
    return Launch(argv, env={"PYTHONPATH": str(PEER_CODE)})


# -- KServe ------------------------------------------------------------------------

KSERVE_CLASSES = {
    "echo": "EchoModel",
    "burn": "BurnModel",
    "big": "BigModel",
    "xgb": "XGBoostModel",
}
KSERVE_ENV = {"KSERVE_LOGLEVEL": "WARNING"}  # KServe's own setting; INFO logs every request


def build_kserve(spec: ServerSpec, ctx: Context) -> Launch:
    """peers/kserve_server.py: the models as kserve.Model subclasses on kserve.ModelServer.

    Ports through KServe's own flags; one process (KServe's --workers adds REST
    processes only, so the layout's worker count does not apply). The launcher
    binds gRPC and REST to 127.0.0.1 and adds ModelConfig/ModelStatistics.
    """
    repo = ctx.workdir / "repo"
    for model in ctx.layout.models:
        write_model_settings(repo / model, model, f"kserve_server.{KSERVE_CLASSES[model]}", ctx)
    python = ctx.venvs[spec.venv]
    argv = [str(python), str(PEER_CODE / "kserve_server.py"), str(repo)]
    argv += ["--grpc_port", str(ctx.port), "--http_port", str(ctx.rest_port())]
    argv += ["--grpc_max_send_message_length", str(MESSAGE_LIMIT)]
    argv += ["--grpc_max_receive_message_length", str(MESSAGE_LIMIT)]
    return Launch(argv, env={"PYTHONPATH": str(PEER_CODE), **KSERVE_ENV})


# -- the bare grpc.aio server --------------------------------------------------------


def build_bare(spec: ServerSpec, ctx: Context) -> Launch:
    if not set(ctx.layout.models) <= {"echo", "burn"}:
        raise ValueError("the bare server serves echo and burn only")
    argv = [str(PROJECT_PYTHON), str(PEER_CODE / "bare_server.py"), "--port", str(ctx.port)]
    argv += ["--iterations", str(ctx.workload.iterations), "--counter", str(ctx.workload.counter)]
    argv += ["--max-message", str(MESSAGE_LIMIT)]
    if ctx.layout.shape:
        argv.append("--dims=" + ",".join(map(str, ctx.layout.shape)))
    return Launch(argv, env={"PYTHONPATH": str(PEER_CODE)}, ready_line="bare: ready")


def build_rest_floor(spec: ServerSpec, ctx: Context) -> Launch:
    """peers/rest_floor.py: one uvicorn process serving echo over REST only."""
    if set(ctx.layout.models) != {"echo"}:
        raise ValueError("the REST floor serves echo only")
    argv = [str(PROJECT_PYTHON), str(PEER_CODE / "rest_floor.py"), "--port", str(ctx.http_port)]
    if ctx.layout.shape:
        argv.append("--dims=" + ",".join(map(str, ctx.layout.shape)))
    return Launch(argv, env={"PYTHONPATH": str(PEER_CODE)}, ready_line="rest-floor: ready")


MLSERVER_NOTE = (
    "MLServer 1.7.1 defaults (Prometheus interceptor on) except parallel_workers, debug false (its "
    "default true adds an access-log interceptor to every call), grpc_max_message_length 64 MiB, "
    "loopback host and free ports; ModelConfig/ModelStatistics added by the bench"
)

KSERVE_NOTE = (
    "KServe 0.21.0 ModelServer defaults (one process) except KSERVE_LOGLEVEL=WARNING, 64 MiB "
    "gRPC message limits and free ports (--grpc_port, --http_port); bound to 127.0.0.1 by the "
    "bench's launcher (KServe binds [::]:PORT and has no host setting: the launcher rewrites "
    "the address passed to add_insecure_port, and uvicorn's REST host); "
    "ModelConfig/ModelStatistics added by the bench"
)
INLINE_NOTE = (
    'the same echo model with "parallel_workers": 0 and parameters.extra.inline_fast: true in its '
    "model-settings.json: it runs in the pool server process on its event loop; echo only"
)

SERVERS: tuple[ServerSpec, ...] = (
    ServerSpec("poolserve", "poolserve (2 workers)", 2, build_poolserve, models=WITH_XGB),
    ServerSpec(
        "poolserve-inline", "poolserve (echo inline, fast)", 0, build_poolserve, "",
        INLINE_NOTE, models=("echo",), inline=True,
    ),
    ServerSpec(
        "kserve", "KServe 0.21.0 (1 process)", 0, build_kserve, "kserve", KSERVE_NOTE,
        models=WITH_XGB,
    ),
    ServerSpec(
        "mlserver-2", "MLServer 1.7.1 (parallel_workers 2)", 2, build_mlserver, "mlserver",
        MLSERVER_NOTE, models=WITH_XGB,
    ),
    ServerSpec(
        "mlserver-0", "MLServer 1.7.1 (parallel_workers 0)", 0, build_mlserver, "mlserver",
        MLSERVER_NOTE,
    ),
    ServerSpec(
        "bare", "bare grpc.aio (1 process)", 0, build_bare, "",
        "the bench's own single-process grpc.aio server: the floor of one Python gRPC hop",
    ),
)  # fmt: skip
# Served in the REST part only (bench/rest.py): no gRPC port.
REST_FLOOR = ServerSpec(
    "rest-floor", "bare uvicorn echo (1 process)", 0, build_rest_floor, "",
    "the bench's own ASGI app on uvicorn (httptools, asyncio loop): decodes the JSON or binary "
    "body into an array and answers it; the floor of one Python HTTP hop", models=("echo",),
)  # fmt: skip
# Served in the router-fleet part only (bench/fleet.py): echo, two routers.
ROUTERS2 = ServerSpec(
    "poolserve-routers2", "poolserve (2 routers, 2 workers)", 2, build_poolserve, "",
    "poolserve with routers: 2 (two router processes on the same ports, SO_REUSEPORT)",
    models=("echo",), routers=2,
)  # fmt: skip
# Served in the response-cache part only (bench/cache.py): echo, and echo with its cache.
CACHE = ServerSpec(
    "poolserve-cache", "poolserve (2 workers, echo and echo_cached)", 2, build_poolserve, "",
    "poolserve with two copies of echo in one pool, one with parameters.extra.response_cache",
    models=("echo", "echo_cached"),
)  # fmt: skip
SUBJECT = "poolserve"
REFERENCE = "mlserver-2"  # the peer the targets compare against
KSERVE = "kserve"  # the single-process peer the light-model targets compare against
INLINE = "poolserve-inline"


def spec(key: str) -> ServerSpec:
    for s in (*SERVERS, REST_FLOOR, ROUTERS2, CACHE):
        if s.key == key:
            return s
    raise KeyError(key)


# -- running processes ----------------------------------------------------------------


def write_json(path: Path, data: object) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def children(pid: int) -> list[int]:
    kids: list[int] = []
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError):
                kids.extend(int(x) for x in (task / "children").read_text().split())
    return kids


def process_tree(root: int) -> list[int]:
    """``root`` (if alive) and all its descendants, from /proc."""
    found = [root] if Path(f"/proc/{root}").exists() else []
    stack = [root]
    while stack:
        for kid in children(stack.pop()):
            found.append(kid)
            stack.append(kid)
    return found


def pss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup", encoding="ascii") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return 0
    return 0


def cpu_seconds(pid: int) -> float:
    """utime + stime of one process (its own, not its reaped children's)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    fields = stat.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"


def machine_busy_seconds() -> float:
    """CPU seconds all cores spent busy since boot (everything but idle and iowait)."""
    ticks = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def start_time(pid: int) -> int:
    """The process's start time in clock ticks since boot (0 if gone or a zombie)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0
    return 0 if fields[0] == "Z" else int(fields[19])


@dataclass
class Running:
    spec: ServerSpec
    layout: Layout
    process: subprocess.Popen[bytes]
    port: int
    workdir: Path
    log: Path
    ready_line: str
    cleanup: tuple[Path, ...] = ()
    http_port: int = 0  # the REST port, when the bench chose it
    seen: dict[int, int] = field(default_factory=dict)  # PID -> start time, all ever seen

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def http_address(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    def tree(self) -> list[int]:
        pids = process_tree(self.process.pid)
        for pid in pids:
            self.seen.setdefault(pid, start_time(pid))
        return pids

    def pss(self) -> int:
        return sum(pss_bytes(p) for p in self.tree())

    def cpu(self) -> float:
        return sum(cpu_seconds(p) for p in self.tree())

    def cpu_by_process(self) -> dict[int, tuple[str, float]]:
        return {p: (comm(p), cpu_seconds(p)) for p in self.tree()}

    def pss_by_process(self) -> list[tuple[str, int]]:
        return [(comm(p), pss_bytes(p)) for p in self.tree()]


def start(spec: ServerSpec, ctx: Context) -> Running:
    ctx.workdir.mkdir(parents=True, exist_ok=True)
    launch = spec.build(spec, ctx)
    log = ctx.workdir / "server.log"
    env = {**os.environ, **launch.env}
    with open(log, "wb") as out:
        process = subprocess.Popen(
            launch.argv,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=ctx.workdir,
            env=env,
            start_new_session=True,
        )
    running = Running(
        spec,
        ctx.layout,
        process,
        ctx.port,
        ctx.workdir,
        log,
        launch.ready_line,
        launch.cleanup,
        ctx.http_port,
    )
    running.tree()
    return running


def wait_line(server: Running, timeout: float) -> None:
    """Waits for the server's ready line on stdout (if it prints one)."""
    if not server.ready_line:
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.ready_line.encode() in server.log.read_bytes():
            return
        if server.process.poll() is not None:
            break
        time.sleep(0.05)
    tail = server.log.read_text(errors="replace")[-2000:]
    raise RuntimeError(f"{server.spec.key} did not print its ready line:\n{tail}")


def stop(server: Running, grace: float = 15.0) -> None:
    """TERM to the root, then KILL, PID by PID, to everything of its tree still alive."""
    server.tree()
    if server.process.poll() is None:
        server.process.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            server.process.wait(grace)
    kill_pids(server.seen)
    with contextlib.suppress(subprocess.TimeoutExpired):
        server.process.wait(5)
    for folder in server.cleanup:
        shutil.rmtree(folder, ignore_errors=True)


def kill_pids(seen: Mapping[int, int]) -> None:
    """SIGKILL each PID still alive that is still the same process (same start time)."""
    for pid, started in sorted(seen.items()):
        if started and start_time(pid) == started:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
