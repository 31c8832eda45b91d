"""Large tensors end to end (issue 20): the default limit lets a 64 MiB message
through both ways, byte for byte; one over it is a clear RESOURCE_EXHAUSTED."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import numpy as np
import pytest

from poolserve.protos import inference_pb2 as pb
from poolserve.protos import inference_pb2_grpc as pbg
from poolserve.service.contract.settings import ServerSettings
from poolserve.service.inference.codec import decode_outputs

from serving import Serving, wait_serving
from support import copy_example

pytestmark = pytest.mark.e2e

LIMIT = ServerSettings().max_message_size  # the default: 64 MiB
CLIENT = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]


def request_of(message_bytes: int) -> pb.ModelInferRequest:
    """An echo request of exactly ``message_bytes`` serialized, an FP32 tensor of
    varied values (a stray byte shift would show)."""
    head = pb.ModelInferRequest(model_name="echo")
    head.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 1])
    for count in range((message_bytes - 64) // 4, 0, -1):  # the tensor and its field head
        head.inputs[0].shape[1] = count
        size = head.ByteSize() + 1 + len(_varint(4 * count)) + 4 * count
        if size <= message_bytes:
            break
    values = np.arange(count, dtype=np.float32) * np.float32(0.5)
    head.raw_input_contents.append(values.tobytes())
    return head


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        out.append((value & 0x7F) | (0x80 if value >> 7 else 0))
        value >>= 7
        if not value:
            return bytes(out)


def test_a_64_mib_request_goes_through_and_one_beyond_the_limit_is_refused(
    tmp_path: Path,
) -> None:
    repo = tmp_path / "repo"
    copy_example(repo, "echo")

    async def main(serving: Serving) -> None:
        async with grpc.aio.insecure_channel(serving.address, options=CLIENT) as channel:
            await wait_serving(channel)
            stub = pbg.GRPCInferenceServiceStub(channel)
            # the reply carries the tensor back with a little less around it: under the limit too
            request = request_of(LIMIT - 256)
            assert LIMIT - 300 < request.ByteSize() <= LIMIT - 256
            reply = await stub.ModelInfer(request, timeout=110)
            sent = np.frombuffer(request.raw_input_contents[0], np.float32)
            assert np.array_equal(decode_outputs(reply)["OUTPUT0"].ravel(), sent)
            over = request_of(LIMIT + 1024)
            assert over.ByteSize() > LIMIT
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.ModelInfer(over, timeout=110)
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert str(LIMIT) in (refused.value.details() or ""), refused.value.details()
            small = request_of(1000)  # the server is still fine
            assert (await stub.ModelInfer(small, timeout=60)).raw_output_contents

    with Serving(repo, tmp_path / "run") as serving:
        asyncio.run(main(serving))
