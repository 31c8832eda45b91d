"""A worker's socket, the pool's end: every byte counts as a sign of life,
every frame is delivered (a self-test notice, a reply, or a broken protocol),
and a job goes out as one frame (:func:`send_job`)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import cast

from poolserve.service.contract.framing import Batcher
from poolserve.service.poolcore.frames import (
    SELF_TEST,
    Reply,
    ReplyBuffer,
    ahead_frame,
    batch_frame,
    request_frame,
    sequence_end_frame,
    stream_frame,
)
from poolserve.service.poolcore.jobs import Job, Worker


class WorkerLink(asyncio.BufferedProtocol):
    """One worker's socket.

    Replies are received straight into the reader's buffers (a large one into a
    buffer of its own size, whose body goes on to the lane as a view);
    requests leave as scatter writes of (header, body view).
    """

    def __init__(
        self,
        worker: Worker,
        closed: asyncio.Future[None],
        self_test: Callable[[Worker, Reply], None],
        reply: Callable[[Worker, Reply], None],
        broken: Callable[[Worker, ValueError], None],
    ) -> None:
        """``closed`` is set once the socket closed; ``self_test`` takes the
        self-test frames, ``reply`` the others, ``broken`` a protocol error."""
        self.worker = worker
        self.self_test = self_test
        self.reply = reply
        self.broken = broken
        self.closed = closed
        self.replies = ReplyBuffer()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports have asyncio.Transport's interface without subclassing it
        self.worker.writer = Batcher(cast(asyncio.Transport, transport))

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.replies.get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        worker = self.worker
        worker.last_seen = time.monotonic()
        try:
            replies = self.replies.buffer_updated(nbytes)
            for reply in replies:
                if reply.kind in SELF_TEST:
                    self.self_test(worker, reply)
                else:
                    self.reply(worker, reply)
        except ValueError as exc:
            self.broken(worker, exc)
            return
        if replies and worker.writer is not None:  # what the answered calls write, this turn
            worker.writer.turn.arm()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.worker.writer is not None:
            self.worker.writer.close()
        if not self.closed.done():
            self.closed.set_result(None)


async def serve_link(
    worker: Worker,
    connected: Callable[[Worker], None],
    self_test: Callable[[Worker, Reply], None],
    reply: Callable[[Worker, Reply], None],
    broken: Callable[[Worker, ValueError], None],
) -> None:
    """Connects to ``worker``'s socket and delivers its frames until it closes."""
    loop = asyncio.get_running_loop()
    closed: asyncio.Future[None] = loop.create_future()
    transport, _ = await loop.connect_accepted_socket(
        lambda: WorkerLink(worker, closed, self_test, reply, broken), sock=worker.sock
    )
    # uvloop's transports (uvicorn picks uvloop when installed) have the
    # asyncio.Transport interface without subclassing it: no isinstance check.
    worker.transport = transport
    connected(worker)
    await closed  # the worker died or closed, or we closed it


def send_job(worker: Worker, job: Job, ahead: bool = False) -> None:
    """Sends ``job`` (with its batch, if it leads one) to the worker it runs on.

    Frames go out as parts (header, body views: no join), at once: a worker's
    socket carries its job and the few sent ahead (:mod:`.ahead`).
    """
    assert worker.writer is not None
    if job.stream is not None:
        worker.writer.write_now(*stream_frame(job.seq, job.stream.window, job.body))
    elif job.notice:
        worker.writer.write_now(*sequence_end_frame(job.seq, job.body))
    elif job.members is None and ahead:
        worker.writer.write_now(*ahead_frame(job.seq, job.deadline, job.body))
    elif job.members is None:
        worker.writer.write_now(*request_frame(job.seq, job.body))
    else:
        worker.writer.write_now(*batch_frame(job.seq, [m.body for m in job.members]))
