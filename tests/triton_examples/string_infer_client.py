"""String (BYTES) tensors in and out, as simple_grpc_string_infer_client.
usage: string_infer_client.py HOST:PORT"""

import sys

import numpy as np
import tritonclient.grpc as tc


def fail(message):
    print(f"FAIL: {message}")
    sys.exit(1)


def main(url):
    client = tc.InferenceServerClient(url)
    a = np.arange(16, dtype=np.int64).reshape(1, 16)
    b = np.full((1, 16), 1000, dtype=np.int64)
    as_bytes = np.vectorize(lambda n: str(n).encode(), otypes=[object])
    inputs = [tc.InferInput("INPUT0", [1, 16], "BYTES"), tc.InferInput("INPUT1", [1, 16], "BYTES")]
    inputs[0].set_data_from_numpy(as_bytes(a))
    inputs[1].set_data_from_numpy(np.array([[str(n) for n in b.ravel()]], dtype=np.object_))
    result = client.infer("simple_string", inputs, client_timeout=30)
    for name, want in (("OUTPUT0", a + b), ("OUTPUT1", a - b)):
        got = result.as_numpy(name)
        if got.shape != (1, 16) or [int(x) for x in got.ravel()] != want.ravel().tolist():
            fail(f"{name}: {got!r}")
        print(f"{name} = {[x.decode() for x in got.ravel()]}")
    bad = tc.InferInput("INPUT0", [1, 16], "BYTES")
    bad.set_data_from_numpy(np.array([["x"] * 16], dtype=np.object_))
    try:
        client.infer("simple_string", [bad, inputs[1]], client_timeout=30)
    except tc.InferenceServerException as exc:
        if exc.status() != "StatusCode.INVALID_ARGUMENT" or "not a decimal" not in exc.message():
            fail(f"bad string answered {exc.status()}: {exc.message()}")
    else:
        fail("a string that is not a number was accepted")
    print("PASS: string infer")


if __name__ == "__main__":
    main(sys.argv[1])
