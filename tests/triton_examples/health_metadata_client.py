"""Health, metadata, configuration and statistics, as simple_grpc_health_metadata.
usage: health_metadata_client.py HOST:PORT"""

import sys

import tritonclient.grpc as tc
import tritonclient.grpc.model_config_pb2 as mc


def fail(message):
    print(f"FAIL: {message}")
    sys.exit(1)


def main(url):
    client = tc.InferenceServerClient(url)
    if not client.is_server_live() or not client.is_server_ready():
        fail("server not live or not ready")
    if not client.is_model_ready("simple") or client.is_model_ready("no_such_model"):
        fail("model readiness wrong")
    server = client.get_server_metadata()
    print(f"server {server.name} {server.version} extensions {list(server.extensions)}")
    for supported in ("classification", "sequence"):
        if supported not in server.extensions:
            fail(f"{supported} is not advertised")
    if "cuda_shared_memory" in server.extensions:
        fail("cuda_shared_memory is advertised")
    meta = client.get_model_metadata("simple")
    if [(t.name, t.datatype, list(t.shape)) for t in meta.inputs] != [
        ("INPUT0", "INT32", [-1, 16]),
        ("INPUT1", "INT32", [-1, 16]),
    ]:
        fail(f"simple's inputs: {meta.inputs}")
    config = client.get_model_config("classifier").config
    image, probs = config.input[0], config.output[0]
    if config.max_batch_size != 8 or list(image.dims) != [3, 32, 32]:
        fail(f"classifier's config: {config}")
    if image.format != mc.ModelInput.FORMAT_NCHW or probs.label_filename != "labels.txt":
        fail(f"format {image.format}, label_filename {probs.label_filename!r}")
    as_json = client.get_model_config("classifier", as_json=True)["config"]
    if as_json["input"][0]["format"] != "FORMAT_NCHW":
        fail(f"config as JSON: {as_json}")
    stats = client.get_inference_statistics("simple")
    if [s.name for s in stats.model_stats] != ["simple"]:
        fail(f"statistics: {stats}")
    try:
        client.get_model_metadata("no_such_model")
    except tc.InferenceServerException as exc:
        if exc.status() != "StatusCode.NOT_FOUND":
            fail(f"metadata of a missing model: {exc.status()}")
    else:
        fail("metadata of a missing model answered")
    print("PASS: health and metadata")


if __name__ == "__main__":
    main(sys.argv[1])
