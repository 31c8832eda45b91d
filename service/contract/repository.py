"""The model repository: discovery of ``model-settings.json`` files and pools.

Compatible with MLServer's repository layout. A model whose settings are
invalid is kept as an :class:`InvalidModel` with its reason, so that it shows
up in RepositoryIndex as UNAVAILABLE and keeps the server not ready; it never
crashes discovery. Models that share an ``inference_pool_gid`` form exactly
one pool (:meth:`Repository.pools` is the only place that groups them).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from poolserve.service.contract.batching import BatchPolicy, batch_settings
from poolserve.service.contract.ensemble import Ensemble, is_ensemble, resolve
from poolserve.service.contract.schedule import PriorityLevels, priority_levels
from poolserve.service.contract.sequence import SequencePolicy, sequence_policy
from poolserve.service.contract.settings import (
    DEFAULT_POOL,
    SAFE_ID,
    ConfigError,
    read_json_object,
)
from poolserve.service.contract.versions import (
    FIELD as VERSION_POLICY,
)
from poolserve.service.contract.versions import (
    LATEST_ONE,
    VersionPolicy,
    numbered_folders,
    parse_version_policy,
    version_number,
)

SETTINGS_FILE = "model-settings.json"
# Triton numbers versions and perf_analyzer parses them as integers: a model
# without parameters.version is version "1". Requests may leave it empty.
DEFAULT_VERSION = "1"
_MODEL_FIELDS = {
    "name",
    "implementation",
    "parameters",
    "inputs",
    "outputs",
    "max_batch_size",
    "max_batch_time",
    "platform",
    "versions",
    VERSION_POLICY,  # Triton's: which numbered version folders are served (contract/versions.py)
    "parallel_workers",
    "warm_workers",
    "cache_enabled",  # MLServer's; poolserve has no response cache
}
_PARAMETER_FIELDS = {
    "uri",
    "version",
    "inference_pool_gid",
    "extra",
    "environment_tarball",
    # MLServer's, read by an mlserver.MLModel's own settings (runtimes/mlmodel.py)
    "content_type",
    "format",
    "environment_path",
    "autogenerate_inference_pool_gid",
}


# Triton's ModelInput.Format: how an image input lays out its dimensions.
INPUT_FORMATS = ("FORMAT_NONE", "FORMAT_NHWC", "FORMAT_NCHW")


@dataclass(frozen=True)
class TensorSpec:
    name: str
    datatype: str
    shape: tuple[int, ...]
    format: str = "FORMAT_NONE"  # inputs: parameters.format
    label_filename: str = ""  # outputs: parameters.label_filename, relative to the model folder


@dataclass(frozen=True)
class TransactionPolicy:
    """How a loaded model answers (declared by the model, see
    ``Model.transaction_policy``; by default its settings' ``decoupled``)."""

    decoupled: bool = False  # ModelStreamInfer runs predict_stream: any number of responses
    unary: bool = True  # ModelInfer runs predict (else refused: use ModelStreamInfer)


@dataclass(frozen=True)
class ModelSettings:
    name: str
    implementation: str
    folder: Path
    source: Path
    version: str = DEFAULT_VERSION
    uri: str | None = None
    gid: str = DEFAULT_POOL
    extra: Mapping[str, Any] = field(default_factory=dict)
    inputs: tuple[TensorSpec, ...] = ()
    outputs: tuple[TensorSpec, ...] = ()
    max_batch_size: int = 0
    max_batch_time: float = 0.0
    platform: str = ""
    parallel_workers: int | None = None
    # parameters.extra.priority_levels and default_priority_level
    priority: PriorityLevels = field(default_factory=PriorityLevels)
    # parameters.extra.preferred_batch_sizes and batch_safe_parameters
    preferred_batch_sizes: tuple[int, ...] = ()
    batch_safe_parameters: frozenset[str] = frozenset()
    # parameters.extra.sequence: a sequence model (sticky routing, per-sequence state)
    sequence: SequencePolicy | None = None
    # parameters.version was written: False when ``version`` is DEFAULT_VERSION by
    # default (MLServer shows such a model with no version at all)
    version_declared: bool = False
    # one version of a model with numbered version folders: ``folder`` is the
    # version's own (``m/2``), the settings file is the model's (``m/``)
    versioned: bool = False
    # version_policy as written (None: not written; a numbered model then serves its latest)
    version_policy: VersionPolicy | None = None

    @property
    def model_folder(self) -> Path:
        """The model's folder: its version folder's parent for a numbered version."""
        return self.folder.parent if self.versioned else self.folder

    def at_version(self, number: int) -> ModelSettings:
        """These settings as version ``number`` of a numbered model, loading from ``<folder>/N``."""
        root = self.model_folder
        folder = root / str(number)
        uri = self.uri
        if uri is not None and Path(uri).is_relative_to(root):
            uri = str(folder / Path(uri).relative_to(root))
        return replace(self, version=str(number), folder=folder, uri=uri, versioned=True)

    @property
    def batching(self) -> BatchPolicy | None:
        """How the dispatcher batches this model's requests; None: one at a time."""
        if self.max_batch_size <= 1:
            return None
        return BatchPolicy(
            self.max_batch_size,
            self.max_batch_time,
            self.preferred_batch_sizes,
            self.batch_safe_parameters,
        )

    @property
    def is_ensemble(self) -> bool:
        """Steps run by other models: by the router, or as one job in the pool the
        steps share (contract/ensemble.py, contract/chain.py)."""
        return self.platform == "ensemble" and not self.implementation

    @property
    def key(self) -> str:
        """The model's identity in its pool (catalog, zygote, workers, dispatcher):
        its name, or ``name:version`` for a version of a model with several
        (names never hold a colon)."""
        return f"{self.name}:{self.version}" if self.versioned else self.name

    @property
    def timeout_s(self) -> float | None:
        value = self.extra.get("timeout_s")
        return float(value) if isinstance(value, int | float) else None

    @property
    def decoupled(self) -> bool:
        """parameters.extra.decoupled: any number of responses per request, on
        ModelStreamInfer only (``Model.predict_stream``)."""
        return self.extra.get("decoupled") is True

    @property
    def policy(self) -> TransactionPolicy:
        """The settings' word: decoupled (stream only) or unary (Triton's rule)."""
        return TransactionPolicy(decoupled=self.decoupled, unary=not self.decoupled)

    @property
    def response_cache(self) -> bool:
        """parameters.extra.response_cache (Triton's ``response_cache { enable: true }``):
        the pool server answers a request it answered before from its cache
        (checked when the settings are read: :func:`response_cache_setting`)."""
        return response_cache_setting("", self.extra)

    @property
    def stream_window(self) -> int:
        """parameters.extra.stream_window: a decoupled model's responses that a
        worker sends ahead of what the client took (default 16)."""
        value = self.extra.get("stream_window")
        return value if isinstance(value, int) and value > 0 else 16


@dataclass(frozen=True)
class InvalidModel:
    name: str
    source: Path
    reason: str
    version: str = DEFAULT_VERSION
    gid: str = DEFAULT_POOL
    ensemble: bool = False  # an ensemble's settings that do not check out
    versioned: bool = False  # a version of a numbered model that cannot be served


@dataclass(frozen=True)
class Repository:
    root: Path
    models: tuple[ModelSettings, ...]
    invalid: tuple[InvalidModel, ...]
    # ensembles have no pool of their own: run by the router over their models' pools,
    # or as one job in the pool their steps share
    ensembles: tuple[Ensemble, ...] = ()
    # versions a model's policy picks that cannot be served (no folder) while
    # others of it can: its pool lists each UNAVAILABLE (InvalidModel.versioned)
    unserved: tuple[InvalidModel, ...] = ()

    def pools(self) -> dict[str, list[ModelSettings]]:
        """Valid models grouped by gid: one entry per pool, never two for a gid."""
        pools: dict[str, list[ModelSettings]] = {}
        for model in self.models:
            pools.setdefault(model.gid, []).append(model)
        return dict(sorted(pools.items()))

    def model(self, name: str) -> ModelSettings | None:
        """The model's settings (its highest version's, for a numbered model)."""
        found = self.versions(name)
        return found[-1] if found else None

    def versions(self, name: str) -> list[ModelSettings]:
        """Every version of a model its policy serves, in increasing order."""
        return [model for model in self.models if model.name == name]

    def unserved_of(self, gid: str) -> list[InvalidModel]:
        """The versions of the pool's models that cannot be served."""
        return [bad for bad in self.unserved if bad.gid == gid]


def _tensor_specs(
    source: str, key: str, value: object, batch_dims: int = 0
) -> tuple[TensorSpec, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise ConfigError(source, key, "expected a list of tensors")
    specs = []
    for i, item in enumerate(value):
        where = f"{key}[{i}]"
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise ConfigError(source, where, "expected {name, datatype, shape}")
        shape = item.get("shape", [])
        if not isinstance(shape, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) for d in shape
        ):
            raise ConfigError(source, f"{where}.shape", "expected a list of integers")
        datatype = item.get("datatype", "")
        if not isinstance(datatype, str):
            raise ConfigError(source, f"{where}.datatype", "expected a string")
        fmt, labels = _tensor_parameters(source, where, key, item.get("parameters"))
        if fmt != "FORMAT_NONE" and len(shape) - batch_dims != 3:
            raise ConfigError(
                source,
                f"{where}.parameters.format",
                f"{fmt} needs 3 dimensions besides the batch dimension, shape is {shape}",
            )
        specs.append(TensorSpec(item["name"], datatype, tuple(shape), fmt, labels))
    return tuple(specs)


def _tensor_parameters(source: str, where: str, key: str, params: object) -> tuple[str, str]:
    """A tensor's ``format`` (inputs) and ``label_filename`` (outputs); the other
    parameters (MLServer's ``content_type``...) are left to the model."""
    if params is None:
        return "FORMAT_NONE", ""
    fields: dict[str, Any] = _expect(source, f"{where}.parameters", params, dict)
    fmt = fields.get("format", "FORMAT_NONE")
    if fmt != "FORMAT_NONE" and key != "inputs":
        raise ConfigError(source, f"{where}.parameters.format", "only inputs have a format")
    if fmt not in INPUT_FORMATS:
        raise ConfigError(
            source, f"{where}.parameters.format", f"expected one of {', '.join(INPUT_FORMATS)}"
        )
    labels = fields.get("label_filename", "")
    if labels and key != "outputs":
        raise ConfigError(source, f"{where}.parameters.label_filename", "only outputs have labels")
    if not isinstance(labels, str):
        raise ConfigError(source, f"{where}.parameters.label_filename", "expected a file name")
    return fmt, labels


def _expect(source: str, key: str, value: object, kind: type | tuple[type, ...]) -> Any:
    if isinstance(value, bool) and kind is not bool:
        raise ConfigError(source, key, f"expected {_kind_name(kind)}, got {value!r}")
    if not isinstance(value, kind):
        raise ConfigError(source, key, f"expected {_kind_name(kind)}, got {value!r}")
    return value


def _kind_name(kind: type | tuple[type, ...]) -> str:
    if isinstance(kind, tuple):
        return " or ".join(k.__name__ for k in kind)
    return kind.__name__


def response_cache_setting(source: str, extra: Mapping[str, Any]) -> bool:
    """``parameters.extra.response_cache``: ``true``/``false`` (or those words,
    as a load's ``config`` override sets parameters), or Triton's ``{"enable":
    true}``; ConfigError (with ``source``) for anything else, and for a
    decoupled or sequence model, whose replies the cache never holds."""
    value: object = extra.get("response_cache", False)
    if isinstance(value, dict) and set(value) <= {"enable"}:
        value = value.get("enable", False)
    if isinstance(value, str) and value.lower() in ("true", "false"):
        value = value.lower() == "true"  # a load's config override: string parameters
    if not isinstance(value, bool):
        if not source:
            return False  # (the settings were checked when read)
        raise ConfigError(
            source,
            "parameters.extra.response_cache",
            f'expected true, false or {{"enable": true}}, got {value!r}',
        )
    if value and source:
        for other in ("decoupled", "sequence"):
            if extra.get(other) not in (None, False):
                raise ConfigError(
                    source,
                    "parameters.extra.response_cache",
                    f"a {other} model's replies are not cached (Triton's rule too)",
                )
    return value


def parse_model_settings(path: Path) -> ModelSettings:
    """Parses one ``model-settings.json``; raises ConfigError naming the field."""
    source = str(path)
    data = read_json_object(path)
    unknown = set(data) - _MODEL_FIELDS
    if unknown:
        raise ConfigError(source, sorted(unknown)[0], "unknown field")
    name = _expect(source, "name", data.get("name", path.parent.name), str)
    if not SAFE_ID.match(name):
        raise ConfigError(source, "name", f"unsafe model name {name!r}")
    params = _expect(source, "parameters", data.get("parameters", {}), dict)
    unknown = set(params) - _PARAMETER_FIELDS
    if unknown:
        raise ConfigError(source, "parameters." + sorted(unknown)[0], "unknown field")
    gid = _expect(
        source,
        "parameters.inference_pool_gid",
        params.get("inference_pool_gid") or DEFAULT_POOL,
        str,
    )
    if not SAFE_ID.match(gid):
        raise ConfigError(source, "parameters.inference_pool_gid", f"unsafe pool id {gid!r}")
    uri = params.get("uri")
    if uri is not None:
        uri = str(path.parent / _expect(source, "parameters.uri", uri, str))
    workers = data.get("parallel_workers")
    if workers is not None:
        workers = _expect(source, "parallel_workers", workers, int)
    extra = _expect(source, "parameters.extra", params.get("extra", {}), dict)
    platform = _expect(source, "platform", data.get("platform", ""), str)
    if is_ensemble(platform, data.get("implementation"), extra):
        if data.get("implementation") is not None:
            raise ConfigError(source, "implementation", "an ensemble has no implementation")
        platform, implementation = "ensemble", ""
    else:
        implementation = _expect(source, "implementation", data.get("implementation"), str)
    batch_size, batch_time, preferred, safe = batch_settings(
        source, data.get("max_batch_size", 0), data.get("max_batch_time", 0), extra
    )
    response_cache_setting(source, extra)
    batch_dims = 1 if batch_size > 0 else 0
    inputs = _tensor_specs(source, "inputs", data.get("inputs"), batch_dims)
    policy = _version_policy(source, data, params, path.parent, platform == "ensemble")
    return ModelSettings(
        name=name,
        implementation=implementation,
        folder=path.parent,
        source=path,
        version=_expect(source, "parameters.version", params.get("version", DEFAULT_VERSION), str),
        uri=uri,
        gid=gid,
        extra=extra,
        inputs=inputs,
        outputs=_tensor_specs(source, "outputs", data.get("outputs"), batch_dims),
        max_batch_size=batch_size,
        max_batch_time=batch_time,
        platform=platform,
        parallel_workers=workers,
        priority=priority_levels(source, extra),
        sequence=sequence_policy(source, extra, {s.name: s.datatype for s in inputs}),
        preferred_batch_sizes=preferred,
        batch_safe_parameters=safe,
        version_declared="version" in params,
        version_policy=policy,
    )


def _version_policy(
    source: str, data: Mapping[str, Any], params: Mapping[str, Any], folder: Path, ensemble: bool
) -> VersionPolicy | None:
    """``version_policy`` as written, checked against the model's layout: it
    picks among numbered version folders, so it needs some, and it does not
    go with ``parameters.version`` (MLServer's one named version) or an ensemble."""
    if VERSION_POLICY not in data:
        return None
    policy = parse_version_policy(source, data[VERSION_POLICY])
    if "version" in params:
        raise ConfigError(
            source,
            VERSION_POLICY,
            "parameters.version names the model's one version; version_policy picks among "
            "numbered version folders (1/, 2/, ...): write one or the other",
        )
    if ensemble:
        raise ConfigError(source, VERSION_POLICY, "an ensemble has one version")
    if not numbered_folders(folder):
        raise ConfigError(
            source,
            VERSION_POLICY,
            f"the model has no numbered version folders ({folder}/1, {folder}/2, ...) to pick from",
        )
    return policy


def model_versions(
    settings: ModelSettings, policy: VersionPolicy | None = None
) -> tuple[list[ModelSettings], list[InvalidModel]]:
    """The versions a model's settings serve: itself for a model without numbered
    version folders (or with ``parameters.version``, MLServer's one version, or an
    ensemble); else one settings per version its policy (``policy``, or the
    file's, or the latest one) picks, each loading from its own folder, and an
    InvalidModel for each picked version that has no folder."""
    if settings.version_declared or settings.is_ensemble:
        return [settings], []
    numbers = numbered_folders(settings.model_folder)
    if not numbers:
        return [settings], []
    chosen = policy or settings.version_policy or LATEST_ONE
    if policy is not None:
        settings = replace(settings, version_policy=policy)
    models, invalid = [], []
    for number in chosen.select(numbers):
        if number in numbers:
            models.append(settings.at_version(number))
        else:
            reason = (
                f"{settings.source}: version {number} of model '{settings.name}' is not in the "
                f"repository (version_policy {chosen.describe()}; no folder "
                f"{settings.model_folder / str(number)})"
            )
            invalid.append(
                InvalidModel(
                    settings.name,
                    settings.source,
                    reason,
                    str(number),
                    settings.gid,
                    versioned=True,
                )
            )
    return models, invalid


def parse_model_version(path: Path, version: str) -> ModelSettings:
    """One version's settings (``version`` "": the file's own model): what a
    zygote loads live and a spawned worker loads, as the pool named it."""
    settings = parse_model_settings(path)
    if not version or settings.version_declared or settings.is_ensemble:
        return settings
    number = int(version)
    if number not in numbered_folders(settings.model_folder):
        raise ConfigError(
            str(path), VERSION_POLICY, f"version {version} has no folder {path.parent / version}"
        )
    return settings.at_version(number)


def _name_guess(path: Path) -> str:
    try:
        data = read_json_object(path)
    except ConfigError:
        return path.parent.name
    name = data.get("name")
    return name if isinstance(name, str) and name else path.parent.name


def scan(root: Path) -> Repository:
    """Discovers every ``**/model-settings.json`` under ``root``."""
    if not root.is_dir():
        raise ConfigError(str(root), "(repository)", "not a directory")
    models: list[ModelSettings] = []
    invalid: list[InvalidModel] = []
    unserved: list[InvalidModel] = []
    seen: dict[str, Path] = {}
    for path in sorted(root.rglob(SETTINGS_FILE)):
        if (
            version_number(path.parent.name) is not None
            and (path.parent.parent / SETTINGS_FILE).is_file()
        ):
            continue  # in a version folder of a model: the version's own file, not a model
        try:
            model = parse_model_settings(path)
            versions, missing = model_versions(model)
        except ConfigError as exc:
            invalid.append(InvalidModel(_name_guess(path), path, str(exc)))
            continue
        earlier = seen.get(model.name)
        if earlier is not None:
            reason = (
                f"{path}: duplicate of model '{model.name}' already defined in "
                f"{earlier / SETTINGS_FILE} (a model's versions are numbered folders "
                "beside its one model-settings.json)"
            )
            invalid.append(InvalidModel(model.name, path, reason, model.version, model.gid))
            continue
        seen[model.name] = path.parent
        if versions:
            models.extend(versions)
            unserved.extend(missing)  # listed by the model's pool, per version
        else:  # no version to serve: the model is invalid, as any
            reason = "; ".join(bad.reason for bad in missing)
            invalid.append(InvalidModel(model.name, path, reason, model.version, model.gid))
    return _with_ensembles(root, models, invalid, unserved)


def _with_ensembles(
    root: Path,
    found: list[ModelSettings],
    invalid: list[InvalidModel],
    unserved: list[InvalidModel],
) -> Repository:
    """The ensembles apart from the models, each checked against them."""
    models = [m for m in found if not m.is_ensemble]
    by_name: dict[str, ModelSettings] = {}
    for m in models:  # by name, the highest version (found last); each version by its key
        by_name[m.name] = by_name[m.key] = m
    ensembles = []
    for settings in found:
        if not settings.is_ensemble:
            continue
        try:
            ensembles.append(resolve(settings, by_name))
        except ConfigError as exc:
            invalid.append(
                InvalidModel(
                    settings.name, settings.source, str(exc), settings.version, ensemble=True
                )
            )
    return Repository(root, tuple(models), tuple(invalid), tuple(ensembles), tuple(unserved))


# A folder with more files than this is not fingerprinted: its loads always
# reload, and a repository reload goes by its settings alone.
MAX_FINGERPRINT_FILES = 10_000
Fingerprint = tuple[tuple[str, int, int, int], ...]


def fingerprint(settings: ModelSettings) -> Fingerprint | None:
    """What a model was loaded from: size, mtime and inode of every file of its
    folder (and of ``parameters.uri`` when that lies outside it).

    None when the folder holds more than MAX_FINGERPRINT_FILES files: such a
    model is always reloaded rather than walked. Runs on a thread.
    """
    roots = [settings.folder]
    if settings.uri is not None and not Path(settings.uri).is_relative_to(settings.folder):
        roots.append(Path(settings.uri))
    seen: list[tuple[str, int, int, int]] = []
    for root in roots:
        if root.is_file():
            seen.append(_stat(root, str(root)))
            continue
        for folder, dirs, files in os.walk(root):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")  # written by imports
            for name in sorted(files):
                path = Path(folder, name)
                seen.append(_stat(path, str(path)))
            if len(seen) > MAX_FINGERPRINT_FILES:
                return None
    return tuple(seen)


def _stat(path: Path, key: str) -> tuple[str, int, int, int]:
    try:
        info = path.stat()
    except OSError:
        return (key, -1, -1, -1)
    return (key, info.st_size, info.st_mtime_ns, info.st_ino)
