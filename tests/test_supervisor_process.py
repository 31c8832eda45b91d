"""Process children with real processes: readiness over the pipe, exit-code
protocol, stop escalation on the whole process group, PDEATHSIG, reaping.

Every process a test starts is known by pid and cleaned up by pid. Deaths are
observed through pidfds (a handshake), not by sleeping.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Coroutine, Iterator
from typing import Any

import pytest

from poolserve.service.lifecycle.child import EXIT_PARENT_GONE, PARENT_PID_ENV, READY_FD_ENV
from poolserve.service.lifecycle.exitcodes import ExitStatus
from poolserve.supervisor.events import ChildExited, ChildStarted, Event
from poolserve.supervisor.process import ChildFailed, ProcessService, process_child
from poolserve.supervisor.spec import (
    ChildSpec,
    SupervisorSpec,
    TerminateTree,
    Unrecoverable,
)
from poolserve.supervisor.tree import SAME_STOP_S, Supervisor

PYTHON = [sys.executable, "-P", "-c"]
WAIT = 60.0  # generous: CI is a loaded two-core machine


def script(source: str) -> list[str]:
    return [*PYTHON, textwrap.dedent(source)]


# A child that reports ready (with a status line), then waits to be stopped.
READY_THEN_WAIT = script(
    """
    import time
    from poolserve.service.lifecycle.child import die_with_parent, notify_ready
    die_with_parent()
    notify_ready("loaded")
    time.sleep(600)
    """
)


def run(main: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(main())


def is_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            state = next(line for line in f if line.startswith("State:"))
    except (FileNotFoundError, ProcessLookupError, StopIteration):
        return False
    return "Z" not in state.split()[1]


def is_our_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
    except FileNotFoundError:
        return False
    return fields["State"].split()[0] == "Z" and int(fields["PPid"]) == os.getpid()


def wait_exit(pid: int, timeout: float = WAIT) -> bool:
    """Waits until ``pid`` has exited, through a pidfd; True if it has."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        readable, _, _ = select.select([fd], [], [], timeout)
        return bool(readable)
    finally:
        os.close(fd)


