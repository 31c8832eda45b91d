"""WorkerPool keeps the server pool's promises, with real zygotes and forked workers.

Every test starts a real pool (an exec'd zygote and forked workers) and
checks that no process it started outlives it. Calls are steered with FIFOs
and marker files (a score that blocks until the test opens its gate), never
with sleeps; assertions are about outcomes and counts, never about speed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import errno
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import workerpool_models as wm

from poolserve.service import ModelLoadError, ScoreError, WorkerPool
from poolserve.service.contract.errors import (
    Cancelled,
    DeadlineExceeded,
    ModelError,
    ModelNotFound,
    ModelNotReady,
    QueueFull,
    Unavailable,
)

from harness import descendants, kill_pids, pid_alive
from support import wait_until

pytestmark = pytest.mark.e2e

MiB = 1 << 20


# -- helpers -------------------------------------------------------------------


async def until(predicate: Callable[[], bool], timeout: float = 30.0) -> None:
    """Polls a condition that has no event to wait on (files, process table)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not predicate():
        if loop.time() > end:
            raise AssertionError("condition never held")
        await asyncio.sleep(0.01)


async def release(gate: Path, timeout: float = 30.0) -> None:
    """Opens the FIFO ``gate`` for writing and closes it: the score blocked on it returns."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while True:
        try:
            fd = os.open(gate, os.O_WRONLY | os.O_NONBLOCK)
        except OSError as exc:
            if exc.errno != errno.ENXIO or loop.time() > end:  # ENXIO: no reader yet
                raise
            await asyncio.sleep(0.01)
            continue
        os.close(fd)
        return


def read_text(path: Path) -> str:
    return path.read_bytes().replace(b"\0", b" ").decode()


def listing(folder: str) -> list[str] | None:
    """The entries of ``folder``, None if it does not exist."""
    try:
        return os.listdir(folder)
    except FileNotFoundError:
        return None


def fifo(tmp_path: Path, name: str = "gate") -> Path:
    path = tmp_path / name
    os.mkfifo(path)
    return path


def pool_pids(pool: WorkerPool) -> set[int]:
    status = pool.status()
    return {status.zygote_pid, *(w.pid for w in status.workers)} - {0}


def assert_all_gone(pids: set[int]) -> None:
    gone = wait_until(lambda: not any(pid_alive(p) for p in pids), timeout=30)
    left = [p for p in pids if pid_alive(p)]
    kill_pids(left)
    assert gone, f"processes left behind: {left}"


@contextlib.asynccontextmanager
async def running(pool: WorkerPool) -> AsyncIterator[WorkerPool]:
    """Starts ``pool``; on the way out closes it and checks every process it had is gone."""
    # Only what the pool started: an earlier test may have left this process a
    # long-lived helper of its own (multiprocessing's resource tracker, say).
    before = set(descendants(os.getpid()))
    seen: set[int] = set()
    try:
        await pool.astart()
        yield pool
    finally:
        seen.update(set(descendants(os.getpid())) - before)
        await pool.aclose()
        assert_all_gone(seen)


def counter(name: str, log: Path | None = None) -> Callable[[], dict[str, Any]]:
    return partial(wm.load_counter, name, str(log) if log else None)


# -- scoring on forked workers ----------------------------------------------------


def test_a_workerpool_zygote_and_its_workers_load_neither_grpc_nor_protobuf() -> None:
    """The pool core is the library's whole world: no gRPC, no protobuf (issue 15)."""
    heavy = ("grpc", "grpc_health", "google.protobuf", "poolserve.protos", "opentelemetry")

    def foreign(names: list[str]) -> list[str]:
        return [n for n in names if n in heavy or n.startswith(tuple(h + "." for h in heavy))]

    async def main() -> None:
        pool = WorkerPool(workers=1)
        pool.add_model("probe", load=wm.load_module_names, score=wm.module_names)
        async with running(pool):
            in_zygote, in_worker = await pool.score("probe", timeout=60)
        assert "poolserve.service.poolcore.zygote" in in_zygote, "the probe saw the zygote"
        assert foreign(in_zygote) == [], "the zygote imported them"
        assert foreign(in_worker) == [], "a worker imported them"

    asyncio.run(main())


