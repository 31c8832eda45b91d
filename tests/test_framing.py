"""Framing without copies (issue 20): frames received in place, written as scatter lists.

The reader is driven the way asyncio drives a BufferedProtocol (get_buffer,
then recv_into that buffer, then buffer_updated with the count), over
real socket pairs where it matters, with reads cut short at every size.
The writers are checked against short writes: the kernel taking a few bytes
at a time, in the middle of a part.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import socket
import threading
import time
from collections.abc import Iterator
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from poolserve.service.contract.errors import Failure
from poolserve.service.contract.framing import (
    CHUNK,
    HEADER,
    SMALL_FRAME,
    Batcher,
    FrameBuffer,
)
from poolserve.service.poolcore import worker
from poolserve.service.poolcore.frames import (
    REPLY,
    TIMINGS,
    Reply,
    ReplyBuffer,
    ahead_frame,
    reply_frame,
)
from poolserve.service.poolcore.stats import Timings
from poolserve.service.poolcore.worker import send_frame


def frame(kind: int, seq: int, body: bytes) -> bytes:
    return HEADER.pack(len(body), kind, seq) + body


def pattern(size: int, seed: int = 0) -> bytes:
    return bytes((i * 7 + seed) % 251 for i in range(size))


def receive(
    reader: FrameBuffer, stream: bytes, steps: Iterator[int]
) -> list[tuple[int, int, bytes]]:
    """Drives ``reader`` as asyncio does: into get_buffer, at most ``step`` bytes a time."""
    got = []
    pos = 0
    while pos < len(stream):
        target = reader.get_buffer(-1)
        assert len(target) > 0
        size = min(len(target), next(steps), len(stream) - pos)
        target[:size] = stream[pos : pos + size]
        pos += size
        for kind, seq, payload in reader.buffer_updated(size):
            got.append((kind, seq, bytes(payload)))
    return got


BIG = SMALL_FRAME + 1


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.sampled_from([0, 1, 100, SMALL_FRAME, BIG, 3 * CHUNK + 5]), min_size=1, max_size=6),
    st.lists(st.integers(1, 2 * CHUNK), min_size=1, max_size=8),
)
def test_any_mix_of_frame_sizes_cut_at_any_read_size(sizes: list[int], cuts: list[int]) -> None:
    bodies = [pattern(size, i) for i, size in enumerate(sizes)]
    stream = b"".join(frame(1, i, body) for i, body in enumerate(bodies))
    steps = itertools.cycle(cuts)
    assert receive(FrameBuffer(), stream, steps) == [(1, i, b) for i, b in enumerate(bodies)]


def test_a_large_frame_is_received_in_place_and_handed_over_as_a_view() -> None:
    body = pattern(9 * 1024 * 1024)
    stream = frame(3, 42, body) + frame(4, 43, b"after")
    reader = FrameBuffer()
    head = reader.get_buffer(-1)
    head[: HEADER.size + 10] = stream[: HEADER.size + 10]
    assert reader.buffer_updated(HEADER.size + 10) == []
    target = reader.get_buffer(-1)
    # the rest of the frame goes straight into a buffer of its announced size
    assert len(target) == len(body) - 10
    target[:] = stream[HEADER.size + 10 : HEADER.size + len(body)]
    ((kind, seq, payload),) = reader.buffer_updated(len(target))
    assert (kind, seq) == (3, 42)
    assert isinstance(payload, memoryview) and payload.readonly
    assert payload.obj is target.obj  # the very buffer received into: no copy
    assert payload == body
    assert reader.feed(stream[HEADER.size + len(body) :]) == [(4, 43, b"after")]


def test_frames_split_anywhere_over_a_real_socket() -> None:
    """Large and small frames through a socket pair, read with recv_into a few
    bytes at a time and in whatever pieces the kernel hands out."""
    bodies = [pattern(size, i) for i, size in enumerate([5, BIG, 0, 2 * CHUNK + 3, 17, 1 << 22])]
    stream = b"".join(frame(2, i, body) for i, body in enumerate(bodies))
    left, right = socket.socketpair()
    writer = threading.Thread(target=left.sendall, args=(stream,))
    writer.start()
    reader, got = FrameBuffer(), []
    sizes = itertools.cycle([1, 2, 13, 100, 7000])
    try:
        while len(got) < len(bodies):
            target = reader.get_buffer(-1)
            n = right.recv_into(target, min(len(target), next(sizes)) if len(got) < 3 else 0)
            assert n > 0
            got += [(k, s, bytes(p)) for k, s, p in reader.buffer_updated(n)]
    finally:
        writer.join(60)
        left.close()
        right.close()
    assert got == [(2, i, b) for i, b in enumerate(bodies)]


def test_an_oversized_frame_is_refused_before_any_buffer_is_made() -> None:
    reader = FrameBuffer(max_frame=1000)
    with pytest.raises(ValueError, match="over the limit"):
        reader.feed(HEADER.pack(1001, 1, 1))


def test_a_large_reply_body_is_a_view_after_its_timings() -> None:
    body = pattern(BIG + 100)
    parts = reply_frame(9, Timings(1, 2, 3), [body[:10], memoryview(body)[10:]])
    (reply,) = ReplyBuffer().feed(b"".join(bytes(p) for p in parts))
    assert (reply.seq, reply.kind, reply.timings) == (9, REPLY, Timings(1, 2, 3))
    assert isinstance(reply.body, memoryview) and reply.body == body
    small = ReplyBuffer().feed(b"".join(reply_frame(8, Timings(), b"tiny")))
    assert small[0].body == b"tiny" and isinstance(small[0].body, bytes)
    assert TIMINGS.size == 24


class ShortSocket:
    """A socket whose sendmsg takes at most ``step`` bytes a call (a full kernel buffer)."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.out = bytearray()
        self.calls = 0

    def sendmsg(self, parts: list[memoryview]) -> int:
        self.calls += 1
        budget = self.step
        for part in parts:
            take = min(budget, len(part))
            self.out += part[:take]
            budget -= take
            if not budget:
                break
        return self.step - budget

    def sendall(self, data: bytes) -> None:
        self.out += data


