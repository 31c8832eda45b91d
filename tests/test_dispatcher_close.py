"""Closing a dispatcher while a worker is still connecting (a respawn that just arrived).

Closing the worker's socket under its reader's pending ``open_connection``
left the reader waiting forever on a dead descriptor, so ``run()`` (and the
pool's close) never returned; WorkerPool's crash-respawn test hit it.
"""

from __future__ import annotations

import asyncio
import socket

import pytest

from poolserve.service.poolcore.dispatcher import Dispatcher


@pytest.mark.parametrize("yields", [0, 1, 2, 3])
def test_close_while_a_worker_is_still_connecting(yields: int) -> None:
    async def main() -> None:
        dispatcher = Dispatcher("p", 10)
        started = asyncio.Event()
        runner = asyncio.create_task(dispatcher.run(started.set))
        await started.wait()
        ours, theirs = socket.socketpair()
        dispatcher.add_worker(7, ours)
        for _ in range(yields):  # stop the reader at each step of its connection
            await asyncio.sleep(0)
        dispatcher.close()
        await asyncio.wait_for(runner, 30)
        theirs.settimeout(30)
        assert theirs.recv(1) == b"", "the worker sees EOF, so it exits"
        theirs.close()

    asyncio.run(main())