def test_scores_on_workers_forked_from_the_zygote_that_loaded_once(tmp_path: Path) -> None:
    log = tmp_path / "loads.log"

    async def main() -> None:
        pool = WorkerPool(workers=2)
        pool.add_model("a", load=counter("a", log), score=wm.whoami)
        pool.add_model("sum", load=counter("sum", log), score=wm.add)
        async with running(pool):
            status = pool.status()
            workers = {w.pid for w in status.workers}
            assert len(workers) == 2
            answers = await asyncio.gather(*(pool.score("a", timeout=60) for _ in range(20)))
            assert {a["loaded_by"] for a in answers} == {status.zygote_pid}
            assert {a["pid"] for a in answers} <= workers
            assert status.zygote_pid not in workers and os.getpid() not in workers
            assert await pool.score("sum", 1, 2, scale=10.0) == 30.0
            assert await pool.score("sum", 1.5) == 1.5
            zygote = Path(f"/proc/{status.zygote_pid}/cmdline")
            assert "poolserve.service.workerpool.scoring" in read_text(zygote), (
                "the zygote is a fresh exec"
            )
        lines = log.read_text().split()
        assert lines == ["a", str(status.zygote_pid), "sum", str(status.zygote_pid)]

    asyncio.run(main())


def test_scores_under_uvloop() -> None:
    """Before: AssertionError (uvloop's transports do not subclass asyncio.Transport) and
    the pool stopped: uvicorn runs apps on uvloop whenever it is installed."""
    uvloop = pytest.importorskip("uvloop", reason="uvloop comes with the mlserver extra")

    async def main() -> None:
        pool = WorkerPool(workers=1)
        pool.add_model("sum", load=counter("sum"), score=wm.add)
        async with running(pool):
            assert await pool.score("sum", 1, 2, scale=10.0, timeout=60) == 30.0

    uvloop.run(main())


def test_add_model_to_a_running_pool_replaces_workers_without_failing_calls(
    tmp_path: Path,
) -> None:
    log = tmp_path / "loads.log"

    async def main() -> None:
        async with running(WorkerPool(workers=2)) as pool:
            pool.add_model("a", load=counter("a", log), score=wm.whoami)
            assert (await pool.score("a", timeout=60))["name"] == "a"
            before = {w.pid for w in pool.status().workers}
            stop = asyncio.Event()
            failures: list[BaseException] = []
            served = 0

            async def load_a() -> None:
                nonlocal served
                while not stop.is_set():
                    try:
                        await pool.score("a", timeout=60)
                        served += 1
                    except Exception as exc:
                        failures.append(exc)

            clients = [asyncio.create_task(load_a()) for _ in range(4)]
            pool.add_model("b", load=counter("b", log), score=wm.whoami)
            answer = await pool.score("b", timeout=60)  # waits for the load and the roll
            stop.set()
            await asyncio.gather(*clients)
            assert failures == []
            assert served > 0
            assert answer["name"] == "b" and answer["loaded_by"] == pool.status().zygote_pid
            after = {w.pid for w in pool.status().workers if not w.retiring}
            assert len(after) == 2 and not after & before, "every worker is a fresh fork"
            await pool.wait_ready(timeout=60)

            pool.add_model("a", load=counter("a", log), score=wm.add)  # reload: new score
            await pool.wait_ready("a", timeout=60)
            assert await pool.score("a", 2, 3) == 5
            pool.remove_model("b")
            with pytest.raises(ModelNotFound, match="no model 'b'"):
                await pool.score("b")
        assert log.read_text().split()[::2] == ["a", "b", "a"]

    asyncio.run(main())


# -- deadlines, cancellation, queue bound -------------------------------------------


