"""A pool server's live model control: RepositoryModelLoad and
RepositoryModelUnload while the pool serves.

A load reads the model's settings as its files say now (a known model
re-reads its own file, any other name waits for the next paced repository
scan), skips a load of unchanged files, shares one load among concurrent
identical requests, has the zygote load it (an inline model loads in the pool
process), then rolls the workers (the fleet's rolling replacement) so that
every worker holds the new version; the previous version serves until then.
One load or unload at a time.

A model with numbered version folders (contract/versions.py) loads each
version its policy picks (the file's, or the load's config override) that
changed, with one roll for them all; a version then left out takes no new
call, and is let go of (one more roll) once no call of it is queued or runs.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from poolserve.protos import inference_pb2 as pb
from poolserve.service.contract.errors import (
    FailedPrecondition,
    ModelNotFound,
    ServingError,
    clip,
    load_failed,
)
from poolserve.service.contract.repository import (
    Fingerprint,
    InvalidModel,
    ModelSettings,
    Repository,
    TensorSpec,
    TransactionPolicy,
    fingerprint,
    model_versions,
    parse_model_settings,
)
from poolserve.service.contract.settings import ConfigError
from poolserve.service.grpcserver.pacing import Pacer, Rescanner
from poolserve.service.inference.cargo import InferenceZygote
from poolserve.service.poolcore.dispatcher import Dispatcher
from poolserve.service.poolcore.fleet import Fleet
from poolserve.service.poolserver.catalog import Catalog, ModelEntry, ModelState
from poolserve.service.poolserver.inline import InlineRunner
from poolserve.service.poolserver.load_request import LoadRequest, parse_load_request

log = logging.getLogger(__name__)

ROLL_TIMEOUT_S = 60.0
# A version a load leaves out is let go of once no call of it is queued or runs:
# looked at this often, and for at most this long.
DRAIN_POLL_S = 0.02
DRAIN_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Wanted:
    """What a load means: each version to serve with its files' fingerprint, and
    the versions its policy picks that have no folder."""

    name: str
    versions: list[tuple[ModelSettings, Fingerprint | None]]
    missing: list[InvalidModel]

    def keys(self) -> set[str]:
        return {s.key for s, _ in self.versions} | {f"{b.name}:{b.version}" for b in self.missing}


def _label(settings: ModelSettings) -> str:
    """How a load's messages name a model: ``'m'``, or ``'m' version 3``."""
    version = f" version {settings.version}" if settings.versioned else ""
    return f"'{settings.name}'{version}"


@dataclass(frozen=True)
class ModelReply:
    """The zygote's answer to a live load or unload."""

    ok: bool
    reason: str
    specs: tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]
    policy: TransactionPolicy  # what the loaded model declared


