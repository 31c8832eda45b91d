"""The router's routes and its view of the pools' health.

One owner (:class:`Routes`) holds which pool serves which model, the models
that cannot be served and why, the channel and lane kept open to each pool,
and what each pool's Watch streams and lane heartbeat say. The doors ask it
for a model's route and for readiness; the supervisor's route tables and a
live load of a model added after start change it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from poolserve.protos import control_pb2 as cpb
from poolserve.service.contract.errors import (
    FailedPrecondition,
    ModelNotReady,
    Unavailable,
    unknown_model,
)
from poolserve.service.contract.lane import lane_path
from poolserve.service.contract.repository import Repository, scan
from poolserve.service.contract.rundir import pool_socket_path
from poolserve.service.contract.settings import ConfigError, ServerSettings
from poolserve.service.contract.slab import Arena
from poolserve.service.grpcserver.handlers import SERVICE
from poolserve.service.grpcserver.health import SERVING, Health
from poolserve.service.grpcserver.pacing import Rescanner
from poolserve.service.router.lane_client import LaneClient

log = logging.getLogger(__name__)

RETRY_WATCH_S = (0.05, 1.0)
# The pool RPCs the router calls on a pool's gRPC socket (ModelInfer goes on the lane).
POOL_METHODS = (
    "ModelInfer",
    "ModelReady",
    "ModelMetadata",
    "ModelConfig",
    "ModelStatistics",
    "RepositoryIndex",
    "RepositoryModelLoad",
    "RepositoryModelUnload",
    "CustomRoutes",  # MLServer models' @custom_handler endpoints (router/custom_routes.py)
    "MLServerModels",  # which models are MLServer's (router/pool_tables.py)
)


@dataclass(eq=False)
class PoolRoute:
    gid: str
    path: Path
    models: list[str]
    channel: grpc.aio.Channel | None = None
    lane: LaneClient | None = None
    calls: dict[str, grpc.aio.UnaryUnaryMultiCallable[bytes, bytes]] = field(default_factory=dict)
    serving: bool = False  # what the pool's Watch stream says
    responsive: bool = True  # answered a lane PING within heartbeat_timeout_s
    # the lane connected and answered a PING since it was last lost or refused: a
    # Watch stream can say SERVING a moment after the pool died (its end not yet
    # read), and nothing reaches a pool whose lane refuses connections
    lane_up: bool = False
    model_serving: dict[str, bool] = field(default_factory=dict)
    watchers: list[asyncio.Task[None]] = field(default_factory=list)
    # wakes the heartbeat: the lane was lost, or the pool said SERVING (try it now)
    nudge: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def where(self) -> str:
        return f"pool '{self.gid}'"

    @property
    def answers(self) -> bool:
        """Whether a call sent now reaches the pool's event loop: it answers its
        heartbeat and its lane is connected (what its models' health needs)."""
        return self.responsive and self.lane_up

    @property
    def reachable(self) -> bool:
        """Whether the pool as a whole serves: it says SERVING (every model in)
        and a call sent now reaches it."""
        return self.serving and self.answers


class Routes:
    """Which pool serves which model, and whether it can serve it now."""

    def __init__(
        self,
        repository: Repository,
        settings: ServerSettings,
        run_dir: Path,
        arena: Arena,
        repo: Path | None = None,
    ) -> None:
        self.settings = settings
        self.repo = repo
        self.arena = arena
        self.invalid = {bad.name: bad.reason for bad in repository.invalid}
        self.pools: dict[str, PoolRoute] = {}
        self.routes: dict[str, PoolRoute] = {}
        # counts what the pools' Watch streams said of their models (a load, an
        # unload): the tables of what only a pool knows (router/pool_tables.py)
        # ask again after a change
        self.model_changes = 0
        for gid, models in repository.pools().items():
            names = list(dict.fromkeys(m.name for m in models))  # a model's versions: one route
            route = PoolRoute(gid, pool_socket_path(run_dir, gid), names)
            self.pools[gid] = route
            for name in route.models:
                self.routes[name] = route
        self.health = Health()
        self.rescanner = Rescanner(
            lambda: scan(repo) if repo is not None else repository,
            settings.repository_rescan_s,
            initial=repository,
        )
        self._generation = 0
        self._tasks: asyncio.TaskGroup | None = None
        # the ensembles' readiness, by name (router/ensemble.py): their health follows their steps'
        self.ensembles_ready: Callable[[], dict[str, bool]] = dict

    def routed_models(self) -> list[tuple[str, str]]:
        """(model, pool) of every route: the series the router's own counters cover."""
        return [(name, route.gid) for name, route in self.routes.items()]

    def route(self, name: str) -> PoolRoute:
        """The pool of a model; ModelNotReady for a broken one, NOT_FOUND for none."""
        route = self.routes.get(name)
        if route is not None:
            return route
        if name in self.invalid:
            raise ModelNotReady(f"model '{name}' is unavailable: {self.invalid[name]}")
        raise unknown_model(name)

    # -- readiness -------------------------------------------------------------

    def ready(self) -> bool:
        return (
            not self.invalid
            and bool(self.pools)
            and all(route.reachable for route in self.pools.values())
        )

    def sync_health(self) -> None:
        ready = self.ready()
        self.health.set_many({"": ready, SERVICE: ready})
        for name, route in self.routes.items():
            serving = route.model_serving.get(name, False) and route.answers
            self.health.set(f"model:{name}", serving)
        for name in self.invalid:
            if name not in self.routes:  # a broken duplicate must not shadow a good model
                self.health.set(f"model:{name}", False)
        for name, ready in self.ensembles_ready().items():
            self.health.set(f"model:{name}", ready)

    async def _watch(self, route: PoolRoute, service: str, apply: Callable[[bool], None]) -> None:
        """Follows one health service of a pool for the router's whole life."""
        assert route.channel is not None
        stub = health_pb2_grpc.HealthStub(route.channel)
        delay = RETRY_WATCH_S[0]
        while True:
            try:
                stream = stub.Watch(
                    health_pb2.HealthCheckRequest(service=service), wait_for_ready=True
                )
                async for reply in stream:
                    apply(reply.status == SERVING)
                    delay = RETRY_WATCH_S[0]
            except grpc.aio.AioRpcError:
                pass
            apply(False)  # the stream broke: the pool is down until it says otherwise
            await asyncio.sleep(delay)  # back-off between reconnects, not a readiness wait
            delay = min(delay * 2, RETRY_WATCH_S[1])

    async def _heartbeat(self, route: PoolRoute) -> None:
        """Pings the pool's lane every heartbeat_interval_s for the router's whole life.

        A Watch stream only breaks when the pool's socket does: a pool that is
        stopped (SIGSTOP) or whose event loop is blocked keeps it open and
        silent. A pool that has not answered for heartbeat_timeout_s is
        NOT_SERVING, with its models, until it answers again. The ping is
        answered by the pool's event loop itself, so it proves what a call needs.
        A lane that is lost or refused makes the pool NOT_SERVING at once (a
        Watch stream may not have said so yet); the lane is tried again, soon
        and when the pool's Watch says SERVING, until it answers.
        """
        assert route.lane is not None
        loop = asyncio.get_running_loop()
        interval = self.settings.heartbeat_interval_s
        limit = self.settings.heartbeat_timeout_s
        answered = loop.time()
        retry = RETRY_WATCH_S[0]
        while True:
            try:
                if route.responsive:
                    async with asyncio.timeout_at(answered + limit):
                        await route.lane.ping()
                else:
                    await route.lane.ping()  # silent already: wait for any answer
            except TimeoutError:
                self._set_responsive(route, False, loop.time() - answered)
                continue
            except Unavailable:
                # down, not silent: its Watch streams say so too, in their time
                self._set_lane(route, False)
                await _pause(route.nudge, retry)
                retry = min(retry * 2, RETRY_WATCH_S[1])
                answered = loop.time()  # silence counts from a lane that accepts pings
                continue
            answered = loop.time()
            retry = RETRY_WATCH_S[0]
            self._set_lane(route, True)
            self._set_responsive(route, True, 0.0)
            await _pause(route.nudge, interval)

    def _set_lane(self, route: PoolRoute, up: bool) -> None:
        if route.lane_up == up:
            return
        route.lane_up = up
        if up:
            log.info("router: %s lane connected", route.where)
        else:
            log.warning("router: %s lane lost or refused: NOT_SERVING", route.where)
        self.sync_health()

    def _lane_down(self, route: PoolRoute) -> None:
        """The lane client's word that its connection ended or was refused."""
        if route.lane_up:  # lost: the heartbeat tries it again now (refused: in its time)
            route.nudge.set()
        self._set_lane(route, False)

    def _set_responsive(self, route: PoolRoute, responsive: bool, silent_s: float) -> None:
        if route.responsive == responsive:
            return
        route.responsive = responsive
        if responsive:
            log.info("router: %s answers its heartbeat again", route.where)
        else:
            log.warning(
                "router: %s has not answered its heartbeat for %.1f s "
                "(stopped, or its event loop is blocked): NOT_SERVING",
                route.where,
                silent_s,
            )
        self.sync_health()

    def _pool_applier(self, route: PoolRoute) -> Callable[[bool], None]:
        def apply(serving: bool) -> None:
            if route.serving != serving:
                log.info("router: %s %s", route.where, "SERVING" if serving else "NOT_SERVING")
            route.serving = serving
            if serving and not route.lane_up:
                route.nudge.set()  # its lane is likely listening now: try it
            self.sync_health()

        return apply

    def _model_applier(self, route: PoolRoute, name: str) -> Callable[[bool], None]:
        def apply(serving: bool) -> None:
            if route.model_serving.get(name) != serving:
                self.model_changes += 1
            route.model_serving[name] = serving
            if serving and not route.lane_up:
                route.nudge.set()  # its lane is likely listening now: try it
            self.sync_health()

        return apply

    # -- channels and watchers -------------------------------------------------

    def _open_channel(self, route: PoolRoute) -> None:
        limit = self.settings.max_message_size
        options = [
            ("grpc.max_receive_message_length", limit),
            ("grpc.max_send_message_length", limit),
        ]
        route.channel = grpc.aio.insecure_channel(f"unix:{route.path}", options=options)
        route.calls = {m: route.channel.unary_unary(f"/{SERVICE}/{m}") for m in POOL_METHODS}
        route.lane = LaneClient(
            lane_path(route.path), route.where, self.arena, on_down=lambda: self._lane_down(route)
        )

    def open_channels(self) -> None:
        for route in self.pools.values():
            self._open_channel(route)

    def start_watching(self, tasks: asyncio.TaskGroup) -> None:
        """Follows every pool's and model's health in ``tasks`` until :meth:`stop_watching`."""
        self._tasks = tasks
        for route in self.pools.values():
            self._watch_pool(route)
            for name in route.models:
                self._watch_model(route, name)

    def stop_watching(self) -> None:
        for route in self.pools.values():
            for task in route.watchers:
                task.cancel()
        self._tasks = None

    async def close(self) -> None:
        for route in self.pools.values():
            if route.lane is not None:
                route.lane.close()
            if route.channel is not None:
                await route.channel.close()

    def _watch_pool(self, route: PoolRoute) -> None:
        assert self._tasks is not None
        route.watchers.append(
            self._tasks.create_task(self._watch(route, "", self._pool_applier(route)))
        )
        route.watchers.append(self._tasks.create_task(self._heartbeat(route)))

    def _watch_model(self, route: PoolRoute, name: str) -> None:
        if self._tasks is None:
            return  # not serving yet: start_watching starts every watcher
        applier = self._model_applier(route, name)
        route.watchers.append(self._tasks.create_task(self._watch(route, f"model:{name}", applier)))

    # -- live route updates (from the supervisor, on a private socket) -------

    async def set_routes(self, table: cpb.RouteTable, _: object) -> cpb.SetRoutesResponse:
        """Applies a whole route table; replies once it is in force."""
        if table.generation <= self._generation:
            return cpb.SetRoutesResponse(generation=self._generation)
        self._generation = table.generation
        wanted = {p.gid: p for p in table.pools}
        removed = [route for gid, route in self.pools.items() if gid not in wanted]
        for gid, pool in wanted.items():
            route = self.pools.get(gid)
            if route is None:
                route = PoolRoute(gid, Path(pool.address.removeprefix("unix:")), [])
                self.pools[gid] = route
                self._open_channel(route)
                self._watch_pool(route)
            for name in pool.models:
                if name not in route.models:
                    route.models.append(name)
                    self._watch_model(route, name)
            route.models[:] = [m for m in route.models if m in set(pool.models)]
        for route in removed:
            del self.pools[route.gid]
        self.routes = {name: r for r in self.pools.values() for name in r.models}
        self.invalid = {bad.name: bad.reason for bad in table.invalid}
        self.sync_health()
        for route in removed:
            for task in route.watchers:
                task.cancel()
            if route.lane is not None:
                route.lane.close()
            if route.channel is not None:
                await route.channel.close(grace=self.settings.stop_grace_s)
        log.info(
            "router: routes generation %d: %d pools, %d models",
            table.generation,
            len(self.pools),
            len(self.routes),
        )
        return cpb.SetRoutesResponse(generation=table.generation)

    async def learn_route(self, name: str) -> Repository | None:
        """A model added to the repository after start: route it to its pool.

        The repository is scanned on a thread, at most once per
        repository_rescan_s, and every load waiting for a name shares the scan:
        a flood of loads for names that do not exist costs one scan per interval.
        """
        if self.repo is None:
            return None
        try:
            repository = await self.rescanner.fresh()
        except ConfigError as exc:
            raise FailedPrecondition(f"the repository cannot be scanned: {exc}") from None
        settings = repository.model(name)
        if settings is None or name in self.routes:
            return repository  # not there: NOT_FOUND; or a concurrent load routed it
        route = self.pools.get(settings.gid)
        if route is None:
            raise FailedPrecondition(
                f"model '{name}' needs a new pool '{settings.gid}': run `poolserve reload` "
                "(or send SIGHUP to the supervisor) to start it"
            )
        self.invalid.pop(name, None)
        route.models.append(name)
        self.routes[name] = route
        self._watch_model(route, name)
        return repository


async def _pause(nudge: asyncio.Event, seconds: float) -> None:
    """Waits ``seconds``, or less if ``nudge`` is set meanwhile (then cleared)."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(seconds):
            await nudge.wait()
    nudge.clear()
