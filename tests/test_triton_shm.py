"""System shared memory end to end (issue 20 §2), through ``poolserve serve``.

tritonclient's own flows (those of Triton's simple_grpc_shm_client and
simple_grpc_shm_string_client) run in a process of their own
(tests/clients/triton_shm.py); the edge cases use raw stubs here, with
shared-memory objects made directly under /dev/shm. Every object a test makes
is unlinked at its end; the tree's PIDs are the fixture's.
"""

from __future__ import annotations

import asyncio
import json
import mmap
import os
import select
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from poolserve.protos import inference_pb2 as pb
from poolserve.protos import inference_pb2_grpc as pbg
from poolserve.service.contract.repository import scan
from poolserve.service.contract.settings import ServerSettings
from poolserve.service.contract.shm import Region, wrap
from poolserve.service.poolserver.inprocess import InProcessServer

from serving import Serving, pool_status, wait_serving
from support import copy_example, run_client, write_model

pytestmark = pytest.mark.e2e

Stub = pbg.GRPCInferenceServiceStub

ADD_SUB = '''
import os
import select

import numpy as np

from poolserve.service import Model


class AddSub(Model):
    """Triton's "simple" and "simple_string": the sum and the difference of two inputs."""

    def predict(self, inputs, parameters):
        a, b = inputs["INPUT0"], inputs["INPUT1"]
        if a.dtype == object:
            x = np.array([int(v) for v in a.ravel()]).reshape(a.shape)
            y = np.array([int(v) for v in b.ravel()]).reshape(b.shape)
            as_bytes = np.vectorize(lambda v: str(v).encode(), otypes=[object])
            return {"OUTPUT0": as_bytes(x + y), "OUTPUT1": as_bytes(x - y)}
        return {"OUTPUT0": a + b, "OUTPUT1": a - b}


class Gate(Model):
    """INPUT0 as OUTPUT0, read only once the test opens the gate: the model
    says it is in predict on the FIFO named by parameter "ready", then waits
    for a byte on the FIFO "go" (tests/test_triton_shm.py's Gate)."""

    def predict(self, inputs, parameters):
        if "go" in parameters:
            go = os.open(parameters["go"], os.O_RDONLY | os.O_NONBLOCK)
            try:
                ready = os.open(parameters["ready"], os.O_WRONLY | os.O_NONBLOCK)
                os.write(ready, b"in")
                os.close(ready)
                select.select([go], [], [], 300)
            finally:
                os.close(go)
        return {"OUTPUT0": np.array(inputs["INPUT0"])}
'''


def _io(datatype: str) -> dict[str, object]:
    tensor = {"datatype": datatype, "shape": [1, 16]}
    return {
        "inputs": [{"name": f"INPUT{k}", **tensor} for k in (0, 1)],
        "outputs": [{"name": f"OUTPUT{k}", **tensor} for k in (0, 1)],
    }


def model_repository(repo: Path) -> Path:
    copy_example(repo, "echo")
    shutil.copytree(repo / "echo", repo / "echo_inline")
    inline = json.loads((repo / "echo" / "model-settings.json").read_text())
    inline.update(name="echo_inline", parallel_workers=0)
    (repo / "echo_inline" / "model-settings.json").write_text(json.dumps(inline))
    shutil.copytree(repo / "echo", repo / "echo_batched")  # a request naming regions runs alone
    batched = json.loads((repo / "echo" / "model-settings.json").read_text())
    batched.update(name="echo_batched", max_batch_size=32, max_batch_time=0.002)
    (repo / "echo_batched" / "model-settings.json").write_text(json.dumps(batched))
    write_model(
        repo,
        "simple",
        {"name": "simple", "implementation": "model.AddSub", **_io("INT32")},
        ADD_SUB,
    )
    write_model(
        repo,
        "simple_string",
        {"name": "simple_string", "implementation": "model.AddSub", **_io("BYTES")},
        ADD_SUB,
    )
    for name, workers in (("gate", None), ("gate_inline", 0)):
        settings: dict[str, Any] = {
            "name": name,
            "implementation": "model.Gate",
            "inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [-1]}],
            "outputs": [{"name": "OUTPUT0", "datatype": "FP32", "shape": [-1]}],
        }
        if workers is not None:
            settings["parallel_workers"] = workers
        write_model(repo, name, settings, ADD_SUB)
    return repo


