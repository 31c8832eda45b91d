"""The requests of MLServer 1.7.1's documentation examples, sent as their
READMEs send them (``requests`` for REST; MLServer's own types, converters and
generated gRPC stubs for gRPC), against one server, in a process of its own
(MLServer's generated modules register protobuf package ``inference``, as
tritonclient's do). Prints one JSON line: every answer as it came (status,
body; gRPC replies as base64 of their bytes, or [code name, details]) and
what the README's client makes of it.

usage: mlserver_readme.py EXAMPLE GRPC_ADDRESS HTTP_ADDRESS [FILE]
  EXAMPLE: custom-json | streaming | model-repository
  FILE: the streaming example's generate-request.json
"""

import asyncio
import base64
import json
import sys
from typing import Any

import grpc
import requests
from mlserver import types
from mlserver.codecs import StringCodec
from mlserver.codecs.string import StringRequestCodec
from mlserver.grpc import converters
from mlserver.grpc import dataplane_pb2 as dataplane
from mlserver.grpc import dataplane_pb2_grpc as dataplane_grpc
from mlserver.grpc import model_repository_pb2 as repository
from mlserver.grpc import model_repository_pb2_grpc as repository_grpc

WAIT = 60


def b64(message: Any) -> str:
    return base64.b64encode(message.SerializeToString()).decode()


def rest(reply: requests.Response) -> dict[str, Any]:
    try:
        body: Any = reply.json()
    except ValueError:
        body = reply.text
    return {"status": reply.status_code, "body": body}


def unary(call: Any, message: Any) -> dict[str, Any]:
    try:
        return {"reply": b64(call(message, timeout=WAIT))}
    except grpc.RpcError as exc:
        return {"status": [exc.code().name, exc.details()]}


def decoded_json(response: types.InferenceResponse) -> Any:
    """The README's reading of json-hello-world's answer."""
    return json.loads(StringRequestCodec.decode_response(response)[0])


