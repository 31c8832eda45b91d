"""What happens in a supervision tree, as typed events through one hook.

A supervisor calls its ``Callable[[Event], None]`` hook for each event; the
same stream feeds logs (:func:`event_logger`), metrics and tests. Every event
has ``to_json()`` (a flat dict with an ``event`` name) and a readable ``str``.
Child events carry ``supervisor``, the id of the supervisor that owns the
child, because child ids only need to be unique among siblings.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, ClassVar, Literal


@dataclass(frozen=True)
class _Event:
    name: ClassVar[str] = "event"
    level: ClassVar[int] = logging.INFO

    def log_level(self) -> int:
        return self.level

    def to_json(self) -> dict[str, Any]:
        return {"event": self.name, **asdict(self)}


@dataclass(frozen=True)
class ChildStarted(_Event):
    name: ClassVar[str] = "child_started"

    id: str
    pid: int | None = None
    supervisor: str = ""

    def __str__(self) -> str:
        pid = f" (pid {self.pid})" if self.pid is not None else ""
        return f"{_where(self.supervisor)}child {self.id} started{pid}"


@dataclass(frozen=True)
class ChildReady(_Event):
    name: ClassVar[str] = "child_ready"

    id: str
    supervisor: str = ""

    def __str__(self) -> str:
        return f"{_where(self.supervisor)}child {self.id} is ready"


@dataclass(frozen=True)
class ChildExited(_Event):
    name: ClassVar[str] = "child_exited"

    id: str
    outcome: str
    will_restart: bool
    supervisor: str = ""
    # True when the child was stopped by its supervisor or finished cleanly.
    normal: bool = False

    def log_level(self) -> int:
        return logging.INFO if self.normal else logging.WARNING

    def __str__(self) -> str:
        then = "will restart" if self.will_restart else "will not restart"
        return f"{_where(self.supervisor)}child {self.id} {self.outcome}; {then}"


@dataclass(frozen=True)
class ChildRestarting(_Event):
    name: ClassVar[str] = "child_restarting"

    id: str
    backoff_s: float
    supervisor: str = ""

    def __str__(self) -> str:
        return f"{_where(self.supervisor)}restarting child {self.id} in {self.backoff_s:.3g}s"


@dataclass(frozen=True)
class BackoffPaused(_Event):
    name: ClassVar[str] = "backoff_paused"
    level: ClassVar[int] = logging.ERROR

    supervisor_id: str
    resume_in_s: float

    def __str__(self) -> str:
        return (
            f"supervisor {self.supervisor_id}: too many failures, "
            f"restarts paused for {self.resume_in_s:.3g}s"
        )


@dataclass(frozen=True)
class BackoffResumed(_Event):
    name: ClassVar[str] = "backoff_resumed"

    supervisor_id: str

    def __str__(self) -> str:
        return f"supervisor {self.supervisor_id}: restarts resumed"


@dataclass(frozen=True)
class StopTimeout(_Event):
    name: ClassVar[str] = "stop_timeout"
    level: ClassVar[int] = logging.ERROR

    id: str
    timeout_s: float
    supervisor: str = ""

    def __str__(self) -> str:
        return (
            f"{_where(self.supervisor)}child {self.id} did not stop within "
            f"{self.timeout_s:.3g}s; killing it"
        )


@dataclass(frozen=True)
class TreeTerminating(_Event):
    name: ClassVar[str] = "tree_terminating"
    level: ClassVar[int] = logging.ERROR

    reason: str
    exit_code: int
    id: str = ""  # the child that asked

    def __str__(self) -> str:
        by = f" (asked by {self.id})" if self.id else ""
        return f"terminating the tree with exit code {self.exit_code}{by}: {self.reason}"


@dataclass(frozen=True)
class OrphanReaped(_Event):
    """A process reparented to us (we are the subreaper) exited and was reaped."""

    name: ClassVar[str] = "orphan_reaped"

    pid: int
    status: str

    def __str__(self) -> str:
        return f"reaped orphan pid {self.pid}: {self.status}"


Event = (
    ChildStarted
    | ChildReady
    | ChildExited
    | ChildRestarting
    | BackoffPaused
    | BackoffResumed
    | StopTimeout
    | TreeTerminating
    | OrphanReaped
)
EventHook = Callable[[Event], None]


def _where(supervisor: str) -> str:
    return f"{supervisor}: " if supervisor else ""


def event_logger(
    logger: logging.Logger | None = None, *, style: Literal["text", "json"] = "text"
) -> EventHook:
    """A hook that logs each event: its readable ``str`` as the message, and
    with ``style="json"`` its ``to_json()`` as the record's ``event`` field
    (a JSON formatter writes it as an object; the message stays text, so a
    log line is never JSON inside a JSON string)."""
    log = logger or logging.getLogger("poolserve.supervisor")

    def hook(event: Event) -> None:
        extra = {"event": event.to_json()} if style == "json" else None
        log.log(event.log_level(), "%s", str(event), extra=extra)

    return hook


def fan_out(*hooks: EventHook) -> EventHook:
    """One hook that calls several (logs and metrics, say) in order."""

    def hook(event: Event) -> None:
        for each in hooks:
            each(event)

    return hook
