"""Model versions without a server: Triton's version_policy, numbered version
folders in the repository scan, the catalog's choice of a version per call,
a worker's choice of its model, and a load's version_policy override."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from poolserve.protos import inference_pb2 as pb
from poolserve.service.contract.errors import InvalidInput, ModelNotFound, ModelNotReady
from poolserve.service.contract.repository import (
    ModelSettings,
    model_versions,
    parse_model_version,
    scan,
)
from poolserve.service.contract.settings import ConfigError
from poolserve.service.contract.versions import (
    VersionPolicy,
    numbered_folders,
    parse_version_policy,
    version_number,
)
from poolserve.service.inference.named import model_named
from poolserve.service.poolserver.catalog import Catalog, ModelState
from poolserve.service.poolserver.load_request import parse_load_request

# -- the policy ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ({"latest": {}}, VersionPolicy("latest", 1)),
        ({"latest": {"num_versions": 2}}, VersionPolicy("latest", 2)),
        ({"latest": {"num_versions": "3"}}, VersionPolicy("latest", 3)),  # int64 as JSON string
        ({"all": {}}, VersionPolicy("all")),
        ({"specific": {"versions": [3, 1, 3]}}, VersionPolicy("specific", versions=(1, 3))),
        ({"specific": {"versions": ["2"]}}, VersionPolicy("specific", versions=(2,))),
    ],
)
def test_policies_in_tritons_json_shape(value: object, expected: VersionPolicy) -> None:
    assert parse_version_policy("m.json", value) == expected


@pytest.mark.parametrize(
    ("value", "field"),
    [
        ("latest", "version_policy"),
        ({}, "version_policy"),
        ({"newest": {}}, "version_policy"),
        ({"latest": {}, "all": {}}, "version_policy"),
        ({"latest": []}, "version_policy.latest"),
        ({"latest": {"num_versions": 0}}, "version_policy.latest.num_versions"),
        ({"latest": {"num_versions": True}}, "version_policy.latest.num_versions"),
        ({"latest": {"count": 1}}, "version_policy.latest.count"),
        ({"all": {"versions": [1]}}, "version_policy.all.versions"),
        ({"specific": {}}, "version_policy.specific.versions"),
        ({"specific": {"versions": []}}, "version_policy.specific.versions"),
        ({"specific": {"versions": [0]}}, "version_policy.specific.versions[0]"),
        ({"specific": {"versions": [1, "x"]}}, "version_policy.specific.versions[1]"),
    ],
)
def test_a_bad_policy_names_its_field(value: object, field: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_version_policy("m.json", value)
    assert caught.value.field_name == field
    assert str(caught.value).startswith("m.json: field ")


def test_each_policy_picks_its_versions() -> None:
    found = [1, 2, 3, 5]
    assert VersionPolicy().select(found) == (5,)
    assert VersionPolicy("latest", 2).select(found) == (3, 5)
    assert VersionPolicy("latest", 9).select(found) == (1, 2, 3, 5)
    assert VersionPolicy("all").select(found) == (1, 2, 3, 5)
    assert VersionPolicy("specific", versions=(1, 4)).select(found) == (1, 4)


def test_version_folders_are_integers_above_zero(tmp_path: Path) -> None:
    for name in ("1", "2", "10", "0", "01", "v3", "x"):
        (tmp_path / name).mkdir()
    (tmp_path / "7").write_text("a file, not a folder")
    assert numbered_folders(tmp_path) == [1, 2, 10]
    assert version_number("3") == 3
    assert version_number("0") is None
    assert version_number("٣") is None  # a digit, but not ASCII


# -- the repository --------------------------------------------------------------


def _model(root: Path, name: str, versions: list[int], **settings: object) -> Path:
    folder = root / name
    folder.mkdir(parents=True)
    document = {"name": name, "implementation": "model.M", **settings}
    (folder / "model-settings.json").write_text(json.dumps(document))
    for number in versions:
        (folder / str(number)).mkdir()
        (folder / str(number) / "weights.txt").write_text(str(number))
    return folder


def _served(root: Path) -> dict[str, list[str]]:
    repository = scan(root)
    out: dict[str, list[str]] = {}
    for model in repository.models:
        out.setdefault(model.name, []).append(model.version)
    return out


def test_numbered_folders_are_versions_and_the_latest_is_served(tmp_path: Path) -> None:
    _model(tmp_path, "m", [1, 2, 3])
    repository = scan(tmp_path)
    (only,) = repository.models
    assert (only.version, only.versioned, only.key) == ("3", True, "m:3")
    assert only.folder == tmp_path / "m" / "3"
    assert only.model_folder == tmp_path / "m"
    assert only.source == tmp_path / "m" / "model-settings.json"


def test_each_policy_in_the_repository(tmp_path: Path) -> None:
    _model(tmp_path, "all", [1, 2, 3], version_policy={"all": {}})
    _model(tmp_path, "two", [1, 2, 3], version_policy={"latest": {"num_versions": 2}})
    _model(tmp_path, "some", [1, 2, 3], version_policy={"specific": {"versions": [1, 3]}})
    _model(tmp_path, "plain", [])
    assert _served(tmp_path) == {
        "all": ["1", "2", "3"],
        "plain": ["1"],
        "some": ["1", "3"],
        "two": ["2", "3"],
    }
    plain = scan(tmp_path).model("plain")
    assert plain is not None and not plain.versioned and plain.key == "plain"


def test_a_version_uri_is_inside_its_folder(tmp_path: Path) -> None:
    _model(tmp_path, "m", [1, 2], parameters={"uri": "model.joblib"}, version_policy={"all": {}})
    uris = [m.uri for m in scan(tmp_path).models]
    assert uris == [
        str(tmp_path / "m" / "1" / "model.joblib"),
        str(tmp_path / "m" / "2" / "model.joblib"),
    ]


def test_a_specific_version_without_its_folder_is_unserved(tmp_path: Path) -> None:
    _model(tmp_path, "m", [1, 2], version_policy={"specific": {"versions": [2, 4]}})
    repository = scan(tmp_path)
    assert [m.version for m in repository.models] == ["2"]
    (bad,) = repository.unserved_of("default")
    assert (bad.name, bad.version, bad.versioned) == ("m", "4", True)
    assert "version 4 of model 'm' is not in the repository" in bad.reason
    assert not repository.invalid


def test_a_policy_with_no_version_to_serve_makes_the_model_invalid(tmp_path: Path) -> None:
    _model(tmp_path, "m", [1], version_policy={"specific": {"versions": [5]}})
    repository = scan(tmp_path)
    assert not repository.models
    (bad,) = repository.invalid
    assert bad.name == "m" and "no folder" in bad.reason


@pytest.mark.parametrize(
    ("versions", "settings", "problem"),
    [
        ([1], {"version_policy": {"latest": {"num_versions": -1}}}, "expected 1 or more"),
        ([], {"version_policy": {"all": {}}}, "no numbered version folders"),
        (
            [1],
            {"version_policy": {"all": {}}, "parameters": {"version": "1"}},
            "write one or the other",
        ),
    ],
)
def test_a_bad_policy_is_an_invalid_model_not_a_crash(
    tmp_path: Path, versions: list[int], settings: dict[str, object], problem: str
) -> None:
    _model(tmp_path, "m", versions, **settings)
    _model(tmp_path, "ok", [])
    repository = scan(tmp_path)
    assert [m.name for m in repository.models] == ["ok"]
    (bad,) = repository.invalid
    assert bad.name == "m" and "version_policy" in bad.reason and problem in bad.reason


def test_mlservers_parameters_version_is_one_named_version(tmp_path: Path) -> None:
    _model(tmp_path, "m", [1, 2], parameters={"version": "v7"})
    (only,) = scan(tmp_path).models
    assert (only.version, only.versioned, only.version_declared) == ("v7", False, True)
    assert only.folder == tmp_path / "m"


def test_a_second_settings_file_of_a_name_is_a_duplicate(tmp_path: Path) -> None:
    _model(tmp_path, "a", [])
    other = tmp_path / "b"
    other.mkdir()
    (other / "model-settings.json").write_text(
        json.dumps({"name": "a", "implementation": "model.M", "parameters": {"version": "2"}})
    )
    repository = scan(tmp_path)
    assert [m.name for m in repository.models] == ["a"]
    assert "duplicate of model 'a'" in repository.invalid[0].reason


def test_one_version_parsed_as_the_pool_names_it(tmp_path: Path) -> None:
    folder = _model(tmp_path, "m", [1, 2])
    two = parse_model_version(folder / "model-settings.json", "2")
    assert (two.key, two.folder) == ("m:2", folder / "2")
    with pytest.raises(ConfigError, match="version 5 has no folder"):
        parse_model_version(folder / "model-settings.json", "5")
    base = parse_model_version(folder / "model-settings.json", "")
    versions, missing = model_versions(base, VersionPolicy("all"))
    assert [v.key for v in versions] == ["m:1", "m:2"] and not missing


def test_an_ensemble_step_names_an_older_version(tmp_path: Path) -> None:
    _model(
        tmp_path,
        "m",
        [1, 2],
        version_policy={"all": {}},
        inputs=[{"name": "X", "datatype": "FP32", "shape": [-1]}],
        outputs=[{"name": "Y", "datatype": "FP32", "shape": [-1]}],
    )

    def ensemble(name: str, version: object) -> None:
        folder = tmp_path / name
        folder.mkdir()
        step = {"model_name": "m", "model_version": version}
        step |= {"input_map": {"X": "IN"}, "output_map": {"Y": "OUT"}}
        document = {"name": name, "platform": "ensemble"}
        document["parameters"] = {"extra": {"ensemble_scheduling": {"step": [step]}}}
        (folder / "model-settings.json").write_text(json.dumps(document))

    ensemble("old", 1)
    ensemble("default", -1)
    ensemble("gone", 3)
    repository = scan(tmp_path)
    steps = {e.name: e.steps[0].version for e in repository.ensembles}
    assert steps == {"default": "", "old": "1"}
    (bad,) = repository.invalid
    assert bad.name == "gone" and "model 'm' has version 1, 2, not 3" in bad.reason


# -- the catalog -----------------------------------------------------------------


def _catalog(tmp_path: Path, policy: dict[str, object]) -> Catalog:
    _model(tmp_path, "m", [1, 2, 3], version_policy=policy)
    _model(tmp_path, "plain", [])
    repository = scan(tmp_path)
    catalog = Catalog.from_settings(repository.models, repository.unserved)
    for entry in catalog.entries():
        if entry.state is ModelState.LOADING:
            catalog.set_state(entry.key, ModelState.READY)
    return catalog


def test_an_empty_version_is_the_highest_ready(tmp_path: Path) -> None:
    catalog = _catalog(tmp_path, {"all": {}})
    assert catalog.lookup_ready("m").key == "m:3"
    assert catalog.lookup_ready("m", "1").key == "m:1"
    catalog.set_state("m:3", ModelState.UNAVAILABLE, "broken")
    assert catalog.lookup_ready("m").key == "m:2"  # the highest that serves
    with pytest.raises(ModelNotReady, match="model 'm' version 3 is not ready"):
        catalog.lookup_ready("m", "3")
    assert [e.version for e in catalog.versions("m")] == ["1", "2", "3"]
    assert catalog.ready_by_name() == {"m": True, "plain": True}


def test_a_version_not_served_is_not_found_in_tritons_words(tmp_path: Path) -> None:
    catalog = _catalog(tmp_path, {"specific": {"versions": [1, 3]}})
    with pytest.raises(ModelNotFound, match="'m' version 2 is not found"):
        catalog.lookup("m", "2")
    with pytest.raises(InvalidInput, match="failed to get model version"):
        catalog.lookup("m", "two")
    catalog.set_state("m:1", ModelState.UNLOADED, "left out")
    with pytest.raises(ModelNotFound):
        catalog.lookup("m", "1")
    assert catalog.version("m", "1") is None
    assert [e.version for e in catalog.versions("m")] == ["3"]
    # a model without version folders keeps its one version's rules
    assert catalog.lookup("plain", "1").key == "plain"
    with pytest.raises(ModelNotFound, match="'plain' version 2 is not found"):
        catalog.lookup("plain", "2")


def test_a_missing_version_is_listed_unavailable(tmp_path: Path) -> None:
    _model(tmp_path, "m", [1, 2], version_policy={"specific": {"versions": [2, 4]}})
    repository = scan(tmp_path)
    catalog = Catalog.from_settings(repository.models, repository.unserved)
    states = {(e.name, e.version): e.state for e in catalog.entries()}
    assert states == {("m", "2"): ModelState.LOADING, ("m", "4"): ModelState.UNAVAILABLE}
    catalog.set_state("m:2", ModelState.READY)
    assert catalog.lookup_ready("m").version == "2"
    assert not catalog.all_ready()  # as Triton: a version that failed keeps the server not ready


# -- a worker's models -------------------------------------------------------------


class _Held:
    def __init__(self, settings: ModelSettings) -> None:
        self.settings = settings


def test_a_worker_picks_the_version_a_request_names(tmp_path: Path) -> None:
    _model(tmp_path, "m", [1, 2], version_policy={"all": {}})
    _model(tmp_path, "plain", [])
    models = {m.key: _Held(m) for m in scan(tmp_path).models}
    assert model_named(models, "m", "1").settings.version == "1"  # type: ignore[arg-type]
    assert model_named(models, "m", "").settings.version == "2"  # type: ignore[arg-type]
    assert model_named(models, "plain", "").settings.key == "plain"  # type: ignore[arg-type]
    for name, version in (("m", "3"), ("plain", "2"), ("other", "")):
        with pytest.raises(ModelNotFound):
            model_named(models, name, version)  # type: ignore[arg-type]


# -- a load's override -------------------------------------------------------------


def test_a_load_may_narrow_the_policy() -> None:
    request = pb.RepositoryModelLoadRequest(model_name="m")
    config = {"version_policy": {"specific": {"versions": [3]}}}
    request.parameters["config"].string_param = json.dumps(config)
    assert parse_load_request(request).version_policy == VersionPolicy("specific", versions=(3,))
    request.parameters["config"].string_param = json.dumps({"version_policy": {"latest": 1}})
    with pytest.raises(InvalidInput, match=r"config field 'version_policy\.latest'"):
        parse_load_request(request)


def test_a_settings_file_in_a_version_folder_is_not_a_model(tmp_path: Path) -> None:
    folder = _model(tmp_path, "m", [1, 2])
    (folder / "1" / "model-settings.json").write_text(json.dumps({"name": "other"}))
    repository = scan(tmp_path)
    assert [m.key for m in repository.models] == ["m:2"]
    assert not repository.invalid


def test_a_reload_loads_a_model_whose_versions_changed(tmp_path: Path) -> None:
    from poolserve.supervisor.reconcile import Desired, plan_reload

    folder = _model(tmp_path, "m", [1, 2], version_policy={"all": {}})
    _model(tmp_path, "plain", [])
    before = Desired.load(tmp_path, {})
    assert plan_reload(before, Desired.load(tmp_path, {})).empty
    (folder / "3").mkdir()
    plan = plan_reload(before, Desired.load(tmp_path, {}))
    (change,) = plan.models
    assert (change.load, change.unload) == (("m",), ())
    assert not plan.routes_changed  # the same model, in the same pool
