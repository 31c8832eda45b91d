"""The documentation a newcomer reads: every relative link in README.md and
docs/ leads to a file that exists (and, with a #fragment, to a heading in it)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from support import ROOT

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def links(path: Path) -> list[str]:
    text = _FENCE.sub("", path.read_text())
    return [target for target in _LINK.findall(text) if "://" not in target]


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation gone, spaces to '-'."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = _FENCE.sub("", path.read_text())
    return {anchor(m) for m in re.findall(r"^#{1,6}\s+(.+)$", text, re.M)}


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc: Path) -> None:
    broken = []
    for target in links(doc):
        if target.startswith("mailto:"):
            continue
        file_part, _, fragment = target.partition("#")
        dest = (doc.parent / file_part).resolve() if file_part else doc
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
            broken.append(f"{target}: no heading #{fragment} in {dest.name}")
    assert not broken, f"{doc.name}: " + "; ".join(broken)


def test_the_link_check_catches_a_broken_link(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("# Title\n\nSee [a](missing.md), [b](#title) and [c](#nowhere).\n")
    assert links(page) == ["missing.md", "#title", "#nowhere"]
    assert "title" in anchors(page) and "nowhere" not in anchors(page)
