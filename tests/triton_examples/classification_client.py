"""The classification extension's edges, with tritonclient's class_count:
more classes than the output has, a label file shorter than the classes, an
output that cannot be scored. usage: classification_client.py HOST:PORT"""

import sys

import numpy as np
import tritonclient.grpc as tc


def fail(message):
    print(f"FAIL: {message}")
    sys.exit(1)


def classify(client, model, mean, classes):
    batch = np.full((1, 3, 32, 32), mean, dtype=np.float32)
    inputs = [tc.InferInput("image", list(batch.shape), "FP32")]
    inputs[0].set_data_from_numpy(batch)
    outputs = [tc.InferRequestedOutput("probs", class_count=classes)]
    return client.infer(model, inputs, outputs=outputs, client_timeout=60).as_numpy("probs")


def main(url):
    client = tc.InferenceServerClient(url)
    every = classify(client, "classifier", 3, 5000)  # more than the 1000 classes
    if every.shape != (1, 1000):
        fail(f"5000 classes of 1000 answered shape {every.shape}")
    indices = [int(s.split(b":")[1]) for s in every[0]]
    if sorted(indices) != list(range(1000)) or indices[:3] != [3, 2, 4]:
        fail(f"all classes: {indices[:10]}...")
    print(f"5000 of 1000 classes: {every.shape}, first {[s.decode() for s in every[0][:3]]}")
    # The inline copy's labels stop at class 99: class 150 has an index only.
    short = [s.decode() for s in classify(client, "classifier_inline", 150, 2)[0]]
    if [s.split(":")[1:] for s in short] != [["150"], ["149"]]:
        fail(f"past the labels: {short}")
    labelled = [s.decode() for s in classify(client, "classifier_inline", 50, 1)[0]]
    if labelled[0].split(":")[1:] != ["50", "class_050"]:
        fail(f"inline with labels: {labelled}")
    print(f"inline, past its labels: {short}")
    strings = [tc.InferInput(n, [1, 16], "BYTES") for n in ("INPUT0", "INPUT1")]
    for tensor in strings:
        tensor.set_data_from_numpy(np.array([[b"1"] * 16], dtype=np.object_))
    try:
        client.infer(
            "simple_string",
            strings,
            outputs=[tc.InferRequestedOutput("OUTPUT0", class_count=1)],
            client_timeout=60,
        )
    except tc.InferenceServerException as exc:
        if exc.status() != "StatusCode.INVALID_ARGUMENT" or "'BYTES'" not in exc.message():
            fail(f"classes of a BYTES output: {exc.status()} {exc.message()}")
        print(f"BYTES output refused: {exc.message()}")
    else:
        fail("classes of a BYTES output were answered")
    print("PASS: classification")


if __name__ == "__main__":
    main(sys.argv[1])
