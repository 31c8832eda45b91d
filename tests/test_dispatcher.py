"""The dispatcher with in-process fake workers over real socketpairs (no fork)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable

import pytest
from hypothesis import given
from hypothesis import strategies as st

from poolserve.service.contract.errors import DeadlineExceeded, Failure, QueueFull, Unavailable
from poolserve.service.poolcore.admission import ServiceTime
from poolserve.service.poolcore.ahead import AHEAD_JOBS
from poolserve.service.poolcore.dispatcher import Dispatcher
from poolserve.service.poolcore.frames import (
    AHEAD,
    COUNT,
    DEADLINE,
    HEADER,
    REQUEST,
    STREAM,
    ReplyBuffer,
    error_frame,
    heartbeat_frame,
    ready_frame,
    reply_frame,
)
from poolserve.service.poolcore.jobqueue import JobQueue
from poolserve.service.poolcore.jobs import Job, Worker, WorkerGone
from poolserve.service.poolcore.stats import Timings


class FakeWorker:
    """The worker's end of a socketpair, driven by the test."""

    def __init__(self, dispatcher: Dispatcher, pid: int) -> None:
        ours, theirs = socket.socketpair()
        self.sock = theirs
        self.pid = pid
        dispatcher.add_worker(pid, ours)
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.kinds: list[int] = []  # of the frames received
        self.deadlines: list[float] = []  # the AHEAD frames'
        FAKES.append(self)

    async def connect(self, ready: bool = True) -> None:
        """Connects; ``ready``: passes its self-test at once (the READY frame)."""
        self.reader, self.writer = await asyncio.open_connection(sock=self.sock)
        if ready:
            self.writer.write(ready_frame(b'{"raised": {}}'))

    async def receive(self) -> tuple[int, bytes]:
        assert self.reader is not None
        length, kind, seq = HEADER.unpack(await self.reader.readexactly(HEADER.size))
        assert kind in (REQUEST, AHEAD, STREAM)
        self.kinds.append(kind)
        if kind == AHEAD:  # a job sent ahead: its deadline, then the request
            (deadline,) = DEADLINE.unpack(await self.reader.readexactly(DEADLINE.size))
            self.deadlines.append(deadline)
            length -= DEADLINE.size
        if kind == STREAM:  # a stream: its window, then the request
            await self.reader.readexactly(COUNT.size)
            length -= COUNT.size
        return seq, await self.reader.readexactly(length)

    def reply(self, seq: int, body: bytes, compute_ns: int = 2) -> None:
        assert self.writer is not None
        self.writer.writelines(reply_frame(seq, Timings(1, compute_ns, 3), body))

    def die(self) -> None:
        assert self.writer is not None
        self.writer.close()

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            await self.writer.wait_closed()
        else:
            self.sock.close()


FAKES: list[FakeWorker] = []


async def until(predicate: Callable[[], bool]) -> None:
    for _ in range(10_000):
        if predicate():
            return
        await asyncio.sleep(0)  # yield to the dispatcher's tasks
    raise AssertionError("condition never held")


def with_dispatcher(
    body: Callable[[Dispatcher, list[WorkerGone]], Awaitable[None]], max_queue: int = 100
) -> None:
    async def main() -> None:
        gone: list[WorkerGone] = []
        dispatcher = Dispatcher("p", max_queue, on_worker_gone=gone.append)
        started = asyncio.Event()
        runner = asyncio.create_task(dispatcher.run(started.set))
        await started.wait()
        try:
            await body(dispatcher, gone)
        finally:
            dispatcher.close()
            await runner
            while FAKES:
                await FAKES.pop().close()

    asyncio.run(main())


def test_priority_then_earliest_deadline_first() -> None:
    async def body(d: Dispatcher, _: list[WorkerGone]) -> None:
        w = FakeWorker(d, 1)
        await w.connect()
        await until(lambda: d.live_workers() == 1)
        loop = asyncio.get_running_loop()
        now = loop.time()
        first = asyncio.ensure_future(d.submit(b"busy", now + 60))
        seq, body_ = await w.receive()
        assert body_ == b"busy"
        jobs = {
            b"late-low": asyncio.ensure_future(d.submit(b"late-low", now + 50)),
            b"early-low": asyncio.ensure_future(d.submit(b"early-low", now + 10)),
            b"prio2": asyncio.ensure_future(d.submit(b"prio2", now + 40, priority=2)),
            b"prio1": asyncio.ensure_future(d.submit(b"prio1", now + 45, priority=1)),
        }
        await until(lambda: d.queue_depth() == 4)
        order = []
        w.reply(seq, b"ok")
        for _ in range(4):
            seq, got = await w.receive()
            order.append(got)
            w.reply(seq, got.upper())
        assert order == [b"prio1", b"prio2", b"early-low", b"late-low"]
        assert (await first).body == b"ok"
        for name, job in jobs.items():
            assert (await job).body == name.upper()

    with_dispatcher(body)


