"""The private run directory: where internal sockets live, and who may use them.

A run_dir belongs to one live tree. ``poolserve serve`` takes an exclusive
flock on :data:`LOCK_FILE` before it touches anything in the directory and
holds it for its life (the descriptor is close-on-exec, so no child keeps
it); a second tree that cannot take it refuses to start and removes nothing.
``poolserve pool`` and ``poolserve router`` started alone (supervisord's flat
layout) hold the same file with a *shared* lock, so they coexist with each
other and keep any ``serve`` tree out. Whoever binds a socket first checks
that no live process answers on its path (a connect), removes it only when it
is stale, and at the end removes only the socket it bound itself.

Light to import on purpose: the supervisor and the router need these names,
and must not pay for the pool's imports (numpy, models) in their memory.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
import stat
import time
from collections.abc import Iterable
from pathlib import Path
from types import TracebackType

from poolserve.service.contract.settings import ConfigError

MAX_UNIX_PATH = 107  # bytes of sun_path, without its terminating NUL
ADDRESS_FILE = "router.addr"  # host:port the router bound (useful with --grpc-port 0)
METRICS_ADDRESS_FILE = "metrics.addr"  # host:port of the router's /metrics (metrics_port)
HTTP_ADDRESS_FILE = "http.addr"  # host:port of the router's HTTP/REST door (http_port)
ROUTER_CONTROL_SOCKET = "router-control.sock"  # RouterControl for the supervisor only
SHM_REGISTRY_FILE = (
    "shm-registry.json"  # a fleet's shared-memory registrations (grpcserver/shm_store)
)
CONTROL_SOCKET = "supervisor.sock"  # SupervisorControl (supervisor/control.py serves it)
LOCK_FILE = "poolserve.lock"  # flock: who owns this run_dir; holds the owner's pid
CLAIM_WAIT_S = 2.0  # a socket still answering after this long belongs to a live process
_CLAIM_POLL_S = 0.05

# A file's identity, to remove at the end only what we created.
FileId = tuple[int, int]


class SocketInUse(Exception):
    """A socket path that a live process serves, or that is not a socket."""

    def __init__(self, path: Path, problem: str) -> None:
        super().__init__(f"{path}: {problem}; refusing to remove it")
        self.path = path


def socket_path(run_dir: Path, name: str) -> Path:
    """``run_dir/name``, or ConfigError (naming run_dir) when a unix socket cannot have it."""
    path = run_dir / name
    size = len(os.fsencode(path))
    if size > MAX_UNIX_PATH:
        raise ConfigError(
            str(run_dir),
            "run_dir",
            f"the socket path {path} is {size} bytes, longer than the {MAX_UNIX_PATH} "
            "a unix socket allows: choose a shorter run_dir",
        )
    return path


def router_control_socket(index: int) -> str:
    """The private control socket of router ``index`` of the fleet (0: the first,
    the one a tree of one router has)."""
    return ROUTER_CONTROL_SOCKET if index == 0 else f"router-control-{index}.sock"


def pool_socket_path(run_dir: Path, gid: str) -> Path:
    # The lane (pool-<gid>.lane) has the same length: one check covers both.
    return socket_path(run_dir, f"pool-{gid}.sock")


def check_socket_paths(run_dir: Path, gids: Iterable[str], routers: int = 1) -> None:
    """Every socket a tree over these pools and routers binds fits in a unix socket path."""
    for name in (CONTROL_SOCKET, ROUTER_CONTROL_SOCKET, router_control_socket(routers - 1)):
        socket_path(run_dir, name)
    for gid in gids:
        pool_socket_path(run_dir, gid)


# -- the directory ------------------------------------------------------------


def ensure_private_dir(path: Path) -> None:
    """The run directory holds our sockets: ours alone, mode 0700, never a symlink.

    Creates it (0700) when missing. An existing one is checked, never fixed,
    as ssh-agent checks its socket directory: a symbolic link, a directory
    of another user, or one that group or others can enter may have been
    prepared by someone else (another user creating ``/tmp/poolserve-UID-PORT``
    first), so it is refused with ConfigError rather than followed or chmod-ed.
    """
    if not os.path.lexists(path):
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(FileExistsError):  # made meanwhile: checked below
                os.mkdir(path, 0o700)
        except OSError as exc:
            raise ConfigError(str(path), "run_dir", f"cannot create it: {exc}") from None
    try:
        info = os.lstat(path)
    except OSError as exc:
        raise ConfigError(str(path), "run_dir", f"cannot read it: {exc.strerror}") from None
    if stat.S_ISLNK(info.st_mode):
        raise ConfigError(
            str(path), "run_dir", "is a symbolic link; refusing to follow it (name the real path)"
        )
    if not stat.S_ISDIR(info.st_mode):
        raise ConfigError(str(path), "run_dir", "exists and is not a directory")
    if info.st_uid != os.getuid():
        raise ConfigError(
            str(path), "run_dir", f"owned by another user (uid {info.st_uid}); refusing to use it"
        )
    mode = stat.S_IMODE(info.st_mode)
    if mode & 0o077:
        raise ConfigError(
            str(path),
            "run_dir",
            f"mode {mode:04o} lets other users in (it must be 0700); refusing to use it: "
            "remove it or chmod 700 it",
        )


class RunDirLock:
    """The lock on a run_dir's :data:`LOCK_FILE`, held while the descriptor is open.

    The descriptor is close-on-exec: processes started with exec never hold
    it. A process that forks without exec (the pool's zygote) must close it
    in the child (:attr:`fd`).
    """

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self.fd = fd

    @staticmethod
    def held(run_dir: Path) -> bool:
        """Whether a live tree holds ``run_dir`` now (creates nothing)."""
        try:
            fd = os.open(run_dir / LOCK_FILE, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)
        return False

    @classmethod
    def take(cls, run_dir: Path) -> RunDirLock:
        """The exclusive lock of ``poolserve serve``; ConfigError naming the holder if taken."""
        path = run_dir / LOCK_FILE
        fd = _open_lock(path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holders = lock_holders(path, fd)
            os.close(fd)
            raise ConfigError(str(run_dir), "run_dir", _in_use(path, holders)) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return cls(path, fd)

    @classmethod
    def share(cls, run_dir: Path) -> RunDirLock | None:
        """For ``poolserve pool`` and ``router``: None under a ``serve`` tree (our
        parent holds the lock); started alone, a shared lock that keeps any
        ``serve`` tree out while we run. ConfigError when another tree owns it."""
        path = run_dir / LOCK_FILE
        fd = _open_lock(path)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            holders = lock_holders(path, fd)
            os.close(fd)
            if os.getppid() in holders:
                return None  # our own tree's supervisor
            raise ConfigError(str(run_dir), "run_dir", _in_use(path, holders)) from None
        return cls(path, fd)

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> RunDirLock:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()


def _open_lock(path: Path) -> int:
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        return os.open(path, flags, 0o600)
    except OSError as exc:
        raise ConfigError(
            str(path.parent), "run_dir", f"cannot open its lock file {path}: {exc.strerror}"
        ) from None


def _in_use(path: Path, holders: list[int]) -> str:
    who = ", ".join(str(pid) for pid in holders) if holders else "unknown"
    return (
        f"in use by another poolserve (pid {who}, holding {path}); a run_dir belongs to "
        "one server: stop that one, or give this one its own --run-dir"
    )


def lock_holders(path: Path, fd: int) -> list[int]:
    """The pids holding a flock on the file open at ``fd``: from /proc/locks, else
    the pid the holder wrote into the file."""
    info = os.fstat(fd)
    wanted = (os.major(info.st_dev), os.minor(info.st_dev), info.st_ino)
    holders: list[int] = []
    with contextlib.suppress(OSError):
        for line in Path("/proc/locks").read_text().splitlines():
            cols = line.split()
            if len(cols) < 6 or cols[1] != "FLOCK":  # "->" marks a waiter, not a holder
                continue
            with contextlib.suppress(ValueError):
                major, minor, inode = cols[5].split(":")
                if (int(major, 16), int(minor, 16), int(inode)) == wanted:
                    holders.append(int(cols[4]))
    if holders:
        return sorted(set(holders))
    with contextlib.suppress(OSError, ValueError):
        return [int(os.pread(fd, 32, 0).decode().strip())]
    return []


# -- sockets ------------------------------------------------------------------


def socket_answers(path: Path) -> bool:
    """Whether a process listens on the unix socket at ``path`` (a connect, nothing sent)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.setblocking(False)
        try:
            probe.connect(str(path))
        except BlockingIOError:
            return True  # its backlog is full: someone listens, and is busy
        except OSError as exc:
            if exc.errno in (errno.ECONNREFUSED, errno.ENOENT):
                return False
            raise
        return True


def claim_socket(path: Path, wait_s: float = 0.0) -> None:
    """Makes way for a unix socket we are about to bind at ``path``.

    A stale socket (nobody listens) is removed; a live one, or anything that
    is not a socket, raises SocketInUse. A socket that still answers is given
    ``wait_s`` to go away (a process of a tree that just died).
    """
    deadline = time.monotonic() + wait_s
    while True:
        try:
            info = os.lstat(path)
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(info.st_mode):
            raise SocketInUse(path, "exists and is not a socket")
        try:
            live = socket_answers(path)
        except OSError as exc:
            raise SocketInUse(path, f"cannot check who serves it: {exc.strerror}") from None
        if not live:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            return
        if time.monotonic() >= deadline:
            raise SocketInUse(path, "a live process serves this socket")
        time.sleep(_CLAIM_POLL_S)


def file_id(path: Path) -> FileId | None:
    try:
        info = os.lstat(path)
    except OSError:
        return None
    return (info.st_dev, info.st_ino)


def remove_own(path: Path, identity: FileId | None) -> None:
    """Removes ``path`` if it is still the file we created (``identity``)."""
    if identity is not None and file_id(path) == identity:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def sweep_stale_sockets(run_dir: Path) -> list[str]:
    """Removes the sockets nobody serves (a tree that died); only the lock holder calls it."""
    removed = []
    for entry in sorted(run_dir.iterdir()):
        with contextlib.suppress(OSError):
            if stat.S_ISSOCK(entry.lstat().st_mode) and not socket_answers(entry):
                entry.unlink()
                removed.append(entry.name)
    return removed
