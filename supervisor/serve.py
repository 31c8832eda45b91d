"""``poolserve serve``: the root of the supervision tree.

    root (one_for_one)
     |- control               the control socket (status, reload, EnsurePool)
     |- pools (one_for_one)   pool:<gid> ... one process per gid, started first
     |- router                started once every pool reported ready; with
     |                        routers N > 1: router-0 ... router-<N-1>, one
     |                        after another, sharing the ports (fleet.py)
     `- systemd               READY=1 once every router serves; watchdog pings

Children start in that order, each after the previous one's readiness
handshake; they stop in reverse (the router drains first, the control socket
answers until the end). SIGHUP, like ``poolserve reload``, re-reads the
repository and settings and reconciles (:mod:`poolserve.supervisor.reconcile`).
This module knows processes and the command lines of pools and router, never
the inference protocol.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import json
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Collection, Iterable, Mapping
from pathlib import Path
from typing import Any

from poolserve.service.contract.repository import scan
from poolserve.service.contract.rundir import (
    ADDRESS_FILE,
    HTTP_ADDRESS_FILE,
    METRICS_ADDRESS_FILE,
    SHM_REGISTRY_FILE,
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
    router_count,
)
from poolserve.service.lifecycle.cpus import usable_cores
from poolserve.service.lifecycle.exitcodes import EXIT_CONFIG, EXIT_OK, EXIT_UNRECOVERABLE
from poolserve.service.lifecycle.limits import raise_open_file_limit
from poolserve.service.lifecycle.logs import setup_logging, wrap_line
from poolserve.supervisor.announce import announce_serving, listening_line
from poolserve.supervisor.control import ControlService, push_fleet_routes
from poolserve.supervisor.events import (
    ChildExited,
    ChildReady,
    Event,
    EventHook,
    event_logger,
    fan_out,
)
from poolserve.supervisor.fleet import PortHold, hold_shared_ports
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
    router_child_id,
)
from poolserve.supervisor.relay import LineSink, json_sink
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


def early_error(text: str, flags: Mapping[str, object]) -> str:
    """An error from before logging is set up: one JSON object when json was
    asked for (by the flag or POOLSERVE_LOG_FORMAT; settings.json may be the
    broken part), else the text as it is."""
    wanted = flags.get("log_format") or os.environ.get("POOLSERVE_LOG_FORMAT")
    if wanted != "json":
        return text
    record = json.loads(wrap_line(text, "supervisor", os.getpid()))
    record.update(level="ERROR", logger="poolserve.serve")
    del record["raw"]
    return json.dumps(record)


# The router's HTTP ports: (setting, flag, what listens there, what -1 turns off).
HTTP_PORTS = (
    ("metrics_port", "--metrics-port", "the router's /metrics", "no /metrics"),
    ("http_port", "--http-port", "the router's REST door", "no REST door"),
)


def check_http_ports(settings: ServerSettings, given: Collection[str]) -> None:
    """:func:`check_host`, then :func:`check_port` for each of the router's HTTP
    ports, and for its gRPC port when one router runs (a fleet holds its ports: fleet.py)."""
    check_host(settings, "--host" if "host" in given else "settings")
    ports = list(HTTP_PORTS)
    if router_count(settings, usable_cores()) == 1:
        ports.insert(0, ("grpc_port", "--grpc-port", "the router's gRPC port", ""))
    for field, flag, what, off in ports:
        source = flag if field in given else "settings"
        check_port(settings, field, flag, what, off, source)


def check_host(settings: ServerSettings, source: str) -> None:
    """``host`` resolves to addresses of this machine, or it is a configuration
    error (exit 2) naming ``host``, before any process starts (the router named
    the port it could not bind, after the pools had loaded)."""
    try:
        addresses = socket.getaddrinfo(
            settings.host or None, 0, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise ConfigError(source, "host", f"cannot resolve {settings.host!r}: {reason}") from None
    refused: list[str] = []
    for family, kind, proto, _, address in addresses:
        try:
            _probe_bind(family, kind, proto, address)
            return  # the router listens on the addresses it can bind, at least this one
        except OSError as exc:
            refused.append(f"{address[0]}: {exc.strerror}")
    raise ConfigError(
        source,
        "host",
        f"{settings.host!r} is no address of this machine ({'; '.join(refused)}); "
        "127.0.0.1 for this machine only, 0.0.0.0 for every interface",
    )


def check_port(
    settings: ServerSettings, field: str, flag: str, what: str, off: str, source: str
) -> None:
    """Binds each address ``what`` would listen on (the port of setting ``field``),
    and lets go: a port in use is a configuration error (exit 2) before any
    process starts. Another program may still take the port between this
    check and the router's bind; the router then exits 2 as before. Port 0
    (any free port) and -1 (off) cannot clash."""
    port = int(getattr(settings, field))
    if port <= 0:
        return
    try:
        addresses = socket.getaddrinfo(
            settings.host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except OSError:
        return  # check_host said so already
    for family, kind, proto, _, address in addresses:
        try:
            _probe_bind(family, kind, proto, address)
        except OSError as exc:
            if exc.errno not in (errno.EADDRINUSE, errno.EACCES):
                continue  # e.g. no IPv6 here: the router skips that address too
            raise ConfigError(
                source,
                field,
                f"{what} cannot listen on {_host_port(address)}: "
                f"{exc.strerror} (another tree? each tree needs its own: "
                f"set {flag} / {field} / POOLSERVE_{field.upper()} to a "
                f"free port, 0 for any free port{f', -1 for {off}' if off else ''})",
            ) from None


def _probe_bind(family: int, kind: int, proto: int, address: tuple[Any, ...]) -> None:
    with socket.socket(family, kind, proto) as probe:
        # As asyncio.start_server binds: SO_REUSEADDR, IPv6 sockets v6 only.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        probe.bind(address)


def _host_port(address: tuple[Any, ...]) -> str:
    host, port = address[0], address[1]
    return f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}"


# A pool's workers x threads_per_worker above this many per usable core is
# warned about. Up to a few per core is a trade people make on purpose (workers
# waiting on I/O or idle between calls, a BLAS call's threads short-lived; the
# default 2 workers x 1 thread on a one-core container is 2 per core). Beyond
# 4, whenever the pool is busy every core is shared by more threads than it
# can run, and OpenMP's threads spin-wait for one another: throughput falls and
# latency grows. That is a mistake far more often than a choice.
THREADS_PER_CORE_WARNING = 4


def warn_oversubscribed(
    settings: ServerSettings, gids: Iterable[str], cores: int | None = None
) -> list[str]:
    """Logs a warning for each pool whose workers x threads_per_worker exceeds
    :data:`THREADS_PER_CORE_WARNING` per usable core (pools with one thread
    per worker are left alone: their count is the workers setting, not this
    one). Returns the warnings."""
    cores = cores or usable_cores()
    warnings: list[str] = []
    for gid in sorted(gids):
        threads = settings.threads_for(gid)
        workers = max(settings.workers_for(gid), 1)  # 0: the models run in the pool itself
        total = workers * threads
        if threads <= 1 or total <= THREADS_PER_CORE_WARNING * cores:
            continue
        text = (
            f"threads_per_worker {threads} in pool {gid!r}: {workers} worker(s) x {threads} "
            f"threads = {total} native threads on {cores} usable core(s) "
            "(affinity, cgroup CPU quota), "
            f"more than {THREADS_PER_CORE_WARNING} per core: when the pool is busy they "
            "fight for the cores (OpenMP threads spin-wait); workers x threads_per_worker "
            "<= cores is the rule of thumb"
        )
        log.warning(
            "%s",
            text,
            extra={"setting": "threads_per_worker", "pool": gid, "threads": total, "cores": cores},
        )
        warnings.append(text)
    return warnings


def child_output(child_id: str, settings: ServerSettings) -> LineSink | None:
    """With log_format json a child's stdout and stderr are relayed, each line
    one JSON object (:mod:`poolserve.supervisor.relay`); with text they are the
    supervisor's own."""
    return json_sink(child_id) if settings.log_format == "json" else None


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
        self.routers = router_count(
            settings, usable_cores()
        )  # fixed for the tree's life (FIXED_SETTINGS)
        children = [
            ChildSpec(
                POOLS, self._build_pools, restart=Restart.PERMANENT, stop_timeout=pools_budget
            ),
            *self.router_specs(settings),
        ]
        if notify.enabled:  # started by systemd (NOTIFY_SOCKET): nothing to tell otherwise
            # Last, so READY=1 reaches systemd only once every router serves.
            children.append(ChildSpec("systemd", lambda: SystemdService(notify)))
        if control is not None:
            children.insert(0, ChildSpec("control", control, stop_timeout=CONTROL_STOP_TIMEOUT))
        routers_budget = self.routers * (grace + KILL_GRACE)  # drained one after another
        budget = pools_budget + routers_budget + KILL_GRACE + CONTROL_STOP_TIMEOUT + 10
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

    def router_specs(self, settings: ServerSettings) -> list[ChildSpec]:
        return [self._router_child(index, settings) for index in range(self.routers)]

    def _router_child(self, index: int, settings: ServerSettings) -> ChildSpec:
        child = router_child_id(index, self.routers)
        argv = child_argv(ROUTER, self.repo, self.flags)
        argv += ["--routers", str(self.routers), "--router-index", str(index)]
        return process_child(
            child,
            argv,
            stop_timeout=settings.stop_grace_s,
            watchdog_timeout=watchdog_timeout(settings),
            output=child_output(child, settings),
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
        output = child_output(pool_child_id(gid), settings)
        if exit_codes is None:
            return process_child(
                pool_child_id(gid),
                argv,
                stop_timeout=grace,
                watchdog_timeout=watchdog,
                output=output,
            )
        return process_child(
            pool_child_id(gid),
            argv,
            stop_timeout=grace,
            exit_codes=exit_codes,
            watchdog_timeout=watchdog,
            output=output,
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
    given = {name for name, value in flags.items() if value is not None}
    try:
        settings = load_server_settings(repo, flags=flags)
        repository = scan(repo)
        if not repository.models and not repository.invalid:
            raise ConfigError(str(repo), "(repository)", "no model-settings.json found")
        if not repository.models:  # nothing could ever serve: no half-started tree
            reasons = "; ".join(bad.reason for bad in repository.invalid)
            raise ConfigError(str(repo), "(repository)", f"no valid model: {reasons}")
        run_dir = settings.resolved_run_dir()
        routers = router_count(settings, usable_cores())
        check_socket_paths(run_dir, repository.pools(), routers)
        # Before run_dir and any pool: a second tree with the same metrics or
        # REST port (the defaults with another --grpc-port) fails now, not after
        # its pools loaded. A tree that holds this run_dir is named below instead.
        held = RunDirLock.held(run_dir)
        if not held:
            check_http_ports(settings, given)
        # A fleet's shared ports: checked and held for the tree's life.
        ports = hold_shared_ports(settings, given) if routers > 1 and not held else PortHold()
        ensure_private_dir(run_dir)
        # Before anything in run_dir is touched: it belongs to one live tree.
        lock = RunDirLock.take(run_dir)
    except ConfigError as exc:
        print(early_error(f"poolserve: {exc}", flags), file=sys.stderr)
        return EXIT_CONFIG
    with lock, ports:
        setup_logging("supervisor", settings.log_format, relay="thread")
        for notice in mlserver_notices(repo):
            log.warning("MLServer setting: %s", notice)
        for bad in repository.invalid:  # served by nobody, and the server never ready
            log.error("model %s is not served: %s", bad.name, bad.reason)
        before, after = raise_open_file_limit()  # the children inherit it
        if after != before:
            log.info("open file limit raised from %d to %d (the hard limit)", before, after)
        removed = sweep_stale_sockets(run_dir)
        if removed:
            log.info("removed stale sockets of a tree gone: %s", ", ".join(removed))
        remove_shm_registry(run_dir)  # a fleet's registrations never outlive their tree
        resolved = dict(flags)
        resolved["run_dir"] = str(run_dir)
        resolved.update(ports.ports)  # port 0 resolved once: every router binds the same
        desired = Desired.from_repository(settings, repository)
        warn_oversubscribed(settings, desired.pools)
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
        return await push_fleet_routes(
            run_dir, tree.routers, routes, generation, ROUTER_PUSH_TIMEOUT
        )

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

    def model_count() -> int:  # a model in several versions counts once
        return len({m.name for models in reconciler.current.pools.values() for m in models})

    def ready() -> None:
        nonlocal ready_seen, address
        ready_seen = True
        address = (run_dir / ADDRESS_FILE).read_text().strip()
        invalid = len(reconciler.current.invalid)
        print(listening_line(address, model_count(), invalid), flush=True)
        listening.set()

    loop = asyncio.get_running_loop()
    # The future is for RPC callers; a signal only asks.
    loop.add_signal_handler(signal.SIGHUP, functools.partial(_request_reload, reconciler))
    try:
        async with OrphanReaper(events=events), asyncio.TaskGroup() as tasks:
            announcer = tasks.create_task(
                announce_serving(
                    run_dir, listening, lambda: address, model_count, notifier, tree.routers
                ),
                name="announce",
            )
            code = await run_root(tree.root(), ready=ready)
            announcer.cancel()
    finally:
        loop.remove_signal_handler(signal.SIGHUP)
        # Every child has exited: what they did not remove (a fleet's shared files, or
        # a forced stop's leftovers) is stale now. The run dir's lock is still ours.
        for name in (ADDRESS_FILE, HTTP_ADDRESS_FILE, METRICS_ADDRESS_FILE):
            (run_dir / name).unlink(missing_ok=True)
        removed = sweep_stale_sockets(run_dir)
        if removed:
            log.info("removed the sockets a forced stop left: %s", ", ".join(removed))
        if tree.routers > 1:
            remove_shm_registry(run_dir)
    log.info("stopped with exit code %d", code)
    return code


def remove_shm_registry(run_dir: Path) -> None:
    """The fleet's shared-memory store (grpcserver/shm_store.py) and its lock file."""
    path = run_dir / SHM_REGISTRY_FILE
    for stale in (path, path.with_suffix(".lock")):
        stale.unlink(missing_ok=True)


def _request_reload(reconciler: Reconciler) -> None:
    log.info("SIGHUP: reloading the repository and settings")
    reconciler.request_reload()
