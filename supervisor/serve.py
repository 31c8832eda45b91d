"""``poolserve serve``: the root of the supervision tree.

    root (one_for_one)
     |- pools (one_for_one)   pool:<gid> ... one process per gid, started first
     `- router                started once every pool reported ready

Children start in that order, each after the previous one's readiness
handshake; they stop in reverse (the router drains first). This module knows
processes and the command lines of pools and router, never the inference
protocol.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Callable, Mapping
from pathlib import Path

from poolserve.service.entrypoints import ensure_private_dir, setup_logging
from poolserve.service.repository import scan
from poolserve.service.router import ADDRESS_FILE
from poolserve.service.settings import ConfigError, ServerSettings, load_server_settings
from poolserve.supervisor.events import Event, event_logger
from poolserve.supervisor.exitcodes import EXIT_CONFIG
from poolserve.supervisor.notify import SystemdNotifier, SystemdService
from poolserve.supervisor.process import process_child
from poolserve.supervisor.reaper import OrphanReaper, become_subreaper
from poolserve.supervisor.spec import ChildSpec, Restart, Service, Strategy, SupervisorSpec
from poolserve.supervisor.tree import KILL_GRACE, Supervisor, run_root

log = logging.getLogger("poolserve.serve")


def child_argv(command: str, repo: Path, flags: Mapping[str, object]) -> list[str]:
    """The command line of a pool or router child: same settings, same repository."""
    argv = [sys.executable, "-P", "-m", "poolserve.supervisor.cli", command, str(repo)]
    names = {"host": "--host", "grpc_port": "--grpc-port", "parallel_workers": "--workers"}
    names |= {"run_dir": "--run-dir", "log_format": "--log-format"}
    for key, flag in names.items():
        value = flags.get(key)
        if value is not None:
            argv += [flag, str(value)]
    return argv


def build_tree(
    repo: Path,
    settings: ServerSettings,
    flags: Mapping[str, object],
    events: Callable[[Event], None],
) -> Supervisor:
    grace = settings.stop_grace_s
    gids = list(scan(repo).pools())

    def pools() -> Service:
        specs = [
            process_child(
                f"pool:{gid}", [*child_argv("pool", repo, flags), "--gid", gid], stop_timeout=grace
            )
            for gid in gids
        ]
        # Pools stop one after another: the budget covers each one's drain.
        budget = len(specs) * (grace + KILL_GRACE) + 5
        return Supervisor(SupervisorSpec("pools", stop_timeout=budget), specs, events=events)

    pools_budget = len(gids) * (grace + KILL_GRACE) + 10
    children = [
        ChildSpec("pools", pools, restart=Restart.PERMANENT, stop_timeout=pools_budget),
        process_child("router", child_argv("router", repo, flags), stop_timeout=grace),
        # Last, so READY=1 reaches systemd only once the router serves.
        ChildSpec("systemd", lambda: SystemdService(SystemdNotifier.from_env())),
    ]
    root_budget = pools_budget + grace + 2 * KILL_GRACE + 10
    spec = SupervisorSpec("root", strategy=Strategy.ONE_FOR_ONE, stop_timeout=root_budget)
    return Supervisor(spec, children, events=events)


def run_serve(repo: Path, flags: Mapping[str, object]) -> int:
    try:
        settings = load_server_settings(repo, flags=flags)
        repository = scan(repo)
        if not repository.models and not repository.invalid:
            raise ConfigError(str(repo), "(repository)", "no model-settings.json found")
        run_dir = settings.resolved_run_dir()
        ensure_private_dir(run_dir)
    except ConfigError as exc:
        print(f"poolserve: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    setup_logging("supervisor", settings.log_format)
    resolved = dict(flags)
    resolved["run_dir"] = str(run_dir)
    return asyncio.run(_serve(repo.resolve(), settings, resolved, run_dir))


async def _serve(
    repo: Path, settings: ServerSettings, flags: Mapping[str, object], run_dir: Path
) -> int:
    become_subreaper()
    events = event_logger(style="json" if settings.log_format == "json" else "text")
    root = build_tree(repo, settings, flags, events)

    def ready() -> None:
        address = (run_dir / ADDRESS_FILE).read_text().strip()
        print(f"poolserve: ready, serving on {address}", flush=True)

    async with OrphanReaper(events=events):
        code = await run_root(root, ready=ready)
    log.info("stopped with exit code %d", code)
    return code