class Gate:
    """The test's side of model Gate: two FIFOs per request, no sleeps.
    :meth:`entered` returns once the request is in the model's predict (its
    input decoded), :meth:`open` lets the model go on."""

    def __init__(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.folder = folder
        self.uses = 0
        self.ready = -1

    def into(self, request: pb.ModelInferRequest) -> None:
        """Gates ``request``: fresh FIFOs (one whose writer came and went
        polls readable for good), their read end open before the model's
        non-blocking open for writing needs it."""
        self.close()
        self.uses += 1
        self.ready_path = self.folder / f"ready{self.uses}"
        self.go_path = self.folder / f"go{self.uses}"
        os.mkfifo(self.ready_path)
        os.mkfifo(self.go_path)
        self.ready = os.open(self.ready_path, os.O_RDONLY | os.O_NONBLOCK)
        request.parameters["ready"].string_param = str(self.ready_path)
        request.parameters["go"].string_param = str(self.go_path)

    async def entered(self, timeout: float = 120) -> None:
        readable, _, _ = await asyncio.to_thread(select.select, [self.ready], [], [], timeout)
        assert readable, f"the request did not reach the model's gate in {timeout} s"
        assert os.read(self.ready, 16) == b"in"

    def open(self) -> None:
        go = os.open(self.go_path, os.O_WRONLY | os.O_NONBLOCK)  # the model holds its read end
        try:
            os.write(go, b"go")
        finally:
            os.close(go)

    def close(self) -> None:
        if self.ready >= 0:
            os.close(self.ready)
            self.ready = -1


@pytest.fixture
def gate(tmp_path: Path) -> Iterator[Gate]:
    made = Gate(tmp_path / "gate")
    yield made
    made.close()


@pytest.fixture(scope="module")
def serving(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Serving]:
    root = tmp_path_factory.mktemp("shm")
    repo = model_repository(root / "repo")
    with Serving(repo, root / "run", workers=2) as served:
        asyncio.run(_wait(served.address))
        yield served


async def _wait(address: str) -> None:
    async with grpc.aio.insecure_channel(address) as channel:
        await wait_serving(channel)


class ShmObject:
    """A POSIX shared-memory object of this test, unlinked at the end."""

    def __init__(self, size: int) -> None:
        self.name = f"poolserve_test_{uuid.uuid4().hex[:12]}"
        self.key = "/" + self.name
        self.path = Path("/dev/shm") / self.name
        fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, size)
            self.memory = mmap.mmap(fd, size)
        finally:
            os.close(fd)

    def write(self, data: bytes, offset: int = 0) -> None:
        self.memory[offset : offset + len(data)] = data

    def read(self, size: int, offset: int = 0) -> bytes:
        return bytes(self.memory[offset : offset + size])

    def truncate(self, size: int) -> None:
        self.memory.close()  # touching our own map past the new end would be SIGBUS
        os.truncate(self.path, size)

    def unlink(self) -> None:
        self.path.unlink(missing_ok=True)

    def close(self) -> None:
        if not self.memory.closed:
            self.memory.close()
        self.unlink()


@pytest.fixture
def objects() -> Iterator[list[ShmObject]]:
    made: list[ShmObject] = []
    yield made
    for obj in made:
        obj.close()


def make(objects: list[ShmObject], size: int) -> ShmObject:
    obj = ShmObject(size)
    objects.append(obj)
    return obj


def run(address: str, body: object) -> None:
    async def main() -> None:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = Stub(channel)
            try:
                await body(stub)  # type: ignore[operator]
            finally:
                await stub.SystemSharedMemoryUnregister(pb.SystemSharedMemoryUnregisterRequest())

    asyncio.run(main())


async def status(call: object) -> tuple[grpc.StatusCode, str]:
    try:
        await call  # type: ignore[misc]
    except grpc.aio.AioRpcError as exc:
        return exc.code(), exc.details() or ""
    return grpc.StatusCode.OK, ""


