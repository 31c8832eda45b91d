"""How a WorkerPool is called from anywhere: its state lives on one event loop
(the caller's, or a thread's own for the synchronous API), and every public
method runs its work there.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from poolserve.service.contract.errors import Cancelled, Unavailable

T = TypeVar("T")


def run_loop(loop: asyncio.AbstractEventLoop) -> None:
    asyncio.set_event_loop(loop)
    try:
        loop.run_forever()
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()


def running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


class LoopBridge:
    """Runs work on the pool's loop from any thread or loop (WorkerPool's base)."""

    name: str
    _loop: asyncio.AbstractEventLoop | None
    _thread: threading.Thread | None

    def _in_loop_soon(self, fn: Callable[[T], None], arg: T) -> None:
        """Runs ``fn(arg)`` on the pool's loop: now if we are on it, else soon."""
        loop = self._loop
        if loop is None or running_loop() is loop:
            fn(arg)
        else:
            loop.call_soon_threadsafe(fn, arg)

    def _on_pool_loop(self, fn: Callable[[], T]) -> T:
        """``fn()``, run on the pool's loop (which owns the state it reads)."""
        loop = self._loop
        if loop is None or loop.is_closed() or running_loop() is loop:
            return fn()

        async def run() -> T:
            return fn()

        return asyncio.run_coroutine_threadsafe(run(), loop).result()

    async def _in_pool_loop(self, coro: Coroutine[Any, Any, T]) -> T:
        loop = self._loop
        if loop is None or running_loop() is loop:
            return await coro
        if loop.is_closed():
            coro.close()
            raise Unavailable(f"workerpool '{self.name}' is closed")
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, loop))

    def _sync(self, coro: Coroutine[Any, Any, T], method: str, instead: str) -> T:
        loop = self._loop
        if loop is None or loop.is_closed():
            coro.close()
            if loop is None:
                raise RuntimeError(
                    f"WorkerPool '{self.name}' is not started: use `with` or start() first"
                )
            raise Unavailable(f"workerpool '{self.name}' is closed")
        try:
            self._refuse_pool_thread(method, f"await pool.{instead}(...)")
        except RuntimeError:
            coro.close()
            raise
        future = asyncio.run_coroutine_threadsafe(coro, loop)
        try:
            return future.result()
        except concurrent.futures.CancelledError:
            raise Cancelled(f"{method} was cancelled") from None
        except BaseException:
            future.cancel()  # e.g. KeyboardInterrupt: the call leaves the queue
            raise

    def _refuse_pool_thread(self, method: str, instead: str) -> None:
        if self._loop is not None and running_loop() is self._loop:
            raise RuntimeError(
                f"{method} would block the event loop the pool runs on; use `{instead}` there"
            )
