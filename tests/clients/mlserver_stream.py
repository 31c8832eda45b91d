"""MLServer 1.7.1's own generated gRPC stubs streaming from an address, as
MLServer's streaming example's client does, in its own process (MLServer's
generated modules register protobuf package ``inference``, as tritonclient's
do). Prints one JSON line: the tokens each response carried, their ids, and
the stream's status (code name and details) if it ended with an error.
usage: mlserver_stream.py HOST:PORT MODEL PROMPT [PROMPT ...]
"""

import asyncio
import json
import sys

import grpc
import mlserver.grpc.converters as converters
import mlserver.grpc.dataplane_pb2_grpc as dataplane
import mlserver.types as types
from mlserver.codecs import StringCodec


async def main(address: str, model: str, prompts: list[str]) -> dict[str, object]:
    async def requests():  # type: ignore[no-untyped-def]
        for i, prompt in enumerate(prompts):
            inference_request = types.InferenceRequest(
                id=f"r{i}",
                inputs=[StringCodec.encode_input(name="prompt", payload=[prompt], use_bytes=True)],
            )
            if prompt == "<no inputs>":
                inference_request.inputs = []
            yield converters.ModelInferRequestConverter.from_types(
                inference_request, model_name=model, model_version=None
            )

    tokens: list[str] = []
    ids: list[str] = []
    status = None
    async with grpc.aio.insecure_channel(address) as channel:
        stub = dataplane.GRPCInferenceServiceStub(channel)
        try:
            async for response in stub.ModelStreamInfer(requests(), timeout=60):
                inference_response = converters.ModelInferResponseConverter.to_types(response)
                output = inference_response.outputs[0]  # the example's client: IndexError
                tokens.append(StringCodec.decode_output(output)[0])
                ids.append(str(inference_response.id))
        except grpc.aio.AioRpcError as exc:
            status = [exc.code().name, exc.details()]
    return {"tokens": tokens, "ids": ids, "status": status}


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3:]))))