def test_deadlines_within_their_precision_keep_arrival_order() -> None:
    """Deadlines from gRPC timeouts are only so precise (a 20 s timeout arrives
    rounded up to 100 ms): a later arrival whose deadline is earlier by less than
    that precision runs after the earlier arrival; one clearly earlier still
    goes first, and an exact deadline (precision 0) is plain EDF."""

    async def body(d: Dispatcher, _: list[WorkerGone]) -> None:
        w = FakeWorker(d, 1)
        await w.connect()
        await until(lambda: d.live_workers() == 1)
        now = asyncio.get_running_loop().time()
        first = asyncio.ensure_future(d.submit(b"busy", now + 60))
        seq, _ = await w.receive()
        arrivals = [  # (name, deadline, precision), in arrival order
            (b"a1", now + 20.1, 0.101),  # its 20 s timeout was rounded up
            (b"a2", now + 20.06, 0.101),  # sent 60 ms later, rounded down
            (b"a3", now + 20.02, 0.101),  # 120 ms later, rounded down again
            (b"exact", now + 20.05, 0.0),  # exact: goes by its deadline
            (b"urgent", now + 10.0, 0.011),  # clearly earlier
            (b"a4", now + 20.2, 0.101),  # later than all the others
        ]
        jobs = [
            asyncio.ensure_future(d.submit(name, deadline, precision=precision))
            for name, deadline, precision in arrivals
        ]
        await until(lambda: d.queue_depth() == len(arrivals))
        order = []
        w.reply(seq, b"ok")
        for _ in arrivals:
            seq, got = await w.receive()
            order.append(got)
            w.reply(seq, got)
        assert order == [b"urgent", b"exact", b"a1", b"a2", b"a3", b"a4"]
        assert (await first).body == b"ok"
        assert [(await job).body for job in jobs] == [name for name, _, _ in arrivals]

    with_dispatcher(body)


@given(
    jitter=st.lists(st.floats(min_value=0.0, max_value=0.1), min_size=1, max_size=30),
    spacing=st.floats(min_value=0.0, max_value=0.2),
)
def test_order_keys_keep_arrival_order_and_stay_within_precision(
    jitter: list[float], spacing: float
) -> None:
    """Equal timeouts sent ``spacing`` apart, each deadline rounded up by up to
    one unit of precision: the queue keeps them in arrival order, and no key is
    more than the precision past its own deadline."""
    queue = JobQueue(1000, "p")
    loop = asyncio.new_event_loop()
    try:
        jobs = []
        for k, extra in enumerate(jitter):
            job = Job(b"", 20.0 + k * spacing + extra, 1, k + 1, loop.create_future())
            queue.push(job, precision=0.1)
            assert job.deadline <= job.key <= job.deadline + 0.1
            jobs.append(job)
        assert [queue.pop() for _ in jobs] == jobs
        assert queue.pop() is None and len(queue) == 0
    finally:
        loop.close()


def test_queue_bound_and_expiry_in_queue() -> None:
    async def body(d: Dispatcher, _: list[WorkerGone]) -> None:
        w = FakeWorker(d, 1)
        await w.connect()
        await until(lambda: d.live_workers() == 1)
        now = asyncio.get_running_loop().time()
        busy = asyncio.ensure_future(d.submit(b"busy", now + 60))
        seq, _ = await w.receive()
        waiting = [asyncio.ensure_future(d.submit(b"w", now + 0.05)) for _ in range(2)]
        await until(lambda: d.queue_depth() == 2)
        with pytest.raises(QueueFull, match="pool 'p'"):
            await d.submit(b"x", now + 60)
        for job in waiting:
            with pytest.raises(DeadlineExceeded, match="never reached a worker"):
                await job
        assert d.queue_depth() == 0
        w.reply(seq, b"done")
        assert (await busy).body == b"done"
        assert d.expired_in_queue == 2

    with_dispatcher(body, max_queue=2)


