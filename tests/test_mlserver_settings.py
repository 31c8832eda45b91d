"""MLServer's settings files and variables read as poolserve's
(service/contract/mlserver_settings.py): an MLServer repository moves over as is."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from poolserve.service.contract.repository import parse_model_settings
from poolserve.service.contract.settings import (
    ConfigError,
    load_server_settings,
    mlserver_notices,
)

MLSERVER_SETTINGS = {
    "debug": True,
    "parallel_workers": 3,
    "host": "0.0.0.0",
    "grpc_port": 9100,
    "http_port": 8080,
    "metrics_port": 8082,
    "model_repository_root": "/elsewhere",
    "grpc_max_message_length": 4096,
    "load_models_at_startup": True,
}


def write_settings(repo: Path, values: dict[str, object]) -> Path:
    repo.mkdir(parents=True, exist_ok=True)
    (repo / "settings.json").write_text(json.dumps(values))
    return repo


def test_mlserver_settings_json_is_read(tmp_path: Path) -> None:
    """Before: ConfigError 'debug: unknown field' (any MLServer-only field)."""
    repo = write_settings(tmp_path, MLSERVER_SETTINGS)
    settings = load_server_settings(repo, environ={})
    assert (settings.parallel_workers, settings.host, settings.grpc_port) == (3, "0.0.0.0", 9100)
    assert settings.max_message_size == 4096  # grpc_max_message_length, renamed
    notices = "\n".join(mlserver_notices(repo, environ={}))
    for field in ("debug", "load_models_at_startup"):
        assert f"{field}: " in notices, notices
    assert settings.metrics_port == 8082  # the same field, the same meaning: read as is
    assert settings.http_port == 8080  # the REST port, as in MLServer
    assert "metrics_port" not in notices and "http_port" not in notices
    assert "model_repository_root: ignored: the repository is the folder" in notices
    assert "grpc_max_message_length: read as max_message_size" in notices
    assert "parallel_workers" not in notices and "grpc_port" not in notices


def test_poolserve_name_wins_over_mlserver_rename(tmp_path: Path) -> None:
    repo = write_settings(tmp_path, {"grpc_max_message_length": 10, "max_message_size": 4096})
    assert load_server_settings(repo, environ={}).max_message_size == 4096
    assert any("max_message_size is set too" in n for n in mlserver_notices(repo, environ={}))


def test_mlserver_variables_below_the_file_and_poolserve_variables(tmp_path: Path) -> None:
    repo = write_settings(tmp_path, {"parallel_workers": 3})
    env = {
        "MLSERVER_PARALLEL_WORKERS": "5",  # the file beats it, as in MLServer
        "MLSERVER_GRPC_PORT": "9200",
        "MLSERVER_HOST": "0.0.0.0",
        "POOLSERVE_HOST": "127.0.0.2",  # poolserve's own wins
        "MLSERVER_DEBUG": "true",
        "MLSERVER_MODEL_IMPLEMENTATION": "x.Y",  # a model setting: not the server's
    }
    settings = load_server_settings(repo, environ=env)
    assert (settings.parallel_workers, settings.grpc_port, settings.host) == (3, 9200, "127.0.0.2")
    assert mlserver_notices(repo, environ=env) == [
        "MLSERVER_* variables: debug: ignored (poolserve's log_format and log level apply)"
    ]


def test_bad_mlserver_variable_names_itself(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="MLSERVER_GRPC_PORT"):
        load_server_settings(tmp_path, environ={"MLSERVER_GRPC_PORT": "eighty"})


def test_unknown_fields_are_still_refused(tmp_path: Path) -> None:
    repo = write_settings(tmp_path, {"parallel_workerz": 2})
    with pytest.raises(ConfigError, match="parallel_workerz"):
        load_server_settings(repo, environ={})


def test_model_settings_with_mlserver_fields_parse(tmp_path: Path) -> None:
    """Before: 'cache_enabled: unknown field' made such a model UNAVAILABLE."""
    path = tmp_path / "m" / "model-settings.json"
    path.parent.mkdir()
    path.write_text(
        json.dumps(
            {
                "name": "m",
                "implementation": "mlserver_sklearn.SKLearnModel",
                "cache_enabled": False,
                "parameters": {"uri": "./model.joblib", "content_type": "np", "format": "x"},
                "inputs": [{"name": "a", "datatype": "BYTES", "shape": [-1],
                            "parameters": {"content_type": "str"}}],
            }
        )
    )  # fmt: skip
    settings = parse_model_settings(path)
    assert settings.uri == str(tmp_path / "m" / "model.joblib")
    assert settings.inputs[0].name == "a"
