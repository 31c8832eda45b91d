"""The catalog of a server's models: their state, specs and statistics.

One catalog lives in each process that answers for models (a pool server, or
the in-process server used in tests). It is the one source for ModelReady,
ServerReady, RepositoryIndex and health, so they cannot disagree: listeners
registered with :meth:`Catalog.subscribe` hear every state change.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from poolserve.service.contract.errors import (
    InvalidInput,
    ModelNotFound,
    ModelNotReady,
    ServingError,
    clip,
    unknown_model,
)
from poolserve.service.contract.repository import (
    InvalidModel,
    ModelSettings,
    TensorSpec,
    TransactionPolicy,
)
from poolserve.service.poolcore.stats import ModelStats


class ModelState(enum.StrEnum):
    LOADING = "LOADING"
    READY = "READY"
    UNAVAILABLE = "UNAVAILABLE"
    UNLOADED = "UNLOADED"


@dataclass
class ModelEntry:
    name: str
    version: str
    gid: str
    state: ModelState
    reason: str = ""
    settings: ModelSettings | None = None
    inputs: tuple[TensorSpec, ...] = ()
    outputs: tuple[TensorSpec, ...] = ()
    stats: ModelStats = field(default_factory=ModelStats)
    # what the loaded model declared (the zygote's load report); None: not loaded yet
    declared: TransactionPolicy | None = None
    # the model's own ModelMetadata answer (an MLServer model's, made by MLServer's
    # code when it loaded); None: poolserve's, from the specs
    own_metadata: bytes | None = None
    # an MLServer model's @custom_handler endpoints: (method, path template) pairs
    custom_routes: tuple[tuple[str, str], ...] = ()
    # its identity in the pool (ModelSettings.key): the name, or name:version for a
    # version of a model with numbered version folders
    key: str = ""

    def __post_init__(self) -> None:
        if not self.key:
            self.key = self.name

    @property
    def versioned(self) -> bool:
        """One of the versions of a model with numbered version folders."""
        return self.key != self.name

    @property
    def policy(self) -> TransactionPolicy:
        """Decoupled (ModelStreamInfer runs predict_stream) and unary (ModelInfer
        runs predict): the loaded model's word, else its settings'."""
        if self.declared is not None:
            return self.declared
        return self.settings.policy if self.settings is not None else TransactionPolicy()

    @property
    def ready(self) -> bool:
        return self.state is ModelState.READY

    @property
    def mlserver(self) -> bool:
        """An MLServer model: one that answers MLServer's own metadata (known once loaded)."""
        return self.own_metadata is not None

    @property
    def shown_version(self) -> str:
        """The version the repository indexes show and requests are checked
        against: none for an MLServer model whose model-settings.json declares
        none (MLServer's registry keeps it unversioned: asking it for "1" is
        NOT_FOUND); :attr:`version` otherwise (Triton's "1" by default)."""
        settings = self.settings
        if self.mlserver and settings is not None and not settings.version_declared:
            return "" if not settings.versioned else self.version
        return self.version

    @property
    def platform(self) -> str:
        return self.settings.platform if self.settings is not None else ""

    @property
    def max_batch_size(self) -> int:
        return self.settings.max_batch_size if self.settings is not None else 0


Listener = Callable[[], None]