def test_call_whose_deadline_passes_in_the_queue_never_runs(tmp_path: Path) -> None:
    gate = fifo(tmp_path)
    never = tmp_path / "never-ran"

    async def main() -> None:
        async with running(WorkerPool(workers=1)) as pool:
            pool.add_model("m", load=counter("m"), score=wm.touch_then_gate)
            pool.add_model("mark", load=counter("mark"), score=wm.mark)
            await pool.wait_ready(timeout=60)
            started = tmp_path / "started"
            blocker = asyncio.create_task(pool.score("m", str(started), str(gate), "done"))
            await until(started.exists)
            with pytest.raises(DeadlineExceeded) as info:
                await pool.score("mark", str(never), timeout=0.3)
            assert info.value.stage == "pool queue"
            assert "never reached a worker" in info.value.message
            await release(gate)
            assert await blocker == "done"
            assert await pool.score("mark", str(tmp_path / "ran"), 7) == 7  # queue flushed
            assert not never.exists()
            assert pool.status().expired_in_queue == 1
            assert pool.stats()["mark"].deadline_exceeded == 1

    asyncio.run(main())


def test_cancelled_caller_leaves_the_queue_at_once(tmp_path: Path) -> None:
    gate = fifo(tmp_path)
    never = tmp_path / "never-ran"

    async def main() -> None:
        async with running(WorkerPool(workers=1)) as pool:
            pool.add_model("m", load=counter("m"), score=wm.touch_then_gate)
            pool.add_model("mark", load=counter("mark"), score=wm.mark)
            await pool.wait_ready(timeout=60)
            started = tmp_path / "started"
            blocker = asyncio.create_task(pool.score("m", str(started), str(gate)))
            await until(started.exists)
            queued = asyncio.create_task(pool.score("mark", str(never)))
            await until(lambda: pool.status().queue_depth == 1)
            queued.cancel()
            with pytest.raises(asyncio.CancelledError):
                await queued
            assert pool.status().queue_depth == 0
            await release(gate)
            await blocker
            await pool.score("mark", str(tmp_path / "ran"))
            assert not never.exists()
            assert pool.stats()["mark"].cancelled == 1

    asyncio.run(main())


def test_result_of_a_call_given_up_while_running_is_dropped(tmp_path: Path) -> None:
    gate = fifo(tmp_path)

    async def main() -> None:
        async with running(WorkerPool(workers=1, shm_threshold=MiB)) as pool:
            pool.add_model("m", load=counter("m"), score=wm.touch_then_gate)
            pool.add_model("sum", load=counter("sum"), score=wm.add)
            await pool.wait_ready(timeout=60)
            started = tmp_path / "started"
            big = np.ones(MiB, dtype=np.float64)  # 8 MiB both ways: through shared memory
            call = asyncio.create_task(pool.score("m", str(started), str(gate), big))
            await until(started.exists)
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call
            segments = pool.status().segment_dir
            await release(gate)  # the worker answers now, to nobody
            await until(lambda: pool.status().late_replies_dropped == 1)
            await until(lambda: listing(segments) == [])  # swept, not left behind
            assert await pool.score("sum", 1, 2, timeout=60) == 3
            assert pool.stats()["m"].cancelled == 1

    asyncio.run(main())


def test_queue_bound_refuses_with_a_clear_error(tmp_path: Path) -> None:
    gate = fifo(tmp_path)

    async def main() -> None:
        async with running(WorkerPool(workers=1, max_queue=1, name="tiny")) as pool:
            pool.add_model("m", load=counter("m"), score=wm.touch_then_gate)
            pool.add_model("sum", load=counter("sum"), score=wm.add)
            await pool.wait_ready(timeout=60)
            started = tmp_path / "started"
            blocker = asyncio.create_task(pool.score("m", str(started), str(gate), 1))
            await until(started.exists)
            queued = asyncio.create_task(pool.score("sum", 1, 1))
            await until(lambda: pool.status().queue_depth == 1)
            with pytest.raises(
                QueueFull, match=r"pool 'tiny' queue is full \(1 requests waiting\)"
            ):
                await pool.score("sum", 2, 2)
            await release(gate)
            assert (await blocker, await queued) == (1, 2)
            assert pool.stats()["sum"].queue_full == 1

    asyncio.run(main())


