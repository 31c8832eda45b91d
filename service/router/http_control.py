"""The HTTP door's answers that are not inferences: health, server and model
metadata, configuration and statistics, the model repository, system shared
memory, KServe V1's readiness. Off the hot path: they call the same pool RPCs
and registries as the gRPC door and render JSON here."""

from __future__ import annotations

import base64
import binascii
from collections.abc import Iterable
from typing import Any

import orjson
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from poolserve.protos import inference_pb2 as pb
from poolserve.service import __version__
from poolserve.service.contract.errors import (
    InvalidInput,
    ServingError,
    clip,
    load_failed,
)
from poolserve.service.contract.settings import ServerSettings
from poolserve.service.grpcserver.handlers import EXTENSIONS
from poolserve.service.grpcserver.shm import SharedMemory
from poolserve.service.router.forwarding import Forwarder
from poolserve.service.router.http_methods import (
    REPOSITORY_PATH,
    SHARED_MEMORY_PATH,
    V1_MODEL_PATH,
    methods_for,
)
from poolserve.service.router.http_wire import (
    MODEL_PATH,
    HttpError,
    Receive,
    Scope,
    budget_of,
    carried_of,
    small_json,
)
from poolserve.service.router.model_repository import MLSERVER_STATES
from poolserve.service.router.pool_tables import MLServerModels
from poolserve.service.router.repository import LOAD, UNLOAD, RepositoryCalls
from poolserve.service.router.routes import Routes


