"""``poolserve serve``: the root of the supervision tree.

    root (one_for_one)
     |- control               the control socket (status, reload, EnsurePool)
     |- pools (one_for_one)   pool:<gid> ... one process per gid, started first
     |- router                started once every pool reported ready
     `- systemd               READY=1 once the router serves; watchdog pings

Children start in that order, each after the previous one's readiness
handshake; they stop in reverse (the router drains first, the control socket
answers until the end). SIGHUP, like ``poolserve reload``, re-reads the
repository and settings and reconciles (:mod:`poolserve.supervisor.reconcile`).
This module knows processes and the command lines of pools and router, never
the inference protocol.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import signal
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from poolserve.service.contract.repository import scan
from poolserve.service.contract.rundir import (
    ADDRESS_FILE,
    RunDirLock,
    check_socket_paths,
    ensure_private_dir,
    sweep_stale_sockets,
)
from poolserve.service.contract.settings import (
    ConfigError,
    ServerSettings,
    load_server_settings,
    mlserver_notices,
)
from poolserve.service.lifecycle.exitcodes import EXIT_CONFIG, EXIT_OK, EXIT_UNRECOVERABLE
from poolserve.service.lifecycle.limits import raise_open_file_limit
from poolserve.service.lifecycle.logs import setup_logging
from poolserve.supervisor.announce import announce_serving, listening_line
from poolserve.supervisor.control import ControlService, push_routes
from poolserve.supervisor.events import (
    ChildExited,
    ChildReady,
    Event,
    EventHook,
    event_logger,
    fan_out,
)
from poolserve.supervisor.notify import SystemdNotifier, SystemdService
from poolserve.supervisor.process import ExitAction, process_child
from poolserve.supervisor.reaper import OrphanReaper, become_subreaper
from poolserve.supervisor.reconcile import (
    POOLS,
    ROUTER,
    ChildWatch,
    Desired,
    Reconciler,
    Routes,
    pool_child_id,
)
from poolserve.supervisor.spec import (
    ChildSpec,
    Restart,
    Service,
    Strategy,
    SupervisorSpec,
    Unrecoverable,
)
from poolserve.supervisor.tree import KILL_GRACE, Supervisor, run_root

log = logging.getLogger("poolserve.serve")

CONTROL_STOP_TIMEOUT = 5.0
ROUTER_PUSH_TIMEOUT = 30.0

# A pool started while the tree runs (reload, EnsurePool, a restart of the
# pools supervisor) that finds the configuration invalid fails alone: a bad
# edit of the repository must not stop a serving tree.
RUNTIME_POOL_EXIT_CODES: Mapping[int, ExitAction] = {
    EXIT_OK: None,
    EXIT_CONFIG: Unrecoverable,
    EXIT_UNRECOVERABLE: Unrecoverable,
}


def child_argv(command: str, repo: Path, flags: Mapping[str, object]) -> list[str]:
    """The command line of a pool or router child: same settings, same repository."""
    argv = [sys.executable, "-P", "-m", "poolserve.supervisor.cli", command, str(repo)]
    names = {"host": "--host", "grpc_port": "--grpc-port", "parallel_workers": "--workers"}
    names |= {"run_dir": "--run-dir", "log_format": "--log-format"}
    names |= {"metrics_port": "--metrics-port", "http_port": "--http-port"}
    for key, flag in names.items():
        value = flags.get(key)
        if value is not None:
            argv += [flag, str(value)]
    return argv


def watchdog_timeout(settings: ServerSettings) -> float:
    """How long a pool or the router may send no heartbeat before it is killed:
    the router calls a pool NOT_SERVING after heartbeat_timeout_s; the
    supervisor gives it watchdog_grace_s more to come back by itself."""
    return settings.heartbeat_timeout_s + settings.watchdog_grace_s


def _pools_budget(count: int, grace: float) -> float:
    # Pools stop one after another: the budget covers each one's drain.
    return count * (grace + KILL_GRACE) + 5


class ServeTree:
    """The tree ``poolserve serve`` runs, and the handles a reload needs
    (:class:`~poolserve.supervisor.reconcile.TreeOps`).

    Stop budgets are sized from the pools at start; a pool added later that
    ignores SIGTERM at shutdown may get SIGKILL without its full grace.
    """

    def __init__(
        self,
        repo: Path,
        flags: Mapping[str, object],
        desired: Desired,
        events: EventHook,
        *,
        control: Callable[[], Service] | None = None,
        notifier: SystemdNotifier | None = None,
    ) -> None:
        self.repo = repo
        self.flags = dict(flags)
        self._desired = desired
        self._events = events
        self._pools: Supervisor | None = None
        self._builds = 0
        settings = desired.settings
        grace = settings.stop_grace_s
        pools_budget = _pools_budget(len(desired.pools), grace) + 5
        notify = notifier or SystemdNotifier(None)
        children = [
            ChildSpec(
                POOLS, self._build_pools, restart=Restart.PERMANENT, stop_timeout=pools_budget
            ),
            self.router_spec(settings),
            # Last, so READY=1 reaches systemd only once the router serves.
            ChildSpec("systemd", lambda: SystemdService(notify)),
        ]
        if control is not None:
            children.insert(0, ChildSpec("control", control, stop_timeout=CONTROL_STOP_TIMEOUT))
        budget = pools_budget + grace + 2 * KILL_GRACE + CONTROL_STOP_TIMEOUT + 10
        spec = SupervisorSpec("root", strategy=Strategy.ONE_FOR_ONE, stop_timeout=budget)
        self._root = Supervisor(spec, children, events=events)

    # -- TreeOps ------------------------------------------------------------

    def root(self) -> Supervisor:
        return self._root

    def pools(self) -> Supervisor:
        if self._pools is None:
            raise RuntimeError("the pools supervisor has not started")
        return self._pools

    def pool_spec(self, gid: str, settings: ServerSettings) -> ChildSpec:
        return self._pool_child(gid, settings, RUNTIME_POOL_EXIT_CODES)

    def router_spec(self, settings: ServerSettings) -> ChildSpec:
        argv = child_argv(ROUTER, self.repo, self.flags)
        return process_child(
            ROUTER,
            argv,
            stop_timeout=settings.stop_grace_s,
            watchdog_timeout=watchdog_timeout(settings),
        )

    def use(self, desired: Desired) -> None:
        self._desired = desired

    # -- building -----------------------------------------------------------

    def _pool_child(
        self, gid: str, settings: ServerSettings, exit_codes: Mapping[int, ExitAction] | None
    ) -> ChildSpec:
        argv = [*child_argv("pool", self.repo, self.flags), "--gid", gid]
        grace = settings.stop_grace_s
        watchdog = watchdog_timeout(settings)
        if exit_codes is None:
            return process_child(
                pool_child_id(gid), argv, stop_timeout=grace, watchdog_timeout=watchdog
            )
        return process_child(
            pool_child_id(gid),
            argv,
            stop_timeout=grace,
            exit_codes=exit_codes,
            watchdog_timeout=watchdog,
        )

    def _build_pools(self) -> Service:
        settings = self._desired.settings
        # The first start keeps the rule "an invalid configuration stops the tree".
        codes = None if self._builds == 0 else RUNTIME_POOL_EXIT_CODES
        self._builds += 1
        specs = [self._pool_child(gid, settings, codes) for gid in self._desired.pools]
        budget = _pools_budget(len(specs), settings.stop_grace_s)
        self._pools = Supervisor(
            SupervisorSpec(POOLS, stop_timeout=budget), specs, events=self._events
        )
        return self._pools


def status_hook(notifier: SystemdNotifier) -> EventHook:
    """STATUS= lines for systemd as children become ready or exit."""

    def hook(event: Event) -> None:
        if not notifier.enabled:
            return
        if isinstance(event, ChildReady):
            notifier.status(f"{event.id} ready")
        elif isinstance(event, ChildExited) and not event.normal:
            notifier.status(f"{event.id} {event.outcome}")

    return hook


def run_serve(repo: Path, flags: Mapping[str, object]) -> int:
    # Resolved first: a reload scans the same paths, so unchanged models compare equal.
    repo = repo.resolve()
    try:
        settings = load_server_settings(repo, flags=flags)
        repository = scan(repo)
        if not repository.models and not repository.invalid:
            raise ConfigError(str(repo), "(repository)", "no model-settings.json found")
        if not repository.models:  # nothing could ever serve: no half-started tree
            reasons = "; ".join(bad.reason for bad in repository.invalid)
            raise ConfigError(str(repo), "(repository)", f"no valid model: {reasons}")
        run_dir = settings.resolved_run_dir()
        check_socket_paths(run_dir, repository.pools())
        ensure_private_dir(run_dir)
        # Before anything in run_dir is touched: it belongs to one live tree.
        lock = RunDirLock.take(run_dir)
    except ConfigError as exc:
        print(f"poolserve: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    with lock:
        setup_logging("supervisor", settings.log_format)
        for notice in mlserver_notices(repo):
            log.warning("MLServer setting: %s", notice)
        before, after = raise_open_file_limit()  # the children inherit it
        if after != before:
            log.info("open file limit raised from %d to %d (the hard limit)", before, after)
        removed = sweep_stale_sockets(run_dir)
        if removed:
            log.info("removed stale sockets of a tree gone: %s", ", ".join(removed))
        resolved = dict(flags)
        resolved["run_dir"] = str(run_dir)
        desired = Desired.from_repository(settings, repository)
        return asyncio.run(_serve(repo, desired, resolved, run_dir))


async def _serve(repo: Path, desired: Desired, flags: Mapping[str, object], run_dir: Path) -> int:
    become_subreaper()
    started_at = time.monotonic()
    settings = desired.settings
    notifier = SystemdNotifier.from_env()
    watch = ChildWatch()
    logger = event_logger(style="json" if settings.log_format == "json" else "text")
    events = fan_out(logger, watch, status_hook(notifier))
    ready_seen = False

    async def update_router(routes: Routes, generation: int) -> bool:
        return await push_routes(run_dir, routes, generation, ROUTER_PUSH_TIMEOUT)

    def control() -> Service:
        return ControlService(run_dir, tree.root, reconciler, started_at=started_at)

    tree = ServeTree(repo, flags, desired, events, control=control, notifier=notifier)
    reconciler = Reconciler(
        repo,
        flags,
        desired,
        tree,
        run_dir=run_dir,
        watch=watch,
        notifier=notifier,
        tree_ready=lambda: ready_seen,
        update_router=update_router,
    )

    address = ""
    listening = asyncio.Event()

    def model_count() -> int:
        return sum(len(models) for models in reconciler.current.pools.values())

    def ready() -> None:
        nonlocal ready_seen, address
        ready_seen = True
        address = (run_dir / ADDRESS_FILE).read_text().strip()
        print(listening_line(address, model_count()), flush=True)
        listening.set()

    loop = asyncio.get_running_loop()
    # The future is for RPC callers; a signal only asks.
    loop.add_signal_handler(signal.SIGHUP, functools.partial(_request_reload, reconciler))
    try:
        async with OrphanReaper(events=events), asyncio.TaskGroup() as tasks:
            announcer = tasks.create_task(
                announce_serving(run_dir, listening, lambda: address, model_count, notifier),
                name="announce",
            )
            code = await run_root(tree.root(), ready=ready)
            announcer.cancel()
    finally:
        loop.remove_signal_handler(signal.SIGHUP)
    log.info("stopped with exit code %d", code)
    return code


def _request_reload(reconciler: Reconciler) -> None:
    log.info("SIGHUP: reloading the repository and settings")
    reconciler.request_reload()
