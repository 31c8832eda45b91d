"""The body of the ``poolserve pool`` process."""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Mapping
from pathlib import Path

from poolserve.service.contract.lane import lane_path
from poolserve.service.contract.repository import scan
from poolserve.service.contract.rundir import (
    CLAIM_WAIT_S,
    RunDirLock,
    SocketInUse,
    claim_socket,
    ensure_private_dir,
    pool_socket_path,
)
from poolserve.service.contract.settings import ConfigError, load_server_settings
from poolserve.service.contract.worker_limits import configure as configure_worker_limits
from poolserve.service.lifecycle.child import (
    announce_ready,
    beating,
    die_with_parent,
    take_ready_pipe,
)
from poolserve.service.lifecycle.exitcodes import EXIT_CONFIG, EXIT_UNRECOVERABLE
from poolserve.service.lifecycle.limits import raise_open_file_limit
from poolserve.service.lifecycle.logs import setup_logging
from poolserve.service.lifecycle.procutil import set_process_name
from poolserve.service.poolcore.threads import limit_native_threads

log = logging.getLogger(__name__)


def run_pool(repo: Path, gid: str, flags: Mapping[str, object]) -> int:
    from poolserve.service.poolserver.server import (
        PoolServer,  # the pool's imports, in the pool only
    )

    die_with_parent()
    set_process_name("poolserve-pool")
    raise_open_file_limit()  # done by the supervisor already; this is for a flat layout
    pipe = take_ready_pipe()
    try:
        settings = load_server_settings(repo, flags=flags)
        setup_logging(f"pool:{gid}", settings.log_format, relay="process", relay_stdout=True)
        # Before the zygote: its forked workers inherit them, spawned ones read the environment.
        configure_worker_limits(settings.max_message_size, settings.slab_mapped_bytes)
        # Before any model code loads, here (inline models) or in the zygote and workers.
        limit_native_threads(settings.threads_for(gid), f"pool {gid}")
        repository = scan(repo)
        models = repository.pools().get(gid)
        if not models:
            raise ConfigError(str(repo), "inference_pool_gid", f"no model uses pool '{gid}'")
        run_dir = settings.resolved_run_dir()
        path = pool_socket_path(run_dir, gid)
        ensure_private_dir(run_dir)
        lock = RunDirLock.share(run_dir)
    except ConfigError as exc:
        print(f"poolserve pool: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    try:
        # Before the zygote exists: a pool that cannot have its sockets has nothing to stop.
        claim_socket(path, CLAIM_WAIT_S)
        claim_socket(lane_path(path), CLAIM_WAIT_S)
    except SocketInUse as exc:
        print(f"poolserve pool: pool '{gid}' cannot work here: {exc}", file=sys.stderr)
        return EXIT_UNRECOVERABLE
    server = PoolServer(gid, models, settings, path, repo, repository.unserved_of(gid))
    # Fork the zygote now: no gRPC object, thread or exporter exists yet.
    # The zygote and its workers must not keep the run_dir's lock or the ready pipe.
    close = [fd for fd in (pipe.fd if pipe else None, lock.fd if lock else None) if fd is not None]
    server.fork_zygote(close_in_child=close)
    try:
        serving = server.serve(lambda: announce_ready(pipe, f"pool {gid} serving"))
        return asyncio.run(beating(serving, pipe, settings.heartbeat_interval_s))
    except SocketInUse as exc:  # taken between the check and the bind
        print(f"poolserve pool: pool '{gid}' cannot work here: {exc}", file=sys.stderr)
        return EXIT_UNRECOVERABLE
    finally:
        if lock is not None:
            lock.release()