async def register(stub: Stub, name: str, obj: ShmObject, size: int, offset: int = 0) -> None:
    request = pb.SystemSharedMemoryRegisterRequest(
        name=name, key=obj.key, offset=offset, byte_size=size
    )
    await stub.SystemSharedMemoryRegister(request, timeout=30)


def in_region(
    tensor: pb.ModelInferRequest.InferInputTensor | pb.ModelInferRequest.InferRequestedOutputTensor,
    region: str,
    size: int,
    offset: int = 0,
) -> None:
    tensor.parameters["shared_memory_region"].string_param = region
    tensor.parameters["shared_memory_byte_size"].int64_param = size
    if offset:
        tensor.parameters["shared_memory_offset"].int64_param = offset


def echo_request(model: str, region: str, count: int, out_region: str = "") -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name=model)
    in_region(
        request.inputs.add(name="INPUT0", datatype="FP32", shape=[1, count]), region, count * 4
    )
    output = request.outputs.add(name="OUTPUT0")
    if out_region:
        in_region(output, out_region, count * 4)
    return request


def floats(values: np.ndarray) -> bytes:
    return np.asarray(values, dtype="<f4").tobytes()


async def worker_pids(serving: Serving) -> list[int]:
    return sorted(w.pid for w in (await pool_status(serving)).workers)


def test_tritonclient_shared_memory_flows(serving: Serving) -> None:
    """simple_grpc_shm_client and simple_grpc_shm_string_client's calls, unchanged."""
    check_client_report(run_client("triton_shm.py", serving.address, prefix()))


def test_serve_inprocess_serves_shared_memory_through_the_same_code(tmp_path: Path) -> None:
    repo = model_repository(tmp_path / "repo")

    async def main() -> None:
        server = InProcessServer(scan(repo), ServerSettings())
        port = await server.start("127.0.0.1:0")
        try:
            address = f"127.0.0.1:{port}"
            report = await asyncio.to_thread(run_client, "triton_shm.py", address, prefix())
        finally:
            await server.stop(0)
        check_client_report(report)

    asyncio.run(main())


def prefix() -> str:
    return f"poolserve_t{uuid.uuid4().hex[:8]}"


def check_client_report(report: dict[str, Any]) -> None:
    assert "system_shared_memory" in report["extensions"]
    assert "cuda_shared_memory" not in report["extensions"]
    assert report["numeric"] == {
        "sum": True,
        "diff": True,
        "raw_entries": [0, 0],  # an empty entry per output in a region, as Triton
        "shapes": [[1, 16], [1, 16]],
    }
    assert sorted(report["status"]) == ["input_data", "output_data"]
    assert report["status"]["input_data"][1:] == [0, 128]
    assert report["status_one"] == ["input_data"]
    assert report["status_unknown"][0] == "StatusCode.NOT_FOUND"
    assert "no_such_region" in report["status_unknown"][1]
    assert report["register_twice"][0] == "StatusCode.ALREADY_EXISTS"
    assert report["after_unregister"] == ["output_data"]
    assert report["infer_unregistered"][0] == "StatusCode.INVALID_ARGUMENT"
    assert "'input_data', which is not registered" in report["infer_unregistered"][1]
    assert report["strings"] == {"sum": True, "diff": True, "datatypes": ["BYTES", "BYTES"]}
    assert report["mixed"] == {"sum_in_region": True, "diff_raw": True}
    assert report["cuda_unregister"] == ["OK", ""]
    assert report["cuda_unregister_one"] == ["OK", ""]
    assert report["cuda_status"] == {}
    code, message = report["cuda_register"]
    assert code == "StatusCode.UNIMPLEMENTED"
    assert "not supported on CPU hosts" in message
    assert report["left_registered"] == []