# -- worker deaths ----------------------------------------------------------------


def test_dead_worker_call_is_retried_once_and_the_worker_replaced(tmp_path: Path) -> None:
    async def main() -> None:
        async with running(WorkerPool(workers=2)) as pool:
            pool.add_model("die", load=counter("die"), score=wm.die_once)
            await pool.wait_ready(timeout=60)
            before = {w.pid for w in pool.status().workers if not w.retiring}
            pid = await pool.score("die", str(tmp_path / "died"), timeout=60)
            assert (tmp_path / "died").exists(), "the first attempt killed its worker"
            assert pid in {w.pid for w in pool.status().workers}
            await until(lambda: len([w for w in pool.status().workers if w.state == "idle"]) == 2)
            after = {w.pid for w in pool.status().workers}
            assert len(before - after) == 1, "exactly one worker died and was replaced"
            assert pool.status().respawns == 1
            assert pool.stats()["die"].succeeded == 1

    asyncio.run(main())


def test_dead_worker_call_fails_clearly_when_not_idempotent(tmp_path: Path) -> None:
    async def main() -> None:
        async with running(WorkerPool(workers=2)) as pool:
            pool.add_model("die", load=counter("die"), score=wm.die_once, idempotent=False)
            await pool.wait_ready(timeout=60)
            with pytest.raises(Unavailable, match=r"died while running .*killed by SIGKILL"):
                await pool.score("die", str(tmp_path / "died"), timeout=60)
            assert isinstance(await pool.score("die", str(tmp_path / "died"), timeout=60), int)
            assert pool.stats()["die"].failed == 1

    asyncio.run(main())


def test_model_that_keeps_killing_workers_is_disabled_others_serve(tmp_path: Path) -> None:
    async def main() -> None:
        async with running(WorkerPool(workers=2)) as pool:
            pool.add_model("bomb", load=counter("bomb"), score=wm.die_always, idempotent=False)
            pool.add_model("sum", load=counter("sum"), score=wm.add)
            await pool.wait_ready(timeout=60)
            deaths = 0
            while not pool.status().models["bomb"].startswith("disabled"):
                with pytest.raises(Unavailable, match="died while running"):
                    await pool.score("bomb", timeout=60)
                deaths += 1  # crash back-off paces the replacements meanwhile
                assert deaths < 10
            assert deaths >= 4
            with pytest.raises(ModelNotReady, match="disabled: model crashed its worker"):
                await pool.score("bomb", timeout=60)
            assert pool.status().models["bomb"].startswith("disabled")
            assert await pool.score("sum", 2, 2, timeout=60) == 4
            await until(lambda: len(pool.status().workers) == 2)
            assert pool.status().respawns >= 4

    asyncio.run(main())


def test_score_longer_than_max_compute_is_killed(tmp_path: Path) -> None:
    async def main() -> None:
        async with running(WorkerPool(workers=1)) as pool:
            pool.add_model("spin", load=counter("spin"), score=wm.spin, max_compute_s=0.5)
            await pool.wait_ready(timeout=60)
            with pytest.raises(DeadlineExceeded, match=r"ran longer than its timeout of 0\.5 s"):
                await pool.score("spin", 600.0, timeout=60)
            assert await pool.score("spin", 0.0, timeout=60) >= 0

    asyncio.run(main())


# -- errors -------------------------------------------------------------------------


