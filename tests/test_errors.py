"""The one place where errors become statuses: names cut, load failures named."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from poolserve.service.contract.errors import (
    MAX_MESSAGE,
    FailedPrecondition,
    InvalidInput,
    ModelNotFound,
    clip,
    load_failed,
)
from poolserve.service.contract.repository import ModelSettings
from poolserve.service.grpcserver.status import grpc_status
from poolserve.service.poolserver.catalog import Catalog


def test_clip_keeps_short_names_and_cuts_long_ones_saying_how_long() -> None:
    assert clip("echo") == "echo"
    assert clip("x" * 200) == "x" * 200
    assert clip("x" * 201) == "x" * 200 + "...[201 characters]"


def test_a_huge_model_name_gets_its_not_found_with_a_short_message() -> None:
    name = "m" * (1 << 20)
    try:
        Catalog().lookup(name)
    except ModelNotFound as exc:
        code, message = grpc_status(exc)
    assert code is grpc.StatusCode.NOT_FOUND
    shown = f"'{'m' * 200}...[{1 << 20} characters]'"
    assert message == f"Request for unknown model: {shown} is not in this repository"


def test_every_status_message_is_bounded() -> None:
    code, message = grpc_status(InvalidInput("x" * 100_000))
    assert code is grpc.StatusCode.INVALID_ARGUMENT
    assert len(message) <= MAX_MESSAGE + 30


def test_load_failures_start_like_tritons_and_keep_their_code() -> None:
    error = load_failed("echo", FailedPrecondition("model 'echo' has invalid settings"))
    assert isinstance(error, FailedPrecondition)
    assert error.message == "failed to load 'echo': model 'echo' has invalid settings"
    assert load_failed("echo", error) is error  # said once, however many layers pass it on
    long = load_failed("n" * 5000, ModelNotFound("no such model"))
    assert long.message.startswith(f"failed to load '{'n' * 200}...[5000 characters]': ")


@pytest.mark.parametrize(
    ("name", "version", "code", "text"),
    [
        # Triton's words, on which its example programs match
        ("nope", "", "NOT_FOUND", "Request for unknown model: 'nope' is not in this repository"),
        (
            "simple",
            "wrong_specification",
            "INVALID_ARGUMENT",
            "failed to get model version from specified version string 'wrong_specification'",
        ),
        ("simple", "-1", "INVALID_ARGUMENT", "from specified version string '-1'"),
        ("simple", "2", "NOT_FOUND", "Request for unknown model: 'simple' version 2 is not found"),
    ],
)
def test_unknown_models_and_versions_are_refused_in_tritons_words(
    name: str, version: str, code: str, text: str
) -> None:
    catalog = Catalog()
    catalog.upsert(ModelSettings("simple", "m.A", Path("."), Path("x")))
    assert catalog.lookup("simple", "1").name == "simple"
    try:
        catalog.lookup(name, version)
    except (ModelNotFound, InvalidInput) as exc:
        got, message = grpc_status(exc)
    assert got.name == code
    assert text in message


def test_versions_are_refused_truthfully() -> None:
    """A model with a string version takes string versions: another one is
    NOT_FOUND (not "a version is an integer"); an MLServer model's answer is
    MLServer's text (mlserver.errors.ModelNotFound)."""
    catalog = Catalog()
    catalog.upsert(ModelSettings("named", "m.A", Path("."), Path("x"), version="v2"))
    catalog.upsert(ModelSettings("mls", "m.A", Path("."), Path("y")))
    mls = catalog.find("mls")
    assert mls is not None
    mls.own_metadata = b""  # it answers MLServer's metadata: an MLServer model
    for name, version, code, text in (
        ("named", "v3", "NOT_FOUND", "Request for unknown model: 'named' version v3 is not found"),
        ("named", "3", "NOT_FOUND", "Request for unknown model: 'named' version 3 is not found"),
        ("mls", "v1.2.3", "NOT_FOUND", "Model mls with version v1.2.3 not found"),
        ("mls", "2", "NOT_FOUND", "Model mls with version 2 not found"),
    ):
        with pytest.raises((ModelNotFound, InvalidInput)) as caught:
            catalog.lookup(name, version)
        got, message = grpc_status(caught.value)
        assert (got.name, message) == (code, text)
    assert catalog.lookup("named", "v2").name == "named"
