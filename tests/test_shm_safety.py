"""Shared memory's safety in one process (issue 28 §1-4, §12): the one safe
open, the worker's own checks, the registry's bounds, sizes checked before
allocation, the settings behind them. The same, end to end through ``poolserve
serve``, is in tests/test_triton_shm.py.
"""

from __future__ import annotations

import json
import mmap
import os
import signal
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from poolserve.protos import inference_pb2 as pb
from poolserve.service.contract import worker_limits
from poolserve.service.contract.errors import (
    InvalidInput,
    MessageTooLarge,
    NotFound,
    QueueFull,
)
from poolserve.service.contract.repository import ModelSettings
from poolserve.service.contract.settings import ConfigError, load_server_settings
from poolserve.service.contract.shm import Region, open_object
from poolserve.service.grpcserver.shm import SharedMemory
from poolserve.service.inference.infer import infer_parts
from poolserve.service.inference.model import Model
from poolserve.service.inference.shm import SharedTensors
from poolserve.service.poolcore import worker
from poolserve.service.poolcore.frames import READY, request_frame


def _shm(tag: str) -> Path:
    return Path(f"/dev/shm/poolserve_unit_{tag}_{uuid.uuid4().hex[:10]}")


@pytest.fixture
def planted(tmp_path: Path) -> Iterator[dict[str, Path]]:
    """A symlink to a secret file, another uid's object, a FIFO, and an object of ours."""
    secret = tmp_path / "secret"
    secret.write_bytes(b"S" * 64)
    made = {
        "link": _shm("link"),
        "foreign": _shm("foreign"),
        "fifo": _shm("fifo"),
        "ours": _shm("ours"),
    }
    made["link"].symlink_to(secret)
    made["foreign"].write_bytes(b"\0" * 64)
    os.chown(made["foreign"], 65534, 65534)
    os.mkfifo(made["fifo"])
    made["ours"].write_bytes(np.arange(16, dtype="<f4").tobytes())
    yield made
    for path in made.values():
        path.unlink(missing_ok=True)
    assert secret.read_bytes() == b"S" * 64


def _key(path: Path) -> str:
    return "/" + path.name


def test_open_object_refuses_what_is_not_the_servers_own_regular_file(
    planted: dict[str, Path],
) -> None:
    with pytest.raises(InvalidInput, match="is a symbolic link"):
        open_object(_key(planted["link"]))
    with pytest.raises(InvalidInput, match=r"is owned by uid 65534, not by the server's uid 0"):
        open_object(_key(planted["foreign"]))
    with pytest.raises(InvalidInput, match="is not a regular file"):
        open_object(_key(planted["fifo"]))
    with pytest.raises(NotFound, match="no shared-memory object"):
        open_object("/poolserve_unit_no_such_object")
    with pytest.raises(InvalidInput, match=r"longer than 255 bytes \(NAME_MAX\)"):
        open_object("/" + "k" * 256)
    fd, size = open_object(_key(planted["ours"]))
    try:
        assert size == 64
        assert os.get_inheritable(fd) is False  # O_CLOEXEC: no worker inherits it
    finally:
        os.close(fd)


def _echo_request(region: str, *, out: str = "") -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="echo")
    tensor = request.inputs.add(name="INPUT0", datatype="FP32", shape=[16])
    tensor.parameters["shared_memory_region"].string_param = region
    tensor.parameters["shared_memory_byte_size"].int64_param = 64
    requested = request.outputs.add(name="OUTPUT0")
    if out:
        requested.parameters["shared_memory_region"].string_param = out
        requested.parameters["shared_memory_byte_size"].int64_param = 64
    return request


def test_a_worker_checks_the_objects_of_a_table_it_is_given(planted: dict[str, Path]) -> None:
    """The table in front of a request is trusted by nobody: reading or writing
    through a planted symlink, another uid's object or a FIFO is refused."""
    for what in ("link", "foreign", "fifo"):
        forged = {"r": Region("r", _key(planted[what]), 0, 64, 1)}
        shared = SharedTensors(forged)
        with pytest.raises(InvalidInput, match="shared-memory region 'r': shared-memory object"):
            shared.read(_echo_request("r").inputs[0])
        with pytest.raises(InvalidInput, match="shared-memory region 'r': shared-memory object"):
            shared.write(_echo_request("", out="r").outputs[0], np.zeros(16, "<f4"), "FP32")
    ours = SharedTensors({"r": Region("r", _key(planted["ours"]), 0, 64, 1)})
    assert ours.read(_echo_request("r").inputs[0]).tolist() == list(range(16))