def custom_json(grpc_address: str, http: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    # REST, as the README: characters, not bytes; the shape is the string's length
    inputs = {"name": "Foo Bar", "message": "Hello from Client (REST)!"}
    inputs_string = json.dumps(inputs)
    body = {
        "inputs": [
            {
                "name": "echo_request",
                "shape": [len(inputs_string)],
                "datatype": "BYTES",
                "data": [inputs_string],
            }
        ]
    }
    endpoint = f"http://{http}/v2/models/json-hello-world/infer"
    reply = requests.post(endpoint, json=body, timeout=WAIT)
    out["rest"] = rest(reply)
    if reply.status_code == 200:
        out["rest_decoded"] = decoded_json(types.InferenceResponse.model_validate_json(reply.text))
    # ... and a string that is not JSON: the model's own error
    body["inputs"][0]["data"] = ["{not json"]
    out["rest_bad"] = rest(requests.post(endpoint, json=body, timeout=WAIT))

    # gRPC, as the README: MLServer's types and converters, its generated stub
    inputs = {"name": "Foo Bar", "message": "Hello from Client (gRPC)!"}
    inputs_bytes = json.dumps(inputs).encode("UTF-8")
    request = types.InferenceRequest(
        inputs=[
            types.RequestInput(
                name="echo_request",
                shape=[len(inputs_bytes)],
                datatype="BYTES",
                data=[inputs_bytes],
                parameters=types.Parameters(content_type="str"),
            )
        ]
    )
    message = converters.ModelInferRequestConverter.from_types(
        request, model_name="json-hello-world", model_version=None
    )
    with grpc.insecure_channel(grpc_address) as channel:
        stub = dataplane_grpc.GRPCInferenceServiceStub(channel)
        out["grpc"] = unary(stub.ModelInfer, message)
        if "reply" in out["grpc"]:
            response = stub.ModelInfer(message, timeout=WAIT)
            typed = converters.ModelInferResponseConverter.to_types(response)
            out["grpc_decoded"] = decoded_json(typed)
        message.inputs[0].contents.bytes_contents[0] = b"{not json"
        out["grpc_bad"] = unary(stub.ModelInfer, message)
    return out


async def stream_grpc(grpc_address: str, message: Any) -> dict[str, Any]:
    async def one() -> Any:
        yield message

    replies: list[str] = []
    tokens: list[str] = []
    status = None
    async with grpc.aio.insecure_channel(grpc_address) as channel:
        stub = dataplane_grpc.GRPCInferenceServiceStub(channel)
        try:
            async for response in stub.ModelStreamInfer(one(), timeout=WAIT):
                replies.append(b64(response))
                typed = converters.ModelInferResponseConverter.to_types(response)
                try:
                    tokens.append(StringCodec.decode_output(typed.outputs[0])[0])
                except IndexError:  # what the README's client dies of on other messages
                    tokens.append("<IndexError>")
        except grpc.aio.AioRpcError as exc:
            status = [exc.code().name, exc.details()]
    return {"replies": replies, "tokens": tokens, "status": status}


def streaming(grpc_address: str, http: str, request_file: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with open(request_file) as file:
        inference_request = types.InferenceRequest.model_validate_json(file.read())
    # REST, as the README: the request as its types dump it (its nulls too), events back
    endpoint = f"http://{http}/v2/models/text-model/generate_stream"
    reply = requests.post(endpoint, json=inference_request.model_dump(), timeout=WAIT)
    events = []
    tokens = []
    for chunk in reply.content.split(b"\n\n"):
        if chunk.startswith(b"data: "):
            event = json.loads(chunk[len(b"data: ") :])
            events.append(event)
            response = types.InferenceResponse.model_validate(event)
            tokens.append(StringCodec.decode_output(response.outputs[0])[0])
    out["rest"] = {
        "status": reply.status_code,
        "content_type": reply.headers.get("content-type", ""),
        "events": events,
        "tokens": tokens,
    }
    # gRPC, as the README: the prompt encoded as bytes, one request on the stream
    prompt = inference_request.inputs[0].data.root
    inference_request.inputs[0] = StringCodec.encode_input("prompt", prompt)
    message = converters.ModelInferRequestConverter.from_types(
        inference_request, model_name="text-model", model_version=None
    )
    out["grpc"] = asyncio.run(stream_grpc(grpc_address, message))
    unknown = dataplane.ModelInferRequest()
    unknown.CopyFrom(message)
    unknown.model_name = "no-such-model"
    out["grpc_unknown"] = asyncio.run(stream_grpc(grpc_address, unknown))
    return out


def model_repository(grpc_address: str, http: str) -> dict[str, Any]:
    base = f"http://{http}"
    # REST, as the README: index, unload mushroom-xgboost, index, load it back, index
    calls = [
        ("index", {}),
        ("models/mushroom-xgboost/unload", None),
        ("index", {}),
        ("models/mushroom-xgboost/load", None),
        ("index", {}),
        ("models/no-such-model/load", None),
        ("models/no-such-model/unload", None),
    ]
    answers = []
    for path, body in calls:
        answers.append(rest(requests.post(f"{base}/v2/repository/{path}", json=body, timeout=WAIT)))
    out: dict[str, Any] = {"rest": answers}
    # the same over gRPC: MLServer's model repository service, then the data plane's
    for key, module, stub_of in (
        ("grpc", repository, repository_grpc.ModelRepositoryServiceStub),
        ("dataplane", dataplane, dataplane_grpc.GRPCInferenceServiceStub),
    ):
        with grpc.insecure_channel(grpc_address) as channel:
            stub = stub_of(channel)
            index = module.RepositoryIndexRequest()
            ready = module.RepositoryIndexRequest(ready=True)
            unload = module.RepositoryModelUnloadRequest(model_name="mushroom-xgboost")
            load = module.RepositoryModelLoadRequest(model_name="mushroom-xgboost")
            out[key] = [
                unary(stub.RepositoryIndex, index),
                unary(stub.RepositoryModelUnload, unload),
                unary(stub.RepositoryIndex, index),
                unary(stub.RepositoryIndex, ready),
                unary(stub.RepositoryModelLoad, load),
                unary(stub.RepositoryIndex, index),
                unary(
                    stub.RepositoryModelLoad,
                    module.RepositoryModelLoadRequest(model_name="no-such-model"),
                ),
                unary(
                    stub.RepositoryModelUnload,
                    module.RepositoryModelUnloadRequest(model_name="no-such-model"),
                ),
            ]
    return out


def main(argv: list[str]) -> dict[str, Any]:
    example, grpc_address, http = argv[:3]
    if example == "custom-json":
        return custom_json(grpc_address, http)
    if example == "streaming":
        return streaming(grpc_address, http, argv[3])
    if example == "model-repository":
        return model_repository(grpc_address, http)
    raise SystemExit(f"unknown example {example!r}")


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:])))
