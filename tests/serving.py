"""``poolserve serve`` as a real process tree for end-to-end tests: the
reliability suite's :class:`harness.Tree` with the tests' calling convention."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import grpc

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
    "serve_as_settings_say",
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


def serve_as_settings_say(
    repo: Path,
    run_dir: Path,
    models: tuple[str, ...],
    env: dict[str, str] | None = None,
    timeout: float = 90,
) -> Serving:
    """A started ``poolserve serve`` on ``repo`` whose own ``settings.json``
    decides the workers (the harness's ``--workers`` left out: an MLServer
    folder's ``parallel_workers``, or MLServer's and poolserve's default),
    once each of ``models`` is SERVING. The caller exits it."""
    serving = Serving(repo, run_dir, env=env)
    at = serving.argv.index("--workers")
    del serving.argv[at : at + 2]
    serving.__enter__()
    try:

        async def ready() -> None:
            async with grpc.aio.insecure_channel(serving.address) as channel:
                for name in models:
                    await wait_serving(channel, f"model:{name}", timeout=timeout)

        asyncio.run(ready())
    except BaseException:
        serving.__exit__(None, None, None)
        raise
    return serving


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
