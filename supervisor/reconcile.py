"""Reload: re-read the repository and settings, and bring the running tree in
line with them, changing as little as possible.

- :class:`Desired` is what the tree should run: the settings and the models
  of each pool gid. :func:`plan_reload` compares two of them (pure, tested
  without processes) and says which pools start, stop, restart (their
  settings changed) or load and unload models live, and whether the router
  needs the new routes or a restart.
- :class:`Reconciler` carries a plan out on the live tree, one operation at a
  time (reloads and :meth:`Reconciler.ensure_pool` share one lock), in an
  order that never routes a request to a pool that is not there: new pools
  start and serve first, then pools load and unload models, then the router
  learns the routes, and only then do the pools nobody routes to stop.
- :class:`ChildWatch` turns the tree's events into "child X is ready"
  futures, the readiness handshake a reload waits on (never a sleep).

A reload never takes the tree down: an invalid configuration is reported and
the tree keeps running as it was; a pool started by a reload that exits with
the "invalid configuration" code fails alone (it does not stop the tree). A
pool that had failed for good (a model that could not load) is started again
by the next reload, since the repository may have been fixed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Protocol

import grpc

from poolserve.protos import inference_pb2 as pb
from poolserve.service.contract.repository import (
    Fingerprint,
    InvalidModel,
    ModelSettings,
    Repository,
    fingerprint,
    scan,
)
from poolserve.service.contract.rundir import pool_socket_path
from poolserve.service.contract.settings import SAFE_ID, ServerSettings, load_server_settings
from poolserve.service.grpcserver.handlers import SERVICE
from poolserve.supervisor.events import ChildExited, ChildReady, ChildStarted, Event
from poolserve.supervisor.notify import SystemdNotifier
from poolserve.supervisor.spec import ChildSpec, ChildState
from poolserve.supervisor.tree import Supervisor

log = logging.getLogger(__name__)

POOLS = "pools"  # id of the supervisor of the pool servers
ROUTER = "router"  # id of the router child of the root
ROOT = "root"

# The settings each kind of child reads. A change in one of them restarts
# that child on reload (settings are read at start-up). Every field of
# ServerSettings is in one of these tuples (a test checks it).
POOL_SETTINGS = (
    "max_queue",
    "max_message_size",
    "default_timeout_s",
    "deadline_margin_ms",
    "stop_grace_s",
    "log_format",
    "heartbeat_interval_s",
    "heartbeat_timeout_s",
    "reject_hopeless",
    "server_name",
    "watchdog_grace_s",
    "repository_rescan_s",
    "warmup_timeout_s",
    "abandon_grace_s",
    "shm_max_regions",  # a pool's own registry (its private socket)
    "shm_max_name_length",
    "slab_mapped_bytes",
    "response_cache_bytes",  # each pool server's response cache
    "response_cache_entries",
    "stream_messages",
)
ROUTER_SETTINGS = (
    "host",
    "stream_messages",
    "grpc_engine",
    "grpc_port",
    "metrics_port",
    "http_port",
    "http_max_header_bytes",
    "http_keepalive_timeout_s",
    "http_max_connections",
    "max_message_size",
    "default_timeout_s",
    "deadline_margin_ms",
    "stop_grace_s",
    "log_format",
    "model_control",
    "server_name",
    "tls_cert_file",
    "tls_key_file",
    "tls_client_ca_file",
    "max_concurrent_streams",
    "heartbeat_interval_s",
    "heartbeat_timeout_s",
    "watchdog_grace_s",
    "handshake_timeout_s",
    "max_connection_idle_s",
    "keepalive_time_s",
    "keepalive_timeout_s",
    "max_connection_age_s",
    "max_connection_age_grace_s",
    "max_unread_reply_bytes",
    "max_unread_reply_bytes_total",
    "max_request_bytes_held",
    "max_request_bytes_held_total",
    "stream_stall_s",
    "unread_reply_grace_s",
    "repository_rescan_s",
    "shm_max_regions",
    "shm_max_name_length",
)
# compared through workers_for(gid), threads_for(gid), start_method_for(gid) and
# unary_workers_for(gid)
PER_POOL_SETTINGS = (
    "parallel_workers",
    "pools",
    "threads_per_worker",
    "start_method",
    "unary_workers",
)
# given to every child on its command line, or fixing the tree's shape: never reloaded
FIXED_SETTINGS = ("run_dir", "routers")


def pool_child_id(gid: str) -> str:
    return f"pool:{gid}"


def router_child_id(index: int, count: int) -> str:
    """``router`` for the one router of a tree, ``router-<index>`` in a fleet."""
    return ROUTER if count == 1 else f"{ROUTER}-{index}"


# -- what should run ------------------------------------------------------------


@dataclass(frozen=True)
class Desired:
    """What the tree should run: settings, and each pool gid's models."""

    settings: ServerSettings
    pools: Mapping[str, tuple[ModelSettings, ...]]
    invalid: tuple[InvalidModel, ...] = ()
    # what each model's folder holds (by ModelSettings.key): a reload loads a
    # model again when its files changed, its code, say, not only its settings
    files: Mapping[str, Fingerprint | None] = field(default_factory=dict)

    @classmethod
    def from_repository(cls, settings: ServerSettings, repository: Repository) -> Desired:
        pools = {gid: tuple(models) for gid, models in repository.pools().items()}
        files = {model.key: fingerprint(model) for model in repository.models}
        return cls(settings, pools, repository.invalid, files)

    @classmethod
    def load(cls, repo: Path, flags: Mapping[str, object]) -> Desired:
        """Reads settings and repository from disk; raises ConfigError."""
        settings = load_server_settings(repo, flags=flags)
        return cls.from_repository(settings, scan(repo))

    def with_pool(self, gid: str, models: Sequence[ModelSettings]) -> Desired:
        return replace(self, pools={**self.pools, gid: tuple(models)})


