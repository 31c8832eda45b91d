"""Callbacks (async_infer) and asyncio (tritonclient.grpc.aio), as
simple_grpc_async_infer_client and simple_grpc_aio_infer_client.
usage: async_infer_client.py HOST:PORT"""

import asyncio
import queue
import sys

import numpy as np
import tritonclient.grpc as tc
import tritonclient.grpc.aio as tca

CALLS = 16


def fail(message):
    print(f"FAIL: {message}")
    sys.exit(1)


def inputs_for(module, value):
    a = np.full((1, 16), value, dtype=np.int32)
    inputs = [module.InferInput(name, [1, 16], "INT32") for name in ("INPUT0", "INPUT1")]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(np.ones((1, 16), dtype=np.int32))
    return inputs


def callbacks(url):
    client = tc.InferenceServerClient(url)
    done = queue.Queue()
    for i in range(CALLS):
        client.async_infer(
            "simple",
            inputs_for(tc, i),
            lambda result, error, i=i: done.put((i, result, error)),
            request_id=str(i),
            client_timeout=60,
        )
    seen = set()
    for _ in range(CALLS):
        i, result, error = done.get(timeout=90)
        if error is not None:
            fail(f"call {i}: {error}")
        if result.get_response().id != str(i) or result.as_numpy("OUTPUT0")[0, 0] != i + 1:
            fail(f"call {i} answered {result.get_response().id}: {result.as_numpy('OUTPUT0')}")
        seen.add(i)
    if seen != set(range(CALLS)):
        fail(f"answers for {sorted(seen)}")
    print(f"{CALLS} callbacks answered")


async def aio(url):
    async with tca.InferenceServerClient(url) as client:
        results = await asyncio.gather(
            *(client.infer("simple", inputs_for(tca, i), client_timeout=60) for i in range(CALLS))
        )
    got = [int(r.as_numpy("OUTPUT1")[0, 0]) for r in results]
    if got != [i - 1 for i in range(CALLS)]:
        fail(f"aio answers {got}")
    print(f"{CALLS} aio calls answered")


if __name__ == "__main__":
    callbacks(sys.argv[1])
    asyncio.run(aio(sys.argv[1]))
    print("PASS: async infer")