@pytest.mark.parametrize("model", ["echo", "echo_inline", "echo_batched"])
def test_a_name_registered_again_is_never_served_from_the_old_mapping(
    serving: Serving, objects: list[ShmObject], model: str
) -> None:
    first, second = make(objects, 64), make(objects, 4096)
    first.write(floats(np.arange(16)))
    second.write(floats(np.full(16, 7.0)), offset=1024)
    out = make(objects, 64)

    async def body(stub: Stub) -> None:
        await register(stub, "in", first, 64)
        await register(stub, "out", out, 64)
        request = echo_request(model, "in", 16, out_region="out")
        for _ in range(6):  # every worker maps the first object
            reply = await stub.ModelInfer(request, timeout=30)
            assert list(reply.raw_output_contents) == [b""]
            assert np.frombuffer(out.read(64), "<f4").tolist() == list(range(16))
        await stub.SystemSharedMemoryUnregister(pb.SystemSharedMemoryUnregisterRequest(name="in"))
        await register(stub, "in", second, 64, offset=1024)
        for _ in range(6):
            await stub.ModelInfer(request, timeout=30)
            assert np.frombuffer(out.read(64), "<f4").tolist() == [7.0] * 16

    run(serving.address, body)


def test_register_checks_the_object_and_the_name(
    serving: Serving, objects: list[ShmObject]
) -> None:
    obj = make(objects, 100)

    async def body(stub: Stub) -> None:
        def call(name: str, key: str, offset: int, size: int) -> object:
            request = pb.SystemSharedMemoryRegisterRequest(
                name=name, key=key, offset=offset, byte_size=size
            )
            return stub.SystemSharedMemoryRegister(request, timeout=30)

        code, message = await status(call("r", obj.key, 60, 41))
        assert code is grpc.StatusCode.INVALID_ARGUMENT
        assert "offset 60 + byte_size 41" in message and "the 100 bytes" in message
        code, message = await status(call("r", "/poolserve_no_such_object", 0, 8))
        assert code is grpc.StatusCode.NOT_FOUND and "poolserve_no_such_object" in message
        code, message = await status(call("r", "/../etc/passwd", 0, 8))
        assert (
            code is grpc.StatusCode.INVALID_ARGUMENT and "not a POSIX shared-memory name" in message
        )
        assert (await status(call("r", obj.key, 60, 40)))[0] is grpc.StatusCode.OK
        code, message = await status(call("r", obj.key, 0, 8))
        assert code is grpc.StatusCode.ALREADY_EXISTS and "'r'" in message
        listed = await stub.SystemSharedMemoryStatus(pb.SystemSharedMemoryStatusRequest())
        assert {n: (r.key, r.offset, r.byte_size) for n, r in listed.regions.items()} == {
            "r": (obj.key, 60, 40)
        }

    run(serving.address, body)


@pytest.mark.parametrize("model", ["echo", "echo_inline"])
def test_tensors_out_of_bounds_or_of_the_wrong_size_are_invalid_argument(
    serving: Serving, objects: list[ShmObject], model: str
) -> None:
    obj = make(objects, 64)
    obj.write(floats(np.arange(16)))
    small = make(objects, 64)

    async def body(stub: Stub) -> None:
        await register(stub, "in", obj, 64)
        await register(stub, "small", small, 32)
        past = echo_request(model, "in", 16)
        in_region(past.inputs[0], "in", 64, offset=8)
        code, message = await status(stub.ModelInfer(past, timeout=30))
        assert code is grpc.StatusCode.INVALID_ARGUMENT
        assert "shared_memory_offset 8 + shared_memory_byte_size 64" in message
        assert "'in'" in message
        wrong = echo_request(model, "in", 16)
        in_region(wrong.inputs[0], "in", 60)
        code, message = await status(stub.ModelInfer(wrong, timeout=30))
        assert code is grpc.StatusCode.INVALID_ARGUMENT
        assert message == (
            "input 'INPUT0': shared_memory_byte_size is 60 but shape [1, 16] of FP32 needs 64 bytes"
        )
        too_small = echo_request(model, "in", 16, out_region="small")
        in_region(too_small.outputs[0], "small", 32)
        code, message = await status(stub.ModelInfer(too_small, timeout=30))
        assert code is grpc.StatusCode.INVALID_ARGUMENT
        assert message.startswith("output 'OUTPUT0' needs 64 bytes but shared-memory region")
        assert "'small' gives it 32" in message
        unknown = echo_request(model, "nowhere", 16)
        code, message = await status(stub.ModelInfer(unknown, timeout=30))
        assert code is grpc.StatusCode.INVALID_ARGUMENT
        assert (
            message
            == "input 'INPUT0' names shared-memory region 'nowhere', which is not registered"
        )
        ok = await stub.ModelInfer(echo_request(model, "in", 16), timeout=30)
        assert np.frombuffer(ok.raw_output_contents[0], "<f4").tolist() == list(range(16))

    run(serving.address, body)