def test_cancel_leaves_queue_and_late_reply_is_dropped() -> None:
    async def body(d: Dispatcher, _: list[WorkerGone]) -> None:
        w = FakeWorker(d, 1)
        await w.connect()
        await until(lambda: d.live_workers() == 1)
        now = asyncio.get_running_loop().time()
        running = asyncio.ensure_future(d.submit(b"r", now + 60))
        seq, _ = await w.receive()
        queued = asyncio.ensure_future(d.submit(b"q", now + 60))
        await until(lambda: d.queue_depth() == 1)
        queued.cancel()
        await until(lambda: d.queue_depth() == 0)
        running.cancel()  # the caller leaves while its job runs
        await asyncio.sleep(0)
        w.reply(seq, b"late")
        await until(lambda: d.late_replies == 1)
        after = asyncio.ensure_future(d.submit(b"next", now + 60))
        seq, got = await w.receive()
        assert got == b"next", "the cancelled queued job never reached the worker"
        w.reply(seq, b"fine")
        assert (await after).body == b"fine"

    with_dispatcher(body)


def test_begun_jobs_keep_the_queue_bound_deadlines_and_cancel() -> None:
    """Dispatcher.begin (a lane call without a task): the same bound, expiry in the
    queue, cancel out of the queue and dropped late reply as submit; each outcome
    delivered once, none after a cancel."""

    async def body(d: Dispatcher, _: list[WorkerGone]) -> None:
        w = FakeWorker(d, 1)
        await w.connect()
        await until(lambda: d.live_workers() == 1)
        now = asyncio.get_running_loop().time()
        outcomes: dict[str, list[object]] = {}
        arrived: dict[str, asyncio.Event] = {}

        def begin(name: str, deadline: float) -> object:
            got = outcomes.setdefault(name, [])
            came = arrived.setdefault(name, asyncio.Event())

            def done(outcome: object) -> None:
                got.append(outcome)
                came.set()

            return d.begin(name.encode(), deadline, done)

        running = begin("busy", now + 60)
        seq, _ = await w.receive()
        begin("late1", now + 0.05)
        cancelled = begin("gone", now + 60)
        await until(lambda: d.queue_depth() == 2)
        with pytest.raises(QueueFull, match="pool 'p'"):
            d.begin(b"x", now + 60, outcomes.setdefault("x", []).append)
        cancelled.cancel()  # type: ignore[attr-defined]
        assert d.queue_depth() == 1, "a cancelled call's job leaves the queue at once"
        await asyncio.wait_for(arrived["late1"].wait(), 30)  # its deadline, 50 ms
        (error,) = outcomes["late1"]
        assert isinstance(error, DeadlineExceeded) and "never reached a worker" in str(error)
        assert d.queue_depth() == 0 and d.expired_in_queue == 1
        running.cancel()  # type: ignore[attr-defined]  # its caller leaves while it runs
        w.reply(seq, b"late")
        await until(lambda: d.late_replies == 1)
        begin("next", now + 60)
        seq, got = await w.receive()
        assert got == b"next", "neither the expired nor the cancelled job reached the worker"
        w.reply(seq, b"fine")
        await asyncio.wait_for(arrived["next"].wait(), 30)
        (result,) = outcomes["next"]
        assert getattr(result, "body", None) == b"fine"
        for _ in range(10):
            await asyncio.sleep(0)
        assert outcomes["busy"] == [] and outcomes["gone"] == [] and outcomes["x"] == []

    with_dispatcher(body, max_queue=2)


def test_worker_death_retries_once_or_fails_with_status() -> None:
    async def body(d: Dispatcher, gone: list[WorkerGone]) -> None:
        a, b = FakeWorker(d, 11), FakeWorker(d, 12)
        await a.connect()
        await b.connect()
        await until(lambda: d.live_workers() == 2)
        now = asyncio.get_running_loop().time()
        job = asyncio.ensure_future(d.submit(b"idem", now + 60, tag="m"))
        first_worker = None
        for worker in (a, b):
            try:
                seq, _ = await asyncio.wait_for(worker.receive(), 0.2)
                first_worker, other = worker, (b if worker is a else a)
                break
            except TimeoutError:
                continue
        assert first_worker is not None
        first_worker.die()
        d.worker_exited(first_worker.pid, "killed by SIGKILL")
        seq, got = await other.receive()
        assert got == b"idem"
        other.reply(seq, b"second try")
        assert (await job).body == b"second try"
        await until(lambda: len(gone) == 1)
        assert gone[0] == WorkerGone(first_worker.pid, "killed by SIGKILL", "m", "")

        once = asyncio.ensure_future(d.submit(b"once", now + 60, idempotent=False))
        seq, _ = await other.receive()
        other.die()
        d.worker_exited(other.pid, "killed by SIGSEGV")
        with pytest.raises(Unavailable, match="SIGSEGV"):
            await once

    with_dispatcher(body)


