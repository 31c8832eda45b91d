"""docs/settings.md's table of every setting agrees with the code: one row per
ServerSettings field, each documented default equal to the code's default,
the environment variable the loader reads and the flag the CLI maps to it."""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import MISSING, fields
from typing import Any

import pytest

from poolserve.service.contract.settings import ServerSettings
from poolserve.supervisor import cli

from support import ROOT

PAGE = ROOT / "docs" / "settings.md"
_CODE = re.compile(r"`([^`]*)`")


def table_rows(text: str) -> dict[str, list[str]]:
    """The rows of the table under "## Every setting", by key (first cell)."""
    section = text.split("## Every setting", 1)[1].split("\n## ", 1)[0]
    rows: dict[str, list[str]] = {}
    for line in section.splitlines():
        if not line.startswith("| `"):
            continue
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        key = _CODE.match(cells[0])
        if key is not None and len(cells) == 5:
            rows[key.group(1)] = cells
    return rows


def documented_default(cell: str) -> Any:
    """The first `literal` of the default cell, read as JSON where it is JSON."""
    literal = _CODE.search(cell)
    assert literal is not None, f"no `default` in {cell!r}"
    text = literal.group(1)
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text  # a bare string such as 127.0.0.1 or fork


def code_default(name: str) -> Any:
    field = next(f for f in fields(ServerSettings) if f.name == name)
    if field.default is not MISSING:
        return field.default
    assert field.default_factory is not MISSING
    return field.default_factory()


def cli_flags() -> dict[str, str]:
    """Setting name -> the `poolserve serve` flag that sets it."""
    parser = cli.build_parser()
    serve = next(
        action.choices["serve"]
        for action in parser._actions
        if isinstance(action, argparse._SubParsersAction)
    )
    options = {a.dest: a.option_strings[0] for a in serve._actions if a.option_strings}
    marked = argparse.Namespace(**{dest: f"<{dest}>" for dest in options})
    return {
        setting: options[str(value)[1:-1]]
        for setting, value in cli._flags(marked).items()
        if isinstance(value, str) and value.startswith("<")
    }


ROWS = table_rows(PAGE.read_text())
NAMES = [f.name for f in fields(ServerSettings)]


def test_every_setting_has_a_row_and_no_row_is_invented() -> None:
    assert set(NAMES) - set(ROWS) == set(), "settings missing from docs/settings.md"
    assert set(ROWS) - set(NAMES) == set(), "rows in docs/settings.md that are no setting"


@pytest.mark.parametrize("name", NAMES)
def test_documented_default_is_the_codes(name: str) -> None:
    if name not in ROWS:
        pytest.fail(f"{name} is missing from docs/settings.md")
    documented = documented_default(ROWS[name][3])
    actual = code_default(name)
    if isinstance(actual, bool) or not isinstance(actual, int | float):
        assert documented == actual, f"{name}: documented {documented!r}, code {actual!r}"
    else:
        assert isinstance(documented, int | float) and not isinstance(documented, bool), name
        assert float(documented) == float(actual), f"{name}: documented {documented}, code {actual}"


@pytest.mark.parametrize("name", NAMES)
def test_documented_variable_and_flag_are_the_ones_read(name: str) -> None:
    if name not in ROWS:
        pytest.fail(f"{name} is missing from docs/settings.md")
    _, flag, variable, _, _ = ROWS[name]
    assert _CODE.findall(variable)[:1] == [f"POOLSERVE_{name.upper()}"], name
    assert _CODE.findall(flag) == ([cli_flags()[name]] if name in cli_flags() else []), name


def test_the_check_sees_a_wrong_default_and_a_missing_row() -> None:
    text = PAGE.read_text()
    wrong = text.replace("| `8081` |", "| `8080` |", 1)
    assert documented_default(table_rows(wrong)["grpc_port"][3]) != code_default("grpc_port")
    missing = "\n".join(line for line in text.splitlines() if not line.startswith("| `max_queue`"))
    assert "max_queue" not in table_rows(missing)
