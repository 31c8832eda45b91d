"""Large request bodies through shared memory: the router's slabs (issue 20 §4).

A ModelInfer body larger than :data:`THRESHOLD` does not travel through the
sockets (router -> pool lane, pool -> worker, and back: four hops, eight
kernel copies). The router writes it once into a *slab*, an anonymous shared
memory file of its own (``memfd_create``, named ``poolserve-slab-<pid>-<random>-<n>``),
and the INFER frame carries an *envelope* instead (:func:`envelope`):
:data:`MARK`, a :class:`Ref` (the slab's name, the router's pid and the
slab's descriptor number there, the request's length, where the reply area
starts and its capacity), then the request's *head*: its bytes without
``raw_input_contents`` (a few hundred bytes), so that the pool still reads
the model name, scheduling, sequence and batching fields as before
(:func:`head`). The pool core relays the envelope as opaque bytes.

The worker that runs the request opens the slab as ``/proc/<pid>/fd/<fd>``
and checks that what it opened is that slab (its memfd name: names are never
reused, descriptor numbers are), maps it once and keeps the mapping
(:class:`Mapper`), takes the request as a read-only view of it (zero copy)
and, when its reply fits the reply area, writes the reply there and answers
a REPLY whose body is :func:`reply_ref` (:data:`REPLY_MARK` and the length);
otherwise the reply goes inline as before. Both marks start with a zero
byte, which no serialized protobuf message does; a client request starting
with one is refused at the router (``contract.shm.forged``), so only the
router names slabs.

Ownership (:class:`Arena`, in the router): a slab is leased for one call and
goes back to the free list only when the worker's REPLY has come back (the
worker is done with it). Any other end (an ERROR, which the pool may send
while a worker still runs the job; a cancel; the router's own deadline; the
lane lost) *retires* it: the router closes it and never reuses it, so a late
reader still sees the bytes it was given and nobody else's. A memfd has no
name in any directory: two routers (sharing a run directory or not) cannot
see each other's slabs, and the kernel frees a slab's memory when its last
descriptor and mapping are gone, a SIGKILLed router's included: nothing to
clean up after a crash.

Standard library only: the router and the pool core both use it.
"""

from __future__ import annotations

import asyncio
import contextlib
import mmap
import os
import struct
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from poolserve.service.contract.errors import InvalidInput, Unavailable, clip
from poolserve.service.contract.wire import Wire, read_varint
from poolserve.service.contract.worker_limits import LIMITS

THRESHOLD = 64 * 1024  # a larger ModelInfer body goes through a slab ...
MAX_BODY = 16 * 1024 * 1024  # ... up to this size, and a reply area never takes more:
# beyond, a slab would double what the router holds per call in flight (gRPC's
# bytes and the slab's pages) and keep it idle after; such bodies go inline
PREFIX = "poolserve-slab-"
MARK = b"\x00slab1"  # an INFER body that is an envelope
REPLY_MARK = b"\x00slabr"  # a REPLY body that says: the reply is in the slab
_REF = struct.Struct("<BIIQQQ")  # name length, pid, fd, request length, reply offset and capacity
_LENGTH = struct.Struct("<Q")
ALIGN = 4096  # the reply area starts on a page
MIN_SLAB = 1 << 20  # slab sizes are powers of two from 1 MiB
MAX_SLABS = 64  # leased and idle together, per router; beyond, a body goes inline
IDLE_BYTES = 512 << 20  # idle slabs kept, by their sizes (what is touched stays in memory)
IDLE_S = 2.0  # an idle slab not leased again for this long is closed (1 to 2 times it)
MAPPED = 64  # slabs a worker keeps mapped (least recently used dropped first) ...
# ... and their sizes together: setting slab_mapped_bytes (512 MiB), in
# worker_limits.LIMITS (a retired slab's memory is held until its last mapping goes)
_RAW_INPUT_TAG = (7 << 3) | 2  # ModelInferRequest.raw_input_contents


@dataclass(frozen=True, slots=True)
class Ref:
    """Where a request is: ``length`` bytes at the start of slab ``name``
    (descriptor ``fd`` of process ``pid``, the router); its reply may take
    ``reply_capacity`` bytes from ``reply_at``."""

    name: str
    pid: int
    fd: int
    length: int
    reply_at: int
    reply_capacity: int


def envelope(ref: Ref, head: bytes) -> bytes:
    name = ref.name.encode()
    fields = (len(name), ref.pid, ref.fd, ref.length, ref.reply_at, ref.reply_capacity)
    return MARK + _REF.pack(*fields) + name + head


def is_enveloped(data: Wire) -> bool:
    return data[: len(MARK)] == MARK


