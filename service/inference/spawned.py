"""A worker started as a fresh interpreter (``start_method: "spawn"``).

For a runtime that cannot survive a fork at all, a pool can start each worker
by exec instead: ``python -m poolserve.service.inference.spawned``, started by the
pool's zygote (which reaps it and reports its exit, as for a forked worker).
It loads the pool's models itself, each announced to the pool by a LOADING
frame, then runs the same self-test and serves the same frames as a forked
worker. The cost: a copy of every model per worker, and the load time at each
start. A model whose load raises here ends the worker (exit code
:data:`EXIT_LOAD_FAILED`, the reason on stderr): the pool counts it against
the model, as a death in the self-test.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
from pathlib import Path
from typing import Any, NoReturn

from poolserve.service.lifecycle.child import die_with_parent
from poolserve.service.lifecycle.logs import setup_inherited_logging
from poolserve.service.lifecycle.procutil import set_process_name
from poolserve.service.poolcore import worker

EXIT_LOAD_FAILED = 3
log = logging.getLogger(__name__)


def main(argv: list[str]) -> NoReturn:
    parser = argparse.ArgumentParser(prog="poolserve-spawned-worker", add_help=False)
    parser.add_argument("--sock-fd", type=int, required=True)
    parser.add_argument("--zygote-pid", type=int, required=True)
    parser.add_argument("--heartbeat", type=float, default=1.0)
    parser.add_argument("--model", action="append", default=[])  # model-settings.json paths
    # each --model's version ("": the file's one model; N: version folder N of it)
    parser.add_argument("--version", action="append", default=[])
    parser.add_argument("--skip", action="append", default=[])  # models left out
    args = parser.parse_args(argv)
    die_with_parent(args.zygote_pid)
    set_process_name("poolserve-wrk")
    setup_inherited_logging("worker")
    sock = socket.socket(fileno=args.sock_fd)
    skip = set(args.skip)

    def prepare(announce: Any) -> tuple[worker.Handler, list[worker.Warmup]]:
        from poolserve.service.contract.repository import parse_model_version
        from poolserve.service.inference.cargo import InferenceCargo

        cargo = InferenceCargo([])
        events: list[dict[str, Any]] = []
        versions = args.version + [""] * (len(args.model) - len(args.version))
        for path, version in zip(args.model, versions, strict=True):
            settings = parse_model_version(Path(path), version)
            if settings.key in skip:
                continue
            announce(settings.key)
            cargo.load_one(settings, events.append)
            if settings.key not in cargo.models:
                reason = events[-1].get("reason", "")
                log.error(
                    "poolserve worker: model %s: %s",
                    settings.name,
                    reason,
                    extra={"model": settings.name, "traceback": events[-1].get("traceback", "")},
                )
                sys.stderr.flush()
                os._exit(EXIT_LOAD_FAILED)
        return cargo.handler(), cargo.warmups(skip)

    worker.run_prepared(sock, args.heartbeat, prepare)


if __name__ == "__main__":
    # Run as a script, this file is ``__main__``; import it under its real name.
    from poolserve.service.inference import spawned

    spawned.main(sys.argv[1:])