@dataclass(frozen=True)
class Routes:
    """What the router needs to know: each pool's models, and the invalid ones."""

    pools: Mapping[str, tuple[str, ...]]
    invalid: Mapping[str, str]

    @classmethod
    def of(cls, desired: Desired) -> Routes:
        return cls(
            {  # a model's versions are one name
                gid: tuple(dict.fromkeys(m.name for m in models))
                for gid, models in desired.pools.items()
            },
            {bad.name: bad.reason for bad in desired.invalid},
        )


@dataclass(frozen=True)
class PoolModelChange:
    """The models one running pool must load or unload to match the repository.

    ``load`` names models that are new in the pool or whose settings changed
    (a load of a loaded model replaces it); ``unload`` names models gone from
    the pool. ``models`` is the pool's whole new model list.
    """

    gid: str
    load: tuple[str, ...]
    unload: tuple[str, ...]
    models: tuple[ModelSettings, ...]


@dataclass(frozen=True)
class ReloadPlan:
    start: tuple[str, ...] = ()  # gids of new pools
    stop: tuple[str, ...] = ()  # gids no model uses any more
    restart: tuple[str, ...] = ()  # gids whose pool settings changed
    models: tuple[PoolModelChange, ...] = ()
    routes_changed: bool = False
    restart_router: bool = False  # the router's own settings changed

    @property
    def empty(self) -> bool:
        return not (
            self.start
            or self.stop
            or self.restart
            or self.models
            or self.routes_changed
            or self.restart_router
        )


def plan_reload(current: Desired, wanted: Desired) -> ReloadPlan:
    """What it takes to go from ``current`` to ``wanted``; pure."""
    start = tuple(gid for gid in wanted.pools if gid not in current.pools)
    stop = tuple(gid for gid in current.pools if gid not in wanted.pools)
    kept = [gid for gid in wanted.pools if gid in current.pools]
    restart = tuple(
        gid for gid in kept if _pool_view(current.settings, gid) != _pool_view(wanted.settings, gid)
    )
    models = tuple(
        change
        for gid in kept
        if gid not in restart
        for change in [
            _model_change(gid, current.pools[gid], wanted.pools[gid], current.files, wanted.files)
        ]
        if change.load or change.unload
    )
    return ReloadPlan(
        start=start,
        stop=stop,
        restart=restart,
        models=models,
        routes_changed=Routes.of(current) != Routes.of(wanted),
        restart_router=_view(current.settings, ROUTER_SETTINGS)
        != _view(wanted.settings, ROUTER_SETTINGS),
    )


def _view(settings: ServerSettings, names: Sequence[str]) -> tuple[object, ...]:
    return tuple(getattr(settings, name) for name in names)


def _pool_view(settings: ServerSettings, gid: str) -> tuple[object, ...]:
    workers, threads = settings.workers_for(gid), settings.threads_for(gid)
    method, unary = settings.start_method_for(gid), settings.unary_workers_for(gid)
    return (workers, threads, method, unary, *_view(settings, POOL_SETTINGS))


