"""An image classification client in the manner of image_client and
grpc_image_client: the model's metadata and configuration decide the layout
(FORMAT_NCHW or FORMAT_NHWC, batching), images are preprocessed to it, and the
top classes come back as "score:index:label" strings.

usage: image_client.py HOST:PORT MODEL CLASSES [--raw-grpc]
Images are synthetic (no files, no PIL): image i is a checkerboard of mean
MEANS[i]; the test's classifier puts such an image in class floor(mean).
"""

import struct
import sys

import grpc
import numpy as np
import tritonclient.grpc as tc
import tritonclient.grpc.model_config_pb2 as mc
from tritonclient.grpc import service_pb2, service_pb2_grpc

MEANS = (17, 200)


def fail(message):
    print(f"FAIL: {message}")
    sys.exit(1)


def parse_model(metadata, config):
    """The checks image_client makes before it sends anything."""
    if len(metadata.inputs) != 1 or len(metadata.outputs) != 1 or len(config.input) != 1:
        fail("expecting 1 input and 1 output")
    meta_in, config_in, meta_out = metadata.inputs[0], config.input[0], metadata.outputs[0]
    if meta_out.datatype != "FP32":
        fail(f"expecting output datatype FP32, got {meta_out.datatype}")
    batched = config.max_batch_size > 0
    if len([d for d in meta_out.shape[1 if batched else 0 :] if d > 1]) > 1:
        fail("expecting model output to be a vector")
    if len(meta_in.shape) != 3 + batched:
        fail(f"expecting input with {3 + batched} dimensions, got {list(meta_in.shape)}")
    if config_in.format not in (mc.ModelInput.FORMAT_NCHW, mc.ModelInput.FORMAT_NHWC):
        fail("unexpected input format " + mc.ModelInput.Format.Name(config_in.format))
    dims = list(meta_in.shape[1 if batched else 0 :])
    if config_in.format == mc.ModelInput.FORMAT_NHWC:
        h, w, c = dims
    else:
        c, h, w = dims
    return config.max_batch_size, meta_in.name, meta_out.name, c, h, w, config_in.format


def image(mean, c, h, w):
    board = (np.indices((h, w)).sum(axis=0) % 2) * 16 - 8  # mean 0 for even h * w
    return np.repeat((mean + board)[:, :, None], c, axis=2).astype(np.uint8)  # HWC, as PIL


def preprocess(img, fmt):
    data = img.astype(np.float32)
    return np.transpose(data, (2, 0, 1)) if fmt == mc.ModelInput.FORMAT_NCHW else data


def check(results, classes):
    """results[i]: the strings for image i; the top classes are known in advance."""
    for mean, found in zip(MEANS, results, strict=True):
        print(f"Image of mean {mean}:")
        expected = [mean, mean - 1, mean + 1, mean - 2, mean + 2][:classes]
        parsed = [s.decode().split(":") for s in found]
        for score, index, *label in parsed:
            print(f"    {score} ({index}) = {label[0] if label else ''}")
        if [int(index) for _, index, *_ in parsed] != expected:
            fail(f"classes {parsed}, expected {expected}")
        if [p[2] if len(p) > 2 else None for p in parsed] != [f"class_{i:03d}" for i in expected]:
            fail(f"labels {parsed}")
        scores = [float(p[0]) for p in parsed]
        six_decimals = all(len(p[0].split(".")[1]) == 6 for p in parsed)
        if scores != sorted(scores, reverse=True) or not six_decimals:
            fail(f"scores {scores}")


def with_tritonclient(url, model, classes):
    client = tc.InferenceServerClient(url)
    metadata = client.get_model_metadata(model)
    config = client.get_model_config(model).config
    max_batch, in_name, out_name, c, h, w, fmt = parse_model(metadata, config)
    if max_batch < len(MEANS):
        fail(f"model batches {max_batch}, this client sends {len(MEANS)}")
    batch = np.stack([preprocess(image(m, c, h, w), fmt) for m in MEANS])
    inputs = [tc.InferInput(in_name, list(batch.shape), "FP32")]
    inputs[0].set_data_from_numpy(batch)
    outputs = [tc.InferRequestedOutput(out_name, class_count=classes)]
    result = client.infer(model, inputs, outputs=outputs, client_timeout=60)
    found = result.as_numpy(out_name)
    if found.shape != (len(MEANS), min(classes, 1000)):
        fail(f"result shape {found.shape}")
    check(found, classes)


def with_raw_grpc(url, model, classes):
    """grpc_image_client's way: its own stub, raw bytes parsed by hand."""
    with grpc.insecure_channel(url) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        metadata = stub.ModelMetadata(service_pb2.ModelMetadataRequest(name=model), timeout=30)
        config = stub.ModelConfig(service_pb2.ModelConfigRequest(name=model), timeout=30).config
        _, in_name, out_name, c, h, w, fmt = parse_model(metadata, config)
        request = service_pb2.ModelInferRequest(model_name=model)
        request.outputs.add(name=out_name).parameters["classification"].int64_param = classes
        data = [preprocess(image(m, c, h, w), fmt) for m in MEANS]
        request.inputs.add(name=in_name, datatype="FP32", shape=[len(MEANS), *data[0].shape])
        request.raw_input_contents.append(b"".join(d.tobytes() for d in data))
        response = stub.ModelInfer(request, timeout=60)
    if len(response.raw_output_contents) != 1 or response.outputs[0].datatype != "BYTES":
        fail(f"response {response.outputs}")
    strings, raw, at = [], response.raw_output_contents[0], 0
    while at < len(raw):
        (length,) = struct.unpack_from("<I", raw, at)
        strings.append(raw[at + 4 : at + 4 + length])
        at += 4 + length
    check(np.array(strings, dtype=object).reshape(list(response.outputs[0].shape)), classes)


if __name__ == "__main__":
    url, model, classes = sys.argv[1], sys.argv[2], int(sys.argv[3])
    if "--raw-grpc" in sys.argv:
        with_raw_grpc(url, model, classes)
    else:
        with_tritonclient(url, model, classes)
    print("PASS: image classification")
