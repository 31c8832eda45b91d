"""``poolserve status`` and ``poolserve reload``: the root's control socket
from the command line.

``status`` prints the supervision tree, like ``supervisorctl status`` but as
a tree: each node's state, pid, uptime and restarts; for pools their workers
(pid, state, requests served), models and memory (PSS of the pool server,
zygote and workers). ``--json`` prints the same as one JSON object.

Exit codes, LSB status style like supervisorctl's:

- status: 0 every node runs and every model is READY; 1 every node runs
  but some model is not READY (LOADING, UNAVAILABLE: a failed load; one
  unloaded on request does not count), a pool did not answer, or the
  repository has a model that cannot be served (an invalid
  model-settings.json, a name taken twice: listed after the tree); 3 some
  node does not run (starting, backoff, stopped, failed); 4 no supervisor
  answers on the socket (no tree runs with that run directory, or it runs
  under supervisord's flat layout, which has no supervisor: the one line on
  stderr says which).
- reload: 0 the tree converged; 1 the reload reported problems; 4 no
  supervisor answers on the socket.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from poolserve.service.contract.settings import ServerSettings

if TYPE_CHECKING:  # gRPC loads only when a command runs, not to build the parser
    from poolserve.protos import control_pb2 as cpb

EXIT_OK = 0
EXIT_RELOAD_PROBLEMS = 1
EXIT_MODELS_NOT_READY = 1  # status: every node runs, not every model is READY
EXIT_NOT_RUNNING = 3
EXIT_UNREACHABLE = 4

DEFAULT_STATUS_TIMEOUT = 30.0
DEFAULT_RELOAD_TIMEOUT = 300.0  # a reload waits for new pools to serve


def add_control_arguments(parser: argparse.ArgumentParser, timeout: float) -> None:
    parser.add_argument("--run-dir", help="the server's run directory (its control socket)")
    parser.add_argument(
        "--grpc-port",
        type=int,
        help="the server's port, to find its default run directory (default 8081)",
    )
    parser.add_argument("--timeout", type=float, default=timeout, help="seconds to wait")


def resolve_run_dir(
    run_dir: str | None, grpc_port: int | None, environ: Mapping[str, str] | None = None
) -> Path:
    """The run directory ``serve`` would use: flag, POOLSERVE_RUN_DIR, or the
    default derived from the port (flag, POOLSERVE_GRPC_PORT, 8081)."""
    env = os.environ if environ is None else environ
    explicit = run_dir or env.get("POOLSERVE_RUN_DIR")
    if explicit:
        return Path(explicit)
    port = default_grpc_port(env) if grpc_port is None else grpc_port
    return ServerSettings(grpc_port=port).resolved_run_dir()


def default_grpc_port(environ: Mapping[str, str]) -> int:
    """POOLSERVE_GRPC_PORT when it is a port number, else the default (8081)."""
    raw = environ.get("POOLSERVE_GRPC_PORT", "")
    return int(raw) if raw.isdigit() else ServerSettings.grpc_port


def status_main(args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    import grpc

    from poolserve.supervisor.control import fetch_tree_status, walk

    run_dir = resolve_run_dir(args.run_dir, args.grpc_port)
    try:
        status = asyncio.run(fetch_tree_status(run_dir, args.timeout))
    except grpc.RpcError as error:
        return _unreachable(run_dir, error)
    if args.json:
        document = tree_json(status.root)
        document["invalid_models"] = [
            {"name": bad.name, "reason": bad.reason} for bad in status.invalid
        ]
        json.dump(document, out, indent=2)
        out.write("\n")
    else:
        out.write(render_tree(status.root))
        out.write(invalid_text(status.invalid))
        out.write(ports_text(run_dir))
    if not all(node.state == "running" for node in walk(status.root)):
        return EXIT_NOT_RUNNING
    if status.invalid or not models_ready(status.root):
        return EXIT_MODELS_NOT_READY
    return EXIT_OK


def invalid_text(invalid: Iterable[cpb.InvalidModelRoute]) -> str:
    """The repository's models that cannot be served, each with its reason."""
    lines = [f"model {bad.name}  UNAVAILABLE  {bad.reason}\n" for bad in invalid]
    if not lines:
        return ""
    return "not served (fix the repository, then `poolserve reload`):\n" + "".join(
        "  " + line for line in lines
    )