def _model_change(
    gid: str,
    before: Sequence[ModelSettings],
    after: Sequence[ModelSettings],
    files_before: Mapping[str, Fingerprint | None],
    files_after: Mapping[str, Fingerprint | None],
) -> PoolModelChange:
    old = _by_name(before)
    new = _by_name(after)

    def changed(name: str, versions: tuple[ModelSettings, ...]) -> bool:
        if old.get(name) != versions:
            return True
        # the same settings: loaded again when a file of its folder changed (a folder
        # too large to fingerprint, None, goes by its settings alone)
        for model in versions:
            was, now = files_before.get(model.key), files_after.get(model.key)
            if was is not None and now is not None and was != now:
                return True
        return False

    load = tuple(name for name, versions in new.items() if changed(name, versions))
    unload = tuple(name for name in old if name not in new)
    return PoolModelChange(gid, load, unload, tuple(after))


def _by_name(models: Sequence[ModelSettings]) -> dict[str, tuple[ModelSettings, ...]]:
    grouped: dict[str, list[ModelSettings]] = {}
    for model in models:
        grouped.setdefault(model.name, []).append(model)
    return {name: tuple(versions) for name, versions in grouped.items()}


# -- live model changes in a pool ------------------------------------------------


class LiveUpdateUnsupported(Exception):
    """The pool cannot load or unload models live; the reconciler restarts it."""


async def apply_pool_models(
    socket_path: Path, change: PoolModelChange, *, timeout: float
) -> list[str]:
    """Makes the running pool behind ``socket_path`` serve ``change.models``.

    The contract the reconciler relies on:

    - On return, every model of ``change.unload`` is unloaded (its in-flight
      requests finished) and every model of ``change.load`` was (re)loaded
      from the repository on disk. Idempotent: loading a loaded model
      replaces it, unloading an absent one is a no-op.
    - Returns one line per model that could not be (re)loaded; the pool
      keeps running (a failed reload keeps the previous version serving).
    - Raises :class:`LiveUpdateUnsupported` when the pool has no live load
      (the reconciler then restarts the pool); any other exception means the
      pool could not be reached (reported; a pool that restarts reads the
      repository anyway).

    It uses the pool's own RepositoryModelLoad/Unload on its private socket
    (the pool scans the repository for the model's settings).
    """
    failures: list[str] = []
    options = (("grpc.use_local_subchannel_pool", 1),)
    async with grpc.aio.insecure_channel(f"unix:{socket_path}", options=options) as channel:
        unload = channel.unary_unary(
            f"/{SERVICE}/RepositoryModelUnload",
            request_serializer=pb.RepositoryModelUnloadRequest.SerializeToString,
            response_deserializer=pb.RepositoryModelUnloadResponse.FromString,
        )
        load = channel.unary_unary(
            f"/{SERVICE}/RepositoryModelLoad",
            request_serializer=pb.RepositoryModelLoadRequest.SerializeToString,
            response_deserializer=pb.RepositoryModelLoadResponse.FromString,
        )
        for name in change.unload:
            try:
                await unload(pb.RepositoryModelUnloadRequest(model_name=name), timeout=timeout)
            except grpc.aio.AioRpcError as error:
                if error.code() is grpc.StatusCode.NOT_FOUND:
                    continue  # already gone
                _raise_unsupported(change.gid, error)
                raise
        for name in change.load:
            try:
                await load(pb.RepositoryModelLoadRequest(model_name=name), timeout=timeout)
            except grpc.aio.AioRpcError as error:
                _raise_unsupported(change.gid, error)
                if error.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
                    raise
                failures.append(f"pool {change.gid}: model {name}: {error.details()}")
    return failures


def _raise_unsupported(gid: str, error: grpc.aio.AioRpcError) -> None:
    if error.code() is grpc.StatusCode.UNIMPLEMENTED:
        raise LiveUpdateUnsupported(f"pool {gid}: {error.details()}") from None


# -- readiness from events ------------------------------------------------------


class ChildNotReady(Exception):
    """A child the reconciler started ended for good before it was ready."""


@dataclass(eq=False)
class _Waiter:
    future: asyncio.Future[None]
    started: bool  # a new incarnation has started since the wait began


