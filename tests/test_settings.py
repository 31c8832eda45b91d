"""Server settings layering and model repository discovery."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from poolserve.service.contract.repository import scan
from poolserve.service.contract.settings import ConfigError, load_server_settings

from support import write_model

IMPL = "poolserve.service.runtimes.SKLearnModel"


def test_defaults(tmp_path: Path) -> None:
    s = load_server_settings(tmp_path, environ={})
    assert (s.host, s.grpc_port, s.parallel_workers, s.max_queue) == ("127.0.0.1", 8081, 2, 1024)
    assert s.max_message_size == 64 * 1024 * 1024


def test_layering_file_then_env_then_flags(tmp_path: Path) -> None:
    (tmp_path / "settings.json").write_text(
        json.dumps({"grpc_port": 9000, "parallel_workers": 3, "pools": {"heavy": {"workers": 4}}})
    )
    s = load_server_settings(tmp_path, environ={"POOLSERVE_GRPC_PORT": "9100"})
    assert s.grpc_port == 9100
    assert s.workers_for("heavy") == 4
    assert s.workers_for("other") == 3
    s = load_server_settings(
        tmp_path, environ={"POOLSERVE_GRPC_PORT": "9100"}, flags={"grpc_port": 9200}
    )
    assert s.grpc_port == 9200


@pytest.mark.parametrize(
    ("content", "field"),
    [
        ("{not json", "(file)"),
        ('{"grpc_port": "x"}', "grpc_port"),
        ('{"grpc_port": 70000}', "grpc_port"),
        ('{"no_such_field": 1}', "no_such_field"),
        ('{"pools": {"a/b": {"workers": 1}}}', "pools.a/b"),
        ('{"pools": {"x": {"workers": -1}}}', "pools.x.workers"),
        ('{"pools": {"x": {"workers": true}}}', "pools.x.workers"),
        ('{"pools": {"x": {"unary_workers": -1}}}', "pools.x.unary_workers"),
        ('{"unary_workers": -1}', "unary_workers"),
        # Values each valid in form that break serving (issue 21, section 5).
        ('{"default_timeout_s": NaN}', "default_timeout_s"),
        ('{"default_timeout_s": Infinity}', "default_timeout_s"),
        ('{"default_timeout_s": -1}', "default_timeout_s"),
        ('{"default_timeout_s": 0}', "default_timeout_s"),
        ('{"stop_grace_s": Infinity}', "stop_grace_s"),
        ('{"deadline_margin_ms": NaN}', "deadline_margin_ms"),
        ('{"heartbeat_timeout_s": 0}', "heartbeat_timeout_s"),
        ('{"heartbeat_interval_s": 0}', "heartbeat_interval_s"),
        ('{"handshake_timeout_s": 0}', "handshake_timeout_s"),
        ('{"keepalive_time_s": 0}', "keepalive_time_s"),
        ('{"keepalive_timeout_s": 0}', "keepalive_timeout_s"),
        ('{"warmup_timeout_s": 0}', "warmup_timeout_s"),
        ('{"heartbeat_timeout_s": 1, "heartbeat_interval_s": 1}', "heartbeat_timeout_s"),
        ('{"heartbeat_timeout_s": 0.5}', "heartbeat_timeout_s"),
        ('{"deadline_margin_ms": 2000, "default_timeout_s": 2}', "deadline_margin_ms"),
        ("[]", "(file)"),
    ],
)
def test_invalid_settings_name_file_and_field(tmp_path: Path, content: str, field: str) -> None:
    (tmp_path / "settings.json").write_text(content)
    with pytest.raises(ConfigError) as info:
        load_server_settings(tmp_path, environ={})
    assert info.value.field_name == field
    assert str(tmp_path / "settings.json") in str(info.value)


@pytest.mark.parametrize("raw", ["nan", "inf", "-inf", "-1", "0"])
def test_a_default_timeout_that_fails_every_call_is_refused_from_the_environment(
    tmp_path: Path, raw: str
) -> None:
    with pytest.raises(ConfigError) as info:
        load_server_settings(tmp_path, environ={"POOLSERVE_DEFAULT_TIMEOUT_S": raw})
    assert info.value.field_name == "default_timeout_s"
    assert info.value.source == "POOLSERVE_DEFAULT_TIMEOUT_S"  # the variable, not "environment"


def test_a_heartbeat_pair_names_the_layer_that_broke_it(tmp_path: Path) -> None:
    (tmp_path / "settings.json").write_text(json.dumps({"heartbeat_interval_s": 1}))
    with pytest.raises(ConfigError) as info:
        load_server_settings(tmp_path, environ={"POOLSERVE_HEARTBEAT_TIMEOUT_S": "1.5"})
    assert (info.value.source, info.value.field_name) == (
        "POOLSERVE_HEARTBEAT_TIMEOUT_S",
        "heartbeat_timeout_s",
    )
    assert "2 x heartbeat_interval_s" in info.value.problem
    ok = load_server_settings(tmp_path, environ={"POOLSERVE_HEARTBEAT_TIMEOUT_S": "2"})
    assert (ok.heartbeat_interval_s, ok.heartbeat_timeout_s) == (1.0, 2.0)


def test_zero_workers_is_accepted_for_the_server_and_for_one_pool(tmp_path: Path) -> None:
    # 0 workers: the pool runs its models inline (tests/test_run_dir_e2e.py serves with it).
    (tmp_path / "settings.json").write_text(json.dumps({"pools": {"light": {"workers": 0}}}))
    s = load_server_settings(tmp_path, environ={}, flags={"parallel_workers": 0})
    assert (s.workers_for("light"), s.workers_for("other")) == (0, 0)


def test_unary_workers_for_every_pool_and_for_one(tmp_path: Path) -> None:
    """The workers a pool keeps from its streams (docs/streaming.md): 1 by
    default, 0 allowed, per pool too."""
    assert load_server_settings(tmp_path, environ={}).unary_workers_for("any") == 1
    (tmp_path / "settings.json").write_text(json.dumps({"pools": {"mixed": {"unary_workers": 3}}}))
    s = load_server_settings(tmp_path, environ={"POOLSERVE_UNARY_WORKERS": "0"})
    assert (s.unary_workers_for("mixed"), s.unary_workers_for("other")) == (3, 0)


def test_invalid_env_value(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="POOLSERVE_PARALLEL_WORKERS"):
        load_server_settings(tmp_path, environ={"POOLSERVE_PARALLEL_WORKERS": "two"})


def test_missing_repository(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not a directory"):
        load_server_settings(tmp_path / "nope", environ={})


def test_models_sharing_a_gid_form_one_pool(tmp_path: Path) -> None:
    write_model(tmp_path, "a", {"implementation": IMPL, "parameters": {"inference_pool_gid": "g"}})
    write_model(tmp_path, "b", {"implementation": IMPL, "parameters": {"inference_pool_gid": "g"}})
    write_model(tmp_path, "nested/c", {"implementation": IMPL})
    repo = scan(tmp_path)
    pools = repo.pools()
    assert list(pools) == ["default", "g"]
    assert sorted(m.name for m in pools["g"]) == ["a", "b"]
    assert [m.name for m in pools["default"]] == ["c"]


def test_model_settings_fields(tmp_path: Path) -> None:
    write_model(
        tmp_path,
        "m",
        {
            "name": "renamed",
            "implementation": IMPL,
            "parameters": {"uri": "w.joblib", "version": "7", "extra": {"timeout_s": 2}},
            "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}],
            "max_batch_size": 8,
        },
    )
    (model,) = scan(tmp_path).models
    assert model.name == "renamed"
    assert model.version == "7"
    assert model.uri == str(tmp_path / "m" / "w.joblib")
    assert model.timeout_s == 2.0
    assert model.inputs[0].shape == (-1, 4)
    assert model.max_batch_size == 8


@pytest.mark.parametrize(
    ("settings", "problem"),
    [
        ({"implementation": 5}, "implementation"),
        ({}, "implementation"),
        ({"implementation": IMPL, "parameters": {"inference_pool_gid": "../x"}}, "unsafe pool"),
        ({"implementation": IMPL, "bogus": 1}, "bogus"),
        ({"implementation": IMPL, "inputs": [{"name": "x", "shape": "1"}]}, "shape"),
    ],
)
def test_invalid_model_is_kept_with_reason(
    tmp_path: Path, settings: dict[str, object], problem: str
) -> None:
    write_model(tmp_path, "bad", settings)
    write_model(tmp_path, "good", {"implementation": IMPL})
    repo = scan(tmp_path)
    assert [m.name for m in repo.models] == ["good"]
    (bad,) = repo.invalid
    assert bad.name == "bad"
    assert problem in bad.reason
    assert "model-settings.json" in bad.reason


def test_duplicate_model_names(tmp_path: Path) -> None:
    write_model(tmp_path, "a", {"name": "same", "implementation": IMPL})
    write_model(tmp_path, "b", {"name": "same", "implementation": IMPL})
    repo = scan(tmp_path)
    assert len(repo.models) == 1
    assert "duplicate" in repo.invalid[0].reason


def test_broken_json_model(tmp_path: Path) -> None:
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "model-settings.json").write_text("{")
    repo = scan(tmp_path)
    assert repo.invalid[0].name == "x"
    assert "invalid JSON" in repo.invalid[0].reason