def test_an_input_is_the_requests_own_copy_and_a_shrunk_object_is_invalid_input(
    planted: dict[str, Path],
) -> None:
    """No view on the client's object survives the read: its truncation
    afterwards cannot fault the model or the reply's encoding (SIGBUS)."""
    path = planted["ours"]
    shared = SharedTensors({"r": Region("r", _key(path), 0, 64, 1)})
    arr = shared.read(_echo_request("r").inputs[0])
    os.truncate(path, 0)
    assert arr.tolist() == list(range(16))  # a view of a mapping would be SIGBUS here
    assert not arr.flags.writeable
    with pytest.raises(InvalidInput, match=r"is now 0 bytes, below the 64 this tensor needs"):
        shared.read(_echo_request("r").inputs[0])
    with pytest.raises(InvalidInput, match=r"is now 0 bytes, below the 64 this tensor needs"):
        shared.write(_echo_request("", out="r").outputs[0], np.zeros(16, "<f4"), "FP32")
    assert path.stat().st_size == 0  # a refused write does not grow it


def test_an_object_truncated_during_the_read_is_invalid_input(tmp_path: Path) -> None:
    """The size check and the copy are two steps: a truncation between them
    ends the copy early (pread returns 0), never with a fault."""
    from poolserve.service.inference.shm import _pread_into

    path = tmp_path / "short"
    path.write_bytes(b"x" * 100)
    fd = os.open(path, os.O_RDONLY)
    try:
        target = np.empty(4096, np.uint8)
        with pytest.raises(InvalidInput, match=r"truncated while being read, below the 4196"):
            _pread_into(fd, target.data, 100, Region("r", "/k", 0, 8192, 1))
    finally:
        os.close(fd)


def test_outputs_are_written_little_endian_whatever_their_layout(
    planted: dict[str, Path],
) -> None:
    path = planted["ours"]
    shared = SharedTensors({"r": Region("r", _key(path), 0, 64, 1)})
    values = np.arange(32, dtype=">f4").reshape(4, 8)[:, ::2]  # big-endian, not contiguous
    shared.write(_echo_request("", out="r").outputs[0], values, "FP32")
    assert np.frombuffer(path.read_bytes(), "<f4").tolist() == values.ravel().tolist()


class _Echo(Model):
    def predict(self, inputs: dict[str, Any], parameters: dict[str, object]) -> dict[str, Any]:
        return {"OUTPUT0": inputs["INPUT0"]}


class _Grow(Model):
    """A small input, a large output."""

    def predict(self, inputs: dict[str, Any], parameters: dict[str, object]) -> dict[str, Any]:
        return {"OUTPUT0": np.zeros(1 << 20, dtype="<f4")}


def _model(cls: type[Model]) -> Model:
    settings = ModelSettings(name="echo", implementation="x", folder=Path(), source=Path())
    return cls(settings)