def models_ready(root: cpb.TreeNode) -> bool:
    """Whether every pool of the tree said its models are READY (one unloaded
    on request aside): a pool that did not answer its status says nothing."""
    from poolserve.supervisor.control import pool_gid, walk

    for node in walk(root):
        if pool_gid(node) is None:
            continue
        if node.pool_error:
            return False
        if any(model.state not in ("READY", "UNLOADED") for model in node.pool.models):
            return False
    return True


def reload_main(args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    import grpc

    from poolserve.supervisor.control import request_reload

    run_dir = resolve_run_dir(args.run_dir, args.grpc_port)
    try:
        response = asyncio.run(request_reload(run_dir, args.timeout))
    except grpc.RpcError as error:
        return _unreachable(run_dir, error)
    if args.json:
        json.dump(reload_json(response), out, indent=2)
        out.write("\n")
    else:
        out.write(f"poolserve: reloaded: {response.summary}\n")
    return EXIT_OK if response.ok else EXIT_RELOAD_PROBLEMS


def ports_text(run_dir: Path) -> str:
    """Where the routers listen (gRPC, REST) and serve /metrics, from their address files."""
    from poolserve.service.contract.rundir import (
        ADDRESS_FILE,
        HTTP_ADDRESS_FILE,
        METRICS_ADDRESS_FILE,
    )

    lines = ""
    for name, template in (
        (ADDRESS_FILE, "grpc     {}"),
        (HTTP_ADDRESS_FILE, "rest     http://{}/v2"),
        (METRICS_ADDRESS_FILE, "metrics  http://{}/metrics"),
    ):
        with contextlib.suppress(OSError):  # not written: that port off, or no router yet
            lines += template.format((run_dir / name).read_text().strip()) + "\n"
    return lines


def _unreachable(run_dir: Path, error: Exception) -> int:
    import grpc

    details = error.details() if isinstance(error, grpc.aio.AioRpcError) else str(error)
    print(f"poolserve: {why_unreachable(run_dir, details or '')}", file=sys.stderr)
    return EXIT_UNREACHABLE


def why_unreachable(run_dir: Path, details: str) -> str:
    """One sentence on why no supervisor answered in ``run_dir``, and what to do."""
    from poolserve.service.contract.rundir import ADDRESS_FILE
    from poolserve.supervisor.control import control_socket_path

    socket = control_socket_path(run_dir)
    if socket.exists():
        return (
            f"a control socket exists at {socket} but no supervisor answers on it "
            f"({details}): the tree may be starting or stopping, or it died and left it"
        )
    if (run_dir / ADDRESS_FILE).exists():
        return (
            f"the tree in {run_dir} has no supervisor (no {socket.name}): it runs under "
            "supervisord's flat layout (poolserve supervisord-config), where "
            "`supervisorctl status` shows its programs and "
            f"`poolserve probe --run-dir {run_dir}` its health"
        )
    return (
        f"no poolserve tree is running with run directory {run_dir} (no {socket.name}); "
        "start one with `poolserve serve REPO`, or name another with --run-dir or --grpc-port"
    )


# -- JSON -------------------------------------------------------------------------


def tree_json(node: cpb.TreeNode) -> dict[str, Any]:
    return {
        "id": node.id,
        "pid": node.pid or None,
        "state": node.state,
        "uptime_s": round(node.uptime_s, 3),
        "restarts": node.restarts,
        "last_exit": node.last_exit or None,
        "pool": pool_json(node.pool) if node.HasField("pool") else None,
        "pool_error": node.pool_error or None,
        "children": [tree_json(child) for child in node.children],
    }


def pool_json(pool: cpb.PoolStatus) -> dict[str, Any]:
    return {
        "gid": pool.gid,
        "pid": pool.pid,
        "zygote_pid": pool.zygote_pid,
        "queue_depth": pool.queue_depth,
        "pss_bytes": pool.pss_bytes,
        "late_replies_dropped": pool.late_replies_dropped,
        "workers": [
            {
                "pid": worker.pid,
                "state": worker.state,
                "requests_served": worker.requests_served,
                "restarts": worker.restarts,
            }
            for worker in pool.workers
        ],
        "models": [
            {
                "name": model.name,
                "version": model.version,
                "state": model.state,
                "reason": model.reason,
            }
            for model in pool.models
        ],
    }


def reload_json(response: cpb.ReloadResponse) -> dict[str, Any]:
    return {
        "ok": response.ok,
        "summary": response.summary,
        "started": list(response.started),
        "stopped": list(response.stopped),
        "updated": list(response.updated),
        "restarted": list(response.restarted),
        "router_updated": response.router_updated,
        "failures": list(response.failures),
    }


# -- text ---------------------------------------------------------------------------


def render_tree(root: cpb.TreeNode) -> str:
    """The tree as aligned text, one node per line::

    root              running  pid 4100  uptime 0:12:03  restarts 0
    ├── control       running            uptime 0:12:03  restarts 0
    ├── pools         running            uptime 0:12:03  restarts 0
    │   └── pool:a    running  pid 4102  uptime 0:12:02  restarts 0  pss 41.2 MiB ...
    │       ├── worker 4110  idle  served 1024
    """
    rows = list(_rows(root, "", ""))
    width = max(len(label) for label, _ in rows)
    return "".join(f"{label.ljust(width)}  {text}".rstrip() + "\n" for label, text in rows)


def _rows(node: cpb.TreeNode, lead: str, indent: str) -> Iterator[tuple[str, str]]:
    yield lead + node.id, _node_text(node)
    leaves: list[tuple[str, str]] = []
    if node.HasField("pool"):
        pool = node.pool
        leaves += [
            (f"worker {w.pid}", f"{w.state:<8} served {w.requests_served}") for w in pool.workers
        ]
        leaves += [
            (f"model {m.name}:{m.version}" if m.version else f"model {m.name}", _model_text(m))
            for m in pool.models
        ]
    total = len(leaves) + len(node.children)
    index = 0
    for label, text in leaves:
        index += 1
        branch, _ = _branch(index == total)
        yield indent + branch + label, text
    for child in node.children:
        index += 1
        branch, more = _branch(index == total)
        yield from _rows(child, indent + branch, indent + more)


def _branch(last: bool) -> tuple[str, str]:
    return ("└── ", "    ") if last else ("├── ", "│   ")


def _node_text(node: cpb.TreeNode) -> str:
    pid = f"pid {node.pid}" if node.pid else ""
    uptime = f"uptime {format_uptime(node.uptime_s)}" if node.uptime_s else ""
    parts = [f"{node.state:<8}", f"{pid:<10}", f"{uptime:<17}", f"restarts {node.restarts}"]
    if node.HasField("pool"):
        pool = node.pool
        parts.append(
            f"pss {format_bytes(pool.pss_bytes)}  queue {pool.queue_depth}"
            f"  zygote {pool.zygote_pid}"
        )
    if node.pool_error:
        parts.append(f"pool status: {node.pool_error}")
    if node.last_exit and node.state != "running":
        parts.append(f"last exit: {node.last_exit}")
    return "  ".join(parts)


def _model_text(model: cpb.ModelState) -> str:
    return f"{model.state}  {model.reason}" if model.reason else model.state


def format_uptime(seconds: float) -> str:
    """``H:MM:SS``, with days in front past one day (like supervisorctl)."""
    whole = int(seconds)
    days, rest = divmod(whole, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    clock = f"{hours}:{minutes:02d}:{secs:02d}"
    if days:
        return f"{days} day{'s' if days > 1 else ''}, {clock}"
    return clock


def format_bytes(count: int) -> str:
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