async def pool_pids(serving: Serving) -> tuple[int, list[int]]:
    """The pool server's pid and its workers' (an inline model runs in the former)."""
    state = await pool_status(serving)
    return state.pid, sorted(w.pid for w in state.workers)


@pytest.mark.parametrize("model", ["gate", "gate_inline"])
def test_an_object_truncated_or_unlinked_under_a_request_takes_no_worker_down(
    serving: Serving, objects: list[ShmObject], gate: Gate, model: str
) -> None:
    source, target = make(objects, 4096), make(objects, 4096)
    source.write(floats(np.arange(1024)))

    async def body(stub: Stub) -> None:
        before = await pool_pids(serving)
        await register(stub, "src", source, 4096)
        await register(stub, "dst", target, 4096)
        request = echo_request(model, "src", 1024, out_region="dst")
        request.inputs[0].shape[:] = [1024]
        await stub.ModelInfer(request, timeout=60)
        gate.into(request)
        # The output object shrinks while the model runs: checked before the write.
        call = stub.ModelInfer(request, timeout=300)
        await gate.entered()
        target.truncate(16)
        gate.open()
        code, message = await status(call)
        assert (code, message) == (
            grpc.StatusCode.INVALID_ARGUMENT,
            "shared-memory region 'dst': its object "
            f"'{target.key}' is now 16 bytes, below the 4096 this tensor needs",
        )
        # Unregistered and its input's object unlinked while the request is in the
        # model: the input was read before predict, so the request completes.
        await register(stub, "dst2", dst2 := make(objects, 4096), 4096)
        in_region(request.outputs[0], "dst2", 4096)
        gate.into(request)
        call = stub.ModelInfer(request, timeout=300)
        await gate.entered()
        await stub.SystemSharedMemoryUnregister(pb.SystemSharedMemoryUnregisterRequest())
        source.unlink()
        gate.open()
        reply = await call
        assert list(reply.raw_output_contents) == [b""]
        assert np.frombuffer(dst2.read(4096), "<f4").tolist() == list(range(1024))
        code, message = await status(stub.ModelInfer(request, timeout=60))  # the router refuses
        assert code is grpc.StatusCode.INVALID_ARGUMENT and "not registered" in message
        assert await pool_pids(serving) == before

    run(serving.address, body)


@pytest.mark.parametrize("model", ["gate", "gate_inline"])
def test_an_input_object_shrunk_while_the_model_reads_it_is_that_clients_error_only(
    serving: Serving, objects: list[ShmObject], gate: Gate, model: str
) -> None:
    """Issue 28 §2: the model reads its input after the client truncated the
    object (SIGBUS through a mapping: the worker, or the inline pool, died)."""
    count = 4 * 4096  # 64 KiB: pages past the first are gone after the truncation
    obj = make(objects, count * 4)
    obj.write(floats(np.arange(count)))
    other = make(objects, 64)
    other.write(floats(np.arange(16)))

    async def body(stub: Stub) -> None:
        before = await pool_pids(serving)
        await register(stub, "shrinks", obj, count * 4)
        await register(stub, "other", other, 64)
        request = echo_request(model, "shrinks", count, out_region="shrinks")
        request.inputs[0].shape[:] = [count]
        gate.into(request)
        call = stub.ModelInfer(request, timeout=300)
        await gate.entered()
        obj.truncate(16)
        gate.open()
        code, message = await status(call)
        assert (code, message) == (
            grpc.StatusCode.INVALID_ARGUMENT,
            "shared-memory region 'shrinks': its object "
            f"'{obj.key}' is now 16 bytes, below the {count * 4} this tensor needs",
        )
        # Nobody else noticed: the same processes, the model ready, others served.
        assert await pool_pids(serving) == before
        ready = await stub.ModelReady(pb.ModelReadyRequest(name=model), timeout=30)
        assert ready.ready
        assert (await stub.ServerReady(pb.ServerReadyRequest(), timeout=30)).ready
        for name in ("echo", "echo_inline"):
            reply = await stub.ModelInfer(echo_request(name, "other", 16), timeout=60)
            assert np.frombuffer(reply.raw_output_contents[0], "<f4").tolist() == list(range(16))
        model_state = [m for m in (await pool_status(serving)).models if m.name == model]
        assert [m.state for m in model_state] == ["READY"]

    run(serving.address, body)


