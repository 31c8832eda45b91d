"""systemd's notify protocol (sd_notify) for the root process.

One AF_UNIX datagram per message to ``$NOTIFY_SOCKET`` (a leading ``@`` names
the abstract namespace), newline-separated ``KEY=value`` assignments. Without
``NOTIFY_SOCKET`` (not under systemd, or ``Type=simple``) every call is a
no-op.

:class:`SystemdService` puts the protocol into the tree: as the root's last
child it starts after everything else is ready (so it sends ``READY=1`` at the
right moment), pings the watchdog from the event loop (a blocked loop stops
the pings, which is the point), and, stopping first, sends ``STOPPING=1``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import Callable, Mapping

from poolserve.supervisor.clock import Clock, RealClock

log = logging.getLogger(__name__)

# A datagram to a full receive queue would block the event loop; give up
# after this long (systemd reads its notify socket promptly).
_SEND_TIMEOUT = 1.0


class SystemdNotifier:
    """Sends notify messages; built from the environment with :meth:`from_env`."""

    def __init__(
        self,
        address: str | None,
        *,
        watchdog_usec: int | None = None,
        watchdog_pid: int | None = None,
    ) -> None:
        self._address = _socket_address(address) if address else None
        self._watchdog_usec = watchdog_usec
        self._watchdog_pid = watchdog_pid

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> SystemdNotifier:
        env = os.environ if environ is None else environ
        return cls(
            env.get("NOTIFY_SOCKET") or None,
            watchdog_usec=_positive_int(env.get("WATCHDOG_USEC")),
            watchdog_pid=_positive_int(env.get("WATCHDOG_PID")),
        )

    @property
    def enabled(self) -> bool:
        return self._address is not None

    def notify(self, *assignments: str) -> bool:
        """Sends ``KEY=value`` lines as one datagram; returns whether it was sent."""
        if self._address is None or not assignments:
            return False
        message = "\n".join(assignments).encode()
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
                sock.settimeout(_SEND_TIMEOUT)
                sock.sendto(message, self._address)
        except OSError as error:
            # Never fatal: a lost notification shows up in systemd, not here.
            log.warning("sd_notify %r failed: %s", assignments[0], error)
            return False
        return True

    def ready(self, status: str | None = None) -> bool:
        return self.notify("READY=1", *([f"STATUS={status}"] if status else []))

    def status(self, text: str) -> bool:
        return self.notify(f"STATUS={_one_line(text)}")

    def stopping(self) -> bool:
        return self.notify("STOPPING=1")

    def reloading(self) -> bool:
        """RELOADING=1 with the CLOCK_MONOTONIC timestamp Type=notify-reload wants."""
        usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        return self.notify("RELOADING=1", f"MONOTONIC_USEC={usec}")

    def watchdog(self) -> bool:
        return self.notify("WATCHDOG=1")

    def mainpid(self, pid: int) -> bool:
        return self.notify(f"MAINPID={pid}")

    def watchdog_interval(self) -> float | None:
        """Seconds between pings (half of WATCHDOG_USEC), or None without a watchdog.

        WATCHDOG_PID, when set, names the process the watchdog is meant for; a
        child that inherited the environment must not ping for its parent.
        """
        if self._address is None or self._watchdog_usec is None:
            return None
        if self._watchdog_pid is not None and self._watchdog_pid != os.getpid():
            return None
        return self._watchdog_usec / 2 / 1_000_000


async def watchdog_loop(notifier: SystemdNotifier, clock: Clock | None = None) -> None:
    """Pings the watchdog every ``watchdog_interval()`` until cancelled.

    Runs in the event loop on purpose: if the loop is blocked, pings stop and
    systemd restarts the service. Returns at once without a watchdog.
    """
    interval = notifier.watchdog_interval()
    if interval is None:
        return
    timer = clock or RealClock()
    while True:
        notifier.watchdog()
        await timer.sleep(interval)


class SystemdService:
    """The notify protocol as a tree child (place it last among the root's children)."""

    def __init__(
        self,
        notifier: SystemdNotifier,
        *,
        clock: Clock | None = None,
        status: Callable[[], str] | None = None,
    ) -> None:
        self._notifier = notifier
        self._clock = clock
        self._status = status

    async def serve(self, ready: Callable[[], None]) -> None:
        self._notifier.ready(self._status() if self._status else None)
        ready()
        try:
            await watchdog_loop(self._notifier, self._clock)
            await _forever()
        finally:
            self._notifier.stopping()


async def _forever() -> None:
    await asyncio.get_running_loop().create_future()


def _socket_address(address: str) -> str | bytes:
    if address.startswith("@"):
        # Abstract namespace: a leading NUL byte, no file in the filesystem.
        return b"\0" + address[1:].encode()
    return address


def _positive_int(raw: str | None) -> int | None:
    if raw is None or not raw.strip().isdigit():
        return None
    value = int(raw)
    return value if value > 0 else None


def _one_line(text: str) -> str:
    return " ".join(text.split())
