"""The ``poolserve`` command line: serve, pool, router, serve-inprocess, probe,
supervisord-config, status, reload, top."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

from poolserve.supervisor.helptext import plain


def _server_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("repo", type=Path, help="model repository folder")
    parser.add_argument("--host", help="router bind address (default 127.0.0.1)")
    parser.add_argument("--grpc-port", type=int, help="router port (default 8081)")
    parser.add_argument(
        "--metrics-port", type=int, help="router's HTTP /metrics port (default 8082; -1: off)"
    )
    parser.add_argument(
        "--http-port", type=int, help="router's HTTP/REST port (default 8080; -1: off)"
    )
    parser.add_argument("--workers", type=int, help="workers per pool (default 2)")
    parser.add_argument(
        "--routers", help="router processes sharing the ports (default 1; 'auto': by cores)"
    )
    parser.add_argument("--run-dir", help="private directory for internal sockets")
    parser.add_argument("--log-format", choices=("text", "json"))


def _flags(args: argparse.Namespace) -> dict[str, object]:
    return {
        "host": args.host,
        "grpc_port": args.grpc_port,
        "metrics_port": args.metrics_port,
        "http_port": args.http_port,
        "parallel_workers": args.workers,
        "routers": args.routers,
        "run_dir": args.run_dir,
        "log_format": args.log_format,
    }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="poolserve", description=plain(__doc__))
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="run the supervision tree: pools and router")
    _server_flags(serve)
    pool = commands.add_parser("pool", help="run one pool server (normally started by serve)")
    _server_flags(pool)
    pool.add_argument("--gid", required=True, help="the inference pool gid")
    router = commands.add_parser("router", help="run the router (normally started by serve)")
    _server_flags(router)
    router.add_argument(
        "--router-index", type=int, default=0, help="this router's place in the fleet (from 0)"
    )
    inproc = commands.add_parser(
        "serve-inprocess", help="serve every model inside one process (development)"
    )
    _server_flags(inproc)
    from poolserve.supervisor.probe import add_probe_arguments

    probe = commands.add_parser(
        "probe", help="check a server's health; exit codes like grpc_health_probe"
    )
    add_probe_arguments(probe)
    flat = commands.add_parser(
        "supervisord-config",
        help="print a flat supervisord config: one program per pool, one for the router",
    )
    _server_flags(flat)
    flat.add_argument("--executable", help="the poolserve command to run (default: this one)")
    flat.add_argument("--user", help="run the programs as this user (supervisord as root)")
    flat.add_argument(
        "--log-stdout", action="store_true", help="programs log to supervisord's stdout"
    )
    flat.add_argument(
        "--standalone",
        type=Path,
        metavar="DIR",
        help="print a complete supervisord.conf (supervisord, its socket, supervisorctl), "
        "with supervisord's log, pid file and socket in DIR; without it, only the "
        "program sections, for an [include]",
    )
    from poolserve.supervisor import status_cli
    from poolserve.supervisor.status_cli import (
        DEFAULT_RELOAD_TIMEOUT,
        DEFAULT_STATUS_TIMEOUT,
        add_control_arguments,
    )

    status = commands.add_parser(
        "status",
        help="print the supervision tree of a running server",
        description=plain(status_cli.__doc__),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_control_arguments(status, DEFAULT_STATUS_TIMEOUT)
    status.add_argument("--json", action="store_true", help="one JSON object, for machines")
    reload = commands.add_parser(
        "reload", help="re-read the repository and settings of a running server (like SIGHUP)"
    )
    add_control_arguments(reload, DEFAULT_RELOAD_TIMEOUT)
    reload.add_argument("--json", action="store_true", help="one JSON object, for machines")
    from poolserve.supervisor.top_cli import add_top_arguments

    top = commands.add_parser("top", help="a live view of a running server, every second")
    add_top_arguments(top)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        return _main(argv)
    except BrokenPipeError:
        # The reader went away (`poolserve status --json | head`): what it did
        # not read is nobody's; stdout is pointed at /dev/null so that the
        # interpreter's own flush at exit does not fail again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0


def _main(argv: Sequence[str] | None) -> int:
    arguments = list(sys.argv[1:] if argv is None else argv)
    if arguments[:1] == ["probe"]:
        # Its own parser: bad arguments exit 1, as grpc_health_probe's do.
        from poolserve.supervisor.probe import main as probe_main

        return probe_main(arguments[1:])
    args = build_parser().parse_args(arguments)
    if args.command == "supervisord-config":
        from poolserve.supervisor.supervisord_config import main as supervisord_config

        return supervisord_config(
            args.repo,
            _flags(args),
            executable=shlex.split(args.executable) if args.executable else None,
            user=args.user,
            log_stdout=args.log_stdout,
            standalone=args.standalone,
        )
    if args.command == "top":
        from poolserve.supervisor.top_cli import top_main

        return top_main(args)
    if args.command in ("status", "reload"):
        from poolserve.supervisor.status_cli import reload_main, status_main

        return status_main(args) if args.command == "status" else reload_main(args)
    if args.command == "pool":
        from poolserve.service.poolserver.main import run_pool

        return run_pool(args.repo, args.gid, _flags(args))
    if args.command == "router":
        from poolserve.service.router.main import run_router

        return run_router(args.repo, _flags(args), args.router_index)
    if args.command == "serve-inprocess":
        return _serve_inprocess(args)
    from poolserve.supervisor.serve import run_serve

    return run_serve(args.repo, _flags(args))


# What only `serve`'s tree has (its router's REST and metrics ports, its routers
# and workers): (setting, flag).
_ROUTER_ONLY = (
    ("http_port", "--http-port"),
    ("metrics_port", "--metrics-port"),
    ("routers", "--routers"),
    ("parallel_workers", "--workers"),
)


def _serve_inprocess(args: argparse.Namespace) -> int:
    from poolserve.service.contract.repository import scan
    from poolserve.service.contract.settings import ConfigError, load_server_settings
    from poolserve.service.lifecycle.exitcodes import EXIT_CONFIG
    from poolserve.service.lifecycle.logs import setup_logging
    from poolserve.service.poolserver.inprocess import InProcessServer

    try:
        settings = load_server_settings(args.repo, flags=_flags(args))
        repository = scan(args.repo)
    except ConfigError as exc:
        print(f"poolserve: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    setup_logging("inprocess", settings.log_format, relay="process")
    flags = _flags(args)
    ignored = [flag for key, flag in _ROUTER_ONLY if flags.get(key) is not None]
    if ignored:  # asked for on the command line: say it is not there
        logging.getLogger("poolserve.inprocess").warning(
            "serve-inprocess is one process serving gRPC only: %s ignored", ", ".join(ignored)
        )

    async def run() -> None:
        server = InProcessServer(repository, settings)
        port = await server.start()
        print(f"poolserve: serving in-process on {settings.host}:{port}", flush=True)
        try:
            await asyncio.Event().wait()
        finally:
            await server.stop()

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
