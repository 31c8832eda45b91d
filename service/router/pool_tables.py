"""Tables the router asks of every pool and keeps fresh: what only a pool
knows of its loaded models, for the doors (the router imports no model code).

A :class:`PoolTable` asks every pool its pool method at most once per
:data:`FRESH_S`, and again on a miss after :data:`MISS_S` (a model loaded a
moment ago): a flood of calls for things no pool has costs one question per
pool per :data:`MISS_S`. A pool that does not answer keeps what it said
last. Two tables: the MLServer models' custom REST endpoints
(:mod:`poolserve.service.router.custom_routes`) and which models are MLServer
models (:class:`MLServerModels`, whose streams speak MLServer's messages
under ``stream_messages: "auto"``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable

import orjson

from poolserve.service.contract.errors import ServingError
from poolserve.service.router.forwarding import Forwarder
from poolserve.service.router.routes import PoolRoute

log = logging.getLogger(__name__)

FRESH_S = 2.0
MISS_S = 0.25
Answers = list[tuple[PoolRoute, bytes | ServingError]]


class PoolTable:
    """One pool method's answers from every pool, kept fresh (see the module)."""

    method = ""  # the pool method (service/poolserver/servicer.py), JSON out

    def __init__(self, core: Forwarder) -> None:
        self.core = core
        self._asked = -FRESH_S  # monotonic time of the last answer
        self._asking: asyncio.Future[None] | None = None

    async def fresh(self, hit: Callable[[], bool]) -> None:
        """Asks again when the table is older than FRESH_S, or older than
        MISS_S and ``hit()`` (what the caller looks for) is false."""
        age = time.monotonic() - self._asked
        if age > FRESH_S or (age > MISS_S and not hit()):
            await self._refresh()

    def take(self, answers: Answers) -> None:
        """The table from the pools' answers (an error: that pool keeps its part)."""
        raise NotImplementedError

    async def _refresh(self) -> None:
        """Asks every pool; concurrent callers share one round of questions."""
        if self._asking is not None:
            await asyncio.shield(self._asking)
            return
        self._asking = asyncio.get_running_loop().create_future()
        try:
            self.take(await self.core.gather(self.method, b"", None, ()))
        except Exception:  # a pool's answer that is not the table: the last one stays
            log.exception("router: the pools' %s could not be read", self.method)
        finally:
            self._asked = time.monotonic()
            self._asking.set_result(None)
            self._asking = None


class MLServerModels(PoolTable):
    """The names of the models served through MLServer's adapter (JSON
    ``[name, ...]`` from each pool: known once loaded). Asked again once a
    pool's Watch stream said a model changed (loaded, unloaded:
    ``Routes.model_changes``), and at most once per FRESH_S besides; a miss
    asks nothing (most models are not MLServer's), so a stream start waits
    for a pool's answer only after a load or once per FRESH_S."""

    method = "MLServerModels"

    def __init__(self, core: Forwarder) -> None:
        super().__init__(core)
        self.names: frozenset[str] = frozenset()
        self._changes = -1  # Routes.model_changes when last asked

    async def current(self) -> frozenset[str]:
        changes = self.core.routes.model_changes
        if changes != self._changes or time.monotonic() - self._asked > FRESH_S:
            self._changes = changes  # a change while asking: asked again next time
            await self._refresh()
        return self.names

    async def has(self, name: str) -> bool:
        return name in await self.current()

    async def all_of(self, names: Iterable[str]) -> bool:
        """Whether ``names`` are all MLServer models (and there is one)."""
        wanted = set(names)
        return bool(wanted) and wanted <= await self.current()

    def take(self, answers: Answers) -> None:
        names: set[str] = set()
        for route, answer in answers:
            if isinstance(answer, ServingError):
                names |= {n for n in self.names if n in route.models}
                continue
            names |= {n for n in orjson.loads(answer) if self.core.routes.routes.get(n) is route}
        self.names = frozenset(names)
