"""Model versions: numbered version folders and Triton's ``version_policy``.

A model folder whose subfolders are named by integers above 0 (``1/``,
``2/``, ...) holds one model in several versions; each version loads from its
own folder. ``version_policy`` (top level of ``model-settings.json``, in
Triton's JSON shape) says which of them are served:

- ``{"latest": {"num_versions": N}}``: the N highest (the default, N = 1);
- ``{"all": {}}``: every one;
- ``{"specific": {"versions": [1, 3]}}``: those named (a named version with
  no folder is listed UNAVAILABLE, the others serve).

A request with no version gets the highest version served, as Triton's do.
Everything here is pure but :func:`numbered_folders`, which lists a folder.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from poolserve.service.contract.settings import ConfigError

FIELD = "version_policy"
KINDS = ("latest", "all", "specific")
MAX_VERSION = 2**63 - 1  # Triton's versions are int64


@dataclass(frozen=True)
class VersionPolicy:
    """Which numbered versions of a model are served."""

    kind: str = "latest"
    num_versions: int = 1  # latest
    versions: tuple[int, ...] = ()  # specific, sorted

    def select(self, available: Iterable[int]) -> tuple[int, ...]:
        """The versions to serve among those with a folder, in increasing order
        (a specific version with no folder is among them: it is listed, UNAVAILABLE)."""
        found = sorted(set(available))
        if self.kind == "all":
            return tuple(found)
        if self.kind == "specific":
            return self.versions
        return tuple(found[-self.num_versions :]) if found else ()

    def describe(self) -> str:
        if self.kind == "all":
            return "all"
        if self.kind == "specific":
            return "specific " + ", ".join(map(str, self.versions))
        return f"latest {self.num_versions}"


LATEST_ONE = VersionPolicy()


def parse_version_policy(source: str, value: object, where: str = FIELD) -> VersionPolicy:
    """Triton's ``version_policy`` in JSON; ConfigError naming the field otherwise."""
    if not isinstance(value, dict) or len(value) != 1 or next(iter(value)) not in KINDS:
        raise ConfigError(
            source,
            where,
            'expected one of {"latest": {"num_versions": N}}, {"all": {}} or '
            f'{{"specific": {{"versions": [1, 3]}}}}, got {value!r}',
        )
    kind, body = next(iter(value.items()))
    key = f"{where}.{kind}"
    if not isinstance(body, dict):
        raise ConfigError(source, key, f"expected an object, got {body!r}")
    allowed = {"latest": {"num_versions"}, "all": set(), "specific": {"versions"}}[kind]
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise ConfigError(source, f"{key}.{unknown[0]}", "unknown field")
    if kind == "all":
        return VersionPolicy("all")
    if kind == "latest":
        count = _integer(source, f"{key}.num_versions", body.get("num_versions", 1))
        if count < 1:
            raise ConfigError(source, f"{key}.num_versions", f"expected 1 or more, got {count}")
        return VersionPolicy("latest", num_versions=count)
    listed = body.get("versions")
    if not isinstance(listed, list) or not listed:
        raise ConfigError(source, f"{key}.versions", f"expected a list of versions, got {listed!r}")
    versions = []
    for i, item in enumerate(listed):
        number = _integer(source, f"{key}.versions[{i}]", item)
        if not 0 < number <= MAX_VERSION:
            raise ConfigError(
                source, f"{key}.versions[{i}]", f"a version is an integer > 0, got {number}"
            )
        versions.append(number)
    return VersionPolicy("specific", versions=tuple(sorted(set(versions))))


def _integer(source: str, key: str, value: object) -> int:
    """An integer, or a string of digits (protobuf's JSON form of int64)."""
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(source, key, f"expected an integer, got {value!r}")
    return value


def version_number(name: str) -> int | None:
    """The version a folder's name says (``"3"`` -> 3); None for any other name."""
    if not (name.isascii() and name.isdigit()) or (len(name) > 1 and name[0] == "0"):
        return None
    number = int(name)
    return number if 0 < number <= MAX_VERSION else None


def numbered_folders(folder: Path) -> list[int]:
    """The version numbers of a model folder's numbered subfolders, in order."""
    try:
        children = list(folder.iterdir())
    except OSError:
        return []
    found = [version_number(child.name) for child in children if child.is_dir()]
    return sorted(n for n in found if n is not None)