def test_a_job_that_cannot_finish_in_time_is_not_started() -> None:
    async def body(d: Dispatcher, _: list[WorkerGone]) -> None:
        w = FakeWorker(d, 1)
        await w.connect()
        await until(lambda: d.live_workers() == 1)
        loop = asyncio.get_running_loop()
        first = asyncio.ensure_future(d.submit(b"learn", loop.time() + 60, tag="m"))
        seq, _ = await w.receive()
        await asyncio.sleep(1.0)  # model m keeps the worker about 1 s: the pool learns it
        w.reply(seq, b"ok")
        await first
        busy = asyncio.ensure_future(d.submit(b"busy", loop.time() + 60, tag="other"))
        seq, _ = await w.receive()
        short = asyncio.ensure_future(d.submit(b"short", loop.time() + 4.0, tag="m"))
        long = asyncio.ensure_future(d.submit(b"long", loop.time() + 30, tag="m"))
        await until(lambda: d.queue_depth() == 2)
        await asyncio.sleep(3.0)  # short has < 1.25 s left now (about 1 s of slack)
        w.reply(seq, b"done")
        with pytest.raises(DeadlineExceeded, match="would pass before the request could finish"):
            await short
        seq, got = await w.receive()
        assert got == b"long", "the hopeless job never reached the worker"
        w.reply(seq, b"fine")
        assert (await long).body == b"fine"
        assert (await busy).body == b"done"
        assert d.skipped_hopeless == 1

    with_dispatcher(body)


def test_a_job_whose_caller_may_have_less_time_is_not_started() -> None:
    """A deadline that came as a gRPC timeout may be later than the caller's own
    by its precision: the start decision counts the caller's earliest deadline."""

    async def body(d: Dispatcher, _: list[WorkerGone]) -> None:
        w = FakeWorker(d, 1)
        await w.connect()
        await until(lambda: d.live_workers() == 1)
        loop = asyncio.get_running_loop()
        first = asyncio.ensure_future(d.submit(b"learn", loop.time() + 60, tag="m"))
        seq, _ = await w.receive()
        await asyncio.sleep(0.3)  # model m keeps the worker about 0.3 s: the pool learns it
        w.reply(seq, b"ok")
        await first  # m now needs about 0.6 s (the first sample, twice)
        busy = asyncio.ensure_future(d.submit(b"busy", loop.time() + 60, tag="other"))
        seq, _ = await w.receive()
        now = loop.time()
        vague = asyncio.ensure_future(d.submit(b"vague", now + 1.0, tag="m", precision=0.6))
        exact = asyncio.ensure_future(d.submit(b"exact", now + 1.0, tag="m"))
        await until(lambda: d.queue_depth() == 2)
        w.reply(seq, b"done")
        with pytest.raises(DeadlineExceeded, match="would pass before the request could finish"):
            await vague
        seq, got = await w.receive()
        assert got == b"exact"
        w.reply(seq, b"fine")
        assert (await exact).body == b"fine"
        assert (await busy).body == b"done"

    with_dispatcher(body)


def test_service_time_needs_about_the_mean_when_quiet_and_more_when_noisy() -> None:
    quiet = ServiceTime(0.020)
    for k in range(40):
        quiet.add(0.020 * (1 + 0.02 * (-1) ** k))
    assert 0.020 <= quiet.needs() <= 0.020 * 1.3  # a quiet host: little more than the mean
    noisy = ServiceTime(0.020)
    samples = [0.020, 0.045, 0.020, 0.030, 0.080, 0.025, 0.020, 0.060] * 6
    for sample in samples:
        noisy.add(sample)
    ninetieth = sorted(samples)[int(0.9 * len(samples))]
    assert noisy.needs() >= ninetieth  # a noisy one: room for the slower runs
    assert noisy.needs() < max(samples) * 2


