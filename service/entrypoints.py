"""The bodies of the ``poolserve pool`` and ``poolserve router`` processes."""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from collections.abc import Mapping
from pathlib import Path

from poolserve.service.procutil import set_process_name
from poolserve.service.repository import scan
from poolserve.service.rundir import ensure_private_dir, pool_socket_path, setup_logging
from poolserve.service.settings import ConfigError, ServerSettings, load_server_settings
from poolserve.service.threads import limit_native_threads
from poolserve.supervisor.child import READY_FD_ENV, die_with_parent, notify_ready
from poolserve.supervisor.exitcodes import EXIT_CONFIG, EXIT_OK

log = logging.getLogger(__name__)


def run_pool(repo: Path, gid: str, flags: Mapping[str, object]) -> int:
    from poolserve.service.pool import PoolServer  # the pool's imports, in the pool only

    die_with_parent()
    set_process_name("poolserve-pool")
    raw_fd = os.environ.get(READY_FD_ENV, "")
    ready_fd = int(raw_fd) if raw_fd.isdigit() else None
    try:
        settings = load_server_settings(repo, flags=flags)
        setup_logging(f"pool:{gid}", settings.log_format)
        # Before any model code loads, here (inline models) or in the zygote and workers.
        limit_native_threads(settings.threads_for(gid), f"pool {gid}")
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
    from poolserve.service.router import Router

    die_with_parent()
    set_process_name("poolserve-rtr")
    try:
        settings: ServerSettings = load_server_settings(repo, flags=flags)
        setup_logging("router", settings.log_format)
        router = Router(scan(repo), settings, settings.resolved_run_dir(), repo)
    except ConfigError as exc:
        print(f"poolserve router: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    try:
        asyncio.run(router.serve(lambda: _ready(f"router listening on port {router.port}")))
    except ConfigError as exc:  # e.g. the port is taken: restarting cannot help
        print(f"poolserve router: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    return EXIT_OK
