"""The ``poolserve`` command line: serve, pool, router, serve-inprocess."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
from collections.abc import Sequence
from pathlib import Path


def _server_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("repo", type=Path, help="model repository folder")
    parser.add_argument("--host", help="router bind address (default 127.0.0.1)")
    parser.add_argument("--grpc-port", type=int, help="router port (default 8081)")
    parser.add_argument("--workers", type=int, help="workers per pool (default 2)")
    parser.add_argument("--run-dir", help="private directory for internal sockets")
    parser.add_argument("--log-format", choices=("text", "json"))


def _flags(args: argparse.Namespace) -> dict[str, object]:
    return {
        "host": args.host,
        "grpc_port": args.grpc_port,
        "parallel_workers": args.workers,
        "run_dir": args.run_dir,
        "log_format": args.log_format,
    }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="poolserve", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="run the supervision tree: pools and router")
    _server_flags(serve)
    pool = commands.add_parser("pool", help="run one pool server (normally started by serve)")
    _server_flags(pool)
    pool.add_argument("--gid", required=True, help="the inference pool gid")
    router = commands.add_parser("router", help="run the router (normally started by serve)")
    _server_flags(router)
    inproc = commands.add_parser(
        "serve-inprocess", help="serve every model inside one process (development)"
    )
    _server_flags(inproc)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "pool":
        from poolserve.service.entrypoints import run_pool

        return run_pool(args.repo, args.gid, _flags(args))
    if args.command == "router":
        from poolserve.service.entrypoints import run_router

        return run_router(args.repo, _flags(args))
    if args.command == "serve-inprocess":
        return _serve_inprocess(args)
    from poolserve.supervisor.serve import run_serve

    return run_serve(args.repo, _flags(args))


def _serve_inprocess(args: argparse.Namespace) -> int:
    from poolserve.service.entrypoints import setup_logging
    from poolserve.service.inprocess import InProcessServer
    from poolserve.service.repository import scan
    from poolserve.service.settings import ConfigError, load_server_settings
    from poolserve.supervisor.exitcodes import EXIT_CONFIG

    try:
        settings = load_server_settings(args.repo, flags=_flags(args))
        repository = scan(args.repo)
    except ConfigError as exc:
        print(f"poolserve: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    setup_logging("inprocess", settings.log_format)

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
