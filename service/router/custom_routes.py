"""MLServer models' custom REST endpoints (``@custom_handler(rest_path=...,
rest_method=...)``, as mlserver-mlflow's ``/invocations``): which model
serves a path, for the HTTP door.

The router imports no model code: each pool says which endpoints its loaded
models declared (the pool method :data:`POOL_METHOD`, JSON
``[[model, method, path], ...]``, from the load reports), kept fresh as
every :class:`~poolserve.service.router.pool_tables.PoolTable`: asked of
every pool at most once per ``FRESH_S``, and again on a miss after
``MISS_S`` (a model loaded a moment ago), so a flood of calls to paths that
do not exist costs one question per pool per ``MISS_S``.
Paths are matched as MLServer's web framework (Starlette) matches them:
``{name}`` is one path segment, ``{name:path}`` the rest of the path,
``{name:int}`` digits, ``{name:float}`` a decimal number.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import orjson

from poolserve.service.contract.errors import ServingError
from poolserve.service.router.forwarding import Forwarder
from poolserve.service.router.pool_tables import Answers, PoolTable

POOL_METHOD = "CustomRoutes"
_PARAM = re.compile(r"{([a-zA-Z_][a-zA-Z0-9_]*)(?::([a-zA-Z_][a-zA-Z0-9_]*))?}")
_CONVERTERS = {
    "str": "[^/]+",
    "path": ".*",
    "int": "[0-9]+",
    "float": r"[0-9]+(?:\.[0-9]+)?",
    "uuid": "[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}",
}


@dataclass(frozen=True)
class CustomRoute:
    model: str
    method: str
    template: str
    pattern: re.Pattern[str]


def compile_path(template: str) -> re.Pattern[str]:
    """A path template's regular expression (Starlette's converters)."""
    out, pos = "^", 0
    for match in _PARAM.finditer(template):
        out += re.escape(template[pos : match.start()])
        out += f"(?:{_CONVERTERS.get(match.group(2) or 'str', '[^/]+')})"
        pos = match.end()
    return re.compile(out + re.escape(template[pos:]) + "$")


class CustomRoutes(PoolTable):
    """The custom endpoints of the models every pool serves, kept fresh."""

    method = POOL_METHOD

    def __init__(self, core: Forwarder) -> None:
        super().__init__(core)
        self.routes: list[CustomRoute] = []

    async def find(self, method: str, path: str) -> tuple[CustomRoute | None, tuple[str, ...]]:
        """(the route of ``method path``, the methods the path has routes for
        when it has none for ``method``)."""
        await self.fresh(lambda: self._match(method, path)[0] is not None)
        return self._match(method, path)

    def _match(self, method: str, path: str) -> tuple[CustomRoute | None, tuple[str, ...]]:
        others: set[str] = set()
        for route in self.routes:
            if route.pattern.match(path):
                if route.method == method:
                    return route, ()
                others.add(route.method)  # as FastAPI's routes: no HEAD beside a GET
        return None, tuple(sorted(others))

    def take(self, answers: Answers) -> None:
        routes: list[CustomRoute] = []
        for route, answer in answers:
            if isinstance(answer, ServingError):
                # that pool's models keep the endpoints they had
                routes += [r for r in self.routes if r.model in route.models]
                continue
            for model, method, template in orjson.loads(answer):
                if self.core.routes.routes.get(model) is route:
                    routes.append(CustomRoute(model, method, template, compile_path(template)))
        self.routes = routes
