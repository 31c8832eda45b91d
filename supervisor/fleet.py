"""The router fleet as the supervisor sees it: the ports its routers share.

With ``routers`` above one, every router listens on the same gRPC port, the
same REST port and the same metrics port with SO_REUSEPORT, and the kernel
spreads the connections over them. SO_REUSEPORT lets any socket of the same
user that asks for it share the port, so before any process starts the
supervisor:

- probes each shared port with a plain bind (no SO_REUSEPORT): anything
  already listening there, ours or another program's, is a configuration
  error (exit 2), as for a single router;
- then holds a bound, never listening, SO_REUSEPORT socket on it for the
  whole life of the tree (:class:`PortHold`). A socket that does not listen
  receives no connection, but the port stays taken: a program that binds it
  without SO_REUSEPORT fails while a router restarts, and port 0 (any free
  port) is resolved once, here, so that every router gets the same one.
"""

from __future__ import annotations

import contextlib
import errno
import socket
from collections.abc import Iterable
from typing import Any

from poolserve.service.contract.settings import ConfigError, ServerSettings

# The ports the routers share: (setting, flag, what listens there).
SHARED_PORTS = (
    ("grpc_port", "--grpc-port", "the routers' gRPC door"),
    ("http_port", "--http-port", "the routers' REST door"),
    ("metrics_port", "--metrics-port", "the routers' /metrics"),
)


class PortHold:
    """Bound SO_REUSEPORT sockets that keep the fleet's ports for the tree."""

    def __init__(self) -> None:
        self.sockets: list[socket.socket] = []
        self.ports: dict[str, int] = {}  # setting -> the port every router binds

    def close(self) -> None:
        for sock in self.sockets:
            sock.close()
        self.sockets.clear()

    def __enter__(self) -> PortHold:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


def hold_shared_ports(settings: ServerSettings, given: Iterable[str]) -> PortHold:
    """Checks and holds each shared port (a REST or metrics port of -1 is off)."""
    hold = PortHold()
    named = set(given)
    try:
        for field, flag, what in SHARED_PORTS:
            port = int(getattr(settings, field))
            if port < 0:
                continue
            source = flag if field in named else "settings"
            hold.ports[field] = _hold(hold, settings.host, port, field, flag, what, source)
    except BaseException:
        hold.close()
        raise
    return hold


def _hold(
    hold: PortHold, host: str, port: int, field: str, flag: str, what: str, source: str
) -> int:
    try:
        addresses = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except OSError as exc:
        raise ConfigError(source, field, f"{what}: cannot resolve host {host!r}: {exc}") from None
    for family, kind, proto, _, address in addresses:
        try:
            if port != 0:
                _probe(family, kind, proto, address)
            sock = _reserve(family, kind, proto, (address[0], port, *address[2:]))
        except OSError as exc:
            if exc.errno not in (errno.EADDRINUSE, errno.EACCES):
                continue  # e.g. no IPv6 here: the routers skip that address too
            raise ConfigError(
                source,
                field,
                f"{what} cannot listen on {_host_port(str(address[0]), port)}: {exc.strerror} "
                f"(another tree? each tree needs its own: set {flag} / {field} / "
                f"POOLSERVE_{field.upper()} to a free port, or 0 for any free port)",
            ) from None
        hold.sockets.append(sock)
        port = sock.getsockname()[1]  # port 0: the others get the same one
    return port


def _probe(family: int, kind: int, proto: int, address: tuple[Any, ...]) -> None:
    """A plain bind: fails while anything listens there, SO_REUSEPORT or not."""
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        probe.bind(address)


def _reserve(family: int, kind: int, proto: int, address: tuple[Any, ...]) -> socket.socket:
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind(address)
    except BaseException:
        with contextlib.suppress(OSError):
            sock.close()
        raise
    return sock


def _host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
