"""System shared memory: a registered region, and how a request carries the
registrations it uses to the worker that runs it.

Triton's system shared-memory extension lets a client register a POSIX
shared-memory object (``key``, ``/name`` as for ``shm_open``) with an offset
and a byte size under a region name; inputs and outputs then name a region
instead of carrying bytes. The registrations live in the router (one registry
for the whole server); a ModelInfer that names regions travels to its pool
with the registrations it names, as a small header in front of the request's
bytes (:func:`wrap`), so that the pool core keeps moving opaque bytes and the
worker maps the regions itself (:mod:`poolserve.service.inference.shm`).

The header starts with a zero byte, which no serialized protobuf message
does (field number 0 is invalid): a front door refuses a request that begins
with it (:func:`forged`), so a client never chooses what a worker maps.

Standard library only: the router and the supervisor carry no numpy.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import struct
from dataclasses import asdict, dataclass

from poolserve.service.contract.errors import InvalidInput, NotFound, clip
from poolserve.service.contract.slab import head as slab_head
from poolserve.service.contract.wire import Wire

SHM_DIR = "/dev/shm"
NAME_MAX = 255  # a key longer than a file name can be names no object
MARK = b"\x00shm1"  # a zero byte first: never the start of a protobuf message
_LENGTH = struct.Struct("<I")


@dataclass(frozen=True, slots=True)
class Region:
    """One registration: ``byte_size`` bytes at ``offset`` of the object ``key``.

    ``generation`` is unique per registration (across router restarts too):
    a worker's cached mapping is keyed by it, so an unregister and a new
    register of the same name is never served from the old mapping.
    """

    name: str
    key: str
    offset: int
    byte_size: int
    generation: int


def new_generation() -> int:
    return int.from_bytes(os.urandom(8), "little") >> 1


def shm_path(key: str) -> str:
    """The file of a POSIX shared-memory key (``/name`` or ``name``), checked
    to name one object directly under /dev/shm."""
    name = key[1:] if key.startswith("/") else key
    if not name or "/" in name or name in (".", "..") or "\x00" in name:
        raise InvalidInput(
            f"shared-memory key '{clip(key)}' is not a POSIX shared-memory name "
            "('/name', with no other '/')"
        )
    if len(name.encode(errors="surrogatepass")) > NAME_MAX:
        raise InvalidInput(
            f"shared-memory key '{clip(key)}' is longer than {NAME_MAX} bytes (NAME_MAX)"
        )
    return f"{SHM_DIR}/{name}"


# O_NOFOLLOW: /dev/shm is world-writable, so anyone can plant a symlink there
# to a file of ours; O_NONBLOCK: a FIFO or device another user made there must
# not block or wake anything when opened (the type is refused right after).
_OPEN_FLAGS = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY


def open_object(key: str) -> tuple[int, int]:
    """Opens the shared-memory object ``key`` for reading and writing as
    ``shm_open`` would, and only if it is safe to: (descriptor, current size).

    The one place that opens a client-named object: registration (the router,
    a pool's own registry) and the process that reads and writes the tensors
    (a worker, an inline pool) call it independently, so a worker never trusts
    the router's check. Refused: a symlink (it would escape /dev/shm), anything
    but a regular file, and a file owned by another uid (another local user's
    object, or one they hard-linked there). NOT_FOUND for a missing object,
    INVALID_ARGUMENT otherwise; the message names the key, the caller says what
    it was doing.
    """
    path = shm_path(key)
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except OSError as exc:
        reason = exc.strerror or str(exc)
        if exc.errno == errno.ENOENT:
            raise NotFound(f"no shared-memory object '{clip(key)}' ({path}: {reason})") from None
        if exc.errno == errno.ELOOP:  # what O_NOFOLLOW answers for a symlink
            raise InvalidInput(
                f"shared-memory object '{clip(key)}' is a symbolic link ({path}); "
                "refused: it could point anywhere"
            ) from None
        raise InvalidInput(
            f"cannot open shared-memory object '{clip(key)}' for reading and writing: {reason}"
        ) from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise InvalidInput(
                f"shared-memory object '{clip(key)}' is not a regular file ({path}); refused"
            )
        if info.st_uid != os.geteuid():
            raise InvalidInput(
                f"shared-memory object '{clip(key)}' is owned by uid {info.st_uid}, not by "
                f"the server's uid {os.geteuid()} ({path}); refused: create it as that user"
            )
    except BaseException:
        os.close(fd)
        raise
    return fd, info.st_size


def wrap(regions: list[Region], request: bytes) -> bytes:
    """The request with the registrations it uses in front (see the module doc)."""
    table = json.dumps([asdict(region) for region in regions], separators=(",", ":")).encode()
    return MARK + _LENGTH.pack(len(table)) + table + request


def is_wrapped(data: Wire) -> bool:
    return data[: len(MARK)] == MARK


def forged(data: Wire) -> bool:
    """Whether a request from a client starts as only :func:`wrap` may."""
    return data[:1] == MARK[:1]


def unwrap(data: Wire) -> tuple[dict[str, Region], Wire]:
    """The registrations by name and the request; ``({}, data)`` when not wrapped.

    A request in a router's slab (:mod:`poolserve.service.contract.slab`) is
    its head here: what the pool peeks at."""
    if data[:1] == MARK[:1] and not is_wrapped(data):
        return {}, slab_head(data)
    if not is_wrapped(data):
        return {}, data
    start = len(MARK) + _LENGTH.size
    if len(data) < start:
        raise InvalidInput("the shared-memory registrations in front of the request are cut short")
    (size,) = _LENGTH.unpack_from(data, len(MARK))
    if len(data) < start + size:
        raise InvalidInput("the shared-memory registrations in front of the request are cut short")
    try:
        rows = json.loads(bytes(data[start : start + size]))
        if not isinstance(rows, list):
            raise TypeError("the table is not a list")
        regions = {row["name"]: Region(**row) for row in rows}
        for region in regions.values():
            for value, kind in ((region.name, str), (region.key, str), (region.offset, int),
                                (region.byte_size, int), (region.generation, int)):  # fmt: skip
                if not isinstance(value, kind) or isinstance(value, bool):
                    raise TypeError(f"{value!r} is not {kind.__name__}")
    except (ValueError, TypeError, KeyError) as exc:
        raise InvalidInput(
            "the shared-memory registrations in front of the request are malformed: "
            + clip(str(exc))
        ) from None
    return regions, data[start + size :]
