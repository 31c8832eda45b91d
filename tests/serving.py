"""``poolserve serve`` as a real process tree for end-to-end tests: the
reliability suite's :class:`harness.Tree` with the tests' calling convention."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

from poolserve.protos import control_pb2 as cpb

from harness import LISTENING_PREFIX, Tree, comm, wait_serving
from harness import cmdline as argv_of
from harness import pool_status as pool_status_at

__all__ = [
    "LISTENING_PREFIX",
    "Serving",
    "cmdline",
    "comm",
    "env_without_notify",
    "pool_status",
    "wait_idle_workers",
    "wait_serving",
]


class Serving(Tree):
    """One ``poolserve serve`` tree: extra arguments positional, and this
    process's environment (NOTIFY_SOCKET included) passed through."""

    def __init__(
        self,
        repo: Path,
        run_dir: Path,
        *extra: str,
        workers: int = 2,
        env: dict[str, str] | None = None,
        env_replace: dict[str, str] | None = None,
    ) -> None:
        super().__init__(
            repo,
            run_dir,
            workers=workers,
            extra=extra,
            env=env,
            env_replace=env_replace,
            keep_notify_socket=True,
        )

    def tree(self) -> list[int]:
        return self.snapshot()


def cmdline(pid: int) -> str:
    return " ".join(argv_of(pid))


def env_without_notify() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("NOTIFY_SOCKET", None)
    return env


async def pool_status(serving: Tree, gid: str = "default") -> cpb.PoolStatus:
    return await pool_status_at(serving.run_dir, gid)


async def wait_idle_workers(serving: Tree, gid: str, count: int, timeout: float = 60) -> None:
    """Until ``count`` workers of pool ``gid`` are idle: health turns SERVING
    with one live worker, while the others may still be in their self-test."""
    end = time.monotonic() + timeout
    while True:  # the pool's status has no event to wait on
        states = [w.state for w in (await pool_status(serving, gid)).workers]
        if states.count("idle") >= count:
            return
        assert time.monotonic() < end, f"pool {gid!r} workers {states} after {timeout} s"
        await asyncio.sleep(0.05)