def parse(data: Wire) -> tuple[Ref, Wire]:
    """(the reference, the head) of an envelope; InvalidInput when malformed."""
    start = len(MARK) + _REF.size
    if len(data) < start:
        raise InvalidInput("the slab reference in front of the request is cut short")
    size, pid, fd, length, reply_at, capacity = _REF.unpack_from(data, len(MARK))
    if len(data) < start + size:
        raise InvalidInput("the slab reference in front of the request is cut short")
    name = bytes(data[start : start + size]).decode("ascii", "replace")
    return Ref(name, pid, fd, length, reply_at, capacity), data[start + size :]


def head(data: Wire) -> Wire:
    """The request to peek at: an envelope's head, anything else as it is."""
    return parse(data)[1] if is_enveloped(data) else data


def without_raw_inputs(data: Wire) -> bytes | None:
    """A request's bytes without its ``raw_input_contents`` entries (top level
    walked, payloads jumped over); None when the bytes are malformed (the
    request then goes inline, and the worker says what is wrong)."""
    kept: list[Wire] = []
    pos, end, since = 0, len(data), 0
    try:
        while pos < end:
            field = pos
            key, pos = read_varint(data, pos)
            wire_type = key & 7
            if wire_type == 0:
                _, pos = read_varint(data, pos)
            elif wire_type == 1:
                pos += 8
            elif wire_type == 5:
                pos += 4
            elif wire_type == 2:
                size, pos = read_varint(data, pos)
                pos += size
                if key == _RAW_INPUT_TAG:
                    kept.append(data[since:field])
                    since = pos
            else:
                return None
    except InvalidInput:
        return None
    if pos != end:
        return None
    kept.append(data[since:end])
    return b"".join(kept)


def reply_ref(length: int) -> bytes:
    return REPLY_MARK + _LENGTH.pack(length)


def reply_length(data: Wire) -> int | None:
    """The length of a reply written into the slab, or None for an inline reply."""
    if len(data) != len(REPLY_MARK) + _LENGTH.size or data[: len(REPLY_MARK)] != REPLY_MARK:
        return None
    return int(_LENGTH.unpack_from(data, len(REPLY_MARK))[0])


def _size_for(nbytes: int) -> int:
    size = MIN_SLAB
    while size < nbytes:
        size <<= 1
    return size


class Slab:
    """One memfd of the arena, mapped in the router."""

    __slots__ = ("fd", "idle_at", "map", "name", "size", "view")

    def __init__(self, name: str, size: int) -> None:
        self.idle_at = 0.0  # when it was last freed (monotonic)
        self.fd = os.memfd_create(name, os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, size)
            self.map = mmap.mmap(self.fd, size)
        except BaseException:
            os.close(self.fd)
            raise
        self.name = name
        self.size = size
        self.view = memoryview(self.map)

    @property
    def closed(self) -> bool:
        return self.fd < 0

    def close(self) -> None:
        """Closes the router's descriptor and mapping (once): the memory goes
        when the last worker mapping it lets go (nobody can open it any more)."""
        if self.fd < 0:
            return
        self.view.release()
        with contextlib.suppress(BufferError):
            self.map.close()
        fd, self.fd = self.fd, -1
        os.close(fd)


UNREACHABLE = "cannot be opened"  # in a worker's error: it cannot map the router's slabs


