"""The private run directory: where internal sockets live, and who may use them.

Light to import on purpose: the supervisor and the router need these names,
and must not pay for the pool's imports (numpy, models) in their memory.
"""

from __future__ import annotations

import logging
import os
import stat
import sys
from pathlib import Path

import grpc

from poolserve.service.settings import ConfigError

MAX_UNIX_PATH = 107
ADDRESS_FILE = "router.addr"  # host:port the router bound (useful with --grpc-port 0)
ROUTER_CONTROL_SOCKET = "router-control.sock"  # RouterControl for the supervisor only


def pool_socket_path(run_dir: Path, gid: str) -> Path:
    path = run_dir / f"pool-{gid}.sock"
    if len(str(path)) > MAX_UNIX_PATH:
        raise ValueError(f"socket path {path} is longer than {MAX_UNIX_PATH} bytes")
    return path


def bind_private_unix(server: grpc.aio.Server, path: Path) -> None:
    """Binds with a umask so the socket is 0600 from its first instant."""
    path.unlink(missing_ok=True)
    old = os.umask(0o177)
    try:
        server.add_insecure_port(f"unix:{path}")
    finally:
        os.umask(old)


def ensure_private_dir(path: Path) -> None:
    """The run directory holds our sockets: ours alone, mode 0700."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = path.stat()
    if info.st_uid != os.getuid():
        raise ConfigError(str(path), "run_dir", "owned by another user")
    if stat.S_IMODE(info.st_mode) != 0o700:
        path.chmod(0o700)


def setup_logging(role: str, log_format: str = "text") -> None:
    if log_format == "json":
        fmt = (
            '{"ts": "%(asctime)s", "level": "%(levelname)s", "role": "' + role + '", '
            '"pid": %(process)d, "msg": "%(message)s"}'
        )
    else:
        fmt = f"%(asctime)s %(levelname)s {role}[%(process)d] %(message)s"
    logging.basicConfig(level=logging.INFO, format=fmt, stream=sys.stderr, force=True)
    for handler in logging.getLogger().handlers:
        handler.addFilter(_late_reply_filter)


def _late_reply_filter(record: logging.LogRecord) -> bool:
    """grpc logs a full traceback when a reply meets a call that already ended
    (the client left, or its deadline passed, a moment before): one line is
    enough, since nobody was waiting for that reply."""
    if record.name.startswith("grpc._cython") and "ExecuteBatchError" in record.getMessage():
        record.msg = "a reply was not sent: its call had already ended (client gone or deadline)"
        record.args = ()
        record.exc_info = None
        record.exc_text = None
        record.levelno, record.levelname = logging.INFO, "INFO"
    return True