class ChildWatch:
    """Futures for "child C of supervisor S is ready", fed by the event hook.

    Put it in the tree's hook (``fan_out``). :meth:`expect` must be called
    before the action that starts the child: the future resolves at the
    first ``ChildReady`` after a ``ChildStarted`` (so the ready of an older
    incarnation never counts), unless ``any_start`` accepts the next one.
    A child that ends and will not restart fails the future.
    """

    def __init__(self) -> None:
        self._waiters: dict[tuple[str, str], list[_Waiter]] = {}

    def expect(
        self, supervisor: str, child: str, *, any_start: bool = False
    ) -> asyncio.Future[None]:
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.setdefault((supervisor, child), []).append(_Waiter(future, any_start))
        return future

    def __call__(self, event: Event) -> None:
        match event:
            case ChildStarted(id=child, supervisor=supervisor):
                for waiter in self._waiters.get((supervisor, child), []):
                    waiter.started = True
            case ChildReady(id=child, supervisor=supervisor):
                self._settle(supervisor, child, lambda w: w.started, None)
            case ChildExited(id=child, supervisor=supervisor, will_restart=False):
                error = ChildNotReady(f"{child}: {event.outcome}")
                self._settle(supervisor, child, lambda w: True, error)
            case _:
                pass

    def _settle(
        self,
        supervisor: str,
        child: str,
        which: Callable[[_Waiter], bool],
        error: Exception | None,
    ) -> None:
        key = (supervisor, child)
        waiters = self._waiters.get(key, [])
        kept = []
        for waiter in waiters:
            if waiter.future.done():
                continue  # the caller stopped waiting
            if not which(waiter):
                kept.append(waiter)
            elif error is None:
                waiter.future.set_result(None)
            else:
                waiter.future.set_exception(error)
        if kept:
            self._waiters[key] = kept
        else:
            self._waiters.pop(key, None)


async def wait_ready(future: asyncio.Future[None], timeout: float) -> str | None:
    """Waits for a :meth:`ChildWatch.expect` future; returns why not, or None."""
    try:
        await asyncio.wait_for(future, timeout)
    except ChildNotReady as error:
        return str(error)
    except TimeoutError:
        return f"not ready within {timeout:g} s"
    return None


# -- the tree as the reconciler sees it ------------------------------------------


class TreeOps(Protocol):
    """The handles a reload needs on the running tree (``serve`` provides them)."""

    def root(self) -> Supervisor: ...

    def pools(self) -> Supervisor:
        """The pools supervisor now serving (a new one after it restarted)."""
        ...

    def pool_spec(self, gid: str, settings: ServerSettings) -> ChildSpec:
        """The spec of a pool started or restarted while the tree runs."""
        ...

    def router_specs(self, settings: ServerSettings) -> list[ChildSpec]:
        """The spec of each router of the fleet (their ids are the tree's)."""
        ...

    def use(self, desired: Desired) -> None:
        """What a restart of the pools supervisor builds from now on."""
        ...


# True: the router took the table live. False: it cannot (restart it).
RouterUpdate = Callable[[Routes, int], Awaitable[bool]]
ModelUpdate = Callable[[Path, PoolModelChange], Awaitable[list[str]]]


@dataclass
class ReloadReport:
    started: list[str] = field(default_factory=list)  # gids
    stopped: list[str] = field(default_factory=list)  # gids
    updated: list[str] = field(default_factory=list)  # gids with models changed live
    restarted: list[str] = field(default_factory=list)  # child ids
    failures: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)  # fixed settings asked to change
    router_updated: bool = False

    @property
    def ok(self) -> bool:
        return not self.failures

    def summary(self) -> str:
        parts = []
        for label, items in (
            ("started", self.started),
            ("stopped", self.stopped),
            ("updated models of", self.updated),
            ("restarted", self.restarted),
        ):
            if items:
                parts.append(f"{label} {', '.join(items)}")
        if self.router_updated:
            parts.append("router took the new routes live")
        text = "; ".join(parts) or "nothing to change"
        if self.kept:
            text += "; " + "; ".join(self.kept)
        if self.failures:
            text += f"; {len(self.failures)} problem(s): " + "; ".join(self.failures)
        return text


@dataclass(frozen=True)
class EnsuredPool:
    address: str
    started: bool


