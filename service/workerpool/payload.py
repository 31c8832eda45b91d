"""Python objects on the wire of a WorkerPool: pickle protocol 5, large buffers in shared memory.

Arguments and results are pickled with protocol 5 and out-of-band buffers,
so a numpy array (or anything else exposing a ``PickleBuffer``) is never
copied into the pickle stream. Each out-of-band buffer then travels one of
two ways:

- smaller than the threshold (:data:`SHM_THRESHOLD`, 1 MiB by default): inline,
  after the pickle, in the same frame over the worker's socket;
- at or above it: in a file of its own in the pool's *segment directory*, a
  private (0700) folder on ``/dev/shm`` (tmpfs: memory, not disk). The sender
  writes the buffer once; the receiver maps it copy-on-write (``MAP_PRIVATE``),
  so a 100 MB array costs one copy instead of four through the socket, and
  the array it gets is writable.

Why files and not ``multiprocessing.shared_memory``: its resource tracker (a
helper process, up to Python 3.12) unlinks segments that another process
created and warns about "leaked" ones at exit; a segment handed between a
host and its workers is exactly that case. Why not memfd with SCM_RIGHTS:
the pool core moves opaque bytes between the dispatcher and a worker over a
stream that carries no descriptors, and the dispatcher picks the worker only
when the job starts.

Who removes a segment: a request's segments are unlinked by the caller when
its call ends (a retried call on another worker still finds them); a result's
segments by the receiver right after mapping them. A result whose caller has
gone away is swept by the pool (:meth:`SegmentDir.sweep`); the whole folder
goes when the pool closes, or when the zygote sees its host die.

``POOLSERVE_SHM_DIR`` (or WorkerPool's ``shm_dir``) moves the folder, e.g.
where ``/dev/shm`` is small (Docker's default is 64 MB). A buffer that does
not fit (ENOSPC) falls back to inline.

Layout of an encoded payload (little-endian)::

    u32 pickle length | u32 buffer count
    per buffer: u8 place (0 inline, 1 segment) | u64 size | u16 name length | name
    pickle bytes | inline buffers, back to back
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import pickle
import secrets
import shutil
import struct
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SHM_THRESHOLD = 1 << 20
SHM_DIR_ENV = "POOLSERVE_SHM_DIR"

_HEAD = struct.Struct("<II")
_BUFFER = struct.Struct("<BQH")
INLINE = 0
SEGMENT = 1
_NO_ROOM = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


class PayloadError(Exception):
    """A payload is malformed, or one of its segments is missing or short."""


def default_base() -> Path:
    """Where segment folders go: $POOLSERVE_SHM_DIR, else /dev/shm, else the temp dir."""
    configured = os.environ.get(SHM_DIR_ENV)
    if configured:
        return Path(configured)
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK | os.X_OK):
        return shm
    return Path(tempfile.gettempdir())


@dataclass
class SegmentDir:
    """One pool's private folder of shared-memory segments."""

    path: Path
    threshold: int = SHM_THRESHOLD
    written: int = 0  # segments written by this process (statistics)

    @classmethod
    def create(cls, base: Path | None = None, threshold: int = SHM_THRESHOLD) -> SegmentDir:
        root = base or default_base()
        path = root / f"poolserve-{os.getpid()}-{secrets.token_hex(6)}"
        path.mkdir(mode=0o700)
        return cls(path, threshold)

    def write(self, name: str, buffer: memoryview) -> bool:
        """Writes one segment; False when there is no room (the caller inlines it)."""
        target = self.path / name
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            view = buffer
            while view:
                view = view[os.write(fd, view) :]
        except OSError as exc:
            target.unlink(missing_ok=True)
            if exc.errno in _NO_ROOM:
                return False
            raise
        finally:
            os.close(fd)
        self.written += 1
        return True

    def map(self, name: str, size: int, unlink: bool) -> memoryview:
        """Maps one segment privately (copy-on-write: writable, never written back)."""
        target = self.path / name
        try:
            fd = os.open(target, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise PayloadError(f"shared-memory segment {name} is gone") from None
        try:
            actual = os.fstat(fd).st_size
            if actual != size:  # mapping past the end would be SIGBUS on access
                raise PayloadError(f"shared-memory segment {name} holds {actual} of {size} bytes")
            mapped = mmap.mmap(
                fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE
            )
        finally:
            os.close(fd)
            if unlink:
                target.unlink(missing_ok=True)
        return memoryview(mapped)

    def unlink(self, names: list[str]) -> None:
        for name in names:
            with contextlib.suppress(OSError):
                os.unlink(self.path / name)

    def sweep(self, keep: Callable[[str], bool]) -> int:
        """Unlinks every segment that ``keep`` rejects; returns how many."""
        removed = 0
        try:
            entries = list(os.scandir(self.path))
        except OSError:
            return 0
        for entry in entries:
            if not keep(entry.name):
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)
                    removed += 1
        return removed

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


