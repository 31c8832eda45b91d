"""Triton's shared-memory RPCs and the registry behind them.

The router owns the one registry of a ``poolserve serve`` tree (a fleet of
routers shares it through a run-dir store,
:mod:`poolserve.service.grpcserver.shm_store`); a pool
server addressed directly on its private socket and ``serve-inprocess`` each
have their own, through this same code. Registering checks what can be
checked at once: the key names an existing POSIX shared-memory object that is
the server's own regular file, not a symlink (the worker checks that again,
:func:`poolserve.service.contract.shm.open_object`), the region lies within
its current size, the name is free (ALREADY_EXISTS as Triton), and the
registry stays within its bounds (RESOURCE_EXHAUSTED). A ModelInfer that
names regions gets their registrations in front of its bytes
(:meth:`SharedMemory.attach`, the wire format in
:mod:`poolserve.service.contract.shm`): a request that does not mention
``shared_memory_region`` costs one substring search and nothing else. The
tensors themselves are never read here; the worker reads and writes them.

CUDA shared memory is not supported on CPU hosts: its register answers
UNIMPLEMENTED, its status and unregister answer OK with nothing registered
(Triton's examples call the CUDA unregister first, whatever memory they use).
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from poolserve.protos import inference_pb2 as pb
from poolserve.service.contract.errors import (
    AlreadyExists,
    InvalidInput,
    NotFound,
    QueueFull,
    ServingError,
    Unimplemented,
    clip,
    error_for,
)
from poolserve.service.contract.settings import ServerSettings
from poolserve.service.contract.shm import (
    NAME_MAX,
    Region,
    forged,
    is_wrapped,
    new_generation,
    open_object,
    wrap,
)
from poolserve.service.grpcserver.handlers import guarded

SHARED_MEMORY_REGION = "shared_memory_region"
DEFAULT_MAX_REGIONS = 1024  # the defaults of settings shm_max_regions ...
DEFAULT_MAX_NAME_LENGTH = 255  # ... and shm_max_name_length
DEFAULT_MAX_STATUS_BYTES = 64 * 1024 * 1024  # max_message_size's
_ROW_FRAMING = 48  # a Status row's tags, lengths, offset and byte_size, at most


def _status_row_bytes(name: str, key: str) -> int:
    """At most what one region adds to a SystemSharedMemoryStatus reply: its
    name twice (the map's key and the row's), its key, and the framing."""
    return (
        2 * len(name.encode(errors="surrogatepass"))
        + len(key.encode(errors="surrogatepass"))
        + _ROW_FRAMING
    )


_MENTION = SHARED_MEMORY_REGION.encode()


def _object_size(name: str, key: str) -> int:
    """The current size of the shared-memory object ``key``, opened as a worker
    will (:func:`poolserve.service.contract.shm.open_object`: no symlink, a
    regular file of the server's uid)."""
    try:
        fd, size = open_object(key)
    except ServingError as exc:
        raise error_for(
            exc.failure, f"cannot register shared-memory region '{clip(name)}': {exc.message}"
        ) from None
    os.close(fd)
    return size


class SharedMemory:
    """One server's system shared-memory registrations and the RPCs over them.

    ``accept_attached``: requests may arrive with registrations already in
    front (a pool's private socket, where only the router and the owner
    connect); elsewhere such a request is refused as malformed.

    ``max_regions`` and ``max_name_length`` bound what clients can make the
    server keep (settings ``shm_max_regions``, ``shm_max_name_length``; keys
    are file names, at most NAME_MAX bytes). ``max_status_bytes`` (the
    server's max_message_size) bounds the registry's SystemSharedMemoryStatus
    reply: a registration that would make it larger is refused, so Status for
    all regions is always answerable, whatever the other settings.
    """

    def __init__(
        self,
        accept_attached: bool = False,
        *,
        max_regions: int = DEFAULT_MAX_REGIONS,
        max_name_length: int = DEFAULT_MAX_NAME_LENGTH,
        max_status_bytes: int = DEFAULT_MAX_STATUS_BYTES,
    ) -> None:
        self.regions: dict[str, Region] = {}
        self.accept_attached = accept_attached
        self.max_regions = max_regions
        self.max_name_length = max_name_length
        self.max_status_bytes = max_status_bytes
        self.status_bytes = 0  # what Status for all regions answers, at most

    @classmethod
    def from_settings(cls, settings: ServerSettings, accept_attached: bool = False) -> SharedMemory:
        return cls(
            accept_attached,
            max_regions=settings.shm_max_regions,
            max_name_length=settings.shm_max_name_length,
            max_status_bytes=settings.max_message_size,
        )

    # -- the registry ----------------------------------------------------------

    def register(self, name: str, key: str, offset: int, byte_size: int) -> Region:
        if not name:
            raise InvalidInput("a shared-memory region needs a name")
        if len(name) > self.max_name_length:
            raise InvalidInput(
                f"shared-memory region name '{clip(name)}' is longer than "
                f"{self.max_name_length} characters (shm_max_name_length)"
            )
        if len(key) > NAME_MAX + 1:  # '/' and a file name; shm_path checks the bytes
            raise InvalidInput(
                f"cannot register shared-memory region '{clip(name)}': key '{clip(key)}' is "
                f"longer than {NAME_MAX} bytes (NAME_MAX), so it names no shared-memory object"
            )
        if name in self.regions:
            raise AlreadyExists(
                f"shared-memory region '{clip(name)}' is already registered "
                f"(key '{clip(self.regions[name].key)}'); unregister it first"
            )
        if len(self.regions) >= self.max_regions:
            raise QueueFull(
                f"cannot register shared-memory region '{clip(name)}': {len(self.regions)} "
                f"regions are registered, the most this server keeps (shm_max_regions); "
                "unregister some first"
            )
        row = _status_row_bytes(name, key)
        if self.status_bytes + row > self.max_status_bytes:
            raise QueueFull(
                f"cannot register shared-memory region '{clip(name)}': the status of all "
                f"{len(self.regions)} regions and this one would not fit one reply of "
                f"max_message_size ({self.max_status_bytes} bytes); unregister some first"
            )
        if byte_size <= 0:
            raise InvalidInput(f"shared-memory region '{clip(name)}': byte_size must be above 0")
        size = _object_size(name, key)
        if offset + byte_size > size:
            raise InvalidInput(
                f"shared-memory region '{clip(name)}': offset {offset} + byte_size {byte_size} "
                f"= {offset + byte_size} bytes exceed the {size} bytes of shared-memory "
                f"object '{clip(key)}'"
            )
        region = Region(name, key, offset, byte_size, new_generation())
        self.regions[name] = region
        self.status_bytes += row
        return region

    def unregister(self, name: str) -> None:
        """One region, or all when ``name`` is empty; an unknown name is no error (as Triton)."""
        if name:
            region = self.regions.pop(name, None)
            if region is not None:
                self.status_bytes -= _status_row_bytes(region.name, region.key)
        else:
            self.regions.clear()
            self.status_bytes = 0

    def status(self, name: str) -> list[Region]:
        if not name:
            return list(self.regions.values())
        region = self.regions.get(name)
        if region is None:
            raise NotFound(f"no shared-memory region '{clip(name)}' is registered")
        return [region]

    def lookup(self, name: str) -> Region | None:
        """The registration of ``name`` a request uses (a fleet's store: the current one)."""
        return self.regions.get(name)

    def needs_attach(self, body: memoryview, head: bytes | None) -> bool:
        """Whether :meth:`attach` has anything to do with a request received as
        a view (router/slab_sink.py): refuse it, or put registrations in front."""
        return head is None or forged(body) or _MENTION in head

    def attach(self, body: bytes, head: bytes | None = None) -> bytes:
        """The ModelInfer request with the registrations of the regions it names in front.

        ``head``: the request without its raw contents, when known (a large
        request's): searched for a region's mention instead of all the tensors."""
        if forged(body):
            if self.accept_attached and is_wrapped(body):
                return body
            raise InvalidInput("ModelInferRequest cannot be parsed: it starts with a zero byte")
        if _MENTION not in (body if head is None else head):
            return body
        request = pb.ModelInferRequest.FromString(body)
        used: dict[str, Region] = {}
        tensors: list[tuple[str, Any]] = [
            *(("input", tensor) for tensor in request.inputs),
            *(("output", tensor) for tensor in request.outputs),
        ]
        for role, tensor in tensors:
            if SHARED_MEMORY_REGION not in tensor.parameters:
                continue
            param = tensor.parameters[SHARED_MEMORY_REGION]
            if param.WhichOneof("parameter_choice") != "string_param":
                raise InvalidInput(
                    f"{role} '{clip(tensor.name)}': parameter shared_memory_region "
                    "must be a string_param"
                )
            name = param.string_param
            region = self.lookup(name)
            if region is None:
                raise InvalidInput(
                    f"{role} '{clip(tensor.name)}' names shared-memory region '{clip(name)}', "
                    "which is not registered"
                )
            used[name] = region
        return wrap(list(used.values()), body) if used else body

    # -- the RPCs --------------------------------------------------------------

    async def system_status(
        self, req: pb.SystemSharedMemoryStatusRequest, _: Any
    ) -> pb.SystemSharedMemoryStatusResponse:
        reply = pb.SystemSharedMemoryStatusResponse()
        for region in self.status(req.name):
            reply.regions[region.name].CopyFrom(
                pb.SystemSharedMemoryStatusResponse.RegionStatus(
                    name=region.name,
                    key=region.key,
                    offset=region.offset,
                    byte_size=region.byte_size,
                )
            )
        return reply

    async def system_register(
        self, req: pb.SystemSharedMemoryRegisterRequest, _: Any
    ) -> pb.SystemSharedMemoryRegisterResponse:
        self.register(req.name, req.key, req.offset, req.byte_size)
        return pb.SystemSharedMemoryRegisterResponse()

    async def system_unregister(
        self, req: pb.SystemSharedMemoryUnregisterRequest, _: Any
    ) -> pb.SystemSharedMemoryUnregisterResponse:
        self.unregister(req.name)
        return pb.SystemSharedMemoryUnregisterResponse()

    async def cuda_status(
        self, req: pb.CudaSharedMemoryStatusRequest, _: Any
    ) -> pb.CudaSharedMemoryStatusResponse:
        return pb.CudaSharedMemoryStatusResponse()

    async def cuda_register(
        self, req: pb.CudaSharedMemoryRegisterRequest, _: Any
    ) -> pb.CudaSharedMemoryRegisterResponse:
        raise Unimplemented(
            f"cannot register CUDA shared-memory region '{clip(req.name)}': CUDA shared memory "
            "is not supported on CPU hosts (use system shared memory)"
        )

    async def cuda_unregister(
        self, req: pb.CudaSharedMemoryUnregisterRequest, _: Any
    ) -> pb.CudaSharedMemoryUnregisterResponse:
        return pb.CudaSharedMemoryUnregisterResponse()

    def handlers(self) -> dict[str, grpc.RpcMethodHandler[Any, Any]]:
        """The six RPCs by method name, for a server's generic handler."""

        def unary(
            fn: Callable[[Any, Any], Awaitable[Any]], req: Any, resp: Any
        ) -> grpc.RpcMethodHandler[Any, Any]:
            return grpc.unary_unary_rpc_method_handler(
                guarded(fn),
                request_deserializer=req.FromString,
                response_serializer=resp.SerializeToString,
            )

        return {
            "SystemSharedMemoryStatus": unary(
                self.system_status,
                pb.SystemSharedMemoryStatusRequest,
                pb.SystemSharedMemoryStatusResponse,
            ),
            "SystemSharedMemoryRegister": unary(
                self.system_register,
                pb.SystemSharedMemoryRegisterRequest,
                pb.SystemSharedMemoryRegisterResponse,
            ),
            "SystemSharedMemoryUnregister": unary(
                self.system_unregister,
                pb.SystemSharedMemoryUnregisterRequest,
                pb.SystemSharedMemoryUnregisterResponse,
            ),
            "CudaSharedMemoryStatus": unary(
                self.cuda_status,
                pb.CudaSharedMemoryStatusRequest,
                pb.CudaSharedMemoryStatusResponse,
            ),
            "CudaSharedMemoryRegister": unary(
                self.cuda_register,
                pb.CudaSharedMemoryRegisterRequest,
                pb.CudaSharedMemoryRegisterResponse,
            ),
            "CudaSharedMemoryUnregister": unary(
                self.cuda_unregister,
                pb.CudaSharedMemoryUnregisterRequest,
                pb.CudaSharedMemoryUnregisterResponse,
            ),
        }
