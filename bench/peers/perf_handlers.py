"""The ModelConfig and ModelStatistics handlers perf_analyzer needs, for peers that lack them.

perf_analyzer asks every server for ModelConfig (to learn the tensors) and
ModelStatistics (before and after each window). MLServer 1.7.1 and KServe
0.21.0 implement neither; their launchers (mlserver_addon.py,
kserve_server.py) add these two handlers, as one generic gRPC handler, to the
server each peer built exactly as usual:

- ModelConfig: name, max_batch_size 0 and the tensors from the model's
  model-settings.json (written by the bench);
- ModelStatistics: the model with version "1" (perf_analyzer parses
  versions as integers) and zero counts: the bench does not touch a peer's
  inference path to count.

Bytes in, bytes out (peers/pbwire.py): no generated ``inference`` package is
imported, so nothing clashes with the peer's own protos.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import grpc
import pbwire

ADDON_VERSION = "1"


def read_models(repo: Path) -> dict[str, dict[str, Any]]:
    """Model name -> its model-settings.json, for every model under ``repo``."""
    models: dict[str, dict[str, Any]] = {}
    for path in sorted(repo.rglob("model-settings.json")):
        settings = json.loads(path.read_text())
        models[settings["name"]] = settings
    return models


def _specs(items: list[dict[str, Any]]) -> list[pbwire.TensorSpec]:
    return [pbwire.TensorSpec(t["name"], t["datatype"], tuple(t["shape"])) for t in items]


class AddonHandlers:
    def __init__(self, models: dict[str, dict[str, Any]], platform: str) -> None:
        self.models = models
        self.platform = platform

    async def model_config(self, body: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
        name = pbwire.first_str(pbwire.decode(body), 1)
        settings = self.models.get(name)
        if settings is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"model {name!r} not found")
        assert settings is not None
        return pbwire.model_config_response(
            name,
            self.platform,
            _specs(settings.get("inputs", [])),
            _specs(settings.get("outputs", [])),
        )

    async def model_statistics(
        self, body: bytes, context: grpc.aio.ServicerContext[Any, Any]
    ) -> bytes:
        name = pbwire.first_str(pbwire.decode(body), 1)
        names = [name] if name else list(self.models)
        if name and name not in self.models:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"model {name!r} not found")
        return pbwire.model_statistics_response(
            [pbwire.ModelStats(n, ADDON_VERSION) for n in names]
        )

    def generic_handler(self) -> grpc.GenericRpcHandler:
        def unary(fn: Any) -> grpc.RpcMethodHandler[Any, Any]:
            return grpc.unary_unary_rpc_method_handler(fn)  # bytes in, bytes out

        return grpc.method_handlers_generic_handler(
            pbwire.SERVICE,
            {
                "ModelConfig": unary(self.model_config),
                "ModelStatistics": unary(self.model_statistics),
            },
        )


# -- the same two answers over REST (Triton's HTTP API: GET .../config, GET .../stats) --------

STAT_KINDS = (
    "success", "fail", "queue", "compute_input", "compute_infer", "compute_output",
    "cache_hit", "cache_miss",
)  # fmt: skip


def _rest_tensors(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        {"name": t["name"], "data_type": f"TYPE_{t['datatype']}", "dims": list(t["shape"])}
        for t in items
    ]


def rest_config(name: str, settings: dict[str, Any], platform: str) -> dict[str, Any]:
    """GET /v2/models/{name}/config: Triton's model configuration as JSON."""
    return {
        "name": name,
        "platform": platform,
        "max_batch_size": 0,
        "input": _rest_tensors(settings.get("inputs", [])),
        "output": _rest_tensors(settings.get("outputs", [])),
    }


def rest_stats(names: list[str]) -> dict[str, Any]:
    """GET /v2/models/{name}/stats: version "1" and zero counts, as over gRPC."""
    zero = {kind: {"count": 0, "ns": 0} for kind in STAT_KINDS}
    return {
        "model_stats": [
            {"name": n, "version": ADDON_VERSION, "last_inference": 0, "inference_count": 0,
             "execution_count": 0, "inference_stats": zero, "batch_stats": []}
            for n in names
        ]
    }  # fmt: skip


def add_rest_routes(app: Any, models: dict[str, dict[str, Any]], platform: str) -> None:
    """GET /v2/models/{m}[/versions/{v}]/config and .../stats on a peer's FastAPI app."""
    from starlette.responses import Response

    def answer(found: object) -> Any:
        if found is None:
            return Response(b'{"error":"model not found"}', 404, media_type="application/json")
        return Response(json.dumps(found).encode(), 200, media_type="application/json")

    async def config(model_name: str, model_version: str = "") -> Any:
        settings = models.get(model_name)
        return answer(rest_config(model_name, settings, platform) if settings else None)

    async def stats(model_name: str, model_version: str = "") -> Any:
        return answer(rest_stats([model_name]) if model_name in models else None)

    for suffix, endpoint in (("config", config), ("stats", stats)):
        app.add_api_route(f"/v2/models/{{model_name}}/{suffix}", endpoint, methods=["GET"])
        app.add_api_route(f"/v2/models/{{model_name}}/versions/{{model_version}}/{suffix}",
                          endpoint, methods=["GET"])  # fmt: skip
