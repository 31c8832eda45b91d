"""When to fork a replacement worker, and when a model is to blame too often.

A worker that dies is replaced at once the first time; repeated deaths back
off with jitter (capped), so a model that kills its worker on every request
cannot fork-bomb the machine. Deaths are also counted against the model the
worker was running: past a threshold the model is marked failed, and the
rest of the pool keeps serving. Both counts decay, as in the supervisor.

A fresh worker that hangs or dies in its self-test (the warm-up prediction
of a model, before any request) is stronger evidence: the model does not
survive the fork. After ``WARMUP_FAILURE_THRESHOLD`` such workers the model is
marked failed for good (until it is loaded again), and later workers leave
its warm-up out (:attr:`Respawner.failed_warmup`), so the others serve.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable

from poolserve.service.lifecycle.backoff import DecayingCounter, backoff_delay

CRASH_HALF_LIFE_S = 60.0
COOLDOWN_S = (30.0, 600.0)  # a failed model is tried again after this, doubling each time
MODEL_CRASH_THRESHOLD = 4.0
WARMUP_FAILURE_THRESHOLD = 2.0
HANGS_AFTER_FORK = (
    "model hangs after fork: a native thread pool started in load()? "
    "see threads_per_worker / start_method"
)
CRASHES_AFTER_FORK = (
    "model crashes after fork: a native runtime that does not survive fork? "
    "see threads_per_worker / start_method"
)
HANGS_IN_SPAWNED = "model hangs in a fresh (spawned) worker: its load or warm-up did not finish"
CRASHES_IN_SPAWNED = "model fails in a fresh (spawned) worker: its load or warm-up ended it"
BACKOFF_BASE_S = 0.05
BACKOFF_CAP_S = 5.0
JITTER = 0.5


class Respawner:
    def __init__(
        self,
        spawn: Callable[[], None],
        mark_failed: Callable[[str, str], None],
        *,
        retry_model: Callable[[str], None] = lambda name: None,
        clock: Callable[[], float],
        rng: random.Random | None = None,
        threshold: float = MODEL_CRASH_THRESHOLD,
        spawned: bool = False,
    ) -> None:
        """``spawned``: workers are fresh interpreters (start_method spawn), not forks."""
        self._spawned = spawned
        self._spawn = spawn
        self._mark_failed = mark_failed
        self._retry_model = retry_model
        self._cooldowns: dict[str, float] = {}
        self._clock = clock
        self._rng = rng or random.Random()
        self._threshold = threshold
        self._pool = DecayingCounter(CRASH_HALF_LIFE_S)
        self._models: dict[str, DecayingCounter] = {}
        self._failed: set[str] = set()
        self._warmups: dict[str, DecayingCounter] = {}
        self.failed_warmup: dict[str, str] = {}  # model -> why (its warm-up is left out)
        self._timers: set[asyncio.TimerHandle] = set()
        self.respawns = 0

    def worker_lost(
        self, model: str, why: str, *, warmup: bool = False, hung: bool = False
    ) -> float:
        """Records a death; schedules the replacement; returns its delay in seconds.

        ``warmup``: the worker died in its self-test, warming up ``model``;
        ``hung``: we killed it there (time limit or heartbeat).
        """
        now = self._clock()
        failures = self._pool.add(now)
        if model and warmup:
            self._warmup_failed(model, why, hung, now)
        elif model and model not in self._failed:
            count = self._models.setdefault(model, DecayingCounter(CRASH_HALF_LIFE_S)).add(now)
            if count >= self._threshold:
                self._failed.add(model)
                cooldown = self._cooldowns.get(model, COOLDOWN_S[0])
                self._cooldowns[model] = min(cooldown * 2, COOLDOWN_S[1])
                self._mark_failed(
                    model,
                    f"model crashed its worker {round(count)} times recently (last: {why}); "
                    f"tried again in {cooldown:.0f} s",
                )
                # Kills from outside (OOM, an operator) look the same as crashes: never
                # give up on a model for good, try it again after a growing cooldown.
                self._after(cooldown, lambda: self._give_another_chance(model))
        delay = 0.0
        if failures > 1.5:
            delay = backoff_delay(
                failures - 1, base=BACKOFF_BASE_S, cap=BACKOFF_CAP_S, jitter=JITTER, rng=self._rng
            )
        self._schedule(delay)
        return delay

    def _warmup_failed(self, model: str, why: str, hung: bool, now: float) -> None:
        if model in self.failed_warmup:
            return
        count = self._warmups.setdefault(model, DecayingCounter(CRASH_HALF_LIFE_S)).add(now)
        if count < WARMUP_FAILURE_THRESHOLD:
            return
        what = "did not finish" if hung else "killed its worker"
        if self._spawned:
            cause = HANGS_IN_SPAWNED if hung else CRASHES_IN_SPAWNED
        else:
            cause = HANGS_AFTER_FORK if hung else CRASHES_AFTER_FORK
        reason = f"{cause} (its self-test {what} in {round(count)} fresh workers; last: {why})"
        self.failed_warmup[model] = reason
        self._mark_failed(model, reason)

    def _schedule(self, delay: float) -> None:
        def fire() -> None:
            self.respawns += 1
            self._spawn()

        self._after(delay, fire)

    def _after(self, delay: float, action: Callable[[], None]) -> None:
        loop = asyncio.get_running_loop()
        handle: asyncio.TimerHandle | None = None

        def fire() -> None:
            assert handle is not None
            self._timers.discard(handle)
            action()

        handle = loop.call_later(delay, fire)
        self._timers.add(handle)

    def _give_another_chance(self, model: str) -> None:
        if model in self._failed:
            self._failed.discard(model)
            self._models.pop(model, None)
            self._retry_model(model)

    def forgive(self, model: str) -> None:
        """A model was (re)loaded: its crash history starts over."""
        self._failed.discard(model)
        self._models.pop(model, None)
        self._cooldowns.pop(model, None)
        self._warmups.pop(model, None)
        self.failed_warmup.pop(model, None)

    def close(self) -> None:
        for handle in self._timers:
            handle.cancel()
        self._timers.clear()
