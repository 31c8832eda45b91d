"""tritonclient against a poolserve address, in its own process.

tritonclient registers protobuf package ``inference`` just as poolserve does,
so it cannot share a process with our modules. Prints one JSON line.
usage: triton_echo.py HOST:PORT [MODEL ...]

Every datatype goes to ``echo_any`` (support.copy_echo_any: echo declaring no
inputs, so it takes them all); ``echo`` itself declares INPUT0 FP32 and
refuses the others, as Triton refuses a datatype its config does not declare.
"""

import json
import sys

import numpy as np
import tritonclient.grpc as tc
from tritonclient.grpc import service_pb2, service_pb2_grpc

DTYPES = {
    "BOOL": np.bool_,
    "UINT8": np.uint8,
    "UINT16": np.uint16,
    "UINT32": np.uint32,
    "UINT64": np.uint64,
    "INT8": np.int8,
    "INT16": np.int16,
    "INT32": np.int32,
    "INT64": np.int64,
    "FP16": np.float16,
    "FP32": np.float32,
    "FP64": np.float64,
    "BYTES": np.object_,
}
TYPED_FIELD = {
    "BOOL": "bool_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}


def sample(datatype):
    if datatype == "BYTES":
        return np.array([[b"a", b"", b"\x00\xffz"]], dtype=np.object_)
    if datatype == "BOOL":
        return np.array([[True, False, True]])
    return np.arange(6).reshape(2, 3).astype(DTYPES[datatype])


def raw_echo(client, model, datatype):
    data = sample(datatype)
    inp = tc.InferInput("INPUT0", list(data.shape), datatype)
    inp.set_data_from_numpy(data)
    result = client.infer(model, [inp], outputs=[tc.InferRequestedOutput("OUTPUT0")])
    out = result.as_numpy("OUTPUT0")
    return out.shape == data.shape and (out == data).all()


def typed_request(model, name, datatype, data):
    request = service_pb2.ModelInferRequest(model_name=model)
    tensor = request.inputs.add(name=name, datatype=datatype, shape=list(data.shape))
    getattr(tensor.contents, TYPED_FIELD[datatype]).extend(data.flatten().tolist())
    return request


def typed_echo(stub, model, datatype):
    """Typed inputs in, read back the way tritonclient reads every answer."""
    data = sample(datatype)
    response = stub.ModelInfer(typed_request(model, "INPUT0", datatype, data))
    out = tc.InferResult(response).as_numpy("OUTPUT0")
    return out is not None and out.shape == data.shape and (out == data).all()


def infer_model(client, stub, model, meta):
    """One raw and one typed inference shaped by the model's own metadata."""
    spec = meta["inputs"][0]
    datatype = spec["datatype"]
    shape = [2 if d < 0 else d for d in (int(x) for x in spec["shape"])]
    data = (np.arange(int(np.prod(shape))) % 5).reshape(shape).astype(DTYPES[datatype])
    inp = tc.InferInput(spec["name"], shape, datatype)
    inp.set_data_from_numpy(data)
    raw = client.infer(model, [inp], client_timeout=30)
    raw_out = raw.get_response(as_json=True)["outputs"]
    typed = stub.ModelInfer(typed_request(model, spec["name"], datatype, data), timeout=30)
    typed_result = tc.InferResult(typed)
    same = []
    for output in typed.outputs:
        got, expected = typed_result.as_numpy(output.name), raw.as_numpy(output.name)
        same.append(got.shape == expected.shape and (got == expected).all())
    return {
        "raw_outputs": [o["name"] for o in raw_out],
        "typed_outputs": [o.name for o in typed.outputs],
        "typed_reads_as_raw": bool(same) and all(bool(x) for x in same),
    }


def status_of(fn):
    try:
        fn()
    except tc.InferenceServerException as exc:
        return exc.status()
    except Exception as exc:  # grpc.RpcError from the raw stub
        return str(exc.code())
    return "OK"


def ready_of(client, name):
    """is_model_ready's answer, or the status it raised."""
    try:
        return client.is_model_ready(name)
    except tc.InferenceServerException as exc:
        return exc.status()


def main():
    url = sys.argv[1]
    models = sys.argv[2:] or ["echo"]
    import grpc

    client = tc.InferenceServerClient(url)
    channel = grpc.insecure_channel(url)
    stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
    report = {
        "live": client.is_server_live(),
        "ready": client.is_server_ready(),
        "metadata": client.get_server_metadata(as_json=True),
        "raw": {},
        "typed": {},
    }
    for dt in DTYPES:
        report["raw"][dt] = bool(raw_echo(client, "echo_any", dt))
        if dt in TYPED_FIELD:
            report["typed"][dt] = bool(typed_echo(stub, "echo_any", dt))
    undeclared = tc.InferInput("INPUT0", [2, 3], "INT32")
    undeclared.set_data_from_numpy(np.zeros((2, 3), np.int32))
    try:
        client.infer("echo", [undeclared])
        report["undeclared_datatype"] = ["OK", ""]
    except tc.InferenceServerException as exc:
        report["undeclared_datatype"] = [exc.status(), exc.message()]
    bad = tc.InferInput("INPUT0", [2, 3], "FP32")
    bad.set_data_from_numpy(np.zeros((2, 3), np.float32))
    report["unknown_model"] = status_of(lambda: client.infer("no-such-model", [bad]))
    malformed = service_pb2.ModelInferRequest(model_name="echo")
    t = malformed.inputs.add(name="INPUT0", datatype="FP32", shape=[2, 3])
    t.contents.fp32_contents.extend([1.0, 2.0])
    report["malformed"] = status_of(lambda: stub.ModelInfer(malformed))
    report["model_ready"] = {name: ready_of(client, name) for name in ("echo", "no-such-model")}
    report["models"] = {}
    for model in models:
        meta = client.get_model_metadata(model, as_json=True)
        config = client.get_model_config(model, as_json=True)
        stats = client.get_inference_statistics(model, as_json=True)
        report["models"][model] = {
            "metadata_inputs": [i["name"] for i in meta.get("inputs", [])],
            "config_name": config["config"]["name"],
            "stats_models": [s["name"] for s in stats.get("model_stats", [])],
            "infer": infer_model(client, stub, model, meta),
        }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
