"""A pool server's live model control: RepositoryModelLoad and
RepositoryModelUnload while the pool serves.

A load reads the model's settings as its files say now (a known model
re-reads its own file, any other name waits for the next paced repository
scan), skips a load of unchanged files, shares one load among concurrent
identical requests, has the zygote load it (an inline model loads in the pool
process), then rolls the workers (the fleet's rolling replacement) so that
every worker holds the new version; the previous version serves until then.
One load or unload at a time.
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
    ModelSettings,
    Repository,
    TensorSpec,
    TransactionPolicy,
    fingerprint,
    parse_model_settings,
)
from poolserve.service.contract.settings import ConfigError
from poolserve.service.grpcserver.pacing import Pacer, Rescanner
from poolserve.service.inference.cargo import InferenceZygote
from poolserve.service.poolcore.fleet import Fleet
from poolserve.service.poolserver.catalog import Catalog, ModelState
from poolserve.service.poolserver.inline import InlineRunner
from poolserve.service.poolserver.load_request import LoadRequest, parse_load_request

log = logging.getLogger(__name__)

ROLL_TIMEOUT_S = 60.0


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
        self.catalog.lookup(req.model_name)
        async with self._model_ops:
            self.catalog.set_state(req.model_name, ModelState.UNLOADED, "unloaded on request")
            self._loaded_from.pop(req.model_name, None)
            if self.inline.unload(req.model_name):
                return pb.RepositoryModelUnloadResponse()
            reply = self._expect_reply(f"unload:{req.model_name}")
            self.zygote.unload(req.model_name)
            await reply
            await self._roll_workers()
        log.info("pool %s: model %s unloaded", self.gid, req.model_name)
        return pb.RepositoryModelUnloadResponse()

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

    async def _wanted(self, request: LoadRequest) -> tuple[ModelSettings, Fingerprint | None]:
        """The settings a load means (the files' plus its config) and the files' fingerprint."""
        settings = await self._find_settings(request.name)
        entry = self.catalog.find(request.name)
        known = (entry.inputs, entry.outputs) if entry is not None and entry.inputs else None
        settings = request.apply(settings, known or (settings.inputs, settings.outputs))
        return settings, await asyncio.to_thread(fingerprint, settings)

    def _unchanged(self, settings: ModelSettings, files: Fingerprint | None) -> bool:
        """Loaded already, from these very settings and files: the load has nothing to do."""
        entry = self.catalog.find(settings.name)
        return (
            entry is not None
            and entry.ready
            and entry.settings == settings
            and files is not None
            and self._loaded_from.get(settings.name) == files
        )

    def _expect_reply(self, key: str) -> asyncio.Future[ModelReply]:
        reply: asyncio.Future[ModelReply] = asyncio.get_running_loop().create_future()
        self._model_replies[key] = reply
        return reply

    async def _load(self, request: LoadRequest) -> None:
        name = request.name
        settings, files = await self._wanted(request)
        if self._unchanged(settings, files):
            log.info("pool %s: model %s is loaded from these files already", self.gid, name)
            return
        if await self._reloads.turn(name):  # it waited: the files may have changed again
            settings, files = await self._wanted(request)
            if self._unchanged(settings, files):
                return
        async with self._model_ops:
            entry = self.catalog.upsert(settings)
            if self._runs_inline(settings):
                failures = await self.inline.load([settings])  # sets the catalog state
                if name in failures:
                    kept = "; the previous version keeps serving" if name in self.inline else ""
                    raise FailedPrecondition(f"inline model '{name}' {failures[name]}{kept}")
                entry.settings, entry.version = settings, settings.version
                self._loaded_from[name] = files
                return
            was_ready = entry.ready
            reply = self._expect_reply(name)
            self.zygote.load(settings.source, request.overrides(settings))
            outcome = await reply
            if not outcome.ok:
                if not was_ready:
                    self.catalog.set_state(name, ModelState.UNAVAILABLE, outcome.reason)
                kept = "; the previous version keeps serving" if was_ready else ""
                raise FailedPrecondition(f"model '{name}' {outcome.reason}{kept}")
            self.fleet.respawner.forgive(name)  # a new version: its own self-test and crash record
            await self._roll_workers()
            # every worker holds the new version now: its policy replaces the old one
            entry.settings, entry.version = settings, settings.version
            entry.declared = outcome.policy
            entry.own_metadata = self._own_metadata.pop(name, None)
            entry.custom_routes = self._custom_routes.pop(name, ())
            failed = self.fleet.respawner.failed_warmup.get(name)
            if failed is not None:  # the fresh workers of the roll could not warm it up
                self.catalog.set_state(name, ModelState.UNAVAILABLE, failed)
                raise FailedPrecondition(f"model '{name}' {failed}")
            self._loaded_from[name] = files
            self.catalog.set_state(name, ModelState.READY, "", outcome.specs)
            log.info("pool %s: model %s loaded live", self.gid, name)

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
