"""tritonclient's system shared-memory flows against a poolserve address, in
its own process (tritonclient and poolserve both register protobuf package
``inference``). Written the way Triton's simple_grpc_shm_client and
simple_grpc_shm_string_client use the API. Prints one JSON line.
usage: triton_shm.py HOST:PORT PREFIX
(PREFIX makes the shared-memory keys of this run unique; every object this
script creates is destroyed before it exits, whatever happens.)
"""

import json
import sys

import numpy as np
import tritonclient.grpc as tc
import tritonclient.utils.shared_memory as shm
from tritonclient import utils


def status_of(fn):
    try:
        fn()
    except tc.InferenceServerException as exc:
        return [exc.status(), exc.message()]
    return ["OK", ""]


class Regions:
    """Creates and registers regions; destroys and unregisters them all at the end."""

    def __init__(self, client, prefix):
        self.client, self.prefix, self.handles = client, prefix, []

    def create(self, name, size, register=True):
        key = f"/{self.prefix}_{name}"
        handle = shm.create_shared_memory_region(name, key, size)
        self.handles.append(handle)
        if register:
            self.client.register_system_shared_memory(name, key, size)
        return handle, key

    def close(self):
        try:
            self.client.unregister_system_shared_memory()
        finally:
            for handle in self.handles:
                shm.destroy_shared_memory_region(handle)


def numeric(client, regions, report):
    """simple_grpc_shm_client: INT32 add/sub with inputs and outputs in regions."""
    input0 = np.arange(16, dtype=np.int32).reshape(1, 16)
    input1 = np.ones((1, 16), dtype=np.int32)
    size = input0.nbytes
    out_handle, _ = regions.create("output_data", size * 2)
    in_handle, _ = regions.create("input_data", size * 2, register=False)
    shm.set_shared_memory_region(in_handle, [input0])
    shm.set_shared_memory_region(in_handle, [input1], offset=size)
    regions.client.register_system_shared_memory(
        "input_data", f"/{regions.prefix}_input_data", size * 2
    )
    inputs = [tc.InferInput("INPUT0", [1, 16], "INT32"), tc.InferInput("INPUT1", [1, 16], "INT32")]
    inputs[0].set_shared_memory("input_data", size)
    inputs[1].set_shared_memory("input_data", size, offset=size)
    outputs = [tc.InferRequestedOutput("OUTPUT0"), tc.InferRequestedOutput("OUTPUT1")]
    outputs[0].set_shared_memory("output_data", size)
    outputs[1].set_shared_memory("output_data", size, offset=size)
    result = client.infer("simple", inputs, outputs=outputs)
    response = result.get_response()
    got = []
    for index, name in enumerate(("OUTPUT0", "OUTPUT1")):
        meta = result.get_output(name)
        got.append(
            shm.get_contents_as_numpy(
                out_handle,
                utils.triton_to_np_dtype(meta.datatype),
                meta.shape,
                offset=index * size,
            )
        )
    report["numeric"] = {
        "sum": bool((got[0] == input0 + input1).all()),
        "diff": bool((got[1] == input0 - input1).all()),
        "raw_entries": [len(raw) for raw in response.raw_output_contents],
        "shapes": [list(result.get_output(n).shape) for n in ("OUTPUT0", "OUTPUT1")],
    }
    status = client.get_system_shared_memory_status(as_json=True)
    report["status"] = {
        name: [region["key"], int(region.get("offset", 0)), int(region["byte_size"])]
        for name, region in status.get("regions", {}).items()
    }
    one = client.get_system_shared_memory_status("input_data", as_json=True)
    report["status_one"] = sorted(one.get("regions", {}))
    report["status_unknown"] = status_of(
        lambda: client.get_system_shared_memory_status("no_such_region")
    )
    report["register_twice"] = status_of(
        lambda: client.register_system_shared_memory(
            "input_data", f"/{regions.prefix}_input_data", size
        )
    )
    client.unregister_system_shared_memory("input_data")
    after = client.get_system_shared_memory_status(as_json=True)
    report["after_unregister"] = sorted(after.get("regions", {}))
    report["infer_unregistered"] = status_of(lambda: client.infer("simple", inputs))


