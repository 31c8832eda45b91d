"""Unit tests of the schedule_policy rules (service/contract/schedule.py) and their parameters."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from poolserve.protos import inference_pb2 as pb
from poolserve.service.contract.errors import InvalidInput
from poolserve.service.contract.repository import parse_model_settings
from poolserve.service.contract.schedule import (
    NO_LEVEL,
    PriorityLevels,
    deadline_precision,
    queue_level,
    request_deadline,
)
from poolserve.service.contract.settings import ConfigError
from poolserve.service.contract.wire import peek_routing


def test_priority_zero_or_absent_is_the_default_level() -> None:
    levels = PriorityLevels(3, 2)
    assert queue_level("m", levels, None) == 2
    assert queue_level("m", levels, 0) == 2
    assert [queue_level("m", levels, p) for p in (1, 2, 3)] == [1, 2, 3]
    assert queue_level("m", PriorityLevels(), None) == NO_LEVEL
    assert queue_level("m", PriorityLevels(), 0) == NO_LEVEL


@pytest.mark.parametrize(
    ("levels", "priority", "words"),
    [
        (PriorityLevels(3, 2), 4, "levels 1 to 3"),
        (PriorityLevels(3, 2), -1, ">= 0"),
        (PriorityLevels(3, 2), 2**64 - 1, "levels 1 to 3"),
        (PriorityLevels(), 1, "declares no priority levels"),
    ],
)
def test_priority_outside_the_models_levels_is_invalid(
    levels: PriorityLevels, priority: int, words: str
) -> None:
    with pytest.raises(InvalidInput, match=words):
        queue_level("m", levels, priority)


def test_timeout_parameter_caps_the_deadline_in_microseconds() -> None:
    assert request_deadline(100.0, 40.0, 250_000) == (40.25, 0.001)  # the cap is exact
    deadline, precision = request_deadline(50.0, 40.0, 60_000_000)  # later than the client's
    assert (deadline, precision) == (50.0, deadline_precision(10.0))
    assert request_deadline(50.0, 40.0, 0)[0] == 50.0  # 0: no timeout, as in Triton
    assert request_deadline(50.0, 40.0, None)[0] == 50.0
    with pytest.raises(InvalidInput, match=">= 0"):
        request_deadline(50.0, 40.0, -1)


def test_deadline_precision_covers_the_grpc_timeout_encoding() -> None:
    # 3% (HPACK reuse) + one unit (ms below 1 s, 10 ms below 10 s, 100 ms below
    # 100 s, 1 s below 1000 s) + a millisecond
    assert deadline_precision(0.2) == pytest.approx(0.006 + 0.002)
    assert deadline_precision(2.0) == pytest.approx(0.06 + 0.011)
    assert deadline_precision(20.0) == pytest.approx(0.6 + 0.101)
    assert deadline_precision(200.0) == pytest.approx(6.0 + 1.001)
    assert deadline_precision(-1.0) == pytest.approx(0.002)


def _settings(tmp_path: Path, extra: dict[str, object]) -> Path:
    path = tmp_path / "m" / "model-settings.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(
        json.dumps({"name": "m", "implementation": "x.Y", "parameters": {"extra": extra}})
    )
    return path


def test_levels_come_from_parameters_extra(tmp_path: Path) -> None:
    assert parse_model_settings(_settings(tmp_path, {})).priority == PriorityLevels()
    settings = parse_model_settings(_settings(tmp_path, {"priority_levels": 4}))
    assert settings.priority == PriorityLevels(4, 4)  # default: the lowest level
    both = {"priority_levels": 4, "default_priority_level": 1}
    assert parse_model_settings(_settings(tmp_path, both)).priority == PriorityLevels(4, 1)


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"priority_levels": -1}, "parameters.extra.priority_levels"),
        ({"priority_levels": "3"}, "parameters.extra.priority_levels"),
        ({"priority_levels": True}, "parameters.extra.priority_levels"),
        ({"priority_levels": 3, "default_priority_level": 0}, "default_priority_level"),
        ({"priority_levels": 3, "default_priority_level": 4}, "default_priority_level"),
        ({"default_priority_level": 1}, "default_priority_level"),
    ],
)
def test_bad_levels_name_the_file_and_field(
    tmp_path: Path, extra: dict[str, object], field: str
) -> None:
    path = _settings(tmp_path, extra)
    with pytest.raises(ConfigError) as info:
        parse_model_settings(path)
    assert field in str(info.value) and str(path) in str(info.value)


def _routing_of(**params: pb.InferParameter) -> bytes:
    request = pb.ModelInferRequest(model_name="m")
    for key, value in params.items():
        request.parameters[key].CopyFrom(value)
    return request.SerializeToString()


def test_wire_reads_priority_and_timeout_as_triton_takes_them() -> None:
    routing = peek_routing(
        _routing_of(
            priority=pb.InferParameter(uint64_param=2**64 - 1),
            timeout=pb.InferParameter(int64_param=1500),
        )
    )
    assert (routing.priority, routing.timeout_us) == (2**64 - 1, 1500)
    negative = peek_routing(_routing_of(timeout=pb.InferParameter(int64_param=-3)))
    assert negative.timeout_us == -3


@pytest.mark.parametrize(
    ("key", "value", "words"),
    [
        ("priority", pb.InferParameter(string_param="1"), "int64_param or uint64_param"),
        ("priority", pb.InferParameter(bool_param=True), "int64_param or uint64_param"),
        ("priority", pb.InferParameter(double_param=1.0), "int64_param or uint64_param"),
        ("timeout", pb.InferParameter(uint64_param=5), "int64_param"),
        ("timeout", pb.InferParameter(string_param="5"), "int64_param"),
        ("idempotent", pb.InferParameter(string_param="no"), "bool_param"),
    ],
)
def test_wire_refuses_scheduling_parameters_of_another_type(
    key: str, value: pb.InferParameter, words: str
) -> None:
    with pytest.raises(InvalidInput, match=words):
        peek_routing(_routing_of(**{key: value}))
