"""sd_notify over a real AF_UNIX datagram socket standing in for systemd."""

from __future__ import annotations

import asyncio
import os
import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from poolserve.supervisor.clock import FakeClock
from poolserve.supervisor.events import ChildReady, Event
from poolserve.supervisor.notify import SystemdNotifier, SystemdService, watchdog_loop
from poolserve.supervisor.spec import ChildSpec, Service, SupervisorSpec
from poolserve.supervisor.tree import Supervisor


@pytest.fixture
def systemd(tmp_path: Path) -> Iterator[tuple[str, socket.socket]]:
    """A bound datagram socket and the NOTIFY_SOCKET value naming it."""
    path = tmp_path / "notify.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(path))
        sock.settimeout(30.0)
        yield str(path), sock


def received(sock: socket.socket) -> list[str]:
    return sock.recv(4096).decode().split("\n")


def nothing_pending(sock: socket.socket) -> bool:
    sock.setblocking(False)
    try:
        sock.recv(4096)
    except BlockingIOError:
        return True
    finally:
        sock.settimeout(30.0)
    return False


def test_without_notify_socket_everything_is_a_no_op() -> None:
    notifier = SystemdNotifier.from_env({"WATCHDOG_USEC": "1000000"})
    assert not notifier.enabled
    assert not notifier.ready()
    assert not notifier.watchdog()
    assert notifier.watchdog_interval() is None


def test_messages(systemd: tuple[str, socket.socket]) -> None:
    address, sock = systemd
    notifier = SystemdNotifier.from_env({"NOTIFY_SOCKET": address})
    assert notifier.ready()
    assert received(sock) == ["READY=1"]
    assert notifier.ready("serving 3 pools")
    assert received(sock) == ["READY=1", "STATUS=serving 3 pools"]
    assert notifier.status("pool a\nrestarting")
    assert received(sock) == ["STATUS=pool a restarting"]  # one line, always
    assert notifier.stopping()
    assert received(sock) == ["STOPPING=1"]
    assert notifier.watchdog()
    assert received(sock) == ["WATCHDOG=1"]
    assert notifier.mainpid(1234)
    assert received(sock) == ["MAINPID=1234"]


def test_reloading_carries_the_monotonic_timestamp(systemd: tuple[str, socket.socket]) -> None:
    address, sock = systemd
    before = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    assert SystemdNotifier(address).reloading()
    after = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    reloading, stamp = received(sock)
    assert reloading == "RELOADING=1"
    key, _, value = stamp.partition("=")
    assert key == "MONOTONIC_USEC"
    assert before <= int(value) <= after


def test_abstract_namespace_address() -> None:
    name = f"poolserve-test-{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(b"\0" + name.encode())
        sock.settimeout(30.0)
        assert SystemdNotifier(f"@{name}").ready()
        assert received(sock) == ["READY=1"]


def test_a_missing_socket_is_reported_not_raised(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    assert not SystemdNotifier(str(tmp_path / "absent.sock")).ready()
    assert "sd_notify" in caplog.text


def test_watchdog_interval_is_half_of_watchdog_usec() -> None:
    env = {"NOTIFY_SOCKET": "/run/x", "WATCHDOG_USEC": "10000000"}
    assert SystemdNotifier.from_env(env).watchdog_interval() == 5.0
    mine = {**env, "WATCHDOG_PID": str(os.getpid())}
    assert SystemdNotifier.from_env(mine).watchdog_interval() == 5.0
    theirs = {**env, "WATCHDOG_PID": str(os.getpid() + 1)}
    assert SystemdNotifier.from_env(theirs).watchdog_interval() is None
    assert SystemdNotifier.from_env({**env, "WATCHDOG_USEC": "nope"}).watchdog_interval() is None


def test_watchdog_loop_pings_on_the_clock(systemd: tuple[str, socket.socket]) -> None:
    address, sock = systemd

    async def main() -> None:
        clock = FakeClock()
        notifier = SystemdNotifier(address, watchdog_usec=2_000_000)
        task = asyncio.create_task(watchdog_loop(notifier, clock))
        for _ in range(3):
            await clock.wait_for_sleepers()
            assert received(sock) == ["WATCHDOG=1"]
            assert nothing_pending(sock)
            assert clock.advance_to_next() == pytest.approx(1.0)
        task.cancel()
        await asyncio.wait({task})

    asyncio.run(main())


def test_watchdog_loop_returns_without_a_watchdog(systemd: tuple[str, socket.socket]) -> None:
    address, sock = systemd
    asyncio.run(watchdog_loop(SystemdNotifier(address)))
    assert nothing_pending(sock)


def test_systemd_service_as_the_last_child(systemd: tuple[str, socket.socket]) -> None:
    address, sock = systemd

    class Gate:
        """A service that becomes ready only when the test says so."""

        def __init__(self) -> None:
            self.started = asyncio.Event()
            self.open = asyncio.Event()

        async def serve(self, ready: object) -> None:
            self.started.set()
            await self.open.wait()
            assert callable(ready)
            ready()
            await asyncio.get_running_loop().create_future()

    async def main() -> None:
        gate = Gate()
        events: list[Event] = []
        notifier = SystemdNotifier(address)

        def systemd_child() -> Service:
            return SystemdService(notifier, status=lambda: "all pools ready")

        children = [ChildSpec("pools", lambda: gate), ChildSpec("systemd", systemd_child)]
        supervisor = Supervisor(SupervisorSpec("root"), children, events=events.append)
        ready = asyncio.Event()
        task = asyncio.create_task(supervisor.serve(ready.set))
        await gate.started.wait()
        assert nothing_pending(sock)  # pools not ready: no READY=1
        gate.open.set()
        await ready.wait()
        assert [e.id for e in events if isinstance(e, ChildReady)] == ["pools", "systemd"]
        assert received(sock) == ["READY=1", "STATUS=all pools ready"]
        task.cancel()
        await asyncio.wait({task})
        assert received(sock) == ["STOPPING=1"]

    asyncio.run(main())