class Catalog:
    def __init__(self) -> None:
        self._entries: dict[str, ModelEntry] = {}  # by key
        # the versions of each model with numbered version folders: name -> version -> entry
        self._versions: dict[str, dict[str, ModelEntry]] = {}
        self._listeners: list[Listener] = []
        self._model_listeners: list[Callable[[str], None]] = []

    @classmethod
    def from_settings(
        cls, models: Iterable[ModelSettings], invalid: Iterable[InvalidModel] = ()
    ) -> Catalog:
        catalog = cls()
        for s in models:
            catalog._add(
                ModelEntry(
                    s.name,
                    s.version,
                    s.gid,
                    ModelState.LOADING,
                    "loading",
                    s,
                    s.inputs,
                    s.outputs,
                    key=s.key,
                )
            )
        for bad in invalid:
            key = f"{bad.name}:{bad.version}" if bad.versioned else bad.name
            if key not in catalog._entries:
                catalog._add(
                    ModelEntry(
                        bad.name, bad.version, bad.gid, ModelState.UNAVAILABLE, bad.reason, key=key
                    )
                )
        return catalog

    def _add(self, entry: ModelEntry) -> None:
        self._entries[entry.key] = entry
        if entry.versioned:
            versions = self._versions.setdefault(entry.name, {})
            versions[entry.version] = entry
            self._versions[entry.name] = dict(sorted(versions.items(), key=_by_version))

    def subscribe(self, listener: Listener) -> None:
        self._listeners.append(listener)

    def watch_models(self, listener: Callable[[str], None]) -> None:
        """``listener(name)`` hears each state change of a model (a load, an
        unload, a failure), before the listeners of :meth:`subscribe`."""
        self._model_listeners.append(listener)

    def _changed(self) -> None:
        for listener in self._listeners:
            listener()

    def entries(self) -> list[ModelEntry]:
        return list(self._entries.values())

    def find(self, key: str) -> ModelEntry | None:
        """The entry of a key (a model's name, or ``name:version``), or by its
        name a numbered model's default version (:func:`_default`)."""
        entry = self._entries.get(key)
        if entry is not None:
            return entry
        versions = self._versions.get(key)
        return _default(versions) if versions else None

    def versions(self, name: str) -> list[ModelEntry]:
        """A model's versions in increasing order (one, for a model without
        numbered version folders); those unloaded on request left out, unless all are."""
        entry = self._entries.get(name)
        if entry is not None and not self._replaced(entry):
            return [entry]
        found = list(self._versions.get(name, {}).values())
        served = [e for e in found if e.state is not ModelState.UNLOADED]
        return served or found

    def _replaced(self, entry: ModelEntry) -> bool:
        """A model without numbered folders, unloaded since its folder got some."""
        return entry.state is ModelState.UNLOADED and entry.name in self._versions

    def version(self, name: str, version: str = "") -> ModelEntry | None:
        """The entry a call naming ``version`` of model ``name`` means, or None
        when the model has no such version served (:meth:`lookup` says why)."""
        entry = self._entries.get(name)
        if entry is not None and not self._replaced(entry):
            return entry if not version or version == entry.shown_version else None
        versions = self._versions.get(name)
        if not versions:
            return None
        if not version:
            return _default(versions)
        entry = versions.get(version)
        return entry if entry is not None and entry.state is not ModelState.UNLOADED else None

    def lookup(self, name: str, version: str = "") -> ModelEntry:
        """The entry for a request; NOT_FOUND for unknown names or versions."""
        entry = self._entries.get(name)
        if entry is not None and not self._replaced(entry):  # one version: the hot path
            if version and version != entry.shown_version:
                raise wrong_version(entry, version)
            return entry
        found = self.version(name, version)
        if found is not None:
            return found
        default = self.find(name)
        if default is None:
            raise unknown_model(name)
        raise wrong_version(default, version)

    def lookup_ready(self, name: str, version: str = "") -> ModelEntry:
        entry = self.lookup(name, version)
        if not entry.ready:
            which = f" version {entry.version}" if entry.versioned else ""
            raise ModelNotReady(
                f"model '{name}'{which} is not ready ({entry.state}: {entry.reason})"
            )
        return entry

    def set_state(
        self,
        key: str,
        state: ModelState,
        reason: str = "",
        specs: tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]] | None = None,
        policy: TransactionPolicy | None = None,
    ) -> None:
        entry = self._entries[key]
        entry.state = state
        entry.reason = reason
        if specs is not None:
            entry.inputs, entry.outputs = specs
        if policy is not None:
            entry.declared = policy
        for listener in self._model_listeners:
            listener(key)
        self._changed()

    def upsert(self, settings: ModelSettings) -> ModelEntry:
        """The entry for a model being (re)loaded live; an existing one keeps serving."""
        entry = self._entries.get(settings.key)
        if entry is None:
            entry = ModelEntry(
                settings.name,
                settings.version,
                settings.gid,
                ModelState.LOADING,
                "loading",
                settings,
                settings.inputs,
                settings.outputs,
                key=settings.key,
            )
            self._add(entry)
            self._changed()
        return entry

    def unserved(self, bad: InvalidModel) -> None:
        """A version a model's policy picks that cannot be served: listed UNAVAILABLE."""
        key = f"{bad.name}:{bad.version}"
        entry = self._entries.get(key)
        if entry is None:
            self._add(
                ModelEntry(
                    bad.name, bad.version, bad.gid, ModelState.UNAVAILABLE, bad.reason, key=key
                )
            )
            self._changed()
        elif not entry.ready:
            self.set_state(key, ModelState.UNAVAILABLE, bad.reason)

    def ready_by_name(self) -> dict[str, bool]:
        """Each model's health: ready when some version of it is."""
        ready: dict[str, bool] = {}
        for e in self._entries.values():
            ready[e.name] = ready.get(e.name, False) or e.ready
        return ready

    def configured(self) -> list[ModelEntry]:
        """Models that should be serving: every one but those unloaded on request."""
        return [e for e in self._entries.values() if e.state is not ModelState.UNLOADED]

    def all_ready(self) -> bool:
        """True only when some model is configured and every configured one is ready."""
        configured = self.configured()
        return bool(configured) and all(e.ready for e in configured)


def wrong_version(entry: ModelEntry, version: str) -> ServingError:
    """A version the model does not have, NOT_FOUND, in the words of the server
    its clients know: MLServer's for an MLServer model (one that answers
    MLServer's own metadata); Triton's otherwise (its examples match on them),
    where a version that is no number at all is INVALID_ARGUMENT only if the
    model's own version is a number (Triton's integer versions): a model with
    a string version (``parameters.version: "v2"``) takes string versions."""
    name = entry.name
    if entry.own_metadata is not None:  # mlserver.errors.ModelNotFound's text
        return ModelNotFound(f"Model {clip(name)} with version {clip(version)} not found")
    if not _numbered(version) and _numbered(entry.version):
        return InvalidInput(
            f"failed to get model version from specified version string '{clip(version)}' "
            f"(model '{clip(name)}' is numbered: a version is an integer > 0, or empty for "
            "the model's version)"
        )
    return ModelNotFound(
        f"Request for unknown model: '{clip(name)}' version {clip(version)} is not found"
    )


def _numbered(version: str) -> bool:
    return version.isascii() and version.isdigit()


def _by_version(item: tuple[str, ModelEntry]) -> tuple[int, str]:
    version = item[0]
    return (int(version), "") if _numbered(version) else (0, version)


def _default(versions: dict[str, ModelEntry]) -> ModelEntry:
    """A call with no version gets the highest version ready (Triton's rule), else
    the highest still configured (a call then hears why it is not ready), else the
    highest of all."""
    entries = list(versions.values())
    for wanted in (
        lambda e: e.ready,
        lambda e: e.state is not ModelState.UNLOADED,
    ):
        found = [e for e in entries if wanted(e)]
        if found:
            return found[-1]
    return entries[-1]
