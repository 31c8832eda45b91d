"""The bare peer: one grpc.aio process, no routing, no workers (the floor of one Python hop).

It parses each ModelInferRequest with the generated KServe V2 messages
(poolserve's copy of the proto: only the message classes, none of poolserve's
serving code), runs the model on the event loop, and answers. ModelConfig and
ModelStatistics are answered too (version "1"), since perf_analyzer asks.
usage: python bare_server.py --port P --iterations N [--counter PATH] [--max-message BYTES]
       [--dims -1,3,224,224]  (the tensor's shape in ModelMetadata/ModelConfig; default 1,16)
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
import workload

from poolserve.protos import inference_pb2 as pb

VERSION = "1"
DTYPES = {"FP32": np.float32, "FP64": np.float64, "INT32": np.int32, "INT64": np.int64}
DIMS = [(1, 16)]  # the served tensor shape, as metadata says (--dims)


@dataclass
class Served:
    name: str
    predict: Callable[[np.ndarray[Any, Any]], np.ndarray[Any, Any]]
    count: int = 0
    ns: int = 0


def build_models(iterations: int, counter_path: str) -> dict[str, Served]:
    counter = workload.ExecutionCounter(counter_path)

    def echo(x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        return x

    def burn(x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        workload.burn(iterations, counter)
        return x

    return {"echo": Served("echo", echo), "burn": Served("burn", burn)}


class BareServicer:
    def __init__(self, models: dict[str, Served]) -> None:
        self.models = models

    def _model(self, name: str) -> Served | None:
        return self.models.get(name)

    async def infer(self, request: pb.ModelInferRequest, context: Any) -> pb.ModelInferResponse:
        began = time.perf_counter_ns()
        model = self._model(request.model_name)
        if model is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"model {request.model_name!r}")
        assert model is not None
        tensor = request.inputs[0]
        x = np.frombuffer(request.raw_input_contents[0], DTYPES[tensor.datatype])
        y = model.predict(x.reshape(tuple(tensor.shape)))
        response = pb.ModelInferResponse(model_name=model.name, model_version=VERSION)
        response.outputs.add(name="OUTPUT0", datatype=tensor.datatype, shape=y.shape)
        response.raw_output_contents.append(y.tobytes())
        model.count += 1
        model.ns += time.perf_counter_ns() - began
        return response

    async def server_live(self, _: pb.ServerLiveRequest, __: Any) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=True)

    async def server_ready(self, _: pb.ServerReadyRequest, __: Any) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=True)

    async def model_ready(self, request: pb.ModelReadyRequest, _: Any) -> pb.ModelReadyResponse:
        return pb.ModelReadyResponse(ready=request.name in self.models)

    async def server_metadata(
        self, _: pb.ServerMetadataRequest, __: Any
    ) -> pb.ServerMetadataResponse:
        return pb.ServerMetadataResponse(name="bare-grpc-aio", version="1")

    async def model_metadata(
        self, request: pb.ModelMetadataRequest, context: Any
    ) -> pb.ModelMetadataResponse:
        if request.name not in self.models:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"model {request.name!r}")
        response = pb.ModelMetadataResponse(name=request.name, versions=[VERSION])
        response.inputs.add(name="INPUT0", datatype="FP32", shape=DIMS[0])
        response.outputs.add(name="OUTPUT0", datatype="FP32", shape=DIMS[0])
        return response

    async def model_config(
        self, request: pb.ModelConfigRequest, context: Any
    ) -> pb.ModelConfigResponse:
        if request.name not in self.models:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"model {request.name!r}")
        config = pb.ModelConfig(name=request.name, platform="bare", max_batch_size=0)
        config.input.add(name="INPUT0", data_type=pb.TYPE_FP32, dims=DIMS[0])
        config.output.add(name="OUTPUT0", data_type=pb.TYPE_FP32, dims=DIMS[0])
        return pb.ModelConfigResponse(config=config)

    async def model_statistics(
        self, request: pb.ModelStatisticsRequest, _: Any
    ) -> pb.ModelStatisticsResponse:
        names = [request.name] if request.name else list(self.models)
        response = pb.ModelStatisticsResponse()
        for name in names:
            m = self.models.get(name)
            if m is None:
                continue
            stats = response.model_stats.add(
                name=name, version=VERSION, inference_count=m.count, execution_count=m.count
            )
            stats.inference_stats.success.count = m.count
            stats.inference_stats.success.ns = m.ns
        return response

    def generic_handler(self) -> grpc.GenericRpcHandler:
        def unary(
            fn: Callable[[Any, Any], Awaitable[Any]], request: Any, response: Any
        ) -> grpc.RpcMethodHandler[Any, Any]:
            return grpc.unary_unary_rpc_method_handler(
                fn, request.FromString, response.SerializeToString
            )

        return grpc.method_handlers_generic_handler(
            "inference.GRPCInferenceService",
            {
                "ModelInfer": unary(self.infer, pb.ModelInferRequest, pb.ModelInferResponse),
                "ServerLive": unary(self.server_live, pb.ServerLiveRequest, pb.ServerLiveResponse),
                "ServerReady": unary(
                    self.server_ready, pb.ServerReadyRequest, pb.ServerReadyResponse
                ),
                "ModelReady": unary(self.model_ready, pb.ModelReadyRequest, pb.ModelReadyResponse),
                "ServerMetadata": unary(
                    self.server_metadata, pb.ServerMetadataRequest, pb.ServerMetadataResponse
                ),
                "ModelMetadata": unary(
                    self.model_metadata, pb.ModelMetadataRequest, pb.ModelMetadataResponse
                ),
                "ModelConfig": unary(
                    self.model_config, pb.ModelConfigRequest, pb.ModelConfigResponse
                ),
                "ModelStatistics": unary(
                    self.model_statistics, pb.ModelStatisticsRequest, pb.ModelStatisticsResponse
                ),
            },
        )


async def serve(port: int, models: dict[str, Served], max_message: int) -> None:
    limits = [
        ("grpc.max_send_message_length", max_message),
        ("grpc.max_receive_message_length", max_message),
    ]
    server = grpc.aio.server(options=limits)
    server.add_generic_rpc_handlers((BareServicer(models).generic_handler(),))
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    print(f"bare: ready, serving on 127.0.0.1:{port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(1.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--iterations", type=int, required=True)
    parser.add_argument("--counter", default="")
    parser.add_argument("--max-message", type=int, default=4 * 1024 * 1024)
    parser.add_argument("--dims", default="1,16")
    args = parser.parse_args()
    DIMS[0] = tuple(int(d) for d in args.dims.split(","))
    models = build_models(args.iterations, args.counter)
    asyncio.run(serve(args.port, models, args.max_message))


if __name__ == "__main__":
    main()
