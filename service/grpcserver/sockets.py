"""Private unix sockets for gRPC servers: 0600 from their first instant."""

from __future__ import annotations

import os
from pathlib import Path

import grpc

from poolserve.service.contract.rundir import FileId, claim_socket, file_id


def bind_private_unix(server: grpc.aio.Server, path: Path) -> FileId | None:
    """Binds with a umask so the socket is 0600 from its first instant; returns
    its identity, for :func:`remove_own`. A live socket at ``path`` raises SocketInUse."""
    claim_socket(path)
    old = os.umask(0o177)
    try:
        server.add_insecure_port(f"unix:{path}")
    finally:
        os.umask(old)
    return file_id(path)
