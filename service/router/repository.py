"""Server-wide calls that both doors make the same way: the repository index
merged from every pool, model load and unload at a model's pool (with the
``model_control`` switch and routes learned for models added after start),
and the statistics of every model. Each takes the request's protobuf bytes
and answers protobuf bytes; a door only translates."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from poolserve.protos import inference_pb2 as pb
from poolserve.service.contract.errors import FailedPrecondition, ServingError, clip
from poolserve.service.contract.settings import ServerSettings
from poolserve.service.router.ensemble import Ensembles
from poolserve.service.router.forwarding import Forwarder, Metadata
from poolserve.service.router.routes import Routes

LOAD = "RepositoryModelLoad"
UNLOAD = "RepositoryModelUnload"


class RepositoryCalls:
    def __init__(
        self,
        settings: ServerSettings,
        routes: Routes,
        core: Forwarder,
        ensembles: Ensembles,
        learned: Callable[[str], Awaitable[None]] | None = None,
    ) -> None:
        self.settings = settings
        self.routes = routes
        self.core = core
        self.ensembles = ensembles  # run here, over the models' pools (router/ensemble.py)
        self.learned = learned  # a fleet: tells the other routers of a route learned here

    async def control(
        self, method: str, name: str, body: bytes, budget: float | None, metadata: Metadata
    ) -> bytes:
        """RepositoryModelLoad or RepositoryModelUnload of one model, at its pool."""
        if not self.settings.model_control:
            # Checked here, at the public door: the pools' private sockets always
            # accept loads, so that `poolserve reload` can use them.
            raise FailedPrecondition(
                "loading and unloading models through the API is disabled (model_control)"
            )
        if method == LOAD and name not in self.routes.routes:
            await self.learn(name)
            known = name in self.routes.routes or name in self.ensembles.plans
            if self.learned is not None and known:
                await self.learned(name)
        if name in self.ensembles.plans:
            if method == LOAD:  # read again above; ready when its steps are
                return pb.RepositoryModelLoadResponse().SerializeToString()
            raise FailedPrecondition(
                f"ensemble '{clip(name)}' runs in the router over its steps' models: unload "
                "those, or remove it from the repository and run `poolserve reload`"
            )
        return await self.core.forward(self.routes.route(name), method, body, budget, metadata)

    async def learn(self, name: str) -> None:
        """A name the router does not route: a model added to the repository after
        start, or an ensemble, new or changed (read again at each load, as Triton
        reads an ensemble's config; a fleet's other routers are told)."""
        fresh = await self.routes.learn_route(name)
        if fresh is not None:
            self.ensembles.learn(name, fresh)

    async def index(self, body: bytes, budget: float | None, metadata: Metadata) -> bytes:
        """Every pool's index merged, with the models that cannot be served."""
        request = pb.RepositoryIndexRequest.FromString(body)
        all_models = pb.RepositoryIndexRequest(repository_name=request.repository_name)
        merged = pb.RepositoryIndexResponse()
        for route, answer in await self.core.gather(
            "RepositoryIndex", all_models.SerializeToString(), budget, metadata
        ):
            if isinstance(answer, ServingError):
                for name in route.models:
                    merged.models.add(
                        name=name,
                        state="UNAVAILABLE",
                        reason=f"{route.where} is not answering: {answer.message}",
                    )
            else:  # a model its folder left (a reload unloaded it) is no longer listed
                listed = set(route.models)
                models = pb.RepositoryIndexResponse.FromString(answer).models
                merged.models.extend(m for m in models if m.name in listed)
        merged.models.extend(self.ensembles.index())
        for name, reason in self.routes.invalid.items():
            merged.models.add(name=name, state="UNAVAILABLE", reason=reason)
        if request.ready:
            kept = [m for m in merged.models if m.state == "READY"]
            del merged.models[:]
            merged.models.extend(kept)
        return merged.SerializeToString()

    async def all_statistics(self, budget: float | None, metadata: Metadata) -> bytes:
        merged = pb.ModelStatisticsResponse()
        empty = pb.ModelStatisticsRequest().SerializeToString()
        for _, answer in await self.core.gather("ModelStatistics", empty, budget, metadata):
            if not isinstance(answer, ServingError):
                merged.model_stats.extend(pb.ModelStatisticsResponse.FromString(answer).model_stats)
        merged.model_stats.extend(self.ensembles.all_statistics())
        return merged.SerializeToString()