class HttpControl:
    """Every endpoint of the REST door but the inferences."""

    def __init__(
        self,
        settings: ServerSettings,
        routes: Routes,
        core: Forwarder,
        repository: RepositoryCalls,
        shared_memory: SharedMemory,
    ) -> None:
        self.settings = settings
        self.routes = routes
        self.core = core
        self.repository = repository
        self.shared_memory = shared_memory
        self.mlserver_models = MLServerModels(core)  # listed in the index as MLServer lists them

    async def answer(
        self, method: str, path: str, scope: Scope, receive: Receive
    ) -> tuple[int, bytes]:
        allowed = methods_for(path)
        if not allowed:
            raise HttpError(404, f"{method} {clip(path)} is not an endpoint of this server")
        if method not in allowed:
            takes = " or ".join(m for m in allowed if m != "HEAD")
            raise HttpError(405, f"{method} {clip(path)}: this endpoint takes {takes}", allowed)
        if path == "/v2/health/live":
            return 200, orjson.dumps({"live": True})
        if path == "/v2/health/ready":
            ready = self.routes.ready()
            return (200 if ready else 503), orjson.dumps({"ready": ready})
        if path == "/v2" or path == "/v2/":
            return 200, orjson.dumps(
                {
                    "name": self.settings.server_name,
                    "version": __version__,
                    "extensions": list(EXTENSIONS),
                }
            )
        budget = budget_of(scope)
        metadata = carried_of(scope)
        if path.startswith(("/v2/systemsharedmemory", "/v2/cudasharedmemory")):
            return await self._shared_memory_call(method, path, receive)
        match = V1_MODEL_PATH.match(path)
        if match is not None and method == "GET":  # KServe's V1: the model's readiness
            ready = await self._model_ready(match.group(1), "", budget, metadata)
            return (200 if ready else 503), orjson.dumps({"name": match.group(1), "ready": ready})
        if path.startswith("/v2/repository/") and method == "POST":
            return await self._repository(path, budget, metadata, receive)
        if path == "/v2/models/stats" and method == "GET":
            reply = await self.repository.all_statistics(budget, metadata)
            return 200, orjson.dumps(plain(pb.ModelStatisticsResponse.FromString(reply)))
        match = MODEL_PATH.match(path)
        if match is None or method != "GET":
            raise HttpError(404, f"{method} {clip(path)} is not an endpoint of this server")
        name, version, action = match.group(1), match.group(2) or "", match.group(3)
        if action == "ready":
            ready = await self._model_ready(name, version, budget, metadata)
            return (200 if ready else 503), orjson.dumps({"name": name, "ready": ready})
        if action is None:
            request = pb.ModelMetadataRequest(name=name, version=version)
            reply = await self._forward(name, "ModelMetadata", request, budget, metadata)
            return 200, metadata_json(pb.ModelMetadataResponse.FromString(reply))
        if action == "config":
            config_request = pb.ModelConfigRequest(name=name, version=version)
            reply = await self._forward(name, "ModelConfig", config_request, budget, metadata)
            return 200, orjson.dumps(plain(pb.ModelConfigResponse.FromString(reply).config))
        if action == "stats":
            stats_request = pb.ModelStatisticsRequest(name=name, version=version)
            reply = await self._forward(name, "ModelStatistics", stats_request, budget, metadata)
            return 200, orjson.dumps(plain(pb.ModelStatisticsResponse.FromString(reply)))
        raise HttpError(404, f"{method} {clip(path)} is not an endpoint of this server")

    async def _shared_memory_call(
        self, method: str, path: str, receive: Receive
    ) -> tuple[int, bytes]:
        """Triton's shared-memory extensions: the router's one registry, as over gRPC."""
        match = SHARED_MEMORY_PATH.match(path)
        if match is None or method != ("GET" if match.group(3) == "status" else "POST"):
            raise HttpError(404, f"{method} {clip(path)} is not an endpoint of this server")
        kind, name, action = match.group(1), match.group(2) or "", match.group(3)
        if kind == "cuda":
            if action == "register":
                await self.shared_memory.cuda_register(
                    pb.CudaSharedMemoryRegisterRequest(name=name), None
                )
            return 200, b"[]" if action == "status" else b""
        if action == "status":
            regions = self.shared_memory.status(name)
            return 200, orjson.dumps(
                [
                    {"name": r.name, "key": r.key, "offset": r.offset, "byte_size": r.byte_size}
                    for r in regions
                ]
            )
        if action == "unregister":
            self.shared_memory.unregister(name)
            return 200, b""
        doc = await small_json(receive, self.settings.max_message_size)
        key, offset, size = doc.get("key"), doc.get("offset", 0), doc.get("byte_size")
        if not name or not isinstance(key, str) or not count(offset) or not count(size):
            raise InvalidInput(
                "register takes /v2/systemsharedmemory/region/<name>/register with "
                '{"key": "/<object>", "offset": <int>, "byte_size": <int>}'
            )
        self.shared_memory.register(name, key, int(offset), int(size))  # type: ignore[arg-type]
        return 200, b""

    async def _repository(
        self, path: str, budget: float | None, metadata: list[tuple[str, str]], receive: Receive
    ) -> tuple[int, bytes]:
        """Triton's model repository extension: index, load, unload."""
        doc = await small_json(receive, self.settings.max_message_size)
        if path == "/v2/repository/index":
            ready = doc.get("ready", False)
            if not isinstance(ready, bool):
                raise InvalidInput("'ready' must be true or false")
            request = pb.RepositoryIndexRequest(ready=ready)
            reply = await self.repository.index(request.SerializeToString(), budget, metadata)
            models = pb.RepositoryIndexResponse.FromString(reply).models
            mlserver = await self.mlserver_models.current()
            return 200, orjson.dumps([listed(m, m.name in mlserver) for m in models])
        match = REPOSITORY_PATH.match(path)
        if match is None:
            raise HttpError(404, f"POST {clip(path)} is not an endpoint of this server")
        name, action = match.group(1), match.group(2)
        method = LOAD if action == "load" else UNLOAD
        load = pb.RepositoryModelLoadRequest(model_name=name)
        repository_parameters(load, doc.get("parameters"))
        try:
            await self.repository.control(method, name, load.SerializeToString(), budget, metadata)
        except ServingError as exc:
            if method == LOAD:
                raise load_failed(name, exc) from None
            raise
        return 200, b""

    async def _model_ready(
        self, name: str, version: str, budget: float | None, metadata: list[tuple[str, str]]
    ) -> bool:
        ensembles = self.repository.ensembles
        if name in ensembles.plans:
            return ensembles.ready_version(name, version)
        if name not in self.routes.routes:
            return False  # as the gRPC door: a model that does not exist is not ready
        request = pb.ModelReadyRequest(name=name, version=version)
        reply = await self._forward(name, "ModelReady", request, budget, metadata)
        return pb.ModelReadyResponse.FromString(reply).ready

    async def _forward(
        self,
        name: str,
        method: str,
        request: Any,
        budget: float | None,
        metadata: list[tuple[str, str]],
    ) -> bytes:
        if name in self.repository.ensembles.plans:  # answered here (router/ensemble.py)
            return self.repository.ensembles.answer(method, name, request.version)
        route = self.routes.route(name)
        return await self.core.forward(route, method, request.SerializeToString(), budget, metadata)

    # -- infer: the hot path --------------------------------------------------


