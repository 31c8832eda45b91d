"""A fleet's shared-memory registry: one file in the run dir every router reads.

With ``routers`` above one, a client's connections may land on different
routers; a region registered through one must be usable, listed and
unregistered through any other. The registrations therefore live in
``shm-registry.json`` in the private run dir (mode 0700, the server's user
only), not in a router's memory:

- Register and Unregister take an exclusive ``flock`` on ``shm-registry.lock``,
  read the file, change it with the same checks as a single router's registry
  (:class:`~poolserve.service.grpcserver.shm.SharedMemory`: name free, bounds,
  the object opened with :func:`~poolserve.service.contract.shm.open_object`'s
  checks), and replace it at once (write a temporary file, rename);
- Status, and a ModelInfer that names a region, first compare the file's
  identity (inode, size, mtime) with what this router read last: one
  ``stat`` per such call, a re-read only when another router changed it.

Each registration keeps the random ``generation`` it got when registered, so
every router hands a worker the same one and a worker's cached mapping is
never used for a region registered again under the same name. The workers
check the object again when they map it. The supervisor removes the file
when a tree starts and when it stops: registrations do not outlive the tree
(a router that restarts in a fleet keeps them: the others still serve).
"""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Callable
from pathlib import Path

from poolserve.service.contract.rundir import SHM_REGISTRY_FILE
from poolserve.service.contract.settings import ServerSettings
from poolserve.service.contract.shm import Region
from poolserve.service.grpcserver.shm import SharedMemory, _status_row_bytes

LOCK_SUFFIX = ".lock"
_Identity = tuple[int, int, int]


class SharedStore(SharedMemory):
    """:class:`SharedMemory` whose registrations are the run dir's store."""

    def __init__(self, path: Path, **bounds: int) -> None:
        super().__init__(False, **bounds)
        self.path = path
        self.lock_path = path.with_suffix(LOCK_SUFFIX)
        self._seen: _Identity | None = None

    @classmethod
    def in_run_dir(cls, settings: ServerSettings, run_dir: Path) -> SharedStore:
        return cls(
            run_dir / SHM_REGISTRY_FILE,
            max_regions=settings.shm_max_regions,
            max_name_length=settings.shm_max_name_length,
            max_status_bytes=settings.max_message_size,
        )

    # -- reading ---------------------------------------------------------------

    def _identity(self) -> _Identity | None:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return None
        return (st.st_ino, st.st_size, st.st_mtime_ns)

    def refresh(self) -> None:
        """Re-reads the store when another router changed it since the last read."""
        seen = self._identity()
        if seen == self._seen:
            return
        regions: dict[str, Region] = {}
        if seen is not None:
            try:
                rows = json.loads(self.path.read_bytes())
            except FileNotFoundError:
                rows, seen = [], None
            for row in rows:
                region = Region(
                    str(row["name"]),
                    str(row["key"]),
                    int(row["offset"]),
                    int(row["byte_size"]),
                    int(row["generation"]),
                )
                regions[region.name] = region
        self.regions = regions
        self.status_bytes = sum(_status_row_bytes(r.name, r.key) for r in regions.values())
        self._seen = seen

    def lookup(self, name: str) -> Region | None:
        self.refresh()
        return self.regions.get(name)

    def status(self, name: str) -> list[Region]:
        self.refresh()
        return super().status(name)

    # -- changing --------------------------------------------------------------

    def _change(self, change: Callable[[], object]) -> None:
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # registers are rare and short: blocking is fine
            self._seen = None
            self.refresh()
            change()
            rows = [
                {
                    "name": r.name,
                    "key": r.key,
                    "offset": r.offset,
                    "byte_size": r.byte_size,
                    "generation": r.generation,
                }
                for r in self.regions.values()
            ]
            partial = self.path.with_suffix(f".{os.getpid()}.tmp")
            partial.write_text(json.dumps(rows))
            os.chmod(partial, 0o600)
            partial.replace(self.path)
            self._seen = self._identity()
        finally:
            os.close(fd)  # and the lock with it

    def register(self, name: str, key: str, offset: int, byte_size: int) -> Region:
        made: list[Region] = []
        self._change(lambda: made.append(SharedMemory.register(self, name, key, offset, byte_size)))
        return made[0]

    def unregister(self, name: str) -> None:
        self._change(lambda: SharedMemory.unregister(self, name))


def remove_store(run_dir: Path) -> None:
    """The supervisor's: no registration outlives its tree."""
    path = run_dir / SHM_REGISTRY_FILE
    for stale in (path, path.with_suffix(LOCK_SUFFIX)):
        stale.unlink(missing_ok=True)
