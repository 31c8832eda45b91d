"""MLServer's server settings read as poolserve's: a repository moves over as is.

An MLServer repository's ``settings.json`` (and the ``MLSERVER_*``
environment variables) may hold MLServer's fields. Those with a poolserve
meaning are taken (``parallel_workers``, ``grpc_port``, ``http_port``,
``host``, ``server_name``, ``metrics_port``: poolserve's own fields of those names;
``grpc_max_message_length`` as ``max_message_size``); the
others are not errors but notices (:func:`notices`) naming them: ``debug``,
``model_repository_root`` (the repository is the folder given on the command
line, as ``mlserver start FOLDER`` also overrides it), the other REST,
metrics, Kafka, cache... fields. Where poolserve's own field is set too, it wins.

Layers (lowest first): defaults < ``MLSERVER_*`` < ``settings.json`` <
``POOLSERVE_*`` < command-line flags. ``MLSERVER_*`` sits below the file as
in MLServer, whose values in ``settings.json`` beat its variables.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

ENV_PREFIX = "MLSERVER_"
# MLServer 1.7's Settings fields (mlserver.settings.Settings).
MLSERVER_FIELDS = frozenset(
    {
        "debug", "parallel_workers", "parallel_workers_timeout", "environments_dir",
        "model_repository_implementation", "model_repository_root",
        "model_repository_implementation_args", "load_models_at_startup", "server_name",
        "server_version", "extensions", "host", "http_port", "root_path", "grpc_port",
        "grpc_max_message_length", "cors_settings", "metrics_endpoint", "metrics_port",
        "metrics_rest_server_prefix", "metrics_dir", "use_structured_logging",
        "logging_settings", "kafka_enabled", "kafka_servers", "kafka_topic_input",
        "kafka_topic_output", "tracing_server", "cache_enabled", "cache_size", "gzip_enabled",
    }
)  # fmt: skip
RENAMED = {"grpc_max_message_length": "max_message_size"}
_INT_FIELDS = {"parallel_workers", "grpc_port", "grpc_max_message_length"}
WHY_IGNORED = {
    "debug": "ignored (poolserve's log_format and log level apply)",
    "model_repository_root": (
        "ignored: the repository is the folder given to `poolserve serve` "
        "(as `mlserver start FOLDER` overrides it too)"
    ),
}


def translate(
    values: Mapping[str, object], own: Collection[str]
) -> tuple[dict[str, object], list[str]]:
    """(poolserve's values, notices) for one layer's values.

    Fields of poolserve (``own``) are kept; MLServer's are renamed where
    poolserve has them under another name (unless poolserve's own name is
    set in the same layer) or left out with a notice; anything else is kept,
    for poolserve's check to refuse as an unknown field.
    """
    kept: dict[str, object] = {}
    notices: list[str] = []
    for name, value in values.items():
        if name in own or name not in MLSERVER_FIELDS:
            kept[name] = value
        elif name in RENAMED:
            target = RENAMED[name]
            if target in values:
                notices.append(f"{name}: ignored, {target} is set too and wins")
            elif value is not None:
                kept[target] = value
                notices.append(f"{name}: read as {target}")
        else:
            notices.append(f"{name}: {WHY_IGNORED.get(name, 'not supported by poolserve')}")
    return kept, notices


def env_values(environ: Mapping[str, str]) -> dict[str, object]:
    """MLServer's server settings from ``MLSERVER_<FIELD>`` variables."""
    from poolserve.service.contract.settings import ConfigError  # settings imports us

    values: dict[str, object] = {}
    for name in sorted(MLSERVER_FIELDS):
        raw = environ.get(ENV_PREFIX + name.upper())
        if raw is None:
            continue
        if name in _INT_FIELDS:
            try:
                values[name] = int(raw)
            except ValueError:
                source = ENV_PREFIX + name.upper()
                raise ConfigError(source, name, f"expected an integer, got {raw!r}") from None
        else:
            values[name] = raw
    return values
