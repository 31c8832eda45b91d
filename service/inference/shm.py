"""System shared memory in the process that runs a request (a worker, or the
pool server for inline models): inputs read out of their regions, outputs
written into them, through the file, never through a mapping.

The registrations come with the request (:mod:`poolserve.service.contract.shm`);
each object is opened again here, as registration opened it
(:func:`~poolserve.service.contract.shm.open_object`: no symlink, a regular
file of the server's uid), because a worker must not trust whoever sent it the
table (a pool's private socket takes tables as they come).

Why ``pread``/``pwrite`` and no ``mmap``: the object belongs to the client,
which may ``ftruncate`` it at any moment, and touching a mapped page past the
new end is SIGBUS, which kills the process (a worker; the pool server itself
for an inline model). A system call past the end returns short instead: an
input is copied out once (one memcpy, in the kernel) into an array of the
request, so neither the model nor the reply's encoding holds a view on the
client's memory; an object found shorter than the tensor is INVALID_ARGUMENT
for that client, and nobody else notices. An output is written after a size
check; if the object shrinks between the check and the write, ``pwrite``
grows it back (at most to the registered size), which cannot fault.

What a request reads from shared memory is charged against max_message_size
before anything is allocated (:data:`~poolserve.service.contract.worker_limits.LIMITS`):
a client's sparse object costs it nothing, and must not cost a worker more
than a request on the wire could.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import numpy as np
import numpy.typing as npt

from poolserve.protos import inference_pb2 as pb
from poolserve.service.contract.errors import (
    InvalidInput,
    MessageTooLarge,
    ServingError,
    clip,
    error_for,
)
from poolserve.service.contract.shm import Region, open_object
from poolserve.service.contract.worker_limits import LIMITS
from poolserve.service.inference.codec import decode_raw, dtype_for, encode_raw


def _gone(region: Region, why: str) -> InvalidInput:
    return InvalidInput(
        f"shared-memory region '{clip(region.name)}': its object '{clip(region.key)}' {why}"
    )


@contextmanager
def _opened(region: Region, end: int) -> Iterator[int]:
    """The region's object, checked (see the module doc) and at least ``end`` bytes now."""
    try:
        fd, size = open_object(region.key)
    except ServingError as exc:
        raise error_for(
            exc.failure, f"shared-memory region '{clip(region.name)}': {exc.message}"
        ) from None
    try:
        if size < end:
            raise _gone(region, f"is now {size} bytes, below the {end} this tensor needs")
        yield fd
    finally:
        os.close(fd)


def _pread_into(fd: int, target: memoryview, offset: int, region: Region) -> None:
    got = 0
    while got < len(target):
        try:
            count = os.preadv(fd, [target[got:]], offset + got)
        except OSError as exc:
            raise _gone(region, f"cannot be read: {exc.strerror or exc}") from None
        if count == 0:  # its end moved under us: truncated since the size check
            raise _gone(
                region,
                f"was truncated while being read, below the {offset + len(target)} bytes "
                "this tensor needs",
            )
        got += count


def _pwrite_from(fd: int, source: memoryview, offset: int, region: Region) -> None:
    done = 0
    while done < len(source):
        try:
            done += os.pwritev(fd, [source[done:]], offset + done)
        except OSError as exc:  # ENOSPC on a full /dev/shm, say
            raise _gone(region, f"cannot be written: {exc.strerror or exc}") from None


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
        self.read_bytes = 0  # read out of shared memory by this request so far

    def _place(self, tensor: Any, where: str, used: int | None = None) -> tuple[Region, int, int]:
        """(region, start, end): where the tensor's bytes are in the region's
        object (``used`` of them when given), checked against the registration."""
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
        start = region.offset + offset
        return region, start, start + (size if used is None else used)

    def read(self, tensor: pb.ModelInferRequest.InferInputTensor) -> npt.NDArray[Any]:
        """An input copied out of its region: the request's own (read-only) array."""
        where = f"input '{clip(tensor.name)}'"
        region, start, end = self._place(tensor, where)
        size = end - start
        if tensor.datatype != "BYTES":
            shape = list(tensor.shape)
            if tensor.datatype and all(dim >= 0 for dim in shape):
                needed = math.prod(shape) * dtype_for(tensor.datatype).itemsize
                if needed != size:
                    raise InvalidInput(
                        f"{where}: shared_memory_byte_size is {size} but shape {shape} "
                        f"of {tensor.datatype} needs {needed} bytes"
                    )
        limit = LIMITS.max_message_size
        if self.read_bytes + size > limit:
            raise MessageTooLarge(
                f"{where} reads {size} bytes from shared-memory region '{clip(region.name)}': "
                f"with the request's other shared-memory inputs ({self.read_bytes} bytes) "
                f"that is over max_message_size ({limit} bytes)"
            )
        self.read_bytes += size
        buffer = np.empty(size, dtype=np.uint8)  # not zeroed: pread fills all of it
        with _opened(region, end) as fd:
            _pread_into(fd, buffer.data, start, region)
        if tensor.datatype != "BYTES":
            return decode_raw(tensor, buffer.data.toreadonly())
        return decode_raw(tensor, buffer.tobytes())

    def write(
        self,
        requested: pb.ModelInferRequest.InferRequestedOutputTensor,
        arr: npt.NDArray[Any],
        datatype: str,
    ) -> None:
        """An output into its region; one that does not fit is INVALID_ARGUMENT."""
        where = f"output '{clip(requested.name)}'"
        size = _int_param(requested, "shared_memory_byte_size", where)
        if datatype == "BYTES":
            data: Any = encode_raw(arr, datatype, where)
        else:  # little-endian and contiguous: copied only when it is not already
            data = np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("<")).reshape(-1)
            data = data.view(np.uint8)
        needed = len(data)
        if needed > size:
            region = requested.parameters["shared_memory_region"].string_param
            raise InvalidInput(
                f"{where} needs {needed} bytes but shared-memory region '{clip(region)}' "
                f"gives it {size} (shared_memory_byte_size)"
            )
        placed, start, end = self._place(requested, where, used=needed)
        with _opened(placed, end) as fd:
            _pwrite_from(fd, memoryview(data), start, placed)