@given(st.lists(st.integers(1, 40), min_size=1, max_size=30))
def test_reply_buffer_cuts_replies_errors_and_heartbeats_out_of_any_chunking(
    cuts: list[int],
) -> None:
    stream = (
        b"".join(reply_frame(1, Timings(1, 2, 3), b"first body"))
        + heartbeat_frame()
        + error_frame(2, Timings(4, 5, 6), Failure.MODEL_ERROR, "model raised")
        + b"".join(reply_frame(3, Timings(), b""))
    )
    buffer = ReplyBuffer()
    got = []
    pos, turn = 0, 0
    while pos < len(stream):
        step = cuts[turn % len(cuts)]
        got.extend(buffer.feed(stream[pos : pos + step]))
        pos, turn = pos + step, turn + 1
    assert [(r.seq, r.body, r.failure, r.message) for r in got] == [
        (1, b"first body", None, ""),
        (2, b"", Failure.MODEL_ERROR, "model raised"),
        (3, b"", None, ""),
    ]
    assert got[0].timings == Timings(1, 2, 3) and got[1].timings == Timings(4, 5, 6)


def test_reply_buffer_rejects_a_frame_a_worker_must_not_send() -> None:
    with pytest.raises(ValueError, match="unexpected frame kind"):
        ReplyBuffer().feed(HEADER.pack(0, REQUEST, 9))


def test_a_pool_that_was_itself_stalled_does_not_blame_its_workers() -> None:
    """After a SIGSTOP or a blocked loop, heartbeats may sit unread in the
    sockets: the first late check must not kill workers for that (seen in
    test_hung_pool as a worker killed right after SIGCONT)."""

    async def body(d: Dispatcher, gone: list[WorkerGone]) -> None:
        fake = FakeWorker(d, 11)
        await fake.connect()
        await until(lambda: d.live_workers() == 1)
        (worker,) = d.workers()
        worker.last_seen -= 10 * d.watch.heartbeat_timeout  # silent far past the timeout
        killed: list[str] = []
        d.watch.kill = lambda worker, reason: killed.append(reason)  # type: ignore[method-assign]
        now = asyncio.get_running_loop().time()
        d.watch.check_heartbeats(now, late_by=2.0, period=0.5)  # this check ran 2 s late
        assert killed == []
        d.watch.check_heartbeats(now, late_by=0.01, period=0.5)  # on time: the silence counts
        assert len(killed) == 1 and killed[0].startswith("stopped heartbeating")

    with_dispatcher(body)


async def nothing_comes(worker: FakeWorker) -> bool:
    """Whether no job reaches ``worker`` within a short while."""
    try:
        await asyncio.wait_for(worker.receive(), 0.3)
    except TimeoutError:
        return True
    return False


async def learn_light(d: Dispatcher, w: FakeWorker, tag: str) -> None:
    """One job of model ``tag`` answered at once: the model is known to be light."""
    now = asyncio.get_running_loop().time()
    job = asyncio.ensure_future(d.submit(b"learn", now + 60, tag=tag))
    seq, _ = await w.receive()
    w.reply(seq, b"learnt")
    await job
    mean = d.admission.service_mean(tag)
    assert mean is not None and mean < 0.005, mean


def test_a_light_models_next_jobs_go_to_its_busy_worker_ahead() -> None:
    async def body(d: Dispatcher, _: list[WorkerGone]) -> None:
        w = FakeWorker(d, 1)
        await w.connect()
        await until(lambda: d.live_workers() == 1)
        await learn_light(d, w, "m")
        now = asyncio.get_running_loop().time()
        a = asyncio.ensure_future(d.submit(b"a", now + 60, tag="m"))
        seq_a, got = await w.receive()
        assert got == b"a" and w.kinds[-1] == REQUEST
        # the next ones reach the worker before a is answered, each with its
        # deadline, and are not queued: AHEAD_JOBS of them at most
        ahead = []
        for i in range(AHEAD_JOBS):
            name = f"b{i}".encode()
            call = asyncio.ensure_future(d.submit(name, now + 50 - i, tag="m"))
            seq, got = await w.receive()
            assert got == name and w.kinds[-1] == AHEAD
            assert w.deadlines[-1] == pytest.approx(now + 50 - i)
            ahead.append((seq, call))
        assert d.queue_depth() == 0
        c = asyncio.ensure_future(d.submit(b"c", now + 60, tag="m"))
        # c waits in the queue (no waiting to see that nothing comes: held by a slow
        # answer, "m" would look slow)
        await until(lambda: d.queue_depth() == 1)
        # a's answer: the first ahead runs, and c (the queue's head) goes ahead in its place
        w.reply(seq_a, b"A")
        assert (await a).body == b"A"
        seq_c, got = await w.receive()
        assert got == b"c" and w.kinds[-1] == AHEAD
        assert d.queue_depth() == 0
        # answers go to their own callers, in the order sent
        for i, (seq, _) in enumerate(ahead):
            w.reply(seq, f"B{i}".encode())
        w.reply(seq_c, b"C")
        assert [(await call).body for _, call in ahead] == [
            f"B{i}".encode() for i in range(AHEAD_JOBS)
        ]
        assert (await c).body == b"C"
        # a caller that leaves while its job is ahead: the reply is dropped
        d_ = asyncio.ensure_future(d.submit(b"d", now + 60, tag="m"))
        seq_d, _ = await w.receive()
        e = asyncio.ensure_future(d.submit(b"e", now + 60, tag="m"))
        seq_e, _ = await w.receive()
        assert w.kinds[-1] == AHEAD
        e.cancel()
        w.reply(seq_d, b"D")
        w.reply(seq_e, b"E")
        assert (await d_).body == b"D"
        await until(lambda: d.late_replies == 1)
        with pytest.raises(asyncio.CancelledError):
            await e
        assert d.sent_ahead == AHEAD_JOBS + 2

    with_dispatcher(body)