def strings(client, regions, report):
    """simple_grpc_shm_string_client: BYTES in regions, serialized as tritonclient does."""
    in0 = np.array([str(x).encode() for x in range(16)], dtype=np.object_).reshape(1, 16)
    in1 = np.array([b"1"] * 16, dtype=np.object_).reshape(1, 16)
    ser0, ser1 = utils.serialize_byte_tensor(in0), utils.serialize_byte_tensor(in1)
    size0, size1 = utils.serialized_byte_size(ser0), utils.serialized_byte_size(ser1)
    expected_sum = np.array([str(x + 1).encode() for x in range(16)], dtype=np.object_)
    expected_diff = np.array([str(x - 1).encode() for x in range(16)], dtype=np.object_)
    out_size = max(
        utils.serialized_byte_size(utils.serialize_byte_tensor(expected))
        for expected in (expected_sum, expected_diff)
    )
    in_handle, _ = regions.create("input_strings", size0 + size1)
    shm.set_shared_memory_region(in_handle, [ser0])
    shm.set_shared_memory_region(in_handle, [ser1], offset=size0)
    out_handle, _ = regions.create("output_strings", out_size * 2)
    inputs = [tc.InferInput("INPUT0", [1, 16], "BYTES"), tc.InferInput("INPUT1", [1, 16], "BYTES")]
    inputs[0].set_shared_memory("input_strings", size0)
    inputs[1].set_shared_memory("input_strings", size1, offset=size0)
    outputs = [tc.InferRequestedOutput("OUTPUT0"), tc.InferRequestedOutput("OUTPUT1")]
    outputs[0].set_shared_memory("output_strings", out_size)
    outputs[1].set_shared_memory("output_strings", out_size, offset=out_size)
    result = client.infer("simple_string", inputs, outputs=outputs)
    sums = shm.get_contents_as_numpy(out_handle, np.object_, [1, 16])
    diffs = shm.get_contents_as_numpy(out_handle, np.object_, [1, 16], offset=out_size)
    report["strings"] = {
        "sum": [bytes(x) for x in sums.ravel()] == list(expected_sum),
        "diff": [bytes(x) for x in diffs.ravel()] == list(expected_diff),
        "datatypes": [result.get_output(n).datatype for n in ("OUTPUT0", "OUTPUT1")],
    }


def mixed(client, regions, report):
    """One input in a region, the other raw; one output in a region, the other raw."""
    input0 = np.arange(16, dtype=np.int32).reshape(1, 16) * 3
    input1 = np.full((1, 16), 2, dtype=np.int32)
    handle, _ = regions.create("mixed_in", input0.nbytes)
    shm.set_shared_memory_region(handle, [input0])
    out_handle, _ = regions.create("mixed_out", input0.nbytes)
    inputs = [tc.InferInput("INPUT0", [1, 16], "INT32"), tc.InferInput("INPUT1", [1, 16], "INT32")]
    inputs[0].set_shared_memory("mixed_in", input0.nbytes)
    inputs[1].set_data_from_numpy(input1)
    outputs = [tc.InferRequestedOutput("OUTPUT0"), tc.InferRequestedOutput("OUTPUT1")]
    outputs[0].set_shared_memory("mixed_out", input0.nbytes)
    result = client.infer("simple", inputs, outputs=outputs)
    in_region = shm.get_contents_as_numpy(out_handle, np.int32, [1, 16])
    report["mixed"] = {
        "sum_in_region": bool((in_region == input0 + input1).all()),
        "diff_raw": bool((result.as_numpy("OUTPUT1") == input0 - input1).all()),
    }


def cuda(client, report):
    report["cuda_unregister"] = status_of(lambda: client.unregister_cuda_shared_memory())
    report["cuda_unregister_one"] = status_of(lambda: client.unregister_cuda_shared_memory("x"))
    report["cuda_status"] = client.get_cuda_shared_memory_status(as_json=True)
    report["cuda_register"] = status_of(
        lambda: client.register_cuda_shared_memory("gpu", b"\0" * 64, 0, 64)
    )


def main():
    url, prefix = sys.argv[1], sys.argv[2]
    client = tc.InferenceServerClient(url)
    report = {"extensions": client.get_server_metadata(as_json=True).get("extensions", [])}
    # As Triton's examples: clear both kinds of registration first.
    client.unregister_system_shared_memory()
    cuda(client, report)
    regions = Regions(client, prefix)
    try:
        numeric(client, regions, report)
        strings(client, regions, report)
        mixed(client, regions, report)
    finally:
        regions.close()
    report["left_registered"] = sorted(
        client.get_system_shared_memory_status(as_json=True).get("regions", {})
    )
    print(json.dumps(report))


if __name__ == "__main__":
    main()
