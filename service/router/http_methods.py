"""Which methods each path of the REST door takes.

A path the door serves with another method is answered ``405 Method Not
Allowed`` with an ``Allow`` header (RFC 9110 15.5.6); a path it does not
serve is ``404``. ``HEAD`` goes wherever ``GET`` does: the same status and
headers, no body (RFC 9110 9.3.2)."""

from __future__ import annotations

import re

from poolserve.service.router.http_wire import MODEL_PATH

GET = ("GET", "HEAD")
POST = ("POST",)
NONE: tuple[str, ...] = ()

_FIXED = {
    "/v2": GET,
    "/v2/": GET,
    "/v2/health/live": GET,
    "/v2/health/ready": GET,
    "/v2/models/stats": GET,
    "/v2/repository/index": POST,
}
_MODEL_ACTIONS = {None: GET, "ready": GET, "config": GET, "stats": GET}
# the door's paths beside MODEL_PATH (http_wire), with the parts its handlers read
STREAM_PATH = re.compile(r"^/v2/models/([^/]+)(?:/versions/([^/]+))?/generate_stream$")
V1_PREDICT_PATH = re.compile(r"^/v1/models/([^/:]+):predict$")
V1_MODEL_PATH = re.compile(r"^/v1/models/([^/:]+)$")
REPOSITORY_PATH = re.compile(r"^/v2/repository/models/([^/]+)/(load|unload)$")
SHARED_MEMORY_PATH = re.compile(
    r"^/v2/(system|cuda)sharedmemory(?:/region/([^/]+))?/(status|register|unregister)$"
)
_POSTED = (STREAM_PATH, V1_PREDICT_PATH, REPOSITORY_PATH)


def methods_for(path: str) -> tuple[str, ...]:
    """The methods ``path`` takes; empty when the door does not serve it."""
    fixed = _FIXED.get(path)
    if fixed is not None:
        return fixed
    match = MODEL_PATH.match(path)
    if match is not None:
        return _MODEL_ACTIONS.get(match.group(3), POST)  # infer, generate
    if any(pattern.match(path) is not None for pattern in _POSTED):
        return POST
    if V1_MODEL_PATH.match(path) is not None:
        return GET
    match = SHARED_MEMORY_PATH.match(path)
    if match is not None:
        return GET if match.group(3) == "status" else POST
    return NONE


def allow_header(methods: tuple[str, ...]) -> bytes:
    return ", ".join(methods).encode("ascii")
