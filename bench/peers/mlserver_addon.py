"""Runs the unmodified MLServer with two gRPC handlers added by the bench.

perf_analyzer asks every server for ModelConfig and ModelStatistics, which
MLServer 1.7.1 does not implement. This launcher wraps
``GRPCServer._create_server`` so that, after MLServer has built its server
exactly as usual, one more generic handler answers those two methods (see
perf_handlers.py: tensors from model-settings.json; statistics with version
"1" and zero counts). Over REST, the same two answers as GET routes
(``/v2/models/{m}/config`` and ``/stats``) on the FastAPI app MLServer builds.

Everything else (ModelInfer included) is MLServer's own code.
usage: python mlserver_addon.py start MODEL_REPOSITORY
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from perf_handlers import AddonHandlers, add_rest_routes, read_models


def install(repo: Path) -> None:
    from mlserver.grpc import server as grpc_server

    original = grpc_server.GRPCServer._create_server
    addon = AddonHandlers(read_models(repo), "mlserver")

    def create_server(self: Any) -> Any:
        server = original(self)
        server.add_generic_rpc_handlers((addon.generic_handler(),))
        return server

    grpc_server.GRPCServer._create_server = create_server  # type: ignore[method-assign]

    from mlserver.rest import server as rest_server

    original_app = rest_server.create_app

    def create_app(*args: Any, **kwargs: Any) -> Any:
        app = original_app(*args, **kwargs)
        add_rest_routes(app, addon.models, "mlserver")
        return app

    rest_server.create_app = create_app


def main() -> None:
    if len(sys.argv) != 3 or sys.argv[1] != "start":
        sys.exit(__doc__)
    install(Path(sys.argv[2]))
    from mlserver.cli import main as mlserver_main

    mlserver_main()


if __name__ == "__main__":
    main()