class Arena:
    """The router's slabs: leased per call, freed on the worker's REPLY,
    retired (closed, never reused) on any other end.

    A freed slab waits idle for the next call of its size; one not leased
    again within ``idle_s`` is closed (:meth:`age`, on a timer of the running
    loop), so the memory of a burst goes back a few seconds after it,
    whatever the router's load and however late its last replies come,
    while steady traffic reuses its slabs (the most recently freed first).
    """

    def __init__(
        self, max_reply: int, idle_s: float = IDLE_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.idle_s = idle_s
        self.clock = clock
        self._aging: asyncio.TimerHandle | None = None
        self.max_reply = max_reply  # a reply area never takes more (max_message_size)
        self.pid = os.getpid()
        self.stem = f"{PREFIX}{self.pid}-{os.urandom(6).hex()}-"
        self._count = 0
        self.idle: dict[int, list[Slab]] = {}
        self.leased: set[Slab] = set()
        self.idle_bytes = 0
        self.closed = False
        self.disabled = ""  # why slabs are not used (a worker cannot open them)

    def lease(self, length: int, reply_capacity: int) -> tuple[Slab, Ref] | None:
        """A slab for a request of ``length`` bytes and a reply of up to
        ``reply_capacity``; None when the arena is full or shm cannot be had."""
        if self.closed or self.disabled:
            return None
        reply_at = -(-length // ALIGN) * ALIGN
        reply_capacity = min(reply_capacity, self.max_reply)
        size = _size_for(reply_at + reply_capacity)
        free = self.idle.get(size)
        if free:
            slab = free.pop()
            self.idle_bytes -= slab.size
        else:
            if len(self.leased) + sum(map(len, self.idle.values())) >= MAX_SLABS:
                return None
            self._count += 1
            try:
                slab = Slab(f"{self.stem}{self._count}", size)
            except OSError:
                return None  # no memory for it: the body goes inline
        self.leased.add(slab)
        capacity = min(slab.size - reply_at, self.max_reply)
        return slab, Ref(slab.name, self.pid, slab.fd, length, reply_at, capacity)

    def free(self, slab: Slab) -> None:
        """The worker is done with it (its REPLY came back): reusable, for
        ``idle_s`` (see the class)."""
        self.leased.discard(slab)
        if self.closed or self.disabled or self.idle_bytes + slab.size > IDLE_BYTES:
            slab.close()
            return
        slab.idle_at = self.clock()
        self.idle.setdefault(slab.size, []).append(slab)
        self.idle_bytes += slab.size
        if self._aging is None:
            with contextlib.suppress(RuntimeError):  # no running loop: age() by hand
                loop = asyncio.get_running_loop()
                self._aging = loop.call_later(self.idle_s, self.age)

    def age(self) -> None:
        """Closes the slabs idle for ``idle_s`` or longer; looks again in
        ``idle_s`` while some are still idle."""
        self._aging = None
        stale = self.clock() - self.idle_s
        for size, free in list(self.idle.items()):
            kept = []
            for slab in free:
                if slab.idle_at > stale:
                    kept.append(slab)
                else:
                    slab.close()
                    self.idle_bytes -= slab.size
            if kept:
                self.idle[size] = kept
            else:
                del self.idle[size]
        if self.idle and not self.closed:
            with contextlib.suppress(RuntimeError):
                self._aging = asyncio.get_running_loop().call_later(self.idle_s, self.age)

    def drop_idle(self) -> None:
        """Closes the idle slabs now (their memory goes back)."""
        for slab in [s for free in self.idle.values() for s in free]:
            slab.close()
        self.idle.clear()
        self.idle_bytes = 0

    def retire(self, slab: Slab) -> None:
        """Someone may still read it: closed here, never reused."""
        self.leased.discard(slab)
        slab.close()

    def disable(self, why: str) -> None:
        """No more slabs: every body goes inline from now on (the idle ones closed)."""
        self.disabled = why
        self.drop_idle()

    def close(self) -> None:
        """Closes every slab (at the router's stop)."""
        self.closed = True
        if self._aging is not None:
            self._aging.cancel()
            self._aging = None
        for slab in [*self.leased, *(s for free in self.idle.values() for s in free)]:
            slab.close()
        self.leased.clear()
        self.idle.clear()
        self.idle_bytes = 0


class Mapper:
    """A worker's (or an inline pool's) mappings of the router's slabs, by name.

    A slab is mapped once and kept (the router reuses its slabs); the least
    recently used beyond :data:`MAPPED` slabs or ``slab_mapped_bytes`` is
    dropped (a retired slab's memory goes once nothing maps it).
    """

    def __init__(self) -> None:
        self._maps: OrderedDict[str, memoryview] = OrderedDict()
        self.mapped_bytes = 0

    def view(self, ref: Ref) -> memoryview:
        """The whole slab, writable (the reply goes there)."""
        name = ref.name
        if not name.startswith(PREFIX) or "/" in name or "\x00" in name:
            raise InvalidInput(f"'{clip(name)}' is not a poolserve slab")
        view = self._maps.get(name)
        if view is None:
            view = _open(ref)
            self._maps[name] = view
            self.mapped_bytes += len(view)
            while len(self._maps) > 1 and (
                len(self._maps) > MAPPED or self.mapped_bytes > LIMITS.slab_mapped_bytes
            ):
                _, dropped = self._maps.popitem(last=False)  # unmapped when its last view goes
                self.mapped_bytes -= len(dropped)
        else:
            self._maps.move_to_end(name)
        if ref.length > ref.reply_at or ref.reply_at + ref.reply_capacity > len(view):
            raise InvalidInput(f"slab '{clip(name)}' is smaller than its reference says")
        return view

    def request(self, ref: Ref) -> memoryview:
        """The request's bytes, a read-only view of the slab."""
        return self.view(ref)[: ref.length].toreadonly()

    def __len__(self) -> int:
        return len(self._maps)


def _open(ref: Ref) -> memoryview:
    """Maps the router's memfd through /proc, after checking that the
    descriptor opened is that very slab (a descriptor number is reused)."""
    try:
        fd = os.open(f"/proc/{ref.pid}/fd/{ref.fd}", os.O_RDWR)
    except OSError as exc:
        raise Unavailable(
            f"slab '{clip(ref.name)}' {UNREACHABLE}: {exc.strerror}", stage="worker"
        ) from None
    try:
        if os.readlink(f"/proc/self/fd/{fd}") != f"/memfd:{ref.name} (deleted)":
            raise InvalidInput(f"slab '{clip(ref.name)}' is gone")
        size = os.fstat(fd).st_size
        return memoryview(mmap.mmap(fd, size)) if size else memoryview(b"")
    finally:
        os.close(fd)