def test_a_request_that_brings_its_own_registrations_is_refused(
    serving: Serving, objects: list[ShmObject]
) -> None:
    """Only the router attaches registrations: a client cannot choose what a worker maps."""
    obj = make(objects, 64)
    body_bytes = echo_request("echo", "forged", 16).SerializeToString()
    forged = wrap([Region("forged", obj.key, 0, 64, 1)], body_bytes)

    obj.write(b"secret" * 10)

    async def main() -> None:
        async with grpc.aio.insecure_channel(serving.address) as channel:
            infer = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
            code, message = await status(infer(forged, timeout=30))
            assert (code, message) == (
                grpc.StatusCode.INVALID_ARGUMENT,
                "request bytes hold a field number 0",
            )

    asyncio.run(main())


def test_a_pool_addressed_directly_has_a_registry_of_its_own(
    serving: Serving, objects: list[ShmObject]
) -> None:
    obj = make(objects, 64)
    obj.write(floats(np.arange(16)))

    async def body(stub: Stub) -> None:
        await register(stub, "direct", obj, 64)
        reply = await stub.ModelInfer(echo_request("echo", "direct", 16), timeout=30)
        assert np.frombuffer(reply.raw_output_contents[0], "<f4").tolist() == list(range(16))

    run(f"unix:{serving.run_dir / 'pool-default.sock'}", body)

    async def router_side(stub: Stub) -> None:
        listed = await stub.SystemSharedMemoryStatus(pb.SystemSharedMemoryStatusRequest())
        assert "direct" not in listed.regions

    run(serving.address, router_side)


def test_a_stream_reads_regions_registered_at_the_router(
    serving: Serving, objects: list[ShmObject]
) -> None:
    obj = make(objects, 64)
    obj.write(floats(np.arange(16)))

    async def body(stub: Stub) -> None:
        await register(stub, "streamed", obj, 64)
        requests = [echo_request("echo", "streamed", 16), echo_request("echo", "elsewhere", 16)]
        replies = [reply async for reply in stub.ModelStreamInfer(iter(requests), timeout=30)]
        first, second = replies
        assert not first.error_message
        values = np.frombuffer(first.infer_response.raw_output_contents[0], "<f4")
        assert values.tolist() == list(range(16))
        assert "'elsewhere', which is not registered" in second.error_message

    run(serving.address, body)


@pytest.mark.parametrize(
    "data",
    [
        b"\x00shm1",  # cut before its length (found by tests/test_fuzz.py)
        b"\x00shm1\x10\x00\x00\x00[]",  # cut inside its table
        b"\x00shm1\x02\x00\x00\x00{}",  # not a list of registrations
        b"\x00shm1\x06\x00\x00\x00[null]",
        b'\x00shm1\x0d\x00\x00\x00[{"name": 1}]',
    ],
)
def test_malformed_registrations_in_front_are_invalid_input(data: bytes) -> None:
    from poolserve.service.contract.errors import InvalidInput
    from poolserve.service.contract.shm import unwrap

    with pytest.raises(InvalidInput, match="shared-memory registrations"):
        unwrap(data)