class Reconciler:
    """Carries out reloads and pool requests on the live tree, one at a time.

    ``current`` is what the tree was last brought to. Reloads are requested
    with :meth:`request_reload` (SIGHUP, the control socket) and run by
    :meth:`run`, which the control service owns; requests that arrive while
    one waits share its result.
    """

    def __init__(
        self,
        repo: Path,
        flags: Mapping[str, object],
        current: Desired,
        tree: TreeOps,
        *,
        run_dir: Path,
        watch: ChildWatch,
        notifier: SystemdNotifier | None = None,
        tree_ready: Callable[[], bool] = lambda: True,
        update_router: RouterUpdate | None = None,
        update_models: ModelUpdate | None = None,
        start_timeout: float = 120.0,
    ) -> None:
        self.repo = repo
        self.flags = dict(flags)
        self.current = current
        self.routers = current.settings.routers  # fixed at start (FIXED_SETTINGS)
        self._tree = tree
        self._run_dir = run_dir
        self._watch = watch
        self._notifier = notifier or SystemdNotifier(None)
        self._tree_ready = tree_ready
        self._update_router = update_router or _no_live_routes
        self._update_models = update_models or self._apply_models
        self.start_timeout = start_timeout
        self._lock = asyncio.Lock()
        self._generation = 0
        self._pending: asyncio.Future[ReloadReport] | None = None
        self._wake = asyncio.Event()

    # -- reload requests ----------------------------------------------------

    def request_reload(self) -> asyncio.Future[ReloadReport]:
        """Asks for a reload; the future gets its report (never an exception)."""
        if self._pending is None or self._pending.done():
            self._pending = asyncio.get_running_loop().create_future()
        self._wake.set()
        return self._pending

    async def run(self) -> None:
        """Runs requested reloads one after another, until cancelled."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            pending, self._pending = self._pending, None
            try:
                report = await self.reload()
            except BaseException:
                # Stopped (or a bug, which propagates): nobody waits forever.
                for future in (pending, self._pending):
                    if future is not None:
                        future.cancel()
                raise
            if pending is not None and not pending.done():
                pending.set_result(report)

    # -- reload ------------------------------------------------------------

    async def reload(self) -> ReloadReport:
        """Re-reads the configuration and reconciles; systemd sees RELOADING=1,
        then READY=1 (once the tree had been ready)."""
        async with self._lock:
            self._notifier.reloading()
            report = ReloadReport()
            try:
                await self._reload(report)
            finally:
                summary = report.summary()
                log.log(logging.INFO if report.ok else logging.WARNING, "reload: %s", summary)
                if self._tree_ready():
                    self._notifier.ready(f"reloaded: {summary}")
                else:
                    self._notifier.status(f"reloaded while starting: {summary}")
            return report

    async def _reload(self, report: ReloadReport) -> None:
        try:
            wanted = await asyncio.to_thread(Desired.load, self.repo, self.flags)
        except Exception as error:  # ConfigError, or an unreadable repository
            report.failures.append(f"configuration not reloaded: {error}")
            return
        # Not served until fixed, and the server not ready meanwhile: a problem to say.
        report.failures.extend(f"model {bad.name}: {bad.reason}" for bad in wanted.invalid)
        plan = plan_reload(self.current, wanted)
        if wanted.settings.routers != self.routers:
            # Against the value the tree started with: self.current takes the
            # new settings below, so comparing with it would warn only once.
            kept = (
                f"routers {self.routers} kept until the server restarts"
                f" (fixed at start; asked: {wanted.settings.routers})"
            )
            log.warning("reload: %s", kept)
            report.kept.append(kept)
        try:
            pools = self._tree.pools()
        except RuntimeError as error:
            report.failures.append(f"the tree is not running: {error}")
            return
        # A pool that failed for good gets another chance: the repository may be fixed.
        states = {status.id: status.state for status in pools.status()}
        retry = tuple(
            gid
            for gid in wanted.pools
            if gid in self.current.pools
            and gid not in plan.restart
            and states.get(pool_child_id(gid)) in (ChildState.FAILED, ChildState.STOPPED)
        )
        if plan.empty and not retry:
            self.current = wanted
            return
        waits: dict[str, asyncio.Future[None]] = {}
        # New pools serve before the router may route to them.
        for gid in plan.start:
            waits[gid] = self._watch.expect(POOLS, pool_child_id(gid))
            try:
                await pools.add_child(self._tree.pool_spec(gid, wanted.settings))
            except ValueError:  # started meanwhile by EnsurePool
                waits.pop(gid).cancel()
                continue
            report.started.append(gid)
        for gid in (*plan.restart, *retry):
            await self._restart_pool(gid, wanted.settings, waits, report)
        for change in plan.models:
            if change.gid not in retry:  # a pool that starts again reads its models anyway
                await self._change_models(change, wanted.settings, waits, report)
        for gid, future in waits.items():
            problem = await wait_ready(future, self.start_timeout)
            if problem is not None:
                report.failures.append(f"pool {gid}: {problem}")
        self.current = wanted
        self._tree.use(wanted)
        await self._reroute(plan, wanted, report)
        # Last: nobody routes to these pools any more.
        for gid in plan.stop:
            with contextlib.suppress(KeyError):  # never started, or already gone
                await pools.remove_child(pool_child_id(gid))
            report.stopped.append(gid)

    async def _restart_pool(
        self,
        gid: str,
        settings: ServerSettings,
        waits: dict[str, asyncio.Future[None]],
        report: ReloadReport,
    ) -> None:
        child = pool_child_id(gid)
        waits[gid] = self._watch.expect(POOLS, child)
        try:
            await self._tree.pools().restart_child(child, self._tree.pool_spec(gid, settings))
        except KeyError:  # not in the tree (removed meanwhile): start it
            await self._tree.pools().add_child(self._tree.pool_spec(gid, settings))
        report.restarted.append(child)

    async def _change_models(
        self,
        change: PoolModelChange,
        settings: ServerSettings,
        waits: dict[str, asyncio.Future[None]],
        report: ReloadReport,
    ) -> None:
        socket_path = pool_socket_path(self._run_dir, change.gid)
        try:
            if not settings.model_control:
                raise LiveUpdateUnsupported("model_control is off")
            failures = await self._update_models(socket_path, change)
        except LiveUpdateUnsupported as error:
            log.info("reload: pool %s restarts to change its models (%s)", change.gid, error)
            await self._restart_pool(change.gid, settings, waits, report)
            return
        except Exception as error:
            report.failures.append(f"pool {change.gid}: models not changed: {error}")
            return
        report.updated.append(change.gid)
        report.failures.extend(failures)

    async def _apply_models(self, socket_path: Path, change: PoolModelChange) -> list[str]:
        return await apply_pool_models(socket_path, change, timeout=self.start_timeout)

    async def _reroute(self, plan: ReloadPlan, wanted: Desired, report: ReloadReport) -> None:
        if not plan.restart_router and not plan.routes_changed:
            return
        if not plan.restart_router:
            self._generation += 1
            try:
                if await self._update_router(Routes.of(wanted), self._generation):
                    report.router_updated = True
                    return
            except Exception as error:
                log.warning("reload: the router did not take the routes live: %s", error)
        # One router after another: in a fleet the others serve meanwhile.
        for spec in self._tree.router_specs(wanted.settings):
            ready = self._watch.expect(ROOT, spec.id)
            try:
                await self._tree.root().restart_child(spec.id, spec)
            except KeyError:
                ready.cancel()
                return  # a tree without a router (tests)
            report.restarted.append(spec.id)
            problem = await wait_ready(ready, self.start_timeout)
            if problem is not None:
                report.failures.append(f"{spec.id}: {problem}")

    # -- EnsurePool -------------------------------------------------------

    async def ensure_pool(self, gid: str) -> EnsuredPool:
        """Starts the pool of ``gid`` unless it runs; returns once it serves.

        Raises ValueError for an unsafe gid, LookupError when no model of
        the repository uses ``gid``, RuntimeError when the pool did not start.
        The router is not told: the caller (the router itself) routes.
        """
        if not SAFE_ID.match(gid):
            raise ValueError(f"unsafe pool id {gid!r}")
        address = f"unix:{pool_socket_path(self._run_dir, gid)}"
        child = pool_child_id(gid)
        async with self._lock:
            pools = self._tree.pools()
            found = {status.id: status for status in pools.status()}.get(child)
            if found is not None and found.state is ChildState.RUNNING:
                return EnsuredPool(address, started=False)
            if found is not None and found.state in (ChildState.STARTING, ChildState.BACKOFF):
                ready = self._watch.expect(POOLS, child, any_start=True)
                started = False
            else:
                wanted = await asyncio.to_thread(Desired.load, self.repo, self.flags)
                models = wanted.pools.get(gid)
                if not models:
                    raise LookupError(f"no model in the repository uses pool '{gid}'")
                ready = self._watch.expect(POOLS, child)
                spec = self._tree.pool_spec(gid, self.current.settings)
                if found is None:
                    await pools.add_child(spec)
                else:  # stopped or failed for good: the repository may be fixed now
                    await pools.restart_child(child, spec)
                self.current = self.current.with_pool(gid, models)
                self._tree.use(self.current)
                started = True
            problem = await wait_ready(ready, self.start_timeout)
        if problem is not None:
            raise RuntimeError(f"pool {gid} did not start: {problem}")
        return EnsuredPool(address, started)


async def _no_live_routes(routes: Routes, generation: int) -> bool:
    return False
