"""The bodies of the ``poolserve pool`` and ``poolserve router`` processes."""

from __future__ import annotations

import asyncio
import logging
import os
import stat
import sys
from collections.abc import Mapping
from pathlib import Path

from poolserve.service.pool import PoolServer, pool_socket_path
from poolserve.service.procutil import set_process_name
from poolserve.service.repository import scan
from poolserve.service.router import Router
from poolserve.service.settings import ConfigError, ServerSettings, load_server_settings
from poolserve.supervisor.child import READY_FD_ENV, die_with_parent, notify_ready
from poolserve.supervisor.exitcodes import EXIT_CONFIG, EXIT_OK

log = logging.getLogger(__name__)


def setup_logging(role: str, log_format: str = "text") -> None:
    if log_format == "json":
        fmt = (
            '{"ts": "%(asctime)s", "level": "%(levelname)s", "role": "' + role + '", '
            '"pid": %(process)d, "msg": "%(message)s"}'
        )
    else:
        fmt = f"%(asctime)s %(levelname)s {role}[%(process)d] %(message)s"
    logging.basicConfig(level=logging.INFO, format=fmt, stream=sys.stderr, force=True)


def ensure_private_dir(path: Path) -> None:
    """The run directory holds our sockets: ours alone, mode 0700."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = path.stat()
    if info.st_uid != os.getuid():
        raise ConfigError(str(path), "run_dir", "owned by another user")
    if stat.S_IMODE(info.st_mode) != 0o700:
        path.chmod(0o700)


def run_pool(repo: Path, gid: str, flags: Mapping[str, object]) -> int:
    die_with_parent()
    set_process_name("poolserve-pool")
    raw_fd = os.environ.get(READY_FD_ENV, "")
    ready_fd = int(raw_fd) if raw_fd.isdigit() else None
    try:
        settings = load_server_settings(repo, flags=flags)
        setup_logging(f"pool:{gid}", settings.log_format)
        models = scan(repo).pools().get(gid)
        if not models:
            raise ConfigError(str(repo), "inference_pool_gid", f"no model uses pool '{gid}'")
        run_dir = settings.resolved_run_dir()
        ensure_private_dir(run_dir)
        server = PoolServer(gid, models, settings, pool_socket_path(run_dir, gid), repo)
    except ConfigError as exc:
        print(f"poolserve pool: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    # Fork the zygote now: no gRPC object, thread or exporter exists yet.
    server.fork_zygote(close_in_child=[ready_fd] if ready_fd is not None else [])
    return asyncio.run(server.serve(lambda: _ready(f"pool {gid} serving")))


def _ready(status: str) -> None:
    notify_ready(status)


def run_router(repo: Path, flags: Mapping[str, object]) -> int:
    die_with_parent()
    set_process_name("poolserve-rtr")
    try:
        settings: ServerSettings = load_server_settings(repo, flags=flags)
        setup_logging("router", settings.log_format)
        router = Router(scan(repo), settings, settings.resolved_run_dir(), repo)
    except ConfigError as exc:
        print(f"poolserve router: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    asyncio.run(router.serve(lambda: _ready(f"router listening on port {router.port}")))
    return EXIT_OK