def count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def repository_parameters(request: pb.RepositoryModelLoadRequest, params: object) -> None:
    """A load's JSON parameters: strings (``file:`` ones base64, as Triton's
    clients send them), booleans and integers."""
    if params is None:
        return
    if not isinstance(params, dict):
        raise InvalidInput("'parameters' must be a JSON object")
    for key, value in params.items():
        param = request.parameters[key]
        if isinstance(value, bool):
            param.bool_param = value
        elif isinstance(value, int):
            param.int64_param = value
        elif isinstance(value, str) and key.startswith("file:"):
            try:
                param.bytes_param = base64.b64decode(value, validate=True)
            except binascii.Error:
                raise InvalidInput(f"parameter '{clip(key)}' is not base64") from None
        elif isinstance(value, str):
            param.string_param = value
        else:
            raise InvalidInput(f"parameter '{clip(key)}' must be a string, a boolean or an integer")


def metadata_json(reply: pb.ModelMetadataResponse) -> bytes:
    def tensors(items: Iterable[pb.ModelMetadataResponse.TensorMetadata]) -> list[dict[str, Any]]:
        return [{"name": t.name, "datatype": t.datatype, "shape": list(t.shape)} for t in items]

    return orjson.dumps(
        {
            "name": reply.name,
            "versions": list(reply.versions),
            "platform": reply.platform,
            "inputs": tensors(reply.inputs),
            "outputs": tensors(reply.outputs),
        }
    )


def listed(model: Any, mlserver: bool) -> dict[str, Any]:
    """A repository index entry as JSON; an MLServer model's as MLServer's REST
    lists it: its state names (unloaded on request: UNAVAILABLE, no reason), the
    reason always there (empty too), the version when it has one."""
    if not mlserver:
        return plain(model)
    out = plain(model)
    out["state"] = MLSERVER_STATES.get(model.state, "UNKNOWN")
    out["reason"] = "" if model.state == "UNLOADED" else model.reason
    return out


def plain(message: Message) -> dict[str, Any]:
    """A message as Triton's HTTP API writes it: field names as in the .proto,
    enums by name, and 64-bit integers as JSON numbers (protobuf's own JSON
    mapping writes them as strings)."""
    out: dict[str, Any] = {}
    for field, value in message.ListFields():
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            value_field = field.message_type.fields_by_name["value"]
            out[field.name] = {k: _plain_value(value_field, v) for k, v in value.items()}
        elif field.is_repeated:
            out[field.name] = [_plain_value(field, v) for v in value]
        else:
            out[field.name] = _plain_value(field, value)
    return out


def _plain_value(field: FieldDescriptor, value: Any) -> Any:
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        return plain(value)
    if field.type == FieldDescriptor.TYPE_ENUM:
        found = field.enum_type.values_by_number.get(value) if field.enum_type else None
        return found.name if found is not None else value
    if field.type == FieldDescriptor.TYPE_BYTES:
        return value.decode("latin-1")
    return value