def kill_quietly(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        if is_alive(pid):
            os.kill(pid, signal.SIGKILL)


def owned_fds() -> int:
    """Open pipes and pidfds: what a ProcessService opens. Sockets and event fds
    are left out, since gRPC (used by other tests in this process) closes its own
    on its threads, whenever it gets to it."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            count += target.startswith("pipe:") or target == "anon_inode:[pidfd]"
    return count


@pytest.fixture
def started_pids() -> Iterator[list[int]]:
    """Pids a test saw; anything still alive at the end is killed by pid."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        kill_quietly(pid)


class Readiness:
    """A ready() callable for a bare ProcessService, awaitable."""

    def __init__(self) -> None:
        self.event = asyncio.Event()

    def __call__(self) -> None:
        self.event.set()

    async def wait(self) -> None:
        await asyncio.wait_for(self.event.wait(), WAIT)


# -- readiness and stop ------------------------------------------------------


def test_ready_over_the_pipe_then_stop_with_sigterm(started_pids: list[int]) -> None:
    async def main() -> None:
        service = ProcessService(READY_THEN_WAIT, stop_timeout=WAIT)
        ready = Readiness()
        task = asyncio.create_task(service.serve(ready))
        await ready.wait()
        pid = service.pid
        assert pid is not None
        started_pids.append(pid)
        assert is_alive(pid)
        assert service.status_text == "loaded"
        assert os.getpgid(pid) == pid  # its own process group

        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert service.pid is None
        assert service.last_exit == ExitStatus(pid, signal=signal.SIGTERM)
        assert not is_our_zombie(pid)

    run(main)


def test_the_child_sees_the_supervision_environment() -> None:
    async def main() -> None:
        argv = script(
            f"""
            import os, sys
            sys.exit(0 if os.environ["{PARENT_PID_ENV}"] == "{os.getpid()}"
                     and os.environ["{READY_FD_ENV}"].isdigit()
                     and os.environ.get("EXTRA") == "yes" else 1)
            """
        )
        env = {**os.environ, "EXTRA": "yes"}
        await ProcessService(argv, env=env).serve(lambda: None)  # exit 0: returns

    run(main)


# -- the exit-code protocol --------------------------------------------------


@pytest.mark.parametrize(
    ("source", "expected", "text"),
    [
        ("import sys; sys.exit(1)", ChildFailed, "exited with code 1"),
        ("import sys; sys.exit(2)", TerminateTree, "invalid configuration"),
        ("import sys; sys.exit(3)", Unrecoverable, "exited with code 3"),
        ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", ChildFailed, "SIGKILL"),
        ("import os, signal; os.kill(os.getpid(), signal.SIGTERM)", ChildFailed, "SIGTERM"),
    ],
)
def test_exit_codes_and_signals_are_decoded(
    source: str, expected: type[Exception], text: str
) -> None:
    async def main() -> None:
        service = ProcessService(script(source), name="worker")
        with pytest.raises(expected, match=text) as caught:
            await service.serve(lambda: None)
        if isinstance(caught.value, TerminateTree):
            assert caught.value.exit_code == 2
        assert service.last_exit is not None
        assert "worker (pid" in str(caught.value)

    run(main)


def test_exit_zero_is_a_normal_return_and_the_mapping_is_configurable() -> None:
    async def main() -> None:
        await ProcessService(script("pass")).serve(lambda: None)
        custom = ProcessService(script("import sys; sys.exit(7)"), exit_codes={7: None})
        await custom.serve(lambda: None)

    run(main)


def test_status_decoding() -> None:
    assert ExitStatus(5, code=1).describe() == "exited with code 1"
    assert str(ExitStatus(5, signal=signal.SIGKILL)) == "pid 5 killed by SIGKILL"
    dumped = ExitStatus(5, signal=signal.SIGSEGV, core_dumped=True)
    assert dumped.describe() == "killed by SIGSEGV (core dumped)"
    assert ExitStatus.from_wait_status(9, 3 << 8) == ExitStatus(9, code=3)
    assert ExitStatus.from_wait_status(9, signal.SIGKILL).signal == signal.SIGKILL


# -- stop escalation on the process group ------------------------------------

# Ignores SIGTERM, starts a grandchild that ignores it too (in the same
# process group), and reports the grandchild's pid once both are set up.
STUBBORN_WITH_GRANDCHILD = script(
    """
    import signal, subprocess, sys, time
    from poolserve.service.lifecycle.child import notify_ready
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    grandchild = subprocess.Popen(
        [sys.executable, "-c",
         "import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
         "print('up', flush=True); time.sleep(600)"],
        stdout=subprocess.PIPE,
    )
    assert grandchild.stdout.readline() == b"up\\n"
    notify_ready(f"grandchild={grandchild.pid}")
    time.sleep(600)
    """
)


def test_stop_timeout_kills_the_whole_process_group(started_pids: list[int]) -> None:
    async def main() -> None:
        service = ProcessService(STUBBORN_WITH_GRANDCHILD, stop_timeout=0.5)
        ready = Readiness()
        task = asyncio.create_task(service.serve(ready))
        await ready.wait()
        pid = service.pid
        assert pid is not None and service.status_text is not None
        grandchild = int(service.status_text.removeprefix("grandchild="))
        started_pids.extend([pid, grandchild])
        assert os.getpgid(grandchild) == pid

        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert service.last_exit == ExitStatus(pid, signal=signal.SIGKILL)
        assert not is_alive(pid)
        assert wait_exit(grandchild)
        assert not is_alive(grandchild)

    run(main)


def test_a_second_cancel_kills_at_once(started_pids: list[int]) -> None:
    async def main() -> None:
        service = ProcessService(STUBBORN_WITH_GRANDCHILD, stop_timeout=WAIT * 10)
        ready = Readiness()
        task = asyncio.create_task(service.serve(ready))
        await ready.wait()
        assert service.pid is not None
        started_pids.append(service.pid)
        task.cancel()
        await asyncio.sleep(0)  # let the first request start the grace period
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert service.last_exit is not None
        assert service.last_exit.signal == signal.SIGKILL

    run(main)


def test_stragglers_in_the_group_die_with_the_leader(started_pids: list[int]) -> None:
    async def main() -> None:
        # The leader exits by itself, leaving a grandchild behind in its group.
        argv = script(
            """
            import subprocess, sys
            from poolserve.service.lifecycle.child import notify_ready
            g = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
            notify_ready(f"grandchild={g.pid}")
            sys.exit(1)
            """
        )
        service = ProcessService(argv)
        seen: list[str] = []
        with pytest.raises(ChildFailed, match="exited with code 1"):
            await service.serve(lambda: seen.append(service.status_text or ""))
        grandchild = int(seen[0].removeprefix("grandchild="))
        started_pids.append(grandchild)
        assert wait_exit(grandchild)

    run(main)


# -- the parent's death ------------------------------------------------------

INTERMEDIATE = script(
    """
    import asyncio, sys
    from poolserve.supervisor.process import ProcessService

    CHILD = [sys.executable, "-P", "-c",
             "import time; from poolserve.service.lifecycle.child import notify_ready; "
             "notify_ready(); time.sleep(600)"]

    async def main():
        service = ProcessService(CHILD)
        await service.serve(lambda: print(service.pid, flush=True))

    asyncio.run(main())
    """
)


def test_the_child_dies_when_its_parent_dies(started_pids: list[int]) -> None:
    parent = subprocess.Popen(INTERMEDIATE, stdout=subprocess.PIPE)
    started_pids.append(parent.pid)
    try:
        assert parent.stdout is not None
        line = parent.stdout.readline()
        child = int(line)
        started_pids.append(child)
        assert is_alive(child)
        parent.kill()  # SIGKILL: the parent gets no chance to stop anything
    finally:
        parent.wait()
        if parent.stdout is not None:
            parent.stdout.close()
    assert wait_exit(child)  # PR_SET_PDEATHSIG did it
    assert not is_alive(child)


def test_die_with_parent_exits_when_the_parent_is_already_gone() -> None:
    source = (
        "from poolserve.service.lifecycle.child import die_with_parent; "
        "die_with_parent(); print('x')"
    )
    env = {**os.environ, PARENT_PID_ENV: "1"}  # not our parent: as if reparented
    result = subprocess.run([*PYTHON, source], env=env, capture_output=True, timeout=WAIT)
    assert result.returncode == EXIT_PARENT_GONE
    assert result.stdout == b""


def test_die_with_parent_keeps_running_under_the_right_parent() -> None:
    source = (
        "import os; from poolserve.service.lifecycle.child import die_with_parent; "
        "die_with_parent(); "
        f"print(os.environ.get('{PARENT_PID_ENV}'))"
    )
    env = {**os.environ, PARENT_PID_ENV: str(os.getpid())}
    result = subprocess.run([*PYTHON, source], env=env, capture_output=True, timeout=WAIT)
    assert result.returncode == 0
    assert result.stdout == b"None\n"  # taken out: our own children never see it


def test_notify_ready_is_a_no_op_without_a_supervisor() -> None:
    source = "from poolserve.service.lifecycle.child import notify_ready; print(notify_ready())"
    env = {k: v for k, v in os.environ.items() if k != READY_FD_ENV}
    result = subprocess.run([*PYTHON, source], env=env, capture_output=True, timeout=WAIT)
    assert result.stdout == b"False\n"


# -- under a supervisor -------------------------------------------------------


def test_many_crashes_leave_no_zombie(started_pids: list[int]) -> None:
    async def main() -> None:
        events: list[Event] = []
        crashed = asyncio.Event()

        def hook(event: Event) -> None:
            events.append(event)
            if sum(isinstance(e, ChildExited) for e in events) >= 12:
                crashed.set()

        fds_before = owned_fds()
        spec = SupervisorSpec("sup", backoff_base=0.001, backoff_max=0.01, failure_threshold=1e9)
        child = ChildSpec("crash", lambda: ProcessService(script("import sys; sys.exit(1)")))
        supervisor = Supervisor(spec, [child], events=hook)
        task = asyncio.create_task(supervisor.serve(lambda: None))
        await asyncio.wait_for(crashed.wait(), WAIT)
        task.cancel()
        await asyncio.wait({task})

        pids = [e.pid for e in events if isinstance(e, ChildStarted) and e.pid is not None]
        started_pids.extend(pids)
        assert len(pids) >= 12
        assert all(not is_our_zombie(pid) for pid in pids)
        outcomes = [e.outcome for e in events if isinstance(e, ChildExited)]
        assert all("exited with code 1" in text for text in outcomes[:12])
        assert owned_fds() == fds_before  # no pipe or pidfd left open

    run(main)


def test_a_program_that_cannot_start_is_a_failure() -> None:
    async def main() -> None:
        fds_before = owned_fds()
        with pytest.raises(FileNotFoundError):
            await ProcessService(["/nonexistent/poolserve-test"]).serve(lambda: None)
        assert owned_fds() == fds_before

    run(main)


def test_status_reports_the_pid_of_a_process_child(started_pids: list[int]) -> None:
    async def main() -> None:
        events: list[Event] = []
        supervisor = Supervisor(
            SupervisorSpec("sup"),
            [process_child("p", READY_THEN_WAIT, stop_timeout=WAIT)],
            events=events.append,
        )
        ready = asyncio.Event()
        task = asyncio.create_task(supervisor.serve(ready.set))
        await asyncio.wait_for(ready.wait(), WAIT)
        [status] = supervisor.status()
        assert status.pid is not None
        started_pids.append(status.pid)
        [started] = [e for e in events if isinstance(e, ChildStarted)]
        assert started.pid == status.pid
        task.cancel()
        await asyncio.wait({task})
        assert not is_alive(status.pid)

    run(main)


# -- the root process: subreaper, orphans, signals ---------------------------

# Runs in its own process (a subreaper is a process-wide setting): a child
# leaves a grandchild in another session (out of reach of the group kill),
# which becomes our orphan; killing it must let the reaper reap it, while the
# child's own exit status still reaches its ProcessService.
ROOT_WITH_ORPHAN = script(
    """
    import asyncio, json, os, signal, sys
    from poolserve.supervisor.process import ChildFailed, ProcessService
    from poolserve.supervisor.reaper import OrphanReaper, become_subreaper
    from poolserve.service.lifecycle.linux import is_child_subreaper

    CHILD = [sys.executable, "-P", "-c", '''
    import subprocess, sys
    from poolserve.service.lifecycle.child import notify_ready
    g = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                         start_new_session=True)
    notify_ready(f"orphan={g.pid}")
    sys.exit(5)
    ''']

    async def main():
        become_subreaper()
        reaped = asyncio.Event()
        events = []
        def hook(event):
            events.append(event.to_json())
            reaped.set()
        async with OrphanReaper(events=hook):
            service = ProcessService(CHILD)
            try:
                await service.serve(lambda: None)
            except ChildFailed as error:
                failure = str(error)
            orphan = int(service.status_text.removeprefix("orphan="))
            with open(f"/proc/{orphan}/status") as f:
                ppid = [l for l in f if l.startswith("PPid:")][0].split()[1]
            os.kill(orphan, signal.SIGKILL)
            await asyncio.wait_for(reaped.wait(), 60)
        print(json.dumps({"failure": failure, "orphan": orphan, "ppid": int(ppid),
                          "me": os.getpid(), "events": events,
                          "subreaper": is_child_subreaper()}))

    asyncio.run(main())
    """
)


def test_orphans_are_reaped_without_stealing_our_childrens_status(
    started_pids: list[int],
) -> None:
    result = subprocess.run(ROOT_WITH_ORPHAN, capture_output=True, timeout=WAIT)
    assert result.returncode == 0, result.stderr.decode()
    report = json.loads(result.stdout)
    started_pids.append(report["orphan"])
    assert report["subreaper"]
    assert "exited with code 5" in report["failure"]  # not stolen by the reaper
    assert report["ppid"] == report["me"]  # reparented to the subreaper
    assert report["events"] == [
        {"event": "orphan_reaped", "pid": report["orphan"], "status": "killed by SIGKILL"}
    ]
    assert not is_alive(report["orphan"])


ROOT_SERVING = script(
    """
    import asyncio, sys
    from poolserve.supervisor.process import process_child
    from poolserve.supervisor.spec import SupervisorSpec
    from poolserve.supervisor.tree import Supervisor, run_root

    CHILD = [sys.executable, "-P", "-c",
             "import time; from poolserve.service.lifecycle.child import notify_ready; "
             "notify_ready(); time.sleep(600)"]

    async def main():
        root = Supervisor(SupervisorSpec("root"), [process_child("c", CHILD)],
                          events=lambda event: None)
        def ready():
            print(root.status()[0].pid, flush=True)
        return await run_root(root, ready=ready)

    sys.exit(asyncio.run(main()))
    """
)


def test_sigterm_stops_the_root_cleanly(started_pids: list[int]) -> None:
    root = subprocess.Popen(ROOT_SERVING, stdout=subprocess.PIPE)
    started_pids.append(root.pid)
    try:
        assert root.stdout is not None
        child = int(root.stdout.readline())
        started_pids.append(child)
        assert is_alive(child)
        root.send_signal(signal.SIGTERM)
        assert root.wait(timeout=WAIT) == 0
    finally:
        if root.poll() is None:
            root.kill()
            root.wait()
        if root.stdout is not None:
            root.stdout.close()
    assert wait_exit(child)
    assert not is_alive(child)


# A nested tree whose process child reports SIGTERM (on stdout) and ignores it.
ROOT_WITH_STUBBORN_POOL = script(
    """
    import asyncio, sys
    from poolserve.supervisor.process import process_child
    from poolserve.supervisor.spec import ChildSpec, SupervisorSpec
    from poolserve.supervisor.tree import Supervisor, run_root

    CHILD = [sys.executable, "-P", "-c", '''
    import signal, sys, time
    from poolserve.service.lifecycle.child import notify_ready
    signal.signal(signal.SIGTERM, lambda *_: print("term", flush=True))
    notify_ready()
    while True:
        time.sleep(600)
    ''']
    quiet = lambda event: None

    def pools():
        child = process_child("pool:a", CHILD, stop_timeout=600)
        return Supervisor(SupervisorSpec("pools", stop_timeout=900), [child], events=quiet)

    async def main():
        root = Supervisor(SupervisorSpec("root", stop_timeout=900),
                          [ChildSpec("pools", pools, stop_timeout=900)], events=quiet)
        def ready():
            print(root.status()[0].children[0].pid, flush=True)
        return await run_root(root, ready=ready)

    sys.exit(asyncio.run(main()))
    """
)


def test_a_second_sigterm_kills_the_whole_tree_at_once(started_pids: list[int]) -> None:
    root = subprocess.Popen(ROOT_WITH_STUBBORN_POOL, stdout=subprocess.PIPE)
    started_pids.append(root.pid)
    try:
        assert root.stdout is not None
        child = int(root.stdout.readline())
        started_pids.append(child)
        root.send_signal(signal.SIGTERM)
        first = time.monotonic()
        assert root.stdout.readline() == b"term\n"  # the graceful stop reached the pool
        # impatient: kill now (a second signal sooner is the same request sent twice)
        time.sleep(max(0.0, first + SAME_STOP_S + 0.1 - time.monotonic()))
        root.send_signal(signal.SIGTERM)
        assert root.wait(timeout=WAIT) == 0
    finally:
        if root.poll() is None:
            root.kill()
            root.wait()
        if root.stdout is not None:
            root.stdout.close()
    assert wait_exit(child)
    assert not is_alive(child)


# -- the watchdog --------------------------------------------------------------

# Ready after a slow start, beats from its event loop for 2 s, then blocks its
# loop (a GIL-holding call, a hung model) and beats no more.
BEATS_THEN_BLOCKS = script(
    """
    import asyncio, os, time
    from poolserve.service.lifecycle.child import die_with_parent, take_ready_pipe
    die_with_parent()
    pipe = take_ready_pipe()
    time.sleep(1.5)  # loading: the watchdog is not armed before READY=1

    async def main():
        pipe.ready("beating")
        beat = asyncio.create_task(pipe.keep_beating(0.1))
        await asyncio.sleep(2.0)
        os.write(pipe.fd, b"STATUS=blocking\\n")
        time.sleep(600)  # the loop stops turning; the beat task never runs again
        beat.cancel()

    asyncio.run(main())
    """
)


def test_the_watchdog_kills_a_child_whose_loop_stops_beating(started_pids: list[int]) -> None:
    async def main() -> None:
        service = ProcessService(BEATS_THEN_BLOCKS, name="pool:a", watchdog_timeout=0.8)
        ready = Readiness()
        task = asyncio.create_task(service.serve(ready))
        await ready.wait()
        assert service.pid is not None
        started_pids.append(service.pid)
        with pytest.raises(ChildFailed, match="without a heartbeat") as caught:
            await asyncio.wait_for(task, WAIT)
        # It lived through its slow start and 2 s of beats (both longer than the
        # timeout) and was killed only once its loop blocked.
        assert service.status_text == "blocking"
        assert "SIGKILL" in str(caught.value)
        assert service.last_exit is not None and service.last_exit.signal == signal.SIGKILL

    run(main)


def test_the_watchdog_kills_a_stopped_child(started_pids: list[int]) -> None:
    source = """
        import asyncio
        from poolserve.service.lifecycle.child import die_with_parent, take_ready_pipe
        die_with_parent()
        pipe = take_ready_pipe()

        async def main():
            pipe.ready()
            await pipe.keep_beating(0.1)

        asyncio.run(main())
        """

    async def main() -> None:
        service = ProcessService(script(source), name="router", watchdog_timeout=0.8)
        ready = Readiness()
        task = asyncio.create_task(service.serve(ready))
        await ready.wait()
        pid = service.pid
        assert pid is not None
        started_pids.append(pid)
        done, _ = await asyncio.wait({task}, timeout=2.0)  # beating: left alone
        assert not done
        os.kill(pid, signal.SIGSTOP)
        with pytest.raises(ChildFailed, match="without a heartbeat"):
            await asyncio.wait_for(task, WAIT)
        assert not is_our_zombie(pid)

    run(main)
