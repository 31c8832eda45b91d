"""What the pool core's parts share: a job and its one state machine, a worker
as the dispatcher sees it, and what a job ends with.

A job has one state machine (QUEUED -> RUNNING -> DONE, or ABANDONED when
its caller gave up through a deadline or a cancel); :func:`finish` answers
its caller once. A worker runs one job (``current``, the lead of its batch)
and holds at most a few more sent ahead (``ahead``, :mod:`.ahead`); it answers
them in the order they were sent, so there is no table of futures keyed by
message id that two parties could disagree about.
"""

from __future__ import annotations

import asyncio
import enum
import socket
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from poolserve.service.contract.batching import BatchPolicy
from poolserve.service.contract.errors import ServingError, error_for
from poolserve.service.contract.framing import Batcher, Payload
from poolserve.service.poolcore.frames import Reply
from poolserve.service.poolcore.stats import Timings

if TYPE_CHECKING:
    from poolserve.service.poolcore.streams import Parts

DEFAULT_PRIORITY = 1 << 30  # below every explicit priority (1 is the highest)
RETRY_PRIORITY = -(1 << 62)  # a retried job goes before everything else


class JobState(enum.Enum):
    QUEUED = 1
    RUNNING = 2
    DONE = 3
    ABANDONED = 4


@dataclass(slots=True, eq=False)
class Job:
    body: Payload  # a large request's body is a view of the lane frame's buffer
    deadline: float
    priority: int
    seq: int
    future: asyncio.Future[Result]
    tag: str = ""
    idempotent: bool = True
    timeout: float | None = None
    state: JobState = JobState.QUEUED
    enqueued: float = 0.0
    started: float = 0.0
    retried: bool = False
    overtime: asyncio.TimerHandle | None = None
    worker: Worker | None = None  # the worker it runs on (RUNNING, ABANDONED)
    key: float = 0.0  # its place in the queue among its priority (see _order_key)
    precision: float = 0.0  # its caller's own deadline may be this much earlier
    entry: int = 0  # which of its queue entries is live (a requeued job has a new one)
    batch: BatchPolicy | None = None  # its model batches: with jobs of the same batch_key
    rows: int = 1  # its rows along dimension 0, when its model batches
    batch_key: bytes = b""
    members: list[Job] | None = None  # the batch it leads on a worker (itself first)
    stream: Parts | None = None  # a stream's parts, then its end (a decoupled model)
    pinned: bool = False  # it runs on the one worker given (a sequence's), after its others
    sequence: str = ""  # the sequence it belongs to, for messages
    notice: bool = False  # a SEQUENCE_END notice, not a request


@dataclass(slots=True)
class Result:
    body: Payload  # a large reply's body is a view of the worker frame's buffer
    timings: Timings
    queue_ns: int
    enqueued: float = 0.0  # loop (monotonic) times, for spans built after the fact
    started: float = 0.0
    finished: float = 0.0
    batch_size: int = 1  # rows of the execution it was part of
    batch_report: bool = True  # the one result of its execution that counts the execution


class WorkerState(enum.StrEnum):
    STARTING = "starting"
    WARMING = "warming"  # in its self-test: no job yet
    IDLE = "idle"
    BUSY = "busy"
    STUCK = "stuck"  # still in a job whose caller left (killed after the abandon grace)
    DEAD = "dead"


@dataclass(eq=False)
class Worker:
    pid: int
    sock: socket.socket
    pidfd: int = -1
    transport: asyncio.Transport | None = None
    writer: Batcher | None = None  # scatter writes to the worker (never transport.write)
    current: Job | None = None
    ahead: deque[Job] = field(default_factory=deque)  # sent before ``current`` ended (ahead.py)
    served: int = 0
    state: WorkerState = WorkerState.STARTING
    started_at: float = field(default_factory=time.monotonic)
    last_seen: float = field(default_factory=time.monotonic)
    kill_reason: str = ""
    status: str | None = None
    lost_jobs: list[Job] = field(default_factory=list)
    lost_tag: str = ""
    generation: int = 0
    retiring: bool = False
    warming: str = ""  # the model whose warm-up prediction (or load, if spawned) runs now
    loading: bool = False
    warmup_timer: asyncio.TimerHandle | None = None
    died_warming: bool = False
    pinned: deque[Job] = field(default_factory=deque)  # its sequences' jobs, in arrival order
    sequences: int = 0  # live sequences whose state it holds (it retires after them)


@dataclass(frozen=True)
class WorkerGone:
    """A dead worker, reported once both its socket closed and its status is known."""

    pid: int
    status: str
    tag: str  # the model it was running when it died, "" if idle
    reason: str  # why we killed it, "" if it died on its own
    retired: bool = False  # we retired it on purpose (rolling replacement)
    warmup: bool = False  # it died (or was killed) in its self-test, warming up ``tag``


@dataclass(frozen=True)
class Limits:
    """A dispatcher's bounds, as both doors configure them (see :class:`Dispatcher`)."""

    max_queue: int
    heartbeat_timeout: float
    warmup_timeout: float
    abandon_grace: float


def finish(job: Job, outcome: Result | ServingError) -> None:
    """Answers ``job``'s caller (once; a later outcome is dropped)."""
    if job.overtime is not None:
        job.overtime.cancel()
        job.overtime = None
    if job.future.done():
        return
    if job.stream is not None and not job.stream.ended:
        job.stream.ended = True
        job.stream.queue.put_nowait(outcome)
    if isinstance(outcome, Result):
        job.future.set_result(outcome)
    else:
        job.future.set_exception(outcome)
        if job.stream is not None:
            job.future.exception()  # the stream's caller reads it from the queue


def reply_per_job(lead: Job, reply: Reply) -> list[Reply]:
    """The replies in ``reply`` (a batch's, or one), one per job of ``lead``'s
    execution; a ValueError if they do not match."""
    members = lead.members or [lead]
    replies = reply.parts if reply.parts is not None else [reply]
    if (reply.parts is None) != (lead.members is None) or len(replies) != len(members):
        raise ValueError(f"{len(replies)} replies for a batch of {len(members)} requests")
    return replies


def answer(lead: Job, replies: list[Reply], finished: float) -> int:
    """Answers each job of one execution (``lead``, alone or leading its batch)
    with its reply; returns how many replies came for callers that left."""
    members = lead.members or [lead]
    rows = sum(m.rows for m in members)
    report, late = True, 0
    for member, part in zip(members, replies, strict=True):
        if member.state is not JobState.RUNNING:
            late += 1
            continue
        member.state = JobState.DONE
        if part.failure is None:
            queue_ns = int((member.started - member.enqueued) * 1e9)
            result = Result(
                part.body,
                part.timings,
                queue_ns,
                member.enqueued,
                member.started,
                finished,
                batch_size=rows,
                batch_report=report,
            )
            report = False
            finish(member, result)
        else:
            finish(member, error_for(part.failure, part.message))
    return late