def test_registrations_of_the_wrong_types_are_invalid_input() -> None:
    from poolserve.service.contract.errors import InvalidInput
    from poolserve.service.contract.shm import Region, unwrap, wrap

    good = wrap([Region("r", "/k", 0, 8, 7)], b"body")
    assert unwrap(good) == ({"r": Region("r", "/k", 0, 8, 7)}, b"body")
    table = json.dumps([{"name": "r", "key": "/k", "offset": "0", "byte_size": 8, "generation": 7}])
    bad = b"\x00shm1" + len(table).to_bytes(4, "little") + table.encode() + b"body"
    with pytest.raises(InvalidInput, match="is not int"):
        unwrap(bad)


# -- issue 28: objects that are not the client's own, and bounds --------------


class Planted:
    """Things another local user could plant in /dev/shm, removed at the end:
    a symlink to a file of ours, a file owned by another uid, a FIFO."""

    def __init__(self, folder: Path) -> None:
        tag = uuid.uuid4().hex[:12]
        self.secret = folder / "secret"
        self.secret.write_bytes(b"top secret, not shared memory!!\n" * 2)  # 64 bytes
        self.link = Path(f"/dev/shm/poolserve_link_{tag}")
        self.link.symlink_to(self.secret)
        self.foreign = Path(f"/dev/shm/poolserve_foreign_{tag}")
        self.foreign.write_bytes(b"\0" * 64)
        os.chown(self.foreign, 65534, 65534)  # nobody's (the tests run as root)
        self.fifo = Path(f"/dev/shm/poolserve_fifo_{tag}")
        os.mkfifo(self.fifo)

    def keys(self) -> dict[str, str]:
        return {what: "/" + path.name for what, path in self.paths().items()}

    def paths(self) -> dict[str, Path]:
        return {"link": self.link, "foreign": self.foreign, "fifo": self.fifo}

    def close(self) -> None:
        for path in self.paths().values():
            path.unlink(missing_ok=True)


@pytest.fixture
def planted(tmp_path: Path) -> Iterator[Planted]:
    made = Planted(tmp_path)
    yield made
    made.close()


REFUSED = {
    "link": "is a symbolic link",
    "foreign": "is owned by uid 65534, not by the server's uid 0",
    "fifo": "is not a regular file",
}


def test_register_refuses_symlinks_other_users_objects_and_non_files(
    serving: Serving, planted: Planted
) -> None:
    """Issue 28 §1: a symlink planted in /dev/shm must not reach the file it points to."""

    async def body(stub: Stub) -> None:
        for what, key in planted.keys().items():
            request = pb.SystemSharedMemoryRegisterRequest(
                name=what, key=key, offset=0, byte_size=16
            )
            code, message = await status(stub.SystemSharedMemoryRegister(request, timeout=30))
            assert code is grpc.StatusCode.INVALID_ARGUMENT, (what, code, message)
            assert message.startswith(f"cannot register shared-memory region '{what}': ")
            assert f"shared-memory object '{key}' {REFUSED[what]}" in message
        listed = await stub.SystemSharedMemoryStatus(pb.SystemSharedMemoryStatusRequest())
        assert dict(listed.regions) == {}

    run(serving.address, body)


@pytest.mark.parametrize("model", ["echo", "echo_inline"])
def test_a_worker_refuses_a_forged_table_naming_such_objects(
    serving: Serving, planted: Planted, model: str
) -> None:
    """The pool's private socket takes registrations as they come: the process
    that reads the tensors checks the object itself (it does not trust the router)."""

    async def main() -> None:
        socket = f"unix:{serving.run_dir / 'pool-default.sock'}"
        async with grpc.aio.insecure_channel(socket) as channel:
            infer = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
            for what, key in planted.keys().items():
                reading = echo_request(model, "forged", 16).SerializeToString()
                table = [Region("forged", key, 0, 64, int(uuid.uuid4().int >> 65))]
                code, message = await status(infer(wrap(table, reading), timeout=60))
                assert code is grpc.StatusCode.INVALID_ARGUMENT, (what, code, message)
                assert message == (
                    f"shared-memory region 'forged': shared-memory object '{key}' "
                    f"{REFUSED[what]} ({planted.paths()[what]})"
                    + ("; refused: it could point anywhere" if what == "link" else "; refused")
                    + (": create it as that user" if what == "foreign" else "")
                )
                # ... and writing through one: the secret stays as it was
                writing = echo_request(model, "in", 16, out_region="forged")
                writing.inputs[0].ClearField("parameters")
                writing.raw_input_contents.append(floats(np.arange(16)))
                table = [Region("forged", key, 0, 64, int(uuid.uuid4().int >> 65))]
                code, message = await status(
                    infer(wrap(table, writing.SerializeToString()), timeout=60)
                )
                assert code is grpc.StatusCode.INVALID_ARGUMENT, (what, code, message)
                assert REFUSED[what] in message
        assert planted.secret.read_bytes() == b"top secret, not shared memory!!\n" * 2

    asyncio.run(main())


