"""tritonclient streaming from an address (ModelStreamInfer, its callback
API), in its own process (see triton_echo.py). Prints one JSON line: the
tokens each response carried, their ids, and the in-stream error messages.
usage: triton_stream.py HOST:PORT MODEL PROMPT [PROMPT ...]
"""

import json
import queue
import sys

import numpy as np
import tritonclient.grpc as tc


def main(address: str, model: str, prompts: list[str]) -> dict[str, object]:
    results: queue.Queue[tuple[object, object]] = queue.Queue()
    client = tc.InferenceServerClient(address)
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    for i, prompt in enumerate(prompts):
        given = tc.InferInput("prompt", [1], "BYTES")
        given.set_data_from_numpy(np.array([prompt.encode()], dtype=np.object_))
        client.async_stream_infer(
            model, [given], request_id=f"r{i}", enable_empty_final_response=True
        )
    tokens: list[str] = []
    ids: list[str] = []
    errors: list[str] = []
    finals = 0
    while finals < len(prompts):
        result, error = results.get(timeout=60)
        if error is not None:
            errors.append(str(error))
            finals += 1  # an error ends that request's responses
            continue
        response = result.get_response()  # type: ignore[attr-defined]
        if response.parameters["triton_final_response"].bool_param:
            finals += 1
        if not response.outputs:
            continue
        tokens.append(result.as_numpy("output").reshape(-1)[0].decode())  # type: ignore[attr-defined]
        ids.append(response.id)
    client.stop_stream()
    client.close()
    return {"tokens": tokens, "ids": ids, "errors": errors}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2], sys.argv[3:])))
