"""Runs the unmodified MLServer with two gRPC handlers added by the bench.

perf_analyzer asks every server for ModelConfig and ModelStatistics, which
MLServer 1.7.1 does not implement. This launcher wraps
``GRPCServer._create_server`` so that, after MLServer has built its server
exactly as usual, one more generic handler answers those two methods:

- ModelConfig: name, max_batch_size 0 and the tensors from the model's
  model-settings.json;
- ModelStatistics: the model with version "1" (perf_analyzer parses
  versions as integers) and zero counts: the bench does not touch
  MLServer's inference path to count.

Everything else (ModelInfer included) is MLServer's own code.
usage: python mlserver_addon.py start MODEL_REPOSITORY
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import grpc
import pbwire

ADDON_VERSION = "1"


def read_models(repo: Path) -> dict[str, dict[str, Any]]:
    models: dict[str, dict[str, Any]] = {}
    for path in sorted(repo.rglob("model-settings.json")):
        settings = json.loads(path.read_text())
        models[settings["name"]] = settings
    return models


def _specs(items: list[dict[str, Any]]) -> list[pbwire.TensorSpec]:
    return [pbwire.TensorSpec(t["name"], t["datatype"], tuple(t["shape"])) for t in items]


class AddonHandlers:
    def __init__(self, models: dict[str, dict[str, Any]]) -> None:
        self.models = models

    async def model_config(self, body: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
        name = pbwire.first_str(pbwire.decode(body), 1)
        settings = self.models.get(name)
        if settings is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"model {name!r} not found")
        assert settings is not None
        return pbwire.model_config_response(
            name,
            "mlserver",
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


def install(repo: Path) -> None:
    from mlserver.grpc import server as grpc_server

    original = grpc_server.GRPCServer._create_server
    addon = AddonHandlers(read_models(repo))

    def create_server(self: Any) -> Any:
        server = original(self)
        server.add_generic_rpc_handlers((addon.generic_handler(),))
        return server

    grpc_server.GRPCServer._create_server = create_server  # type: ignore[method-assign]


def main() -> None:
    if len(sys.argv) != 3 or sys.argv[1] != "start":
        sys.exit(__doc__)
    install(Path(sys.argv[2]))
    from mlserver.cli import main as mlserver_main

    mlserver_main()


if __name__ == "__main__":
    main()
