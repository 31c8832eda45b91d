"""System shared memory in the process that runs a request (a worker, or the
pool server for inline models): regions mapped once and cached, inputs
decoded straight from them, outputs written straight into them.

The registrations come with the request (:mod:`poolserve.service.contract.shm`).
A mapping is cached per process under the registration's generation: a name
unregistered and registered again (another key, another size) has a new
generation, and the old mapping of that name is closed when the new one is
first used. The object's current size is checked (``fstat``) before every
read and write, so a client that truncated its object gets INVALID_ARGUMENT
instead of a worker killed by SIGBUS; a client that truncates it *while* a
tensor is being copied can still bring that worker down (it is respawned,
the call gets an error).
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os
import threading
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from poolserve.protos import inference_pb2 as pb
from poolserve.service.contract.errors import InvalidInput, clip
from poolserve.service.contract.shm import Region, shm_path
from poolserve.service.inference.codec import decode_raw, dtype_for, encode_raw

MAX_MAPPINGS = 64  # regions mapped at once per process; the least recently used goes


@dataclass(eq=False)
class _Mapped:
    region: Region
    fd: int
    memory: mmap.mmap

    def close(self) -> None:
        with contextlib.suppress(BufferError):  # arrays still view it: unmapped when they go
            self.memory.close()
        os.close(self.fd)


class _Mappings:
    """This process's mapped regions, by registration generation."""

    def __init__(self) -> None:
        self._mapped: OrderedDict[int, _Mapped] = OrderedDict()
        self._lock = threading.Lock()  # inline models run on threads of their own

    def get(self, region: Region) -> _Mapped:
        with self._lock:
            mapped = self._mapped.get(region.generation)
            if mapped is not None:
                self._mapped.move_to_end(region.generation)
                return mapped
            for generation, old in list(self._mapped.items()):
                if old.region.name == region.name:  # registered again since
                    del self._mapped[generation]
                    old.close()
            mapped = _map(region)
            self._mapped[region.generation] = mapped
            while len(self._mapped) > MAX_MAPPINGS:
                self._mapped.popitem(last=False)[1].close()
            return mapped

    def clear(self) -> None:
        with self._lock:
            for mapped in self._mapped.values():
                mapped.close()
            self._mapped.clear()


MAPPINGS = _Mappings()


def _gone(region: Region, why: str) -> InvalidInput:
    return InvalidInput(
        f"shared-memory region '{clip(region.name)}': its object '{clip(region.key)}' {why}"
    )


def _map(region: Region) -> _Mapped:
    length = region.offset + region.byte_size
    try:
        fd = os.open(shm_path(region.key), os.O_RDWR | os.O_CLOEXEC)
    except OSError as exc:
        raise _gone(region, f"cannot be opened: {exc.strerror or exc}") from None
    try:
        size = os.fstat(fd).st_size
        if size < length:
            raise _gone(region, f"is now {size} bytes, below the {length} it was registered with")
        memory = mmap.mmap(fd, length, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.close(fd)
        raise
    return _Mapped(region, fd, memory)


def _int_param(tensor: Any, key: str, where: str) -> int:
    if key not in tensor.parameters:
        return 0
    param = tensor.parameters[key]
    choice = param.WhichOneof("parameter_choice")
    if choice not in ("int64_param", "uint64_param"):
        raise InvalidInput(f"{where}: parameter {key} must be an int64_param")
    return int(getattr(param, choice))


class SharedTensors:
    """Reads inputs from and writes outputs to the regions one request carries."""

    def __init__(self, regions: Mapping[str, Region]) -> None:
        self.regions = regions

    def _view(self, tensor: Any, where: str, used: int | None = None) -> memoryview:
        """The tensor's bytes in its region (``used`` of them when given), bounds checked."""
        name = tensor.parameters["shared_memory_region"].string_param
        region = self.regions.get(name)
        if region is None:
            raise InvalidInput(
                f"{where} names shared-memory region '{clip(name)}', which is not registered"
            )
        offset = _int_param(tensor, "shared_memory_offset", where)
        size = _int_param(tensor, "shared_memory_byte_size", where)
        if offset < 0 or size < 0 or offset + size > region.byte_size:
            raise InvalidInput(
                f"{where}: shared_memory_offset {offset} + shared_memory_byte_size {size} "
                f"run past the {region.byte_size} bytes of shared-memory region '{clip(name)}'"
            )
        mapped = MAPPINGS.get(region)
        start = region.offset + offset
        end = start + (size if used is None else used)
        current = os.fstat(mapped.fd).st_size  # touching pages past it would be SIGBUS
        if current < end:
            raise _gone(region, f"is now {current} bytes, below the {end} this tensor needs")
        return memoryview(mapped.memory)[start:end]

    def read(self, tensor: pb.ModelInferRequest.InferInputTensor) -> npt.NDArray[Any]:
        """An input straight from its region: a read-only view (BYTES: copied out)."""
        where = f"input '{clip(tensor.name)}'"
        view = self._view(tensor, where)
        if tensor.datatype != "BYTES":
            shape = list(tensor.shape)
            if tensor.datatype and all(dim >= 0 for dim in shape):
                needed = math.prod(shape) * dtype_for(tensor.datatype).itemsize
                if needed != len(view):
                    raise InvalidInput(
                        f"{where}: shared_memory_byte_size is {len(view)} but shape {shape} "
                        f"of {tensor.datatype} needs {needed} bytes"
                    )
            return decode_raw(tensor, view.toreadonly())
        return decode_raw(tensor, bytes(view))

    def write(
        self,
        requested: pb.ModelInferRequest.InferRequestedOutputTensor,
        arr: npt.NDArray[Any],
        datatype: str,
    ) -> None:
        """An output straight into its region; one that does not fit is INVALID_ARGUMENT."""
        where = f"output '{clip(requested.name)}'"
        size = _int_param(requested, "shared_memory_byte_size", where)
        data = encode_raw(arr, datatype, where) if datatype == "BYTES" else None
        needed = len(data) if data is not None else arr.nbytes
        if needed > size:
            region = requested.parameters["shared_memory_region"].string_param
            raise InvalidInput(
                f"{where} needs {needed} bytes but shared-memory region '{clip(region)}' "
                f"gives it {size} (shared_memory_byte_size)"
            )
        view = self._view(requested, where, used=needed)
        if data is not None:
            view[:] = data
            return
        target = np.frombuffer(view, dtype=arr.dtype.newbyteorder("<")).reshape(arr.shape)
        np.copyto(target, arr, casting="equiv")  # a byte swap at most
