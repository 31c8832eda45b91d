"""Load with a config override, unload, load back, as simple_grpc_model_control.
usage: model_control_client.py HOST:PORT"""

import json
import sys

import numpy as np
import tritonclient.grpc as tc


def fail(message):
    print(f"FAIL: {message}")
    sys.exit(1)


def adds(client):
    inputs = [tc.InferInput("INPUT0", [1, 16], "INT32"), tc.InferInput("INPUT1", [1, 16], "INT32")]
    for tensor in inputs:
        tensor.set_data_from_numpy(np.ones((1, 16), dtype=np.int32))
    return client.infer("simple", inputs, client_timeout=60).as_numpy("OUTPUT0")[0, 0] == 2


def main(url):
    client = tc.InferenceServerClient(url)
    index = {m.name: m.state for m in client.get_model_repository_index().models}
    if index.get("simple") != "READY":
        fail(f"repository index {index}")
    # The configuration as the server reports it, changed and sent back (64-bit
    # integers come as strings in ModelConfig's JSON form).
    config = client.get_model_config("simple", as_json=True)["config"]
    config["max_batch_size"] = 4
    client.load_model("simple", config=json.dumps(config), client_timeout=120)
    if client.get_model_config("simple").config.max_batch_size != 4 or not adds(client):
        fail("the override did not apply")
    print("loaded with max_batch_size 4")
    # A classifier's config round-trips too: its format and label file included.
    classifier = client.get_model_config("classifier", as_json=True)["config"]
    client.load_model("classifier", config=json.dumps(classifier), client_timeout=120)
    try:
        client.load_model("simple", config=json.dumps({"dynamic_batching": {}}))
    except tc.InferenceServerException as exc:
        if not exc.message().startswith("failed to load 'simple'"):
            fail(f"refused load said {exc.message()!r}")
        print(f"refused: {exc.message()}")
    else:
        fail("an unsupported config was accepted")
    client.unload_model("simple", client_timeout=120)
    if client.is_model_ready("simple"):
        fail("simple still ready after its unload")
    client.load_model("simple", client_timeout=120)  # a plain load: the file's settings
    if client.get_model_config("simple").config.max_batch_size != 8 or not adds(client):
        fail("the plain load did not restore the settings")
    print("PASS: model control")


if __name__ == "__main__":
    main(sys.argv[1])
