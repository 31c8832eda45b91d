"""The body of the ``poolserve router`` process."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Mapping
from pathlib import Path

from poolserve.service.contract.repository import scan
from poolserve.service.contract.rundir import (
    CLAIM_WAIT_S,
    RunDirLock,
    SocketInUse,
    claim_socket,
    ensure_private_dir,
    router_control_socket,
    socket_path,
)
from poolserve.service.contract.settings import (
    ConfigError,
    ServerSettings,
    load_server_settings,
    router_count,
)
from poolserve.service.lifecycle.child import (
    announce_ready,
    beating,
    die_with_parent,
    take_ready_pipe,
)
from poolserve.service.lifecycle.cpus import usable_cores
from poolserve.service.lifecycle.exitcodes import EXIT_CONFIG, EXIT_OK
from poolserve.service.lifecycle.limits import raise_open_file_limit
from poolserve.service.lifecycle.logs import setup_logging
from poolserve.service.lifecycle.procutil import set_process_name


def run_router(repo: Path, flags: Mapping[str, object], index: int = 0) -> int:
    from poolserve.service.router.fleet import Fleet
    from poolserve.service.router.router import Router

    die_with_parent()
    set_process_name("poolserve-rtr")
    raise_open_file_limit()  # done by the supervisor already; this is for a flat layout
    pipe = take_ready_pipe()
    try:
        settings: ServerSettings = load_server_settings(repo, flags=flags)
        setup_logging("router", settings.log_format, relay="process", relay_stdout=True)
        run_dir = settings.resolved_run_dir()
        count = router_count(settings, usable_cores())
        if not 0 <= index < count:
            raise ConfigError(
                "command line", "router_index", f"{index} is not below routers {count}"
            )
        router = Router(scan(repo), settings, run_dir, repo, Fleet(run_dir, index, count))
        ensure_private_dir(run_dir)
        lock = RunDirLock.share(run_dir)
    except ConfigError as exc:
        print(f"poolserve router: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    try:
        claim_socket(socket_path(run_dir, router_control_socket(index)), CLAIM_WAIT_S)
        serving = router.serve(
            lambda: announce_ready(pipe, f"router listening on port {router.port}")
        )
        asyncio.run(beating(serving, pipe, settings.heartbeat_interval_s))
    except ConfigError as exc:  # e.g. the port is taken: restarting cannot help
        print(f"poolserve router: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except SocketInUse as exc:  # another router serves this run_dir
        print(f"poolserve router: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    finally:
        if lock is not None:
            lock.release()
    return EXIT_OK
