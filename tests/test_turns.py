"""contract/turns.py: what the callbacks a read woke write leaves in their own turn."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable

from poolserve.service.contract.framing import Batcher
from poolserve.service.contract.turns import turn_end


def _writer(loop: asyncio.AbstractEventLoop, order: list[str]) -> Callable[[], None]:
    """A writer as poolserve's are: the first write of a turn schedules its flush."""
    state = {"pending": False}

    def flush() -> None:
        state["pending"] = False
        order.append("flushed")

    def write() -> None:
        order.append("woken, wrote")
        if not state["pending"]:
            state["pending"] = True
            if not turn_end(loop).take(flush):
                loop.call_soon(flush)

    return write


async def _woken(arm: bool) -> list[str]:
    loop = asyncio.get_running_loop()
    order: list[str] = []
    write = _writer(loop, order)
    futures = [loop.create_future() for _ in range(3)]
    for future in futures:
        future.add_done_callback(lambda _: write())
    for future in futures:  # a reader resolves what it read...
        future.set_result(None)
    if arm:  # ...and arms the turn's end behind the callbacks it woke
        turn_end(loop).arm()
    loop.call_soon(order.append, "the next turn's first callback")
    for _ in range(3):
        await asyncio.sleep(0)
    return order


def test_an_armed_turn_flushes_right_after_the_callbacks_it_woke() -> None:
    armed = asyncio.run(_woken(arm=True))
    assert armed == [
        "woken, wrote",
        "woken, wrote",
        "woken, wrote",
        "flushed",
        "the next turn's first callback",
    ]
    # unarmed, the flush is scheduled by the first write and runs a turn later
    plain = asyncio.run(_woken(arm=False))
    assert plain.index("flushed") > plain.index("the next turn's first callback")
    assert plain.count("flushed") == 1


def test_an_armed_turn_with_nothing_written_flushes_nothing_and_disarms() -> None:
    async def main() -> list[str]:
        loop = asyncio.get_running_loop()
        order: list[str] = []
        turns = turn_end(loop)
        turns.arm()
        turns.arm()  # once armed, armed: one flush runs
        await asyncio.sleep(0)
        write = _writer(loop, order)
        write()  # after the armed end ran: the writer schedules its own flush
        await asyncio.sleep(0)
        return order

    assert asyncio.run(main()) == ["woken, wrote", "flushed"]


def test_a_batchers_frames_leave_in_the_turn_their_writers_ran() -> None:
    """A lane's Batcher written by callbacks a read woke: the bytes are in the
    peer's socket when the next turn's first callback runs."""

    async def main() -> tuple[bytes, bytes]:
        loop = asyncio.get_running_loop()
        ours, theirs = socket.socketpair()
        theirs.setblocking(False)
        transport, _ = await loop.create_connection(asyncio.Protocol, sock=ours)
        batcher = Batcher(transport)
        seen: dict[str, bytes] = {}

        def peek() -> None:
            try:
                seen["then"] = theirs.recv(100)
            except BlockingIOError:
                seen["then"] = b""

        future: asyncio.Future[None] = loop.create_future()
        future.add_done_callback(lambda _: batcher.write(b"one", b"-two"))
        future.set_result(None)
        batcher.turn.arm()
        loop.call_soon(peek)
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        transport.close()
        batcher.close()
        theirs.close()
        return seen["then"], b"one-two"

    then, sent = asyncio.run(main())
    assert then == sent
