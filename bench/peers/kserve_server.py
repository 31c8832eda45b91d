"""The bench's models on the unmodified KServe ModelServer, plus what perf_analyzer needs.

KServe's own way to serve custom Python models: ``kserve.Model`` subclasses
(``echo`` and ``burn`` below: the same loop and counter from workload.py that
every server runs, the iteration count the bench calibrated) passed to
``kserve.ModelServer().start``, configured by KServe's own flags and
environment:

- ``--grpc_port`` and ``--http_port`` (KServe's ModelServer flags): free ports
  chosen by the bench; everything else is KServe's default (one process, its
  gRPC server with 4 threads, its logging and latency interceptors);
- ``KSERVE_LOGLEVEL=WARNING`` (KServe's own setting; the bench sets it): at
  its default INFO it writes a log line per gRPC call and a latency line per
  request (issue 10 measured them at 14-21 % of its echo throughput).

Two things KServe 0.21.0 has no setting for, which this launcher adds:

- **loopback only**: KServe binds its gRPC server to ``[::]:PORT`` (every
  interface) and uvicorn, its REST server, to ``0.0.0.0``. The launcher wraps
  the ``grpc.aio`` server KServe creates so that ``add_insecure_port("[::]:PORT")``
  binds ``127.0.0.1:PORT`` instead, and sets the REST server's uvicorn host to
  ``127.0.0.1``;
- **ModelConfig and ModelStatistics** (perf_handlers.py): added as one generic
  handler just before KServe starts the server it built and registered its own
  servicer on; over REST, as two GET routes (``/v2/models/{m}/config`` and
  ``/stats``) on the FastAPI app KServe builds. KServe's interceptors,
  middlewares, servicer, routes and inference paths are its own.

usage: python kserve_server.py MODEL_REPOSITORY --grpc_port N --http_port M
(MODEL_REPOSITORY holds one model-settings.json per model, written by the bench.)
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("KSERVE_LOGLEVEL", "WARNING")  # read when kserve is imported

import kserve  # parses its own flags (--grpc_port, --http_port) from sys.argv
import numpy as np
import workload
from kserve import InferOutput, InferRequest, InferResponse
from perf_handlers import AddonHandlers, add_rest_routes, read_models

LOOPBACK = "127.0.0.1"
ALL_INTERFACES = ("[::]", "0.0.0.0", "")


# -- the models: written the way KServe's docs write custom v2 models ---------------------


class BenchModel(kserve.Model):
    """Ready at once; declares its tensors (from model-settings.json) as KServe models do, by
    get_input_types/get_output_types: perf_analyzer reads them from ModelMetadata."""

    def __init__(self, name: str, settings: dict[str, Any]) -> None:
        super().__init__(name)
        self.inputs = list(settings.get("inputs", []))
        self.outputs = list(settings.get("outputs", []))
        self.extra = dict((settings.get("parameters") or {}).get("extra") or {})
        self.load()

    def load(self) -> bool:
        self.ready = True
        return self.ready

    def get_input_types(self) -> list[dict[str, Any]]:
        return self.inputs

    def get_output_types(self) -> list[dict[str, Any]]:
        return self.outputs

    def respond(self, payload: InferRequest, y: np.ndarray, name: str = "OUTPUT0") -> InferResponse:
        out = InferOutput(name, shape=list(y.shape), datatype="FP32", data=y)
        if payload.from_grpc:  # the gRPC part's path, unchanged
            return InferResponse(response_id=payload.id, model_name=self.name, infer_outputs=[out])
        # REST: binary outputs when the request asks (Triton's binary tensor extension:
        # binary_data_output or an output's binary_data), passed on as KServe's API takes them.
        return InferResponse(response_id=payload.id, model_name=self.name, infer_outputs=[out],
                             use_binary_outputs=payload.use_binary_outputs,
                             requested_outputs=payload.request_outputs)  # fmt: skip


class EchoModel(BenchModel):
    def predict(self, payload: InferRequest, headers: dict[str, str] | None = None) -> Any:
        x = payload.inputs[0].as_numpy()
        return self.respond(payload, x)


class BurnModel(BenchModel):
    def load(self) -> bool:
        self.iterations = int(self.extra["iterations"])
        self.counter = workload.ExecutionCounter(str(self.extra.get("counter", "")))
        return super().load()

    def predict(self, payload: InferRequest, headers: dict[str, str] | None = None) -> Any:
        x = payload.inputs[0].as_numpy()
        workload.burn(self.iterations, self.counter)
        return self.respond(payload, x)


class BigModel(BenchModel):
    """Holds ``extra.array_mib`` MiB of float64 (written, so resident) and reads it per request."""

    def load(self) -> bool:
        count = int(self.extra["array_mib"]) * 1024 * 1024 // 8
        self.table = np.ones(count, dtype=np.float64)
        return super().load()

    def predict(self, payload: InferRequest, headers: dict[str, str] | None = None) -> Any:
        x = payload.inputs[0].as_numpy()
        return self.respond(payload, x + np.float32(self.table[x.size]))


class XGBoostModel(BenchModel):
    """KServe's own XGBoost server's model code (kserve/python/xgbserver, not on PyPI): a
    Booster with nthread 1 (xgbserver's default --nthread), a DMatrix per request."""

    nthread = 1

    def load(self) -> bool:
        import xgboost

        self.xgboost = xgboost
        self.booster = xgboost.Booster(
            params={"nthread": self.nthread}, model_file=str(self.extra["model_file"])
        )
        return super().load()

    def predict(self, payload: InferRequest, headers: dict[str, str] | None = None) -> Any:
        x = payload.inputs[0].as_numpy()
        y = self.booster.predict(self.xgboost.DMatrix(x, nthread=self.nthread))
        return self.respond(payload, np.asarray(y, np.float32), workload.XGB_OUTPUT)


CLASSES = {
    "EchoModel": EchoModel,
    "BurnModel": BurnModel,
    "BigModel": BigModel,
    "XGBoostModel": XGBoostModel,
}


# -- what the bench adds around KServe ------------------------------------------------------


def loopback(address: str) -> str:
    """``[::]:8081`` or ``0.0.0.0:8081`` -> ``127.0.0.1:8081``; other addresses unchanged."""
    host, _, port = address.rpartition(":")
    return f"{LOOPBACK}:{port}" if host in ALL_INTERFACES else address


class _AioWithAddon:
    """``grpc.aio`` as KServe's gRPC server module sees it, with ``server()`` wrapped."""

    def __init__(self, aio: Any, addon: AddonHandlers) -> None:
        self._aio = aio
        self._addon = addon

    def __getattr__(self, name: str) -> Any:
        return getattr(self._aio, name)

    def server(self, *args: Any, **kwargs: Any) -> Any:
        server = self._aio.server(*args, **kwargs)  # KServe's own arguments, unchanged
        add_port, start = server.add_insecure_port, server.start
        addon = self._addon

        def add_insecure_port(address: str) -> int:
            bound = loopback(address)
            print(f"kserve-bench: gRPC {address} -> {bound}", flush=True)
            port: int = add_port(bound)
            return port

        async def start_with_addon() -> None:
            # After KServe registered its servicer: its handlers come first.
            server.add_generic_rpc_handlers((addon.generic_handler(),))
            await start()

        server.add_insecure_port = add_insecure_port
        server.start = start_with_addon
        return server


def install(repo: Path) -> None:
    from kserve.protocol.grpc import server as grpc_server
    from kserve.protocol.rest import server as rest_server

    addon = AddonHandlers(read_models(repo), "kserve")
    grpc_server.aio = _AioWithAddon(grpc_server.aio, addon)  # type: ignore[attr-defined]

    original_init = rest_server.RESTServer.__init__

    def rest_init(self: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        if self.config.host in ALL_INTERFACES:
            print(f"kserve-bench: REST {self.config.host} -> {LOOPBACK}", flush=True)
            self.config.host = LOOPBACK

    rest_server.RESTServer.__init__ = rest_init  # type: ignore[method-assign]

    original_register = rest_server.RESTServer._register_endpoints

    def register(self: Any, app: Any) -> None:
        add_rest_routes(app, addon.models, "kserve")  # before KServe's own /v2 routes
        original_register(self, app)

    rest_server.RESTServer._register_endpoints = register  # type: ignore[method-assign]


def models(repo: Path) -> list[kserve.Model]:
    found = []
    for name, settings in read_models(repo).items():
        cls = CLASSES[str(settings["implementation"]).rpartition(".")[2]]
        found.append(cls(name, settings))
    return found


def main() -> None:
    if len(sys.argv) < 2 or not Path(sys.argv[1]).is_dir():
        sys.exit(__doc__)
    repo = Path(sys.argv[1])
    install(repo)
    served = models(repo)
    print(f"kserve-bench: serving {', '.join(m.name for m in served)}", flush=True)
    kserve.ModelServer().start(served)


if __name__ == "__main__":
    main()