def test_exception_in_score_reaches_the_caller_with_type_message_traceback() -> None:
    async def main() -> None:
        async with running(WorkerPool(workers=1)) as pool:
            pool.add_model("fail", load=counter("fail"), score=wm.fail)
            pool.add_model("custom", load=counter("custom"), score=wm.fail_custom)
            await pool.wait_ready(timeout=60)
            worker = pool.status().workers[0].pid
            with pytest.raises(ScoreError) as info:
                await pool.score("fail", "bad features")
            error = info.value
            assert isinstance(error, ModelError)
            assert error.type_name == "ValueError"
            assert error.remote_message == "bad features"
            assert "model 'fail': score raised ValueError: bad features" in str(error)
            assert (
                "in fail" in error.remote_traceback and "raise ValueError" in error.remote_traceback
            )
            assert any("Traceback in the pool worker" in n for n in error.__notes__)
            assert isinstance(error.original, ValueError) and error.__cause__ is error.original
            with pytest.raises(ScoreError) as info:
                await pool.score("custom")
            assert info.value.type_name == "workerpool_models.Unpicklable"
            assert info.value.remote_message == "custom failure 1/2"
            assert pool.status().workers[0].pid == worker, "an exception never kills the worker"
            assert pool.stats()["fail"].raised == 1

    asyncio.run(main())


def test_callables_that_do_not_pickle_by_reference_are_refused() -> None:
    pool = WorkerPool(workers=1)
    with pytest.raises(TypeError, match="module-level functions"):
        pool.add_model("l", load=lambda: 1, score=wm.add)

    def nested(model: Any) -> None:
        pass

    with pytest.raises(TypeError, match="Lambdas and nested functions are not"):
        pool.add_model("n", load=counter("n"), score=nested)

    async def main() -> None:
        async with running(WorkerPool(workers=1)) as pool:
            pool.add_model("sum", load=counter("sum"), score=wm.add)
            with pytest.raises(TypeError, match="arguments of a call to model 'sum' cannot be"):
                await pool.score("sum", threading.Lock(), timeout=60)
            with pytest.raises(ModelNotFound, match="no model 'nope'"):
                await pool.score("nope")

    asyncio.run(main())


def test_failed_load_fails_start_or_the_calls_with_the_reason() -> None:
    async def main() -> None:
        pool = WorkerPool(workers=1)
        pool.add_model("bad", load=partial(wm.load_failing, "no weights here"), score=wm.add)
        before = set(descendants(os.getpid()))
        with pytest.raises(ModelLoadError, match="RuntimeError: no weights here"):
            await pool.astart()
        assert_all_gone(set(descendants(os.getpid())) - before)

        async with running(WorkerPool(workers=1)) as pool:
            pool.add_model("bad", load=partial(wm.load_failing, "still none"), score=wm.add)
            with pytest.raises(ModelLoadError, match="still none") as info:
                await pool.score("bad", 1, timeout=60)
            assert "Traceback" in info.value.reason
            with pytest.raises(ModelLoadError):
                await pool.wait_ready("bad", timeout=60)
            assert pool.status().models["bad"].startswith("failed: load raised RuntimeError")

    asyncio.run(main())