def test_jobs_ahead_of_a_worker_that_dies_run_elsewhere_in_their_order() -> None:
    async def body(d: Dispatcher, gone: list[WorkerGone]) -> None:
        a = FakeWorker(d, 31)
        await a.connect()
        await until(lambda: d.live_workers() == 1)
        await learn_light(d, a, "m")
        now = asyncio.get_running_loop().time()
        first = asyncio.ensure_future(d.submit(b"first", now + 60, tag="m", idempotent=False))
        await a.receive()
        names = [f"n{i}".encode() for i in range(AHEAD_JOBS)]
        calls = [asyncio.ensure_future(d.submit(n, now + 60, tag="m")) for n in names]
        for name in names:
            assert (await a.receive())[1] == name and a.kinds[-1] == AHEAD
        later = asyncio.ensure_future(d.submit(b"later", now + 60, tag="m"))
        await until(lambda: d.queue_depth() == 1)
        a.die()
        d.worker_exited(a.pid, "killed by SIGKILL")
        with pytest.raises(Unavailable, match="SIGKILL"):
            await first  # it ran (it may have done its work): not run twice
        # none of those ahead started: they run on a new worker, before the one
        # queued behind them, in the order they came
        b = FakeWorker(d, 32)
        await b.connect()
        order = []
        for _ in range(AHEAD_JOBS + 1):
            seq, got = await b.receive()
            order.append(got)
            b.reply(seq, got.upper())
        assert order == [*names, b"later"]
        assert [(await call).body for call in calls] == [n.upper() for n in names]
        assert (await later).body == b"LATER"
        await until(lambda: len(gone) == 1)

    with_dispatcher(body)


def test_jobs_of_an_unknown_or_slow_model_are_not_sent_ahead() -> None:
    async def body(d: Dispatcher, _: list[WorkerGone]) -> None:
        w = FakeWorker(d, 1)
        await w.connect()
        await until(lambda: d.live_workers() == 1)
        now = asyncio.get_running_loop().time()
        # no answer yet: its service time is unknown
        a = asyncio.ensure_future(d.submit(b"a", now + 60, tag="slow"))
        seq, _ = await w.receive()
        b = asyncio.ensure_future(d.submit(b"b", now + 60, tag="slow"))
        await until(lambda: d.queue_depth() == 1)
        assert await nothing_comes(w)
        await asyncio.sleep(0.05)  # the model's run: it takes 50 ms or more
        w.reply(seq, b"A")
        await a
        seq, got = await w.receive()
        assert got == b"b"
        mean = d.admission.service_mean("slow")
        assert mean is not None and mean >= 0.05
        c = asyncio.ensure_future(d.submit(b"c", now + 60, tag="slow"))
        await until(lambda: d.queue_depth() == 1)
        assert await nothing_comes(w)
        w.reply(seq, b"B")
        seq, got = await w.receive()
        assert got == b"c" and w.kinds == [REQUEST, REQUEST, REQUEST]
        w.reply(seq, b"C")
        assert [(await f).body for f in (b, c)] == [b"B", b"C"]
        assert d.sent_ahead == 0

    with_dispatcher(body)


