"""The supervision contract and its specs: what a service is, how it ends, and
the data (with defaults) that tells a supervisor how to run it.

A service runs until it is cancelled (a normal stop); returning or raising
is how it ends by itself. Two exceptions are outcomes rather than failures:
:class:`DoNotRestart` and :class:`TerminateTree`.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


class Service(Protocol):
    """Anything a supervisor can run: pools, the router, supervisors themselves.

    ``serve`` calls ``ready()`` once it can do its job (the supervisor starts
    the next child only after that), then runs until cancelled. Cancellation
    is a stop request; a second cancellation while stopping means "now":
    ``asyncio.current_task().cancelling() > 1`` tells a service to skip its
    grace period.
    """

    async def serve(self, ready: Callable[[], None]) -> None: ...


@runtime_checkable
class SpawnReporter(Protocol):
    """A ``ready`` callable that also wants to hear the pid of a spawned process.

    The supervisor passes one to every child; :class:`ProcessService` reports
    its pid through it so that the ``ChildStarted`` event carries the pid.
    """

    def __call__(self) -> None: ...

    def spawned(self, pid: int) -> None: ...


@runtime_checkable
class HasPid(Protocol):
    """A service that runs an OS process (its pid is None when not running)."""

    @property
    def pid(self) -> int | None: ...


class DoNotRestart(Exception):
    """The child finished for good: do not restart it; its siblings keep running."""


class Unrecoverable(DoNotRestart):
    """The child failed in a way a restart cannot fix (a model that cannot load).

    Not restarted, like :class:`DoNotRestart`, but its status says ``failed``.
    """


class TerminateTree(Exception):
    """Stop the whole tree; the root's ``run_root`` returns ``exit_code``."""

    def __init__(self, exit_code: int, reason: str) -> None:
        super().__init__(exit_code, reason)
        self.exit_code = exit_code
        self.reason = reason

    def __str__(self) -> str:
        return f"terminate tree (exit code {self.exit_code}): {self.reason}"


class Restart(enum.Enum):
    """When a child that ended by itself is started again (Erlang's restart types)."""

    PERMANENT = "permanent"  # always
    TRANSIENT = "transient"  # only after an abnormal exit (it raised)
    TEMPORARY = "temporary"  # never


class Strategy(enum.Enum):
    """Which children restart when one of them fails."""

    ONE_FOR_ONE = "one_for_one"  # only the failed child
    ONE_FOR_ALL = "one_for_all"  # every child: stop all (reverse order), start all
    REST_FOR_ONE = "rest_for_one"  # the failed child and those after it in spec order


@dataclass(frozen=True)
class ChildSpec:
    """One child of a supervisor.

    ``start`` builds a fresh service for every (re)start; it must not start
    anything itself (constructors have no side effects). ``stop_timeout`` bounds
    the wait after the stop request; ``None`` means a brutal kill (the service
    is cancelled twice at once, so a process child gets SIGKILL without grace).
    """

    id: str
    start: Callable[[], Service]
    restart: Restart = Restart.PERMANENT
    stop_timeout: float | None = 10.0


@dataclass(frozen=True)
class SupervisorSpec:
    """Restart policy as data, with suture's defaults (times in seconds).

    - ``failure_decay``: half-life of the failure counter.
    - ``failure_threshold``: above it, restarts pause for ``failure_backoff``.
    - ``backoff_base``, ``backoff_max``, ``jitter``: each restart waits
      ``min(backoff_max, backoff_base * 2 ** (recent failures of that child - 1))``
      shortened by a random fraction of at most ``jitter``.
    - ``stop_timeout``: budget for stopping all children when the supervisor
      stops; once spent, the remaining children are killed without grace.
    """

    id: str
    strategy: Strategy = Strategy.ONE_FOR_ONE
    failure_decay: float = 30.0
    failure_threshold: float = 5.0
    failure_backoff: float = 15.0
    backoff_base: float = 0.1
    backoff_max: float = 15.0
    jitter: float = 0.5
    stop_timeout: float = 10.0

    def __post_init__(self) -> None:
        if self.failure_decay <= 0:
            raise ValueError("failure_decay must be positive")
        if not 0.0 <= self.jitter <= 1.0:
            raise ValueError("jitter must be within [0, 1]")
        if self.backoff_base < 0 or self.backoff_max < 0 or self.failure_backoff < 0:
            raise ValueError("backoff times must not be negative")


class ChildState(enum.Enum):
    STARTING = "starting"  # scheduled or started, not ready yet
    RUNNING = "running"  # called ready()
    BACKOFF = "backoff"  # waiting before a restart
    STOPPED = "stopped"  # not running and not coming back (or never started)
    FAILED = "failed"  # ended by an error and will not be restarted


@dataclass(frozen=True)
class ChildStatus:
    """A snapshot of one child, for the control socket and tests."""

    id: str
    state: ChildState
    pid: int | None = None
    restarts: int = 0
    started_at: float | None = None  # monotonic time of the latest start
    last_exit: str | None = None
    children: tuple[ChildStatus, ...] = field(default=())

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "state": self.state.value,
            "pid": self.pid,
            "restarts": self.restarts,
            "started_at": self.started_at,
            "last_exit": self.last_exit,
            "children": [child.to_json() for child in self.children],
        }