def test_a_reply_over_max_message_size_is_refused_before_it_is_built(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(worker_limits.LIMITS, "max_message_size", 1 << 20)
    request = pb.ModelInferRequest(model_name="echo")
    request.inputs.add(name="INPUT0", datatype="FP32", shape=[4])
    request.raw_input_contents.append(b"\0" * 16)
    with pytest.raises(MessageTooLarge) as caught:
        infer_parts(_model(_Grow), request.SerializeToString())
    assert caught.value.message == (
        f"model 'echo' replied {4 << 20} bytes, over max_message_size ({1 << 20} bytes)"
    )
    # Under the limit: served as before.
    parts, _ = infer_parts(_model(_Echo), request.SerializeToString())
    assert b"".join(bytes(p) for p in parts).endswith(b"\0" * 16)


def test_shared_memory_inputs_over_max_message_size_are_refused_before_any_is_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A sparse object costs its client nothing: reading it must not cost the worker."""
    monkeypatch.setattr(worker_limits.LIMITS, "max_message_size", 1 << 20)
    path = _shm("sparse")
    try:
        with open(path, "wb") as f:
            f.truncate(1 << 30)  # 1 GiB, no page touched
        request = pb.ModelInferRequest(model_name="echo")
        tensor = request.inputs.add(name="INPUT0", datatype="FP32", shape=[1 << 28])
        tensor.parameters["shared_memory_region"].string_param = "sparse"
        tensor.parameters["shared_memory_byte_size"].int64_param = 1 << 30
        regions = {"sparse": Region("sparse", _key(path), 0, 1 << 30, 1)}
        with pytest.raises(MessageTooLarge, match=r"reads 1073741824 bytes from shared-memory"):
            infer_parts(_model(_Echo), request.SerializeToString(), regions)
        assert os.stat(path).st_blocks == 0  # nothing was read, so nothing was allocated
    finally:
        path.unlink(missing_ok=True)


def test_the_registry_bounds_regions_names_and_keys(planted: dict[str, Path]) -> None:
    registry = SharedMemory(max_regions=3, max_name_length=8)
    key = _key(planted["ours"])
    for name in ("a", "b", "c"):
        registry.register(name, key, 0, 8)
    with pytest.raises(QueueFull, match=r"3 regions are registered, .*\(shm_max_regions\)"):
        registry.register("d", key, 0, 8)
    registry.unregister("a")
    registry.register("d", key, 0, 8)
    with pytest.raises(InvalidInput, match=r"longer than 8 characters \(shm_max_name_length\)"):
        registry.register("n" * 9, key, 0, 8)
    with pytest.raises(InvalidInput, match=r"longer than 255 bytes \(NAME_MAX\)") as caught:
        SharedMemory().register("k", "/" + "k" * (4 << 20), 0, 8)
    assert len(caught.value.message) < 1000


def test_the_registry_keeps_its_status_within_one_reply(planted: dict[str, Path]) -> None:
    """However the counts are set, Status for all regions fits max_message_size."""
    key = _key(planted["ours"])
    limit = 4096
    registry = SharedMemory(max_regions=1000, max_name_length=255, max_status_bytes=limit)
    names = [f"{i:03d}" + "n" * 252 for i in range(1000)]
    registered = 0

    def fill() -> None:
        nonlocal registered
        for name in names:
            registry.register(name, key, 0, 8)
            registered += 1

    with pytest.raises(QueueFull, match=r"would not fit one reply of max_message_size \(4096"):
        fill()
    reply = pb.SystemSharedMemoryStatusResponse()
    for region in registry.status(""):
        row = reply.regions[region.name]
        row.name, row.key, row.offset, row.byte_size = region.name, region.key, 1 << 62, 1 << 62
    assert registered > 0 and reply.ByteSize() <= limit
    registry.unregister(names[0])
    registry.register("again", key, 0, 8)  # room given back
    registry.unregister("")
    assert registry.status_bytes == 0


def test_shm_and_slab_settings_have_safe_defaults_and_layers(tmp_path: Path) -> None:
    defaults = load_server_settings(tmp_path, environ={})
    assert (defaults.shm_max_regions, defaults.shm_max_name_length) == (1024, 255)
    assert defaults.slab_mapped_bytes == 512 << 20
    (tmp_path / "settings.json").write_text(json.dumps({"shm_max_regions": 10}))
    layered = load_server_settings(
        tmp_path,
        environ={"POOLSERVE_SLAB_MAPPED_BYTES": str(64 << 20)},
        flags={"shm_max_name_length": 64},
    )
    assert (layered.shm_max_regions, layered.shm_max_name_length) == (10, 64)
    assert layered.slab_mapped_bytes == 64 << 20
    with pytest.raises(ConfigError, match="slab_mapped_bytes"):
        load_server_settings(tmp_path, environ={"POOLSERVE_SLAB_MAPPED_BYTES": "0"})


def test_worker_limits_reach_a_spawned_worker_through_its_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A forked worker inherits LIMITS; a spawned one (a fresh interpreter) reads them back."""
    monkeypatch.setattr(worker_limits, "LIMITS", worker_limits.WorkerLimits())
    monkeypatch.delenv(worker_limits.ENV, raising=False)
    worker_limits.configure(8 << 20, 3 << 20)
    env = dict(os.environ)
    monkeypatch.delenv(worker_limits.ENV)
    code = (
        "from poolserve.service.contract import slab, worker_limits as w; "
        "print(w.LIMITS.max_message_size, w.LIMITS.slab_mapped_bytes, slab.LIMITS is w.LIMITS)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.stdout.split() == [str(8 << 20), str(3 << 20), "True"], out.stderr


def test_a_worker_that_cannot_send_its_reply_dies_saying_why(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """A reply whose bytes fault (EFAULT from sendmsg: a view of a mapping that
    shrank) once ended the worker with exit code 0, logged as if the pool had
    closed it. It is a death with its own code and its reason on stderr."""
    path = tmp_path / "shrinks"
    path.write_bytes(b"\0" * 65536)
    with open(path, "r+b") as f:
        mapped = mmap.mmap(f.fileno(), 65536)
    os.truncate(path, 16)

    def handler(body: bytes, seq: int) -> worker.FrameOut:
        return [memoryview(mapped)[4096:8192]]  # a frame whose bytes are gone

    ours, theirs = socket.socketpair()
    pid = child = os.fork()
    if pid == 0:  # the worker
        try:
            ours.close()
            worker.run_prepared(theirs, 3600, lambda announce: (handler, []))
        finally:
            os._exit(99)
    theirs.close()
    try:
        ours.settimeout(120)
        reader = ours.makefile("rb")
        header = reader.read(worker.HEADER.size)
        length, kind, _ = worker.HEADER.unpack(header)
        assert kind == READY  # its self-test (no warm-ups) is done
        reader.read(length)
        ours.sendall(b"".join(bytes(part) for part in request_frame(1, b"request")))
        _, status = os.waitpid(pid, 0)
        pid = 0
    finally:
        if pid:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        ours.close()
    assert os.waitstatus_to_exitcode(status) == worker.EXIT_OS_ERROR
    assert f"poolserve worker {child}: OSError: [Errno 14] Bad address" in capfd.readouterr().err
