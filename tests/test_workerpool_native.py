"""WorkerPool and native runtimes: thread counts, the self-test, the abandon grace.

The same pool core as the server's (tests/test_native_hangs.py), through the
library API: a real exec'd zygote and forked workers.
"""

from __future__ import annotations

import asyncio
from functools import partial

import pytest
import workerpool_models as wm
from test_workerpool import counter, running, until

from poolserve.service import WorkerPool
from poolserve.service.contract.errors import DeadlineExceeded, ModelNotReady

pytestmark = pytest.mark.e2e


def test_workers_run_native_runtimes_with_threads_per_worker(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MKL_NUM_THREADS", "3")  # set by the host: it wins

    async def main() -> None:
        async with running(WorkerPool(workers=1, threads_per_worker=2)) as pool:
            pool.add_model("t", load=counter("t"), score=wm.threads_seen)
            await pool.wait_ready(timeout=60)
            seen = await pool.score("t", timeout=60)
            assert seen["env"] == {
                "OMP_NUM_THREADS": "2",
                "MKL_NUM_THREADS": "3",
                "OPENBLAS_NUM_THREADS": "2",
            }
            assert seen["blas"] == [2]

    asyncio.run(main())


def test_model_that_hangs_after_fork_is_disabled_by_the_self_test_others_serve() -> None:
    async def main() -> None:
        pool = WorkerPool(workers=2, warmup_timeout=2)
        pool.add_model(
            "hangs", load=partial(wm.load_thread_pool, "hangs"), score=wm.via_thread, example=(1.0,)
        )
        pool.add_model("sum", load=counter("sum"), score=wm.add, example=(1, 2))
        async with running(pool):  # starts: the model that hangs does not hold up the others
            assert (
                pool.status()
                .models["hangs"]
                .startswith(
                    "disabled: model hangs after fork: a native thread pool started in load()?"
                )
            )
            with pytest.raises(ModelNotReady, match="see threads_per_worker / start_method"):
                await pool.score("hangs", 1.0, timeout=60)
            assert await pool.score("sum", 2, 3, timeout=60) == 5
            await until(lambda: [w.state for w in pool.status().workers] == ["idle", "idle"], 60)

    asyncio.run(main())


def test_worker_stuck_in_c_after_its_caller_left_is_replaced() -> None:
    async def main() -> None:
        async with running(WorkerPool(workers=1, abandon_grace=1.0)) as pool:
            pool.add_model("csleep", load=counter("csleep"), score=wm.c_sleep)
            pool.add_model("sum", load=counter("sum"), score=wm.add)
            await pool.wait_ready(timeout=60)
            (before,) = pool.status().workers
            with pytest.raises(DeadlineExceeded):
                await pool.score("csleep", 3600, timeout=0.5)
            await until(lambda: before.pid not in {w.pid for w in pool.status().workers}, 30)
            assert await pool.score("sum", 1, 1, timeout=60) == 2

    asyncio.run(main())
