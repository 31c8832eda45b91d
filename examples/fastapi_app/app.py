"""A FastAPI app that scores a CPU-bound model on a poolserve WorkerPool.

Run it (from the repository root)::

    .venv/bin/uvicorn app:app --app-dir examples/fastapi_app --port 8000
    curl -s localhost:8000/predict -H 'content-type: application/json' \\
        -d '{"features": [0.5, 1.5, 2.5], "work": 200000}'

The pool starts in the lifespan, before the app serves its first request:
its zygote is a clean exec (never a fork of this process, which by then has
an event loop and threads), loads the model once, and forks the workers.
``POST /predict`` awaits ``pool.score``: the event loop stays free while a
worker computes. ``POST /predict-inline`` computes in this process instead
(FastAPI runs a plain ``def`` endpoint on its thread pool, where the GIL lets
one request compute at a time): the baseline of ``bench/workerpool_bench.py``.

Environment: ``WORKERS`` (default 2), ``MAX_QUEUE`` (default 256).
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import asdict
from functools import partial
from typing import Any

from cpu_model import load_model, score
from fastapi import FastAPI, HTTPException, Request
from pydantic import BaseModel, Field

from poolserve.service import (
    DeadlineExceeded,
    QueueFull,
    ScoreError,
    ServingError,
    Unavailable,
    WorkerPool,
)

MODEL = "burn"
SEED = 7


class PredictRequest(BaseModel):
    features: list[float] = Field(min_length=1)
    work: int = Field(default=200_000, ge=0, le=50_000_000)
    timeout: float | None = Field(default=None, gt=0)


class Prediction(BaseModel):
    score: float


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    pool = WorkerPool(
        workers=int(os.environ.get("WORKERS", "2")),
        name="fastapi-example",
        max_queue=int(os.environ.get("MAX_QUEUE", "256")),
    )
    pool.add_model(MODEL, load=partial(load_model, seed=SEED), score=score)
    async with pool:  # forks before the app serves; drains and stops at shutdown
        app.state.pool = pool
        app.state.inline_model = load_model(seed=SEED)  # for /predict-inline only
        yield


app = FastAPI(title="poolserve WorkerPool example", lifespan=lifespan)


def http_error(exc: ServingError) -> HTTPException:
    if isinstance(exc, DeadlineExceeded):
        return HTTPException(504, exc.message)
    if isinstance(exc, QueueFull | Unavailable):
        return HTTPException(503, exc.message)
    if isinstance(exc, ScoreError):
        return HTTPException(500, f"{exc.type_name}: {exc.remote_message}")
    return HTTPException(500, exc.message)


@app.post("/predict")
async def predict(body: PredictRequest, request: Request) -> Prediction:
    pool: WorkerPool = request.app.state.pool
    try:
        value = await pool.score(MODEL, body.features, body.work, timeout=body.timeout)
    except ServingError as exc:
        raise http_error(exc) from exc
    return Prediction(score=value)


@app.post("/predict-inline")
def predict_inline(body: PredictRequest, request: Request) -> Prediction:
    try:
        value = score(request.app.state.inline_model, body.features, body.work)
    except ValueError as exc:
        raise HTTPException(500, f"ValueError: {exc}") from exc
    return Prediction(score=value)


@app.get("/stats")
async def stats(request: Request) -> dict[str, Any]:
    pool: WorkerPool = request.app.state.pool
    status = pool.status()
    return {
        "models": {name: asdict(s) for name, s in pool.stats().items()},
        "zygote_pid": status.zygote_pid,
        "workers": [w.pid for w in status.workers],
    }


@app.get("/healthz")
async def healthz(request: Request) -> dict[str, str]:
    pool: WorkerPool = request.app.state.pool
    return {"status": pool.status().models.get(MODEL, "missing")}