def test_load_that_leaves_threads_running_is_warned_about(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def main() -> None:
        async with running(WorkerPool(workers=1)) as pool:
            pool.add_model("t", load=partial(wm.load_with_thread, "t"), score=wm.whoami)
            assert (await pool.score("t", timeout=60))["name"] == "t"

    with caplog.at_level("WARNING", logger="poolserve.service.workerpool.pool"):
        asyncio.run(main())
    assert "load left 1 new thread(s) running in the zygote" in caplog.text


# -- payloads --------------------------------------------------------------------------


def test_large_buffers_travel_through_shared_memory_and_are_cleaned_up() -> None:
    async def main() -> None:
        async with running(WorkerPool(workers=1, shm_threshold=MiB)) as pool:
            pool.add_model("owner", load=counter("owner"), score=wm.buffer_owner)
            pool.add_model("echo", load=counter("echo"), score=wm.echo_array)
            pool.add_model("make", load=counter("make"), score=wm.make_array)
            await pool.wait_ready(timeout=60)
            big = np.arange(MiB // 2, dtype=np.float64)  # 4 MiB
            assert await pool.score("owner", big) == "mmap"
            assert await pool.score("owner", big[:1000]) == "bytearray"  # small: inline
            echoed = await pool.score("echo", big, 1.0)
            assert np.array_equal(echoed, big + 1.0)
            assert wm.owner_of(echoed) == "mmap" and echoed.flags.writeable
            made = await pool.score("make", MiB, 2.5)
            assert made.shape == (MiB,) and float(made.sum()) == 2.5 * MiB
            segments = pool.status().segment_dir
            assert listing(segments) == []
        assert listing(segments) is None

        async with running(WorkerPool(workers=1, shm_threshold=None)) as pool:
            pool.add_model("echo", load=counter("echo"), score=wm.echo_array)
            echoed = await pool.score("echo", big, 1.0, timeout=60)
            assert np.array_equal(echoed, big + 1.0) and wm.owner_of(echoed) == "bytearray"
            assert pool.status().segment_dir == ""

    asyncio.run(main())


# -- lifecycle ----------------------------------------------------------------------------


def test_close_lets_running_calls_finish_and_refuses_new_ones(tmp_path: Path) -> None:
    gate = fifo(tmp_path)

    async def main() -> None:
        async with running(WorkerPool(workers=1)) as pool:
            pool.add_model("m", load=counter("m"), score=wm.touch_then_gate)
            await pool.wait_ready(timeout=60)
            started = tmp_path / "started"
            call = asyncio.create_task(pool.score("m", str(started), str(gate), "finished"))
            await until(started.exists)
            pids = pool_pids(pool)
            closing = asyncio.create_task(pool.aclose(grace=60))
            await until(lambda: pool.status().state == "closing")
            with pytest.raises(Unavailable, match="is closing"):
                await pool.score("m", str(started), str(gate))
            await release(gate)
            assert await call == "finished"
            await closing
            assert pool.status().state == "closed"
            assert_all_gone(pids)

    asyncio.run(main())


def test_close_cancels_what_outlives_its_grace(tmp_path: Path) -> None:
    gate = fifo(tmp_path)

    async def main() -> None:
        async with running(WorkerPool(workers=1)) as pool:
            pool.add_model("m", load=counter("m"), score=wm.touch_then_gate)
            await pool.wait_ready(timeout=60)
            started = tmp_path / "started"
            call = asyncio.create_task(pool.score("m", str(started), str(gate)))
            await until(started.exists)
            pids = pool_pids(pool)
            await pool.aclose(grace=0.2)  # the call is stuck on its gate: never released
            with pytest.raises(Cancelled, match="closed before the call finished"):
                await call
            assert_all_gone(pids)
            assert pool.stats()["m"].cancelled == 1

    asyncio.run(main())


def test_zygote_death_fails_calls_with_a_clear_error(tmp_path: Path) -> None:
    gate = fifo(tmp_path)

    async def main() -> None:
        async with running(WorkerPool(workers=1)) as pool:
            pool.add_model("m", load=counter("m"), score=wm.touch_then_gate)
            await pool.wait_ready(timeout=60)
            started = tmp_path / "started"
            call = asyncio.create_task(pool.score("m", str(started), str(gate)))
            await until(started.exists)
            pids = pool_pids(pool)
            os.kill(pool.status().zygote_pid, signal.SIGKILL)
            with pytest.raises(
                (Cancelled, Unavailable), match=r"zygote \(pid \d+\) exited unexpectedly"
            ):
                await call
            with pytest.raises(Unavailable, match="close this pool and start a new one"):
                await pool.score("m", str(started), str(gate))
            assert_all_gone(pids)  # its workers died with it (PR_SET_PDEATHSIG)

    asyncio.run(main())


def test_sync_facade_from_threads_and_other_loops() -> None:
    with WorkerPool(workers=2) as pool:
        pool.add_model("sum", load=counter("sum"), score=wm.add)
        pids = pool_pids(pool)
        assert pool.score_sync("sum", 1, 2, timeout=60) == 3
        with concurrent.futures.ThreadPoolExecutor(4) as threads:
            results = list(threads.map(lambda i: pool.score_sync("sum", i, i), range(40)))
        assert results == [2 * i for i in range(40)]

        async def from_another_loop() -> float:
            result: float = await pool.score("sum", 5, 5)
            return result

        assert asyncio.run(from_another_loop()) == 10
        pool.wait_ready_sync("sum", timeout=60)
        with pytest.raises(ScoreError, match="TypeError"):
            pool.score_sync("sum")
        assert pool.stats()["sum"].succeeded == 42
    assert_all_gone(pids)
    with pytest.raises(Unavailable, match="closed"):
        pool.score_sync("sum", 1)


def test_score_sync_on_the_pools_own_loop_is_refused() -> None:
    async def main() -> None:
        async with running(WorkerPool(workers=1)) as pool:
            pool.add_model("sum", load=counter("sum"), score=wm.add)
            with pytest.raises(RuntimeError, match="would block the event loop"):
                pool.score_sync("sum", 1)

    asyncio.run(main())


# -- fork safety and host processes -------------------------------------------------------

SCRIPT = """
import asyncio, concurrent.futures, json, os, sys, threading

from poolserve.service import WorkerPool


def load_table(size):
    return list(range(size))


def lookup(table, i):
    return {"value": table[i], "worker": os.getpid(), "threads": threading.active_count()}


def main():
    # A host the way real ones look: threads running, an event loop with its executor.
    stop = threading.Event()
    busy = threading.Thread(target=stop.wait, daemon=True)
    busy.start()

    async def serve():
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, sum, [1, 2, 3])  # the default executor's thread
        async with WorkerPool(workers=2) as pool:
            pool.add_model("table", load=lambda_free_load, score=lookup)
            answers = await asyncio.gather(*(pool.score("table", i) for i in range(10)))
            zygote = pool.status().zygote_pid
            cmdline = open(f"/proc/{zygote}/cmdline", "rb").read().split(b"\\0")
            ppid = int(open(f"/proc/{zygote}/stat").read().rsplit(")", 1)[1].split()[1])
            print(json.dumps({
                "values": [a["value"] for a in answers],
                "host_threads": threading.active_count(),
                "zygote_cmdline": [c.decode() for c in cmdline if c],
                "zygote_parent": ppid,
                "host": os.getpid(),
            }), flush=True)

    asyncio.run(serve())
    stop.set()


def lambda_free_load():
    return load_table(100)


if __name__ == "__main__":
    main()
"""

UNGUARDED = """
from poolserve.service import WorkerPool


def load():
    return 1


def score(model):
    return model


pool = WorkerPool(workers=1)
pool.add_model("m", load=load, score=score)
with pool:
    print(pool.score_sync("m"))
"""

HOST_DIES = """
import json, sys
from functools import partial

sys.path.insert(0, sys.argv[1])
import workerpool_models as wm
from poolserve.service import WorkerPool

pool = WorkerPool(workers=2).start()
pool.add_model("m", load=partial(wm.load_counter, "m"), score=wm.add)
pool.wait_ready_sync(timeout=60)
status = pool.status()
print(json.dumps({"pids": [status.zygote_pid] + [w.pid for w in status.workers],
                  "segments": status.segment_dir}), flush=True)
sys.stdin.read()
"""


def run_script(path: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    proc = subprocess.Popen(
        [sys.executable, str(path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=path.parent,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        seen = descendants(proc.pid)
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        assert_all_gone({proc.pid, *seen})
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_plain_script_with_threads_and_a_loop_uses_functions_from_main(tmp_path: Path) -> None:
    script = tmp_path / "host_app.py"
    script.write_text(SCRIPT)
    result = run_script(script)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["values"] == list(range(10))
    assert report["host_threads"] >= 2, "the host had threads when the pool started"
    assert report["zygote_parent"] == report["host"]
    assert report["zygote_cmdline"][1:3] == ["-m", "poolserve.service.workerpool.scoring"] or (
        "poolserve.service.workerpool.scoring" in report["zygote_cmdline"]
    )


def test_script_that_starts_a_pool_on_import_gets_an_explanation(tmp_path: Path) -> None:
    script = tmp_path / "unguarded.py"
    script.write_text(UNGUARDED)
    result = run_script(script)
    assert result.returncode != 0
    assert "ModelLoadError" in result.stderr
    assert 'if __name__ == "__main__":' in result.stderr


def test_host_killed_leaves_no_process_or_segment_behind(tmp_path: Path) -> None:
    script = tmp_path / "host_dies.py"
    script.write_text(HOST_DIES)
    tests = str(Path(__file__).resolve().parent)
    proc = subprocess.Popen(
        [sys.executable, str(script), tests],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        report = json.loads(line)
        pids = set(report["pids"])
        assert len(pids) == 3 and all(pid_alive(p) for p in pids)
        proc.kill()
        proc.wait(timeout=30)
        assert_all_gone(pids)
        assert wait_until(lambda: not Path(report["segments"]).exists(), timeout=30)
    finally:
        seen = descendants(proc.pid)
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
        for stream in (proc.stdin, proc.stdout):
            if stream is not None:
                stream.close()
        kill_pids(seen)


def test_batched_model_gives_each_call_its_own_rows(tmp_path: Path) -> None:
    """add_model(max_batch_size=...): calls queued behind a busy worker run as
    one stacked score; each caller gets exactly its own rows; a call that
    does not fit (float64, keyword arguments) runs alone; a score whose
    result has the wrong rows fails only its batch, clearly."""
    gate = fifo(tmp_path)

    def call_args(n: int, rows: int) -> tuple[np.ndarray, np.ndarray]:
        x = (1000.0 * (n + 1) + np.arange(rows * 3)).reshape(rows, 3).astype(np.float32)
        names = np.array([f"c{n}r{r}" for r in range(rows)], dtype=object)
        return x, names

    async def main() -> None:
        async with running(WorkerPool(workers=1)) as pool:
            pool.add_model("m", load=counter("m"), score=wm.touch_then_gate)
            pool.add_model("rows", load=counter("rows"), score=wm.stacked, max_batch_size=16,
                           max_batch_time=0.002)  # fmt: skip
            pool.add_model("short", load=counter("short"), score=wm.stacked_short,
                           max_batch_size=16)  # fmt: skip
            await pool.wait_ready(timeout=60)
            started = tmp_path / "started"
            blocker = asyncio.create_task(pool.score("m", str(started), str(gate), "done"))
            await until(started.exists)
            calls = [call_args(n, 1 + n % 3) for n in range(10)]
            futures = [asyncio.create_task(pool.score("rows", *a, timeout=60)) for a in calls]
            wide = (calls[0][0].astype(np.float64), calls[0][1])
            odd = asyncio.create_task(pool.score("rows", *wide, timeout=60))
            short = [
                asyncio.create_task(pool.score("short", *call_args(n, 2), timeout=60))
                for n in range(3)
            ]
            await until(lambda: pool.status().queue_depth == 14)
            await release(gate)
            assert await blocker == "done"
            batches = set()
            for (x, names), future in zip(calls, futures, strict=True):
                got = await future
                np.testing.assert_array_equal(got["double"], x * 2)
                assert list(got["names"]) == [n.upper() for n in names]
                assert len(got["batch"]) == len(x)
                batches.add(int(got["batch"][0]))
            assert max(batches) > 3, batches
            with pytest.raises(ScoreError) as info:
                await odd
            assert "float32" in str(info.value)  # it ran alone: the others were not failed
            for future in short:
                with pytest.raises(ScoreError) as short_info:
                    await future
                assert "batch of 6 rows" in str(short_info.value), short_info.value

    asyncio.run(main())