def test_the_registry_is_bounded_and_its_status_stays_answerable(
    serving: Serving, objects: list[ShmObject]
) -> None:
    """Issue 28 §3: defaults shm_max_regions 1024, shm_max_name_length 255."""
    obj = make(objects, 64)

    async def body(stub: Stub) -> None:
        def call(name: str, key: str = obj.key) -> object:
            request = pb.SystemSharedMemoryRegisterRequest(
                name=name, key=key, offset=0, byte_size=8
            )
            return stub.SystemSharedMemoryRegister(request, timeout=60)

        code, message = await status(call("n" * 256))
        assert code is grpc.StatusCode.INVALID_ARGUMENT
        assert "longer than 255 characters (shm_max_name_length)" in message
        assert len(message) < 1000  # the name is clipped, not repeated
        code, message = await status(call("long key", "/" + "k" * (4 << 20)))
        assert code is grpc.StatusCode.INVALID_ARGUMENT
        assert "longer than 255 bytes (NAME_MAX)" in message and len(message) < 1000
        names = [f"{i:04d}" + "r" * 251 for i in range(1024)]  # the longest names allowed
        for start in range(0, len(names), 64):
            await asyncio.gather(*(call(name) for name in names[start : start + 64]))  # type: ignore[misc]
        code, message = await status(call("one too many"))
        assert code is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert message == (
            "cannot register shared-memory region 'one too many': 1024 regions are "
            "registered, the most this server keeps (shm_max_regions); unregister some first"
        )
        listed = await stub.SystemSharedMemoryStatus(pb.SystemSharedMemoryStatusRequest())
        assert sorted(listed.regions) == names
        await stub.SystemSharedMemoryUnregister(
            pb.SystemSharedMemoryUnregisterRequest(name=names[0])
        )
        await call("one too many")  # room again

    run(serving.address, body)


def _peak_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmHWM for pid {pid}")


@pytest.mark.parametrize("model", ["echo", "echo_inline"])
def test_a_sparse_region_over_the_message_limit_costs_no_memory(
    serving: Serving, objects: list[ShmObject], model: str
) -> None:
    """Issue 28 §4: 256 MiB of a sparse object cost its client nothing; echoing
    them must not cost the worker (or the inline pool) 256 MiB before the
    reply is refused as over max_message_size (64 MiB)."""
    size = 256 << 20
    obj = make(objects, size)  # ftruncate: sparse, no page touched

    async def body(stub: Stub) -> None:
        state = await pool_status(serving)
        pids = [state.pid, *(w.pid for w in state.workers)]
        peaks = {pid: _peak_rss(pid) for pid in pids}
        await register(stub, "sparse", obj, size)
        request = echo_request(model, "sparse", size // 4)
        code, message = await status(stub.ModelInfer(request, timeout=120))
        assert code is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert message == (
            f"input 'INPUT0' reads {size} bytes from shared-memory region 'sparse': with the "
            "request's other shared-memory inputs (0 bytes) that is over max_message_size "
            f"({64 << 20} bytes)"
        )
        grown = {pid: _peak_rss(pid) - peak for pid, peak in peaks.items()}
        assert max(grown.values()) < 32 << 20, grown

    run(serving.address, body)