def test_a_job_ahead_on_a_worker_that_dies_runs_on_another_even_if_not_idempotent() -> None:
    async def body(d: Dispatcher, gone: list[WorkerGone]) -> None:
        a, b = FakeWorker(d, 21), FakeWorker(d, 22)
        await a.connect()
        await until(lambda: d.live_workers() == 1)
        await learn_light(d, a, "m")
        await b.connect()
        await until(lambda: d.live_workers() == 2)
        now = asyncio.get_running_loop().time()
        first = asyncio.ensure_future(d.submit(b"1", now + 60, tag="m", idempotent=False))
        got = {}
        for fake in (a, b):  # one job on each worker
            try:
                got[fake] = await asyncio.wait_for(fake.receive(), 0.3)
            except TimeoutError:
                continue
        (runs_first,) = got
        other = b if runs_first is a else a
        second = asyncio.ensure_future(d.submit(b"2", now + 60, tag="m"))
        seq2, _ = await other.receive()
        # the third goes ahead to the worker whose job started first
        third = asyncio.ensure_future(d.submit(b"3", now + 60, tag="m", idempotent=False))
        _, body3 = await runs_first.receive()
        assert body3 == b"3" and runs_first.kinds[-1] == AHEAD
        runs_first.die()
        d.worker_exited(runs_first.pid, "killed by SIGKILL")
        with pytest.raises(Unavailable, match="SIGKILL"):
            await first  # it ran (it may have done its work): not run twice
        # the one ahead never started: it runs on the other worker after its job
        other.reply(seq2, b"two")
        assert (await second).body == b"two"
        seq3, body3 = await other.receive()
        assert body3 == b"3"
        other.reply(seq3, b"three")
        assert (await third).body == b"three"
        await until(lambda: len(gone) == 1)

    with_dispatcher(body)


async def streamed(d: Dispatcher, body: bytes, pinned: Worker | None = None) -> list[object]:
    """A stream's parts and its Result, as its caller takes them."""
    deadline = asyncio.get_running_loop().time() + 60
    sequence = "s" if pinned is not None else ""
    stream = d.submit_stream(body, deadline, window=4, tag="gen", pinned=pinned, sequence=sequence)
    return [item async for item in stream]


async def holding(d: Dispatcher, a: FakeWorker, b: FakeWorker) -> tuple[FakeWorker, FakeWorker]:
    """(the worker a stream was started on, the other), once there is one."""

    def runs_stream(fake: FakeWorker) -> bool:
        current = d.roster.workers[fake.pid].current
        return current is not None and current.stream is not None

    await until(lambda: runs_stream(a) or runs_stream(b))
    return (a, b) if runs_stream(a) else (b, a)


async def two_workers(d: Dispatcher) -> tuple[FakeWorker, FakeWorker]:
    a, b = FakeWorker(d, 61), FakeWorker(d, 62)
    await a.connect()
    await b.connect()
    await until(lambda: d.live_workers() == 2)
    return a, b


def test_streams_leave_unary_workers_for_the_other_calls() -> None:
    """With ``unary_workers`` 1 of 2 workers, a second stream waits in the queue
    while the first holds its worker, and the other calls get the other worker;
    the waiting stream starts when the first ends (issue 42, item 5)."""

    async def body(d: Dispatcher, _: list[WorkerGone]) -> None:
        d.share.reserve = 1
        a, b = await two_workers(d)
        first = asyncio.ensure_future(streamed(d, b"s1"))
        holder, other = await holding(d, a, b)
        second = asyncio.ensure_future(streamed(d, b"s2"))
        seq1, request = await holder.receive()
        assert request == b"s1" and holder.kinds == [STREAM]
        await until(lambda: d.queue_depth() == 1)  # s2 waits: one worker is kept
        now = asyncio.get_running_loop().time()
        for name in (b"u1", b"u2"):  # the other calls run on the other worker
            call = asyncio.ensure_future(d.submit(name, now + 60))
            seq, request = await other.receive()
            assert request == name and other.kinds[-1] == REQUEST
            other.reply(seq, name.upper())
            assert (await call).body == name.upper()
        assert await nothing_comes(other)  # idle, and still not given s2
        assert d.queue_depth() == 1
        holder.reply(seq1, b"end1")  # s1 ends: s2 starts
        assert [item.body for item in await first] == [b"end1"]  # type: ignore[attr-defined]
        seq2, request = await holder.receive()
        assert request == b"s2" and holder.kinds[-1] == STREAM
        holder.reply(seq2, b"end2")
        assert [item.body for item in await second] == [b"end2"]  # type: ignore[attr-defined]

    with_dispatcher(body)