class LiveModels:
    """The live load and unload of :class:`~poolserve.service.poolserver.server.PoolServer`."""

    gid: str
    repo: Path | None
    catalog: Catalog
    inline: InlineRunner
    zygote: InferenceZygote
    fleet: Fleet
    dispatcher: Dispatcher
    _model_ops: asyncio.Lock
    _flights: dict[tuple[str, str], asyncio.Task[ServingError | None]]
    _model_replies: dict[str, asyncio.Future[ModelReply]]
    _own_metadata: dict[str, bytes]
    _custom_routes: dict[str, tuple[tuple[str, str], ...]]
    _rescanner: Rescanner[Repository] | None
    _reloads: Pacer
    _loaded_from: dict[str, Fingerprint | None]
    _tasks: asyncio.TaskGroup | None

    def _runs_inline(self, settings: ModelSettings) -> bool:
        raise NotImplementedError

    async def repository_model_load(
        self, req: pb.RepositoryModelLoadRequest, _: Any
    ) -> pb.RepositoryModelLoadResponse:
        try:
            request = parse_load_request(req)
        except ServingError as exc:
            raise load_failed(req.model_name, exc) from None
        key = (request.name, request.key)
        flight = self._flights.get(key)
        if flight is None:  # concurrent loads of one model (and override) share one load
            assert self._tasks is not None
            flight = self._tasks.create_task(self._load_outcome(request))
            self._flights[key] = flight
            flight.add_done_callback(lambda _: self._flights.pop(key, None))
        error = await asyncio.shield(flight)
        if error is not None:
            raise load_failed(request.name, error)
        return pb.RepositoryModelLoadResponse()

    async def _load_outcome(self, request: LoadRequest) -> ServingError | None:
        """The load as a value: a failed load must not take the pool's task group down."""
        name = request.name
        try:
            await self._load(request)
        except ServingError as exc:
            return exc
        except Exception as exc:  # a bug of ours: report it, keep the pool up
            log.exception("pool %s: live load of %s failed", self.gid, name)
            return ServingError(f"live load of '{name}' failed: {type(exc).__name__}: {exc}")
        return None

    async def repository_model_unload(
        self, req: pb.RepositoryModelUnloadRequest, _: Any
    ) -> pb.RepositoryModelUnloadResponse:
        """Triton's unload: the whole model, every version of it (one version
        goes by a load whose version_policy leaves it out)."""
        name = req.model_name
        self.catalog.lookup(name)
        async with self._model_ops:
            keys = [e.key for e in self.catalog.entries() if e.name == name]
            for key in keys:
                self.catalog.set_state(key, ModelState.UNLOADED, "unloaded on request")
            await self._unload_keys(keys)
        log.info("pool %s: model %s unloaded", self.gid, name)
        return pb.RepositoryModelUnloadResponse()

    async def _unload_keys(self, keys: list[str]) -> None:
        """Lets the zygote (or the inline runner) go of each model key, then rolls
        the workers once so that none holds them."""
        rolled = False
        for key in keys:
            self._loaded_from.pop(key, None)
            if self.inline.unload(key):
                continue
            reply = self._expect_reply(f"unload:{key}")
            self.zygote.unload(key)
            await reply
            rolled = True
        if rolled:
            await self._roll_workers()

    async def _find_settings(self, name: str) -> ModelSettings:
        """The model's settings as its files say now, read on a thread: a model
        this pool knows re-reads its own file; any other name waits for the
        next repository scan (at most one per repository_rescan_s)."""
        if self.repo is None:
            raise FailedPrecondition(f"pool '{self.gid}' has no repository to load from")
        entry = self.catalog.find(name)
        settings = None
        if entry is not None and entry.settings is not None:
            settings = await asyncio.to_thread(_reread, entry.settings.source, name)
        if settings is None:
            repository = await self._repository()
            for bad in repository.invalid:
                if bad.name == name:
                    raise FailedPrecondition(f"model '{name}' has invalid settings: {bad.reason}")
            settings = repository.model(name)
        if settings is None:
            raise ModelNotFound(f"model '{clip(name)}' is not in the repository {self.repo}")
        if settings.gid != self.gid:
            raise FailedPrecondition(
                f"model '{name}' belongs to pool '{settings.gid}', not '{self.gid}'"
            )
        return settings

    async def _repository(self) -> Repository:
        assert self._rescanner is not None, "serve() starts the rescanner"
        try:
            return await self._rescanner.fresh()
        except ConfigError as exc:
            raise FailedPrecondition(f"the repository cannot be scanned: {exc}") from None

    async def _wanted(self, request: LoadRequest) -> Wanted:
        """The settings a load means for each version it serves (the files' plus
        its config), each with its files' fingerprint, and the versions its
        policy picks that cannot be served."""
        found = await self._find_settings(request.name)
        if found.versioned:  # from a scan: the model's own settings, as its file says
            base = await asyncio.to_thread(_reread, found.source, request.name)
            found = base if base is not None else found
        versions, missing = await asyncio.to_thread(model_versions, found, request.version_policy)
        if not versions:
            raise FailedPrecondition("; ".join(bad.reason for bad in missing))
        wanted = []
        for settings in versions:
            entry = self.catalog.find(settings.key)
            known = (entry.inputs, entry.outputs) if entry is not None and entry.inputs else None
            settings = request.apply(settings, known or (settings.inputs, settings.outputs))
            wanted.append((settings, await asyncio.to_thread(fingerprint, settings)))
        return Wanted(request.name, wanted, missing)

    def _unchanged(self, settings: ModelSettings, files: Fingerprint | None) -> bool:
        """Loaded already, from these very settings and files: the load has nothing to do."""
        entry = self.catalog.find(settings.key)
        return (
            entry is not None
            and entry.key == settings.key
            and entry.ready
            and entry.settings == settings
            and files is not None
            and self._loaded_from.get(settings.key) == files
        )

    def _stale(self, wanted: Wanted) -> list[str]:
        """The keys of the model's versions that serve but the load leaves out."""
        keep = wanted.keys()
        return [
            e.key
            for e in self.catalog.entries()
            if e.name == wanted.name and e.key not in keep and e.state is not ModelState.UNLOADED
        ]

    def _nothing_to_do(self, wanted: Wanted) -> bool:
        return (
            all(self._unchanged(s, files) for s, files in wanted.versions)
            and not self._stale(wanted)
            and all(self._listed_unserved(bad) for bad in wanted.missing)
        )

    def _listed_unserved(self, bad: InvalidModel) -> bool:
        entry = self.catalog.find(f"{bad.name}:{bad.version}")
        return entry is not None and entry.state is ModelState.UNAVAILABLE

    def _expect_reply(self, key: str) -> asyncio.Future[ModelReply]:
        reply: asyncio.Future[ModelReply] = asyncio.get_running_loop().create_future()
        self._model_replies[key] = reply
        return reply

    async def _load(self, request: LoadRequest) -> None:
        name = request.name
        wanted = await self._wanted(request)
        if self._nothing_to_do(wanted):
            log.info("pool %s: model %s is loaded from these files already", self.gid, name)
            return
        if await self._reloads.turn(name):  # it waited: the files may have changed again
            wanted = await self._wanted(request)
            if self._nothing_to_do(wanted):
                return
        async with self._model_ops:
            failures: list[str] = []
            rolling: list[tuple[ModelEntry, ModelSettings, Fingerprint | None, ModelReply]] = []
            for settings, files in wanted.versions:
                if self._unchanged(settings, files):
                    continue
                started = await self._load_version(request, settings, files, failures)
                if started is not None:
                    rolling.append(started)
            if rolling:
                await self._roll_workers()
            for entry, settings, files, outcome in rolling:
                self._serve_version(entry, settings, files, outcome, failures)
            for bad in wanted.missing:
                self.catalog.unserved(bad)
            await self._retire(self._stale(wanted))
            if failures:
                raise FailedPrecondition("; ".join(failures))

    async def _load_version(
        self,
        request: LoadRequest,
        settings: ModelSettings,
        files: Fingerprint | None,
        failures: list[str],
    ) -> tuple[ModelEntry, ModelSettings, Fingerprint | None, ModelReply] | None:
        """One model (or version) loaded by the zygote, or inline: what the roll
        of the workers then brings in (None: inline, or failed, said in ``failures``)."""
        key, label = settings.key, _label(settings)
        entry = self.catalog.upsert(settings)
        if self._runs_inline(settings):
            inline_failures = await self.inline.load([settings])  # sets the catalog state
            if key in inline_failures:
                kept = "; the previous version keeps serving" if key in self.inline else ""
                failures.append(f"inline model {label} {inline_failures[key]}{kept}")
                return None
            entry.settings, entry.version = settings, settings.version
            self._loaded_from[key] = files
            return None
        was_ready = entry.ready
        reply = self._expect_reply(key)
        version = settings.version if settings.versioned else ""
        self.zygote.load(settings.source, request.overrides(settings), version)
        outcome = await reply
        if not outcome.ok:
            if not was_ready:
                self.catalog.set_state(key, ModelState.UNAVAILABLE, outcome.reason)
            kept = "; the previous version keeps serving" if was_ready else ""
            failures.append(f"model {label} {outcome.reason}{kept}")
            return None
        self.fleet.respawner.forgive(key)  # a new version: its own self-test and crash record
        return entry, settings, files, outcome

    def _serve_version(
        self,
        entry: ModelEntry,
        settings: ModelSettings,
        files: Fingerprint | None,
        outcome: ModelReply,
        failures: list[str],
    ) -> None:
        """Every worker holds the new load now: its settings and policy replace the old."""
        key = settings.key
        entry.settings, entry.version = settings, settings.version
        entry.declared = outcome.policy
        entry.own_metadata = self._own_metadata.pop(key, None)
        entry.custom_routes = self._custom_routes.pop(key, ())
        failed = self.fleet.respawner.failed_warmup.get(key)
        if failed is not None:  # the fresh workers of the roll could not warm it up
            self.catalog.set_state(key, ModelState.UNAVAILABLE, failed)
            failures.append(f"model {_label(settings)} {failed}")
            return
        self._loaded_from[key] = files
        self.catalog.set_state(key, ModelState.READY, "", outcome.specs)
        log.info("pool %s: model %s loaded live", self.gid, key)

    async def _retire(self, keys: list[str]) -> None:
        """Versions a load leaves out: no call starts on them from now on, and
        they are let go of once the calls they took have finished (or after
        DRAIN_TIMEOUT_S)."""
        if not keys:
            return
        for key in keys:
            self.catalog.set_state(key, ModelState.UNLOADED, "unloaded: left out by a load")
        deadline = asyncio.get_running_loop().time() + DRAIN_TIMEOUT_S
        while any(self.dispatcher.holds(key) for key in keys):
            if asyncio.get_running_loop().time() > deadline:
                log.warning("pool %s: unloading %s with calls still running", self.gid, keys)
                break
            await asyncio.sleep(DRAIN_POLL_S)
        await self._unload_keys(keys)
        log.info("pool %s: %s unloaded (left out by a load)", self.gid, ", ".join(keys))

    async def _roll_workers(self) -> None:
        """Replaces every worker by a fresh fork of the zygote (the fleet's roll:
        a replacement passes its self-test before its predecessor retires, so
        the pool never serves with fewer workers; the retiring one finishes its
        current request first)."""
        await self.fleet.roll(ROLL_TIMEOUT_S)


def _reread(source: Path, name: str) -> ModelSettings | None:
    """A known model's settings file, read again; None when it no longer holds
    that model (moved, renamed, removed): the caller then scans the repository."""
    if not source.is_file():
        return None
    try:
        settings = parse_model_settings(source)
    except ConfigError as exc:
        raise FailedPrecondition(f"model '{name}' has invalid settings: {exc}") from None
    return settings if settings.name == name else None
