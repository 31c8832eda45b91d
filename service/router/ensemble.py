"""Ensembles, run by the router: each step forwarded to its model's pool.

An ensemble (:mod:`poolserve.service.contract.ensemble`) has no pool. Its
call is taken by a door as any call, and run here: the steps of one level at
once (one alone in the call's own task), each an inference of its model
through the forwarding core (:meth:`Forwarder.step`), over the model's
pool's lane. The tensors stay raw bytes (:mod:`ensemble_tensors`): a step's
outputs become the next steps' ``raw_input_contents`` without being decoded.

- The deadline is the call's, computed once: every step is forwarded with
  what remains of it.
- A step that fails ends the call with its status (its gRPC code) and a
  message that names it: ``ensemble 'x' step 2 (model 'y'): ...``; the other
  steps of its level are cancelled.
- A caller that leaves cancels the call's task, and with it the step in
  flight: the lane tells the pool at once.

The control calls about an ensemble are answered here as Triton does:
ModelReady (every step's model ready), ModelMetadata and ModelConfig
(platform ``ensemble``, its declared tensors, its steps), ModelStatistics
(this router's count of the ensemble's calls; each step's model counts its
own calls in its pool, as Triton's composing models do).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

from poolserve.protos import inference_pb2 as pb
from poolserve.service.contract.chain import REFUSED as CHAIN_REFUSED
from poolserve.service.contract.chain import ChainPlan, ChainStep
from poolserve.service.contract.chain import wrap as wrap_chain
from poolserve.service.contract.ensemble import PLATFORM, Ensemble
from poolserve.service.contract.errors import (
    InvalidInput,
    MessageTooLarge,
    ModelError,
    ModelNotFound,
    ServingError,
    Unimplemented,
    clip,
    prefixed,
)
from poolserve.service.contract.repository import Repository, TensorSpec
from poolserve.service.contract.slab import THRESHOLD as SLAB_THRESHOLD
from poolserve.service.router.ensemble_tensors import Tensor, request_tensors, response_tensors
from poolserve.service.router.forwarding import Forwarder
from poolserve.service.router.routes import PoolRoute, Routes

_T = TypeVar("_T")
CHAIN_MAX = SLAB_THRESHOLD  # a larger request goes through the router's steps (no slab for chains)

Carrier = Iterable[tuple[str, Any]] | None


@dataclass
class _Counts:
    """One ensemble's calls through this router, as Triton's statistics count them."""

    success: int = 0
    success_ns: int = 0
    fail: int = 0
    fail_ns: int = 0
    inferences: int = 0
    last_ms: int = 0


def _data_type(datatype: str) -> Any:
    """Triton's config type of a datatype (BYTES is TYPE_STRING)."""
    name = "TYPE_STRING" if datatype == "BYTES" else f"TYPE_{datatype}"
    return pb.DataType.Value(name) if name in pb.DataType.keys() else pb.TYPE_INVALID  # noqa: SIM118


