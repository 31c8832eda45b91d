"""Plain text for ``--help`` from the docstrings the commands are documented in.

The docstrings are written for Sphinx-style readers (````name````,
``:func:`x```); a terminal shows them as plain words.
"""

from __future__ import annotations

import re

_ROLE = re.compile(r":[a-z]+:`~?([^`]+)`")
_LITERAL = re.compile(r"``([^`]+)``")


def plain(doc: str | None) -> str:
    """``doc`` without reStructuredText markup: roles and literals become their text."""
    text = _ROLE.sub(r"\1", doc or "")
    return _LITERAL.sub(r"\1", text).strip()
