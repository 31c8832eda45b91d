"""Runs the unmodified MLServer with two gRPC handlers added by the bench.

perf_analyzer asks every server for ModelConfig and ModelStatistics, which
MLServer 1.7.1 does not implement. This launcher wraps
``GRPCServer._create_server`` so that, after MLServer has built its server
exactly as usual, one more generic handler answers those two methods (see
perf_handlers.py: tensors from model-settings.json; statistics with version
"1" and zero counts).

Everything else (ModelInfer included) is MLServer's own code.
usage: python mlserver_addon.py start MODEL_REPOSITORY
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from perf_handlers import AddonHandlers, read_models


def install(repo: Path) -> None:
    from mlserver.grpc import server as grpc_server

    original = grpc_server.GRPCServer._create_server
    addon = AddonHandlers(read_models(repo), "mlserver")

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
