"""A REST body's JSON as Triton's REST reads it, for the pool's scheduling
peek and the worker's decode alike: orjson, which refuses NaN, Infinity and
-Infinity, and then, for a body that holds one of those words, Python's json,
which reads them as numbers (Triton: rapidjson's kParseNanAndInfFlag)."""

from __future__ import annotations

import json
import re
from typing import Any

import orjson

_NON_FINITE = re.compile(rb"NaN|Infinity")


class NotJson(ValueError):
    """The body is not JSON; the message is orjson's (the first reader's)."""


def loads(text: bytes | bytearray | memoryview) -> Any:
    """The body's JSON; NotJson when it has none."""
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        refused = str(exc)
    if _NON_FINITE.search(text) is None:
        raise NotJson(refused)
    try:
        return json.loads(bytes(text))
    except (ValueError, RecursionError):  # (UnicodeDecodeError is a ValueError)
        raise NotJson(refused) from None