def test_streams_hold_every_worker_when_none_is_kept() -> None:
    """``unary_workers`` 0 (a pool of decoupled models only): both streams run."""

    async def body(d: Dispatcher, _: list[WorkerGone]) -> None:
        a, b = await two_workers(d)
        calls = [asyncio.ensure_future(streamed(d, name)) for name in (b"s1", b"s2")]
        got = [await a.receive(), await b.receive()]
        assert sorted(request for _, request in got) == [b"s1", b"s2"]
        assert a.kinds == b.kinds == [STREAM] and d.queue_depth() == 0
        a.reply(got[0][0], b"")
        b.reply(got[1][0], b"")
        await asyncio.gather(*calls)

    with_dispatcher(body)


def test_a_waiting_stream_starts_when_the_worker_of_another_dies() -> None:
    """The worker holding the one stream allowed dies: its stream fails, and
    the stream that waited starts on the worker left."""

    async def body(d: Dispatcher, _: list[WorkerGone]) -> None:
        d.share.reserve = 1
        a, b = await two_workers(d)
        first = asyncio.ensure_future(streamed(d, b"s1"))
        holder, other = await holding(d, a, b)
        second = asyncio.ensure_future(streamed(d, b"s2"))
        await until(lambda: d.queue_depth() == 1)
        holder.die()
        d.worker_exited(holder.pid, "killed by signal 9")
        with pytest.raises(Unavailable):
            await first
        seq, request = await other.receive()
        assert request == b"s2" and other.kinds[-1] == STREAM
        other.reply(seq, b"")
        await second

    with_dispatcher(body)


def test_a_sequences_stream_waits_on_its_worker_which_serves_others_meanwhile() -> None:
    """A stream pinned to its sequence's worker waits, as one from the queue,
    while the pool's streams hold what they may; the worker runs other calls
    meanwhile, and the stream before the sequence's later jobs."""

    async def body(d: Dispatcher, _: list[WorkerGone]) -> None:
        d.share.reserve = 1
        a, b = await two_workers(d)
        first = asyncio.ensure_future(streamed(d, b"s1"))
        holder, other = await holding(d, a, b)
        seq1, _ = await holder.receive()
        pinned_to = d.roster.workers[other.pid]
        pinned = asyncio.ensure_future(streamed(d, b"p1", pinned=pinned_to))
        now = asyncio.get_running_loop().time()
        later = asyncio.ensure_future(d.submit_pinned(pinned_to, b"p2", now + 60, sequence="s"))
        await until(lambda: len(pinned_to.pinned) == 2)
        call = asyncio.ensure_future(d.submit(b"u", now + 60))  # the kept worker serves it
        seq, request = await other.receive()
        assert request == b"u" and other.kinds == [REQUEST]
        other.reply(seq, b"U")
        assert (await call).body == b"U"
        assert await nothing_comes(other)
        holder.reply(seq1, b"")  # s1 ends: the sequence's stream, then its next job
        await first
        seq, request = await other.receive()
        assert request == b"p1" and other.kinds[-1] == STREAM
        other.reply(seq, b"")
        await pinned
        seq, request = await other.receive()
        assert request == b"p2" and other.kinds[-1] == REQUEST
        other.reply(seq, b"P2")
        assert (await later).body == b"P2"

    with_dispatcher(body)


def test_streams_waiting_for_a_worker_never_fill_the_other_calls_queue() -> None:
    """Streams and the other calls each have ``max_queue`` to themselves: a
    client's waiting streams are refused past it, and the pool's other calls
    still queue."""

    async def body(d: Dispatcher, _: list[WorkerGone]) -> None:
        d.share.reserve = 1
        a, b = await two_workers(d)
        first = asyncio.ensure_future(streamed(d, b"s1"))
        _, other = await holding(d, a, b)
        second = asyncio.ensure_future(streamed(d, b"s2"))
        await until(lambda: d.queue_depth() == 1)
        with pytest.raises(QueueFull, match=r"\(1 streams waiting\)"):
            await streamed(d, b"s3")
        now = asyncio.get_running_loop().time()
        busy = asyncio.ensure_future(d.submit(b"u1", now + 60))
        seq, _ = await other.receive()
        queued = asyncio.ensure_future(d.submit(b"u2", now + 60))  # queued, not refused
        await until(lambda: d.queue_depth() == 2)
        with pytest.raises(QueueFull, match=r"\(1 requests waiting\)"):
            await d.submit(b"u3", now + 60)
        other.reply(seq, b"U1")
        assert (await busy).body == b"U1"
        seq, request = await other.receive()
        assert request == b"u2"
        other.reply(seq, b"U2")
        assert (await queued).body == b"U2"
        first.cancel()
        second.cancel()

    with_dispatcher(body, max_queue=1)