@dataclass
class Encoded:
    data: bytes
    segments: list[str] = field(default_factory=list)  # written for this payload
    segment_bytes: int = 0


def dumps(
    obj: Any, segments: SegmentDir | None = None, prefix: str = "", head: bytes = b""
) -> Encoded:
    """Pickles ``obj``; large out-of-band buffers go to ``segments`` as ``{prefix}{i}``.

    ``head`` is put in front of the payload in the same single copy (a caller's
    own header, such as the model name of a call).
    """
    buffers: list[pickle.PickleBuffer] = []
    stream = pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
    encoded = Encoded(b"")
    table: list[bytes] = []
    inline: list[memoryview] = []
    try:
        for i, buffer in enumerate(buffers):
            raw = buffer.raw()  # contiguous bytes (PickleBuffer guarantees C or F order)
            name = f"{prefix}{i}"
            if (
                segments is not None
                and raw.nbytes
                and raw.nbytes >= segments.threshold
                and segments.write(name, raw)
            ):
                encoded.segments.append(name)
                encoded.segment_bytes += raw.nbytes
                key = name.encode()
                table.append(_BUFFER.pack(SEGMENT, raw.nbytes, len(key)) + key)
            else:
                inline.append(raw)
                table.append(_BUFFER.pack(INLINE, raw.nbytes, 0))
    except BaseException:
        if segments is not None:
            segments.unlink(encoded.segments)
        raise
    encoded.data = b"".join([head, _HEAD.pack(len(stream), len(buffers)), *table, stream, *inline])
    return encoded


def loads(
    data: bytes | memoryview, segments: SegmentDir | None = None, unlink: bool = False
) -> Any:
    """Unpickles a payload; ``unlink`` removes its segments once mapped (results)."""
    view = memoryview(data)
    try:
        size, count = _HEAD.unpack_from(view)
        pos = _HEAD.size
        places: list[tuple[int, int, str]] = []
        for _ in range(count):
            place, nbytes, name_len = _BUFFER.unpack_from(view, pos)
            pos += _BUFFER.size
            name = bytes(view[pos : pos + name_len]).decode()
            pos += name_len
            places.append((place, nbytes, name))
    except (struct.error, UnicodeDecodeError) as exc:
        raise PayloadError(f"malformed payload header: {exc}") from None
    stream = view[pos : pos + size]
    pos += size
    inline_total = sum(n for place, n, _ in places if place == INLINE)
    if len(stream) != size or len(view) - pos != inline_total:
        raise PayloadError("payload is shorter or longer than its header says")
    # One copy of the small buffers, so the objects built on them are writable.
    inline = memoryview(bytearray(view[pos:]))
    buffers: list[memoryview] = []
    offset = 0
    try:
        for place, nbytes, name in places:
            if place == SEGMENT:
                if segments is None:
                    raise PayloadError(f"payload names segment {name} but no segment folder")
                buffers.append(segments.map(name, nbytes, unlink))
            else:
                buffers.append(inline[offset : offset + nbytes])
                offset += nbytes
    finally:
        if unlink and segments is not None:
            segments.unlink([name for place, _, name in places if place == SEGMENT])
    return pickle.loads(stream, buffers=buffers)
