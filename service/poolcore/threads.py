"""How many threads the native runtimes of a pool's processes may start.

Parallelism in a pool comes from its workers. A native runtime that starts
its own thread pool in the zygote (libgomp, behind XGBoost, LightGBM,
scikit-learn and PyTorch, runs its parallel regions on one) hands every
forked worker a pool whose threads do not exist there: the worker's first
parallel region waits for them forever. One thread per runtime starts no
pool, and the total stays workers x threads <= cores.

:func:`limit_native_threads` sets the runtimes' environment variables before
any model code is imported (each runtime reads them once, when it is
loaded), keeping a value the user set, and calls the setters of runtimes
already loaded by then, where an environment variable comes too late.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import MutableMapping

log = logging.getLogger(__name__)

THREAD_VARIABLES = (
    "OMP_NUM_THREADS",  # OpenMP: libgomp, llvm-openmp (XGBoost, LightGBM, scikit-learn, PyTorch)
    "MKL_NUM_THREADS",  # Intel MKL (numpy or PyTorch builds on MKL)
    "OPENBLAS_NUM_THREADS",  # OpenBLAS (numpy and scipy wheels)
    "NUMEXPR_NUM_THREADS",  # numexpr (pandas)
    "VECLIB_MAXIMUM_THREADS",  # Apple Accelerate
)
# Modules whose thread pools exist once imported: the environment is read by then.
NATIVE_MODULES = ("numpy", "scipy", "torch", "sklearn", "xgboost", "lightgbm", "onnxruntime")


def thread_environment(
    threads: int, environ: MutableMapping[str, str] | None = None
) -> dict[str, str]:
    """Sets each thread variable to ``threads`` unless it is set already.

    Returns the variables that were set already (the user's choice, kept).
    """
    env = os.environ if environ is None else environ
    kept: dict[str, str] = {}
    for name in THREAD_VARIABLES:
        value = env.get(name)
        if value is not None:
            kept[name] = value
        else:
            env[name] = str(threads)
    return kept


def limit_native_threads(threads: int, who: str) -> None:
    """Thread counts for this process and every process it forks or starts.

    Call it before model code is imported. A variable already in the
    environment wins, with a log line saying so. Runtimes already loaded (their
    variables read too early) are told through their own setters.
    """
    kept = thread_environment(threads)
    for name, value in kept.items():
        log.info(
            "%s: %s=%s from the environment wins over threads_per_worker=%d",
            who,
            name,
            value,
            threads,
        )
    sync_loaded_runtimes(who)


def _count(name: str) -> int | None:
    raw = os.environ.get(name, "")
    return int(raw) if raw.isdigit() and int(raw) > 0 else None


def sync_loaded_runtimes(who: str) -> None:
    """Applies the thread variables to runtimes loaded before they were set.

    A runtime reads its variable once, when it loads: one imported earlier
    (numpy's OpenBLAS, say) gets the value through threadpoolctl, where it
    is installed, and PyTorch through ``torch.set_num_threads``. Nothing to do
    (the usual case) when no native module is loaded yet.
    """
    if not any(m in sys.modules for m in NATIVE_MODULES):
        return
    omp = _count("OMP_NUM_THREADS")
    torch = sys.modules.get("torch")
    set_threads = getattr(torch, "set_num_threads", None)
    if omp is not None and callable(set_threads):
        set_threads(omp)
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        log.warning(
            "%s: native libraries were loaded before their thread counts could be set, and "
            "threadpoolctl is not installed: their thread pools stay as they are",
            who,
        )
        return
    for api, variable in (("blas", "OPENBLAS_NUM_THREADS"), ("openmp", "OMP_NUM_THREADS")):
        count = _count(variable)
        if count is not None:
            threadpool_limits(limits=count, user_api=api)