@pytest.mark.parametrize("step", [1, 3, 4096, 10**9])
def test_worker_send_frame_resumes_short_writes_inside_a_part(step: int) -> None:
    parts = [b"head", memoryview(pattern(5000)), b"", bytearray(b"tail"), pattern(3, 9)]
    sock = ShortSocket(step)
    send_frame(sock, parts)  # type: ignore[arg-type]
    assert bytes(sock.out) == b"".join(bytes(p) for p in parts)
    assert sock.calls == max(1, -(-len(sock.out) // step))


def test_batcher_short_writes_keep_order_across_writable_waits() -> None:
    """A frame larger than the socket buffer: the rest waits as views for the
    socket to drain, frames written meanwhile follow it in order."""

    async def main() -> None:
        loop = asyncio.get_running_loop()
        left, right = socket.socketpair()
        left.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        right.setblocking(False)
        transport, _ = await loop.connect_accepted_socket(asyncio.Protocol, sock=left)
        assert isinstance(transport, asyncio.Transport)
        batcher = Batcher(transport)
        big = pattern(3 * 1024 * 1024)
        expected = b"H" + big + b"x" + b"y"
        copies: list[int] = []
        real = os.writev

        def writev(fd: int, parts: list[memoryview]) -> int:
            copies.append(sum(1 for p in parts if p.obj is not big))
            return real(fd, parts)

        received = bytearray()
        try:
            with mock.patch("os.writev", side_effect=writev):
                batcher.write(b"H", memoryview(big))
                await asyncio.sleep(0)
                batcher.write(b"x")
                batcher.write(b"y")
                while len(received) < len(expected):
                    try:
                        received += right.recv(65536)
                    except BlockingIOError:
                        await asyncio.sleep(0.001)
            assert bytes(received) == expected
            assert len(copies) > 2  # it did wait for the socket several times
        finally:
            batcher.close()
            transport.close()
            right.close()
            await asyncio.sleep(0)

    asyncio.run(main())


def test_batcher_closes_its_transport_when_the_peer_is_gone() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        left, right = socket.socketpair()
        lost = loop.create_future()

        class Watch(asyncio.Protocol):
            def connection_lost(self, exc: Exception | None) -> None:
                lost.set_result(True)

        transport, _ = await loop.connect_accepted_socket(Watch, sock=left)
        assert isinstance(transport, asyncio.Transport)
        batcher = Batcher(transport)
        right.close()
        batcher.write(pattern(1 << 20))
        assert await asyncio.wait_for(lost, 30)
        batcher.close()

    asyncio.run(main())


def test_write_now_sends_at_once_after_what_this_turn_queued() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        left, right = socket.socketpair()
        right.setblocking(False)
        transport, _ = await loop.connect_accepted_socket(asyncio.Protocol, sock=left)
        assert isinstance(transport, asyncio.Transport)
        batcher = Batcher(transport)
        try:
            batcher.write_now(b"now", memoryview(b"!"))
            assert right.recv(100) == b"now!"  # before the turn ends
            batcher.write(b"first")
            batcher.write_now(b"second")  # may not overtake a frame of this turn
            await asyncio.sleep(0)
            assert right.recv(100) == b"firstsecond"
        finally:
            batcher.close()
            transport.close()
            right.close()
            await asyncio.sleep(0)

    asyncio.run(main())


def test_write_now_keeps_what_a_short_write_left_in_order() -> None:
    """A frame of bytes parts that the socket takes only in part: the rest goes out
    once it is writable, before any later frame, nothing lost or doubled."""

    async def main() -> None:
        loop = asyncio.get_running_loop()
        left, right = socket.socketpair()
        left.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        right.setblocking(False)
        transport, _ = await loop.connect_accepted_socket(asyncio.Protocol, sock=left)
        assert isinstance(transport, asyncio.Transport)
        batcher = Batcher(transport)
        big = bytes(pattern(1 << 20))
        expected = b"head" + big + b"next" + b"last"
        received = bytearray()
        try:
            batcher.write_now(b"head", big)  # far more than the socket holds
            batcher.write_now(b"next")  # waits behind the rest of the first
            batcher.write_now(b"last")
            while len(received) < len(expected):
                try:
                    received += right.recv(65536)
                except BlockingIOError:
                    await asyncio.sleep(0.001)
            assert bytes(received) == expected
        finally:
            batcher.close()
            transport.close()
            right.close()
            await asyncio.sleep(0)

    asyncio.run(main())


def test_frames_of_bytes_a_short_write_cuts_go_out_whole_and_in_order() -> None:
    """Frames written in one turn as ``bytes`` parts (one writev of them as they
    are) on a socket that takes only part: the rest follows, then later frames."""

    async def main() -> None:
        loop = asyncio.get_running_loop()
        left, right = socket.socketpair()
        left.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        right.setblocking(False)
        transport, _ = await loop.connect_accepted_socket(asyncio.Protocol, sock=left)
        assert isinstance(transport, asyncio.Transport)
        batcher = Batcher(transport)
        parts = [bytes(pattern(n)) for n in (10, 300_000, 0, 7, 200_000)]
        expected = b"".join(parts) + b"after" + b"now"
        received = bytearray()
        try:
            for part in parts:
                batcher.write(b"", part)
            await asyncio.sleep(0)  # the turn's flush: a short write
            batcher.write(b"after")
            batcher.write_now(b"now")  # after what this turn queued, and what waits
            while len(received) < len(expected):
                try:
                    received += right.recv(65536)
                except BlockingIOError:
                    await asyncio.sleep(0.001)
            assert bytes(received) == expected
        finally:
            batcher.close()
            transport.close()
            right.close()
            await asyncio.sleep(0)

    asyncio.run(main())


def test_a_worker_does_not_start_a_job_sent_ahead_once_its_deadline_passed() -> None:
    """A worker's own loop over a real socket: an AHEAD frame whose deadline
    passed gets a DEADLINE error and never reaches the model; one still in time
    runs as a REQUEST does."""
    ran: list[bytes] = []

    def handler(body: bytes, seq: int) -> worker.FrameOut:
        ran.append(bytes(body))
        return reply_frame(seq, Timings(), b"out:" + body)

    pool, theirs = socket.socketpair()
    serving = threading.Thread(
        target=worker.serve, args=(theirs, handler, threading.Lock()), daemon=True
    )
    serving.start()
    try:
        now = time.monotonic()
        pool.sendall(b"".join(ahead_frame(1, now - 0.001, b"late")))
        pool.sendall(b"".join(ahead_frame(2, now + 60, b"on time")))
        replies = ReplyBuffer()
        got: list[Reply] = []
        pool.settimeout(30)
        while len(got) < 2:
            chunk = pool.recv(65536)
            assert chunk, "the worker closed its socket"
            got.extend(replies.feed(chunk))
        late, on_time = got
        assert (late.seq, late.failure) == (1, Failure.DEADLINE)
        assert "not started" in late.message
        assert (on_time.seq, on_time.failure, bytes(on_time.body)) == (2, None, b"out:on time")
        assert ran == [b"on time"]
    finally:
        pool.close()
        serving.join(30)
        theirs.close()
    assert not serving.is_alive()
