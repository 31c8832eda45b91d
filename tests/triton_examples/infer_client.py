"""Raw and typed inputs, read back with as_numpy (as simple_grpc_infer_client
and grpc_explicit_int_content_client do). usage: infer_client.py HOST:PORT"""

import sys

import grpc
import numpy as np
import tritonclient.grpc as tc
from tritonclient.grpc import service_pb2, service_pb2_grpc


def fail(message):
    print(f"FAIL: {message}")
    sys.exit(1)


def raw(url):
    client = tc.InferenceServerClient(url)
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    b = np.ones((1, 16), dtype=np.int32)
    inputs = [tc.InferInput("INPUT0", [1, 16], "INT32"), tc.InferInput("INPUT1", [1, 16], "INT32")]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(b)
    outputs = [tc.InferRequestedOutput("OUTPUT0"), tc.InferRequestedOutput("OUTPUT1")]
    result = client.infer("simple", inputs, outputs=outputs, request_id="7", client_timeout=30)
    if result.get_response().id != "7":
        fail(f"request id {result.get_response().id!r}")
    for name, want in (("OUTPUT0", a + b), ("OUTPUT1", a - b)):
        got = result.as_numpy(name)
        if got.dtype != np.int32 or not np.array_equal(got, want):
            fail(f"raw {name}: {got!r}, expected {want!r}")
        print(f"{name} = {got.ravel().tolist()}")
    # No requested outputs: every output comes back.
    every = client.infer("simple", inputs, client_timeout=30)
    if sorted(o.name for o in every.get_response().outputs) != ["OUTPUT0", "OUTPUT1"]:
        fail("without requested outputs, not every output came back")


def typed(url):
    # tritonclient has no API for typed contents: its stub does, as Triton's example.
    with grpc.insecure_channel(url) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        request = service_pb2.ModelInferRequest(model_name="simple")
        for name, values in (("INPUT0", range(16)), ("INPUT1", [-3] * 16)):
            tensor = request.inputs.add(name=name, datatype="INT32", shape=[1, 16])
            tensor.contents.int_contents.extend(values)
        response = stub.ModelInfer(request, timeout=30)
    result = tc.InferResult(response)  # what client.infer wraps the response in
    got = result.as_numpy("OUTPUT0")
    if got is None or got.ravel().tolist() != [i - 3 for i in range(16)]:
        fail(f"typed OUTPUT0 read back as {got!r}")
    print(f"typed OUTPUT0 = {got.ravel().tolist()}")


if __name__ == "__main__":
    raw(sys.argv[1])
    typed(sys.argv[1])
    print("PASS: infer")