class Ensembles:
    """Every ensemble of the repository, over the routes and the forwarding core."""

    def __init__(self, ensembles: Iterable[Ensemble], routes: Routes, core: Forwarder) -> None:
        self.plans = {e.name: e for e in ensembles}
        self.routes = routes
        self.core = core
        self._counts = {name: _Counts() for name in self.plans}
        self._chains: dict[str, tuple[Ensemble, bytes]] = {}  # each plan's chain, encoded
        self._unchained: set[str] = set()  # ensembles their pool would not run in one worker
        routes.ensembles_ready = self.readiness  # the health service's model:<ensemble>

    def learn(self, name: str, repository: Repository) -> None:
        """An ensemble loaded by name (RepositoryModelLoad): its settings read
        again from a fresh scan; ones that do not check out fail the load with
        the reason, and a previous plan keeps serving."""
        for plan in repository.ensembles:
            if plan.name == name:
                self.plans[name] = plan
                self._counts.setdefault(name, _Counts())
                self._unchained.discard(name)  # its pool is asked again
                self.routes.sync_health()
                return
        for bad in repository.invalid:
            if bad.name == name and bad.ensemble:
                raise InvalidInput(bad.reason)

    def plan(self, name: str, version: str) -> Ensemble:
        plan = self.plans[name]
        if version and version != plan.version:
            raise ModelNotFound(
                f"Request for unknown model: '{clip(name)}' has no version {clip(version)} "
                f"(its version: {plan.version})"
            )
        return plan

    # -- readiness and control -------------------------------------------------

    def readiness(self) -> dict[str, bool]:
        return {name: self.ready(plan) for name, plan in self.plans.items()}

    def ready_version(self, name: str, version: str) -> bool:
        """ModelReady's answer: a version the ensemble does not have is not ready (as Triton)."""
        plan = self.plans[name]
        return (not version or version == plan.version) and self.ready(plan)

    def ready(self, plan: Ensemble) -> bool:
        """Every step's model ready in a pool that answers."""
        for step in plan.steps:
            route = self.routes.routes.get(step.model)
            if route is None or not route.reachable:
                return False
            if not route.model_serving.get(step.model, False):
                return False
        return True

    def answer(self, method: str, name: str, version: str) -> bytes:
        """ModelReady, ModelMetadata, ModelConfig or ModelStatistics of an ensemble."""
        if method == "ModelReady":
            return pb.ModelReadyResponse(
                ready=self.ready_version(name, version)
            ).SerializeToString()
        plan = self.plan(name, version)
        if method == "ModelMetadata":
            return self.metadata(plan).SerializeToString()
        if method == "ModelConfig":
            return pb.ModelConfigResponse(config=self.config(plan)).SerializeToString()
        if method == "ModelStatistics":
            stats = pb.ModelStatisticsResponse(model_stats=[self.statistics(plan)])
            return stats.SerializeToString()
        raise Unimplemented(f"{method} is not answered for ensemble '{clip(name)}'")

    def metadata(self, plan: Ensemble) -> pb.ModelMetadataResponse:
        def tensors(specs: tuple[TensorSpec, ...]) -> list[pb.ModelMetadataResponse.TensorMetadata]:
            return [
                pb.ModelMetadataResponse.TensorMetadata(
                    name=s.name, datatype=s.datatype, shape=list(s.shape)
                )
                for s in specs
            ]

        return pb.ModelMetadataResponse(
            name=plan.name,
            versions=[plan.version],
            platform=PLATFORM,
            inputs=tensors(plan.inputs),
            outputs=tensors(plan.outputs),
        )

    def config(self, plan: Ensemble) -> pb.ModelConfig:
        skip = 1 if plan.max_batch_size > 0 else 0  # Triton's dims leave out the batch
        config = pb.ModelConfig(
            name=plan.name,
            platform=PLATFORM,
            max_batch_size=plan.max_batch_size,
            input=[
                pb.ModelInput(name=s.name, data_type=_data_type(s.datatype), dims=s.shape[skip:])
                for s in plan.inputs
            ],
            output=[
                pb.ModelOutput(name=s.name, data_type=_data_type(s.datatype), dims=s.shape[skip:])
                for s in plan.outputs
            ],
        )
        for step in plan.steps:
            config.ensemble_scheduling.step.add(
                model_name=step.model,
                model_version=int(step.version) if step.version else -1,
                input_map=dict(step.input_map),
                output_map=dict(step.output_map),
            )
        return config

    def statistics(self, plan: Ensemble) -> pb.ModelStatistics:
        counts = self._counts[plan.name]
        stats = pb.ModelStatistics(
            name=plan.name,
            version=plan.version,
            last_inference=counts.last_ms,
            inference_count=counts.inferences,
            execution_count=counts.success,
        )
        infer = stats.inference_stats
        infer.success.count, infer.success.ns = counts.success, counts.success_ns
        infer.fail.count, infer.fail.ns = counts.fail, counts.fail_ns
        # the whole pipeline is the ensemble's compute; its queues are its steps'
        infer.compute_infer.count, infer.compute_infer.ns = counts.success, counts.success_ns
        # Counted with no time of their own, as every call passes them: a client
        # that names no version (perf_analyzer) finds the version that served by
        # the queue count that grew.
        for duration in (infer.queue, infer.compute_input, infer.compute_output):
            duration.count = counts.success
        return stats

    def all_statistics(self) -> list[pb.ModelStatistics]:
        return [self.statistics(plan) for plan in self.plans.values()]

    def index(self) -> list[pb.RepositoryIndexResponse.ModelIndex]:
        entries = []
        for plan in self.plans.values():
            ready = self.ready(plan)
            entries.append(
                pb.RepositoryIndexResponse.ModelIndex(
                    name=plan.name,
                    version=plan.version,
                    state="READY" if ready else "UNAVAILABLE",
                    reason="" if ready else "a step's model is not ready",
                )
            )
        return entries

    # -- inference -------------------------------------------------------------

    async def infer(
        self, body: bytes, name: str, version: str, remaining: float | None, carrier: Carrier
    ) -> bytes:
        """A gRPC ModelInfer of an ensemble: its bytes in, the response's bytes out."""
        plan = self.plan(name, version)
        pool = self._one_pool(plan) if len(body) <= CHAIN_MAX else None
        if pool is not None:  # every step in one worker of that pool: the bytes go as they came
            reply = await self._counted(
                plan, body, self._chained(plan, pool, body, remaining, carrier)
            )
        else:
            try:
                request = pb.ModelInferRequest.FromString(body)
            except Exception:  # a malformed message: DecodeError and kin
                raise InvalidInput("the request is not a ModelInferRequest") from None
            stepped = self._run(plan, request, remaining, carrier)
            reply = (await self._counted(plan, request, stepped)).SerializeToString()
        limit = self.core.settings.max_message_size
        if len(reply) > limit:  # said here, clearly, rather than by gRPC's send
            raise MessageTooLarge.reply(name, len(reply), limit)
        return reply

    async def run(
        self,
        plan: Ensemble,
        request: pb.ModelInferRequest,
        remaining: float | None,
        carrier: Carrier,
    ) -> pb.ModelInferResponse:
        """The ensemble's steps in order, counted in its statistics (a REST call's)."""
        pool = self._one_pool(plan)
        body = request.SerializeToString() if pool is not None else b""
        if pool is None or len(body) > CHAIN_MAX:
            return await self._counted(plan, request, self._run(plan, request, remaining, carrier))
        reply = await self._counted(
            plan, request, self._chained(plan, pool, body, remaining, carrier)
        )
        return pb.ModelInferResponse.FromString(reply)

    async def _counted(
        self, plan: Ensemble, request: pb.ModelInferRequest | bytes, work: Awaitable[_T]
    ) -> _T:
        """``work``, the ensemble's call, counted in its statistics."""
        self.core.requests += 1
        started = time.monotonic_ns()
        counts = self._counts[plan.name]
        try:
            done = await work
        except (ServingError, asyncio.CancelledError):
            counts.fail += 1
            counts.fail_ns += time.monotonic_ns() - started
            raise
        counts.success += 1
        counts.success_ns += time.monotonic_ns() - started
        counts.last_ms = time.time_ns() // 1_000_000
        if plan.max_batch_size > 0:
            if isinstance(request, bytes):
                request = pb.ModelInferRequest.FromString(request)
            counts.inferences += _rows(request)
        else:
            counts.inferences += 1
        return done

    # -- in one worker -----------------------------------------------------------

    def _one_pool(self, plan: Ensemble) -> PoolRoute | None:
        """The pool all the ensemble's steps are in, when a worker there can
        run them all in one job (contract/chain.py); None: the router runs
        the steps (also for an ensemble its pool refused to chain). The callers
        chain no request over :data:`CHAIN_MAX` (one a slab would carry)."""
        if plan.name in self._unchained:
            return None
        pool: PoolRoute | None = None
        for step in plan.steps:
            route = self.routes.routes.get(step.model)
            if route is None or (pool is not None and route is not pool):
                return None
            pool = route
        return pool

    def _chain_plan(self, plan: Ensemble) -> bytes:
        encoded = self._chains.get(plan.name)
        if encoded is None or encoded[0] is not plan:
            order = [i for level in plan.levels for i in level]
            chain = ChainPlan(
                name=plan.name,
                version=plan.version,
                inputs=tuple(s.name for s in plan.inputs),
                outputs=tuple(s.name for s in plan.outputs),
                steps=tuple(
                    ChainStep(
                        plan.steps[i].model,
                        plan.steps[i].version,
                        plan.steps[i].input_map,
                        plan.steps[i].output_map,
                    )
                    for i in order
                ),
            )
            encoded = (plan, chain.encode())
            self._chains[plan.name] = encoded
        return encoded[1]

    async def _chained(
        self,
        plan: Ensemble,
        pool: PoolRoute,
        body: bytes,
        remaining: float | None,
        carrier: Carrier,
    ) -> bytes:
        """The ensemble run in one worker of ``pool``: one call with the shared
        deadline. A pool that refuses to (a step now batching, cached or
        inline there) is remembered, and the router runs the steps."""
        deadline = self.core.deadline(remaining)
        first = plan.steps[plan.levels[0][0]].model
        try:
            chain = wrap_chain(self._chain_plan(plan), body)  # the router's own envelope
            return await self.core.step(first, chain, deadline, carrier, attached=True)
        except ServingError as exc:
            if exc.message.startswith(CHAIN_REFUSED):
                self._unchained.add(plan.name)
                request = pb.ModelInferRequest.FromString(body)
                return (await self._run(plan, request, remaining, carrier)).SerializeToString()
            if exc.message.startswith(f"ensemble '{plan.name}' "):
                raise  # a step's own error, already named
            models = ", ".join(f"'{s.model}'" for s in plan.steps)
            raise prefixed(
                exc, f"ensemble '{plan.name}' (models {models}, in one worker of {pool.where})"
            ) from None

    async def _run(
        self,
        plan: Ensemble,
        request: pb.ModelInferRequest,
        remaining: float | None,
        carrier: Carrier,
    ) -> pb.ModelInferResponse:
        deadline = self.core.deadline(remaining)  # one deadline, shared by every step
        tensors = request_tensors(request, (s.name for s in plan.inputs))
        produced = {s.name for s in plan.outputs}
        wanted = [o.name for o in request.outputs] or [s.name for s in plan.outputs]
        for output in request.outputs:
            if output.name not in produced:
                raise InvalidInput(
                    f"unexpected inference output '{clip(output.name)}' for ensemble "
                    f"'{plan.name}' (its outputs: {', '.join(sorted(produced))})"
                )
            if output.parameters:
                key = next(iter(output.parameters))
                if key in ("shared_memory_region", "classification"):
                    raise InvalidInput(
                        f"output '{output.name}': an ensemble's outputs take no '{key}'"
                    )
        for level in plan.levels:
            if len(level) == 1:
                await self._step(plan, level[0], request, tensors, deadline, carrier)
                continue
            try:
                async with asyncio.TaskGroup() as group:
                    for index in level:
                        group.create_task(
                            self._step(plan, index, request, tensors, deadline, carrier)
                        )
            except BaseExceptionGroup as group_error:
                first = group_error.exceptions[0]
                raise first from None
        response = pb.ModelInferResponse(
            model_name=plan.name, model_version=plan.version, id=request.id
        )
        for name in wanted:
            tensor = tensors[name]
            response.outputs.add(name=name, datatype=tensor.datatype, shape=tensor.shape)
            response.raw_output_contents.append(tensor.raw)
        return response

    async def _step(
        self,
        plan: Ensemble,
        index: int,
        request: pb.ModelInferRequest,
        tensors: dict[str, Tensor],
        deadline: float,
        carrier: Carrier,
    ) -> None:
        step = plan.steps[index]
        call = pb.ModelInferRequest(
            model_name=step.model, model_version=step.version, id=request.id
        )
        for key, value in request.parameters.items():
            call.parameters[key].CopyFrom(value)
        for step_input, name in step.input_map:
            tensor = tensors[name]
            call.inputs.add(name=step_input, datatype=tensor.datatype, shape=tensor.shape)
            call.raw_input_contents.append(tensor.raw)
        for step_output, _ in step.output_map:
            call.outputs.add(name=step_output)
        try:
            reply = await self.core.step(step.model, call.SerializeToString(), deadline, carrier)
            got = response_tensors(pb.ModelInferResponse.FromString(reply))
        except ServingError as exc:
            raise prefixed(exc, plan.step_name(index)) from None
        for step_output, name in step.output_map:
            output = got.get(step_output)
            if output is None:
                raise ModelError(
                    f"{plan.step_name(index)}: the model's reply has no output '{step_output}'"
                )
            tensors[name] = output


def _rows(request: pb.ModelInferRequest) -> int:
    """A batching ensemble's request's rows: its first input's first dimension."""
    shape = request.inputs[0].shape if request.inputs else ()
    return max(1, int(shape[0])) if shape else 1
