"""Server and model settings: parsing, validation, and where each value comes from.

Server settings are layered: defaults < MLServer's ``MLSERVER_*`` variables <
``settings.json`` in the repository root (poolserve's fields, or MLServer's:
:mod:`poolserve.service.contract.mlserver_settings`) < ``POOLSERVE_*``
environment variables < command-line flags. Model
settings follow MLServer's ``model-settings.json`` so repositories move over.
Every problem is a :class:`ConfigError` that names the file and the field.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

SAFE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
DEFAULT_POOL = "default"
MIB = 1024 * 1024


class ConfigError(Exception):
    """An invalid configuration. The CLI prints it and exits with code 2."""

    def __init__(self, source: str, field_name: str, problem: str) -> None:
        super().__init__(f"{source}: field '{field_name}': {problem}")
        self.source = source
        self.field_name = field_name
        self.problem = problem


START_METHODS = ("fork", "spawn")


@dataclass(frozen=True)
class PoolOverride:
    workers: int | None = None
    threads_per_worker: int | None = None
    start_method: str | None = None
    unary_workers: int | None = None


@dataclass(frozen=True)
class ServerSettings:
    host: str = "127.0.0.1"
    grpc_port: int = 8081
    metrics_port: int = 8082  # the router's HTTP /metrics, on host; 0: any free port, -1: off
    parallel_workers: int = 2
    # Router processes sharing grpc_port and http_port (SO_REUSEPORT); "auto":
    # one per ROUTER_CORES usable cores (affinity, cgroup CPU quota), at least one.
    routers: int | str = 1
    pools: Mapping[str, PoolOverride] = field(default_factory=dict)
    max_queue: int = 1024
    max_message_size: int = 64 * MIB
    max_concurrent_streams: int = 1024  # per client connection, at the router
    run_dir: str = ""
    default_timeout_s: float = 60.0
    deadline_margin_ms: float = 1.0
    stop_grace_s: float = 10.0
    log_format: str = "text"
    heartbeat_interval_s: float = 1.0
    heartbeat_timeout_s: float = 30.0
    reject_hopeless: bool = False
    model_control: bool = True
    # Model control touches the repository at most once per this many seconds:
    # one scan for every load of a name not yet routed, one real reload per model.
    repository_rescan_s: float = 2.0
    tls_cert_file: str = ""
    tls_key_file: str = ""
    tls_client_ca_file: str = ""  # set: clients must present a certificate it signed
    server_name: str = "poolserve"
    # A pool or router whose event loop has not turned for heartbeat_timeout_s
    # plus this long is killed (SIGKILL to its process group) and restarted.
    watchdog_grace_s: float = 10.0
    # Connections to the router's port (gRPC server channel options).
    handshake_timeout_s: float = 10.0  # until the client's HTTP/2 SETTINGS (and TLS)
    max_connection_idle_s: float = 300.0  # no call in flight: GOAWAY; 0 = never
    keepalive_time_s: float = 60.0  # ping a connection with calls but no traffic
    keepalive_timeout_s: float = 20.0  # no ping ack within this: the connection is closed
    max_connection_age_s: float = 0.0  # 0 = no limit
    max_connection_age_grace_s: float = 30.0  # calls in flight may finish within this
    # Reply bytes held for clients that do not read them (RESOURCE_EXHAUSTED beyond).
    max_unread_reply_bytes: int = 32 * MIB  # per client connection
    max_unread_reply_bytes_total: int = 256 * MIB  # all connections together
    # Request bytes the router's own HTTP/2 port holds for calls (arrived, not yet
    # answered); past them windows are not given back and new streams are refused.
    max_request_bytes_held: int = 128 * MIB  # per client connection
    max_request_bytes_held_total: int = 256 * MIB  # all connections together
    # A ModelStreamInfer whose client takes none of its responses for this long
    # (they wait on its gRPC window) is ended with RESOURCE_EXHAUSTED and its
    # worker freed for the pool's other callers; 0: never (docs/streaming.md).
    stream_stall_s: float = 10.0
    # Workers of a pool that its streams (decoupled models) may not hold, kept for
    # its other calls, in a pool that serves both; streams always get one worker.
    unary_workers: int = 1
    # A reply past a bound waits while its connection (or, for the total, any)
    # reads; refused once nothing was read for this long (0: refused at once).
    unread_reply_grace_s: float = 5.0
    # The router's HTTP/REST door (Open Inference Protocol REST, Triton's HTTP API).
    http_port: int = 8080  # on host; 0: any free port, -1: off
    http_max_header_bytes: int = 16 * 1024  # request line and headers together; 431 beyond
    http_keepalive_timeout_s: float = 75.0  # an idle keep-alive connection is closed after this
    http_max_connections: int = 1024  # open HTTP connections; one more is closed at once

    # Native runtimes and fork (docs/native-runtimes.md):
    threads_per_worker: int = 1  # OMP/MKL/OpenBLAS/... threads in each pool process
    warmup_timeout_s: float = 10.0  # a fresh worker's warm-up prediction of each model
    abandon_grace_s: float = 5.0  # a worker still on a job its caller left is killed (0: never)
    start_method: str = "fork"  # "spawn": each worker a fresh interpreter that loads the models
    # ModelStreamInfer's messages: "kserve" (ModelStreamInferResponse, errors in-stream
    # in error_message: Triton's and KServe's clients), "mlserver" (bare
    # ModelInferResponses, an error ends the stream with its status: MLServer's stubs)
    # or "auto" (per stream: MLServer's for a stream of an MLServer model, as
    # `mlserver start` answers it; KServe's for every other model)
    stream_messages: str = "auto"
    # The router's gRPC port: "poolserve" (its own HTTP/2 on the event loop, the
    # lighter path for light calls) or "grpcio" (grpcio's server, as before).
    grpc_engine: str = "poolserve"

    # Shared memory and the workers' own memory (docs/protocol.md):
    shm_max_regions: int = 1024  # registered at once, per registry (RESOURCE_EXHAUSTED beyond)
    shm_max_name_length: int = 255  # characters of a region's name (keys: NAME_MAX bytes)
    slab_mapped_bytes: int = 512 * MIB  # the router's slabs one worker keeps mapped

    # The response cache of each pool server (models with parameters.extra.response_cache,
    # docs/models.md): its bounds, shared by the pool's models; 0 in either: no cache.
    response_cache_bytes: int = 64 * MIB
    response_cache_entries: int = 100_000

    def threads_for(self, gid: str) -> int:
        override = self.pools.get(gid)
        if override is not None and override.threads_per_worker is not None:
            return override.threads_per_worker
        return self.threads_per_worker

    def start_method_for(self, gid: str) -> str:
        override = self.pools.get(gid)
        if override is not None and override.start_method is not None:
            return override.start_method
        return self.start_method

    def unary_workers_for(self, gid: str) -> int:
        override = self.pools.get(gid)
        if override is not None and override.unary_workers is not None:
            return override.unary_workers
        return self.unary_workers

    def workers_for(self, gid: str) -> int:
        override = self.pools.get(gid)
        if override is not None and override.workers is not None:
            return override.workers
        return self.parallel_workers

    def resolved_run_dir(self) -> Path:
        if self.run_dir:
            return Path(self.run_dir)
        base = os.environ.get("XDG_RUNTIME_DIR") or "/tmp"
        return Path(base) / f"poolserve-{os.getuid()}-{self.grpc_port}"


_INT_FIELDS = {
    "grpc_port",
    "metrics_port",
    "http_port",
    "http_max_header_bytes",
    "http_max_connections",
    "parallel_workers",
    "unary_workers",
    "max_queue",
    "max_message_size",
    "max_concurrent_streams",
    "max_unread_reply_bytes",
    "max_unread_reply_bytes_total",
    "max_request_bytes_held",
    "max_request_bytes_held_total",
    "threads_per_worker",
    "shm_max_regions",
    "shm_max_name_length",
    "slab_mapped_bytes",
    "response_cache_bytes",
    "response_cache_entries",
}
_FLOAT_FIELDS = {
    "default_timeout_s",
    "deadline_margin_ms",
    "stop_grace_s",
    "heartbeat_interval_s",
    "heartbeat_timeout_s",
    "watchdog_grace_s",
    "handshake_timeout_s",
    "unread_reply_grace_s",
    "max_connection_idle_s",
    "keepalive_time_s",
    "keepalive_timeout_s",
    "stream_stall_s",
    "max_connection_age_s",
    "max_connection_age_grace_s",
    "repository_rescan_s",
    "warmup_timeout_s",
    "abandon_grace_s",
    "http_keepalive_timeout_s",
}
# Float fields that must be above zero (in the others 0 means "off" or "at
# once"): a default deadline of 0 fails every call, a heartbeat of 0 kills every
# worker, a handshake timeout of 0 closes every connection, a warm-up limit of
# 0 marks every model failed, a keepalive of 0 pings or drops every connection.
_POSITIVE_FIELDS = {
    "default_timeout_s",
    "heartbeat_interval_s",
    "heartbeat_timeout_s",
    "handshake_timeout_s",
    "keepalive_time_s",
    "keepalive_timeout_s",
    "warmup_timeout_s",
    "http_keepalive_timeout_s",
}
HEARTBEAT_MISSES = 2  # heartbeat_timeout_s spans at least this many intervals
_BOOL_FIELDS = {"reject_hopeless", "model_control"}
_STR_FIELDS = {
    "host",
    "run_dir",
    "log_format",
    "server_name",
    "tls_cert_file",
    "tls_key_file",
    "tls_client_ca_file",
    "start_method",
    "stream_messages",
    "grpc_engine",
}
STREAM_MESSAGES = ("auto", "kserve", "mlserver")
GRPC_ENGINES = ("poolserve", "grpcio")
ROUTERS_AUTO = "auto"
MAX_ROUTERS = 64
ROUTER_CORES = 4  # routers "auto": one router per this many usable cores


def _check_routers(source: str, value: object) -> int | str:
    """``routers``: an integer 1..MAX_ROUTERS or "auto" (a string of digits, from
    the environment or the command line, is the integer)."""
    if isinstance(value, str):
        text = value.strip().lower()
        if text == ROUTERS_AUTO:
            return ROUTERS_AUTO
        if text.isdigit():
            value = int(text)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(
            source,
            "routers",
            f"expected an integer from 1 to {MAX_ROUTERS} or 'auto', got {value!r}",
        )
    if not 1 <= value <= MAX_ROUTERS:
        raise ConfigError(
            source, "routers", f"out of range: {value} (expected 1 to {MAX_ROUTERS}, or 'auto')"
        )
    return value


def router_count(settings: ServerSettings, cores: int) -> int:
    """How many router processes ``routers`` asks for on a machine where this
    process may use ``cores`` (:func:`poolserve.service.lifecycle.cpus.usable_cores`)."""
    if settings.routers == ROUTERS_AUTO:
        return max(1, min(MAX_ROUTERS, cores // ROUTER_CORES))
    return int(settings.routers)


def _check_value(source: str, name: str, value: object) -> object:
    if name in _INT_FIELDS:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(source, name, f"expected an integer, got {value!r}")
        low = {
            "grpc_port": 0,
            "parallel_workers": 0,
            "unary_workers": 0,
            "metrics_port": -1,
            "http_port": -1,
            "response_cache_bytes": 0,
            "response_cache_entries": 0,
        }.get(name, 1)
        if value < low or (name in {"grpc_port", "metrics_port", "http_port"} and value > 65535):
            raise ConfigError(source, name, f"out of range: {value}")
        return value
    if name in _FLOAT_FIELDS:
        if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
            raise ConfigError(source, name, f"expected a non-negative number, got {value!r}")
        if not math.isfinite(value):  # JSON's NaN and Infinity, or "inf" in a variable
            raise ConfigError(source, name, f"expected a finite number, got {value!r}")
        if name in _POSITIVE_FIELDS and value == 0:
            raise ConfigError(source, name, "must be above 0")
        return float(value)
    if name in _STR_FIELDS:
        if not isinstance(value, str):
            raise ConfigError(source, name, f"expected a string, got {value!r}")
        if name == "log_format" and value not in ("text", "json"):
            raise ConfigError(source, name, "expected 'text' or 'json'")
        if name == "start_method" and value not in START_METHODS:
            raise ConfigError(source, name, "expected 'fork' or 'spawn'")
        if name == "stream_messages" and value not in STREAM_MESSAGES:
            raise ConfigError(source, name, "expected 'auto', 'kserve' or 'mlserver'")
        if name == "grpc_engine" and value not in GRPC_ENGINES:
            raise ConfigError(source, name, "expected 'poolserve' or 'grpcio'")
        return value
    if name in _BOOL_FIELDS:
        if not isinstance(value, bool):
            raise ConfigError(source, name, f"expected true or false, got {value!r}")
        return value
    if name == "pools":
        return _parse_pools(source, value)
    if name == "routers":
        return _check_routers(source, value)
    raise ConfigError(source, name, "unknown field")


def _parse_pools(source: str, value: object) -> dict[str, PoolOverride]:
    if not isinstance(value, dict):
        raise ConfigError(source, "pools", "expected an object of gid -> settings")
    pools: dict[str, PoolOverride] = {}
    for gid, raw in value.items():
        if not SAFE_ID.match(gid):
            raise ConfigError(source, f"pools.{gid}", "unsafe pool id")
        if not isinstance(raw, dict) or set(raw) - _POOL_FIELDS:
            raise ConfigError(
                source,
                f"pools.{gid}",
                'expected {"workers": N, "threads_per_worker": N, "start_method": "fork"|"spawn", '
                '"unary_workers": N}',
            )
        for key, least in (("workers", 0), ("threads_per_worker", 1), ("unary_workers", 0)):
            # workers 0, as parallel_workers 0: the pool runs its models inline
            count = raw.get(key)
            if count is not None and (
                isinstance(count, bool) or not isinstance(count, int) or count < least
            ):
                raise ConfigError(source, f"pools.{gid}.{key}", f"expected an integer >= {least}")
        method = raw.get("start_method")
        if method is not None and method not in START_METHODS:
            raise ConfigError(source, f"pools.{gid}.start_method", "expected 'fork' or 'spawn'")
        pools[gid] = PoolOverride(
            raw.get("workers"), raw.get("threads_per_worker"), method, raw.get("unary_workers")
        )
    return pools


_POOL_FIELDS = {"workers", "threads_per_worker", "start_method", "unary_workers"}


def apply_overrides(
    base: ServerSettings, values: Mapping[str, object], source: str
) -> ServerSettings:
    checked = {name: _check_value(source, name, v) for name, v in values.items()}
    return replace(base, **checked)  # type: ignore[arg-type]


def _env_values(environ: Mapping[str, str]) -> dict[str, object]:
    values: dict[str, object] = {}
    for f in fields(ServerSettings):
        raw = environ.get("POOLSERVE_" + f.name.upper())
        if raw is None:
            continue
        source = "POOLSERVE_" + f.name.upper()
        if f.name in _INT_FIELDS:
            try:
                values[f.name] = int(raw)
            except ValueError:
                raise ConfigError(source, f.name, f"expected an integer, got {raw!r}") from None
        elif f.name in _FLOAT_FIELDS:
            try:
                values[f.name] = float(raw)
            except ValueError:
                raise ConfigError(source, f.name, f"expected a number, got {raw!r}") from None
        elif f.name in _BOOL_FIELDS:
            if raw.lower() not in ("true", "false", "1", "0"):
                raise ConfigError(source, f.name, f"expected true or false, got {raw!r}")
            values[f.name] = raw.lower() in ("true", "1")
        elif f.name == "pools":
            try:
                values[f.name] = json.loads(raw)
            except json.JSONDecodeError as exc:
                raise ConfigError(source, f.name, f"invalid JSON: {exc}") from None
        else:
            values[f.name] = raw
    return values


def read_json_object(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ConfigError(str(path), "(file)", f"invalid JSON: {exc}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(str(path), "(file)", f"cannot read: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(str(path), "(file)", "expected a JSON object")
    return data


def check_tls(settings: ServerSettings, source: str) -> None:
    """Both or neither of cert and key; a client CA only with them; files readable."""
    if bool(settings.tls_cert_file) != bool(settings.tls_key_file):
        raise ConfigError(source, "tls_cert_file", "tls_cert_file and tls_key_file go together")
    if settings.tls_client_ca_file and not settings.tls_cert_file:
        raise ConfigError(source, "tls_client_ca_file", "mutual TLS needs tls_cert_file too")
    for name in ("tls_cert_file", "tls_key_file", "tls_client_ca_file"):
        path = getattr(settings, name)
        if path and not os.access(path, os.R_OK):
            raise ConfigError(source, name, f"cannot read {path}")


def load_server_settings(
    repository: Path,
    environ: Mapping[str, str] | None = None,
    flags: Mapping[str, object] | None = None,
) -> ServerSettings:
    """Layers defaults, ``settings.json``, ``POOLSERVE_*`` and CLI flags."""
    if not repository.is_dir():
        raise ConfigError(str(repository), "(repository)", "not a directory")
    env = os.environ if environ is None else environ
    settings, sources, _ = _file_layers(repository, env)
    path = repository / "settings.json"
    env_values = _env_values(env)
    for name, value in env_values.items():  # an error names the variable, as a parse error does
        settings = apply_overrides(settings, {name: value}, "POOLSERVE_" + name.upper())
    sources |= {name: "POOLSERVE_" + name.upper() for name in env_values}
    cli = {k: v for k, v in (flags or {}).items() if v is not None}
    settings = apply_overrides(settings, cli, "command line")
    sources |= dict.fromkeys(cli, "command line")
    check_tls(settings, str(path) if path.exists() else "environment")
    check_together(settings, sources)
    return settings


def _file_layers(
    repository: Path, environ: Mapping[str, str]
) -> tuple[ServerSettings, dict[str, str], list[str]]:
    """Defaults < MLServer's ``MLSERVER_*`` < ``settings.json`` (poolserve's or
    MLServer's fields, :mod:`poolserve.service.contract.mlserver_settings`):
    (settings, the layer of each field set, notices about MLServer's fields)."""
    from poolserve.service.contract import mlserver_settings as mls

    own = {f.name for f in fields(ServerSettings)}
    settings = ServerSettings()
    sources: dict[str, str] = {}  # field -> the layer that set it last
    values, env_notices = mls.translate(mls.env_values(environ), own)
    settings = apply_overrides(settings, values, "MLSERVER_* environment")
    sources |= dict.fromkeys(values, "MLSERVER_* environment")
    notices = [f"MLSERVER_* variables: {n}" for n in env_notices]
    path = repository / "settings.json"
    if path.exists():
        values, file_notices = mls.translate(read_json_object(path), own)
        settings = apply_overrides(settings, values, str(path))
        sources |= dict.fromkeys(values, str(path))
        notices += [f"{path}: {n}" for n in file_notices]
    return settings, sources, notices


def mlserver_notices(repository: Path, environ: Mapping[str, str] | None = None) -> list[str]:
    """What of MLServer's settings poolserve reads, renames or leaves out: said
    once, by ``poolserve serve``."""
    return _file_layers(repository, os.environ if environ is None else environ)[2]


def check_together(settings: ServerSettings, sources: Mapping[str, str]) -> None:
    """Fields that are valid alone but break serving together; the error names
    the layer that set the field last."""

    def source(*names: str) -> str:
        return next((sources[n] for n in names if n in sources), "defaults")

    interval, timeout = settings.heartbeat_interval_s, settings.heartbeat_timeout_s
    if timeout < HEARTBEAT_MISSES * interval:
        raise ConfigError(
            source("heartbeat_timeout_s", "heartbeat_interval_s"),
            "heartbeat_timeout_s",
            f"{timeout:g} s is below {HEARTBEAT_MISSES} x heartbeat_interval_s ({interval:g} s): "
            "healthy workers would be killed for a late heartbeat",
        )
    if settings.deadline_margin_ms >= settings.default_timeout_s * 1000:
        raise ConfigError(
            source("deadline_margin_ms", "default_timeout_s"),
            "deadline_margin_ms",
            f"{settings.deadline_margin_ms:g} ms leaves nothing of default_timeout_s "
            f"({settings.default_timeout_s:g} s): every call without a deadline would fail",
        )
