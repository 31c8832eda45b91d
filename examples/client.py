"""A plain grpc.aio client for a running poolserve: python examples/client.py [HOST:PORT]."""

from __future__ import annotations

import asyncio
import sys

import grpc
import numpy as np

from poolserve.protos import inference_pb2 as pb
from poolserve.protos import inference_pb2_grpc as pbg
from poolserve.service import decode_outputs, encode_inputs


async def main(address: str) -> None:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pbg.GRPCInferenceServiceStub(channel)
        ready = await stub.ServerReady(pb.ServerReadyRequest(), timeout=5)
        print(f"ServerReady: {ready.ready}")
        for model in (await stub.RepositoryIndex(pb.RepositoryIndexRequest())).models:
            print(f"  {model.name:8} {model.state:12} {model.reason}")
        request = pb.ModelInferRequest(model_name="echo")
        encode_inputs({"INPUT0": np.arange(16, dtype=np.float32).reshape(1, 16)}, request, raw=True)
        reply = await stub.ModelInfer(request, timeout=1.0)
        print("echo ->", decode_outputs(reply)["OUTPUT0"].tolist())
        iris = pb.ModelInferRequest(model_name="iris")
        encode_inputs({"INPUT0": np.array([[5.1, 3.5, 1.4, 0.2]])}, iris, raw=True)
        print("iris ->", decode_outputs(await stub.ModelInfer(iris, timeout=1.0))["predict"])


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1] if len(sys.argv) > 1 else "127.0.0.1:8081"))
