"""Restart policy: the pause once failures come too fast (suture's semantics),
on the decaying failure counter and jittered back-off of
:mod:`poolserve.service.lifecycle.backoff`.

Pure: time comes from an injected :class:`Clock`, randomness from an injected
``random.Random``; the supervisor acts on the :class:`RestartDecision`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from poolserve.service.lifecycle.backoff import DecayingCounter, backoff_delay
from poolserve.supervisor.clock import Clock
from poolserve.supervisor.spec import SupervisorSpec


@dataclass(frozen=True)
class RestartDecision:
    """What to do about one failure.

    ``delay`` is the backoff before the restart. ``paused`` means restarts are
    on hold until :meth:`RestartPolicy.resume`; ``pause_started`` is True only
    for the failure that crossed the threshold, with ``resume_in`` seconds.
    """

    delay: float
    paused: bool = False
    pause_started: bool = False
    resume_in: float = 0.0


class RestartPolicy:
    """One supervisor's failure accounting.

    The supervisor-wide counter (the restart intensity) decides the pause; a
    per-child counter, decaying the same way, sets that child's backoff.
    """

    def __init__(self, spec: SupervisorSpec, clock: Clock, rng: random.Random) -> None:
        self._spec = spec
        self._clock = clock
        self._rng = rng
        self._intensity = DecayingCounter(spec.failure_decay)
        self._per_child: dict[str, DecayingCounter] = {}
        self._paused_until: float | None = None

    @property
    def paused(self) -> bool:
        return self._paused_until is not None

    def failures(self) -> float:
        """The supervisor-wide failure counter as of now."""
        return self._intensity.value(self._clock.monotonic())

    def pause_remaining(self) -> float:
        if self._paused_until is None:
            return 0.0
        return max(0.0, self._paused_until - self._clock.monotonic())

    def on_failure(self, child_id: str) -> RestartDecision:
        now = self._clock.monotonic()
        intensity = self._intensity.add(now)
        counter = self._per_child.setdefault(child_id, DecayingCounter(self._spec.failure_decay))
        delay = backoff_delay(
            counter.add(now),
            base=self._spec.backoff_base,
            cap=self._spec.backoff_max,
            jitter=self._spec.jitter,
            rng=self._rng,
        )
        if self._paused_until is not None:
            return RestartDecision(delay=delay, paused=True)
        if intensity > self._spec.failure_threshold:
            self._paused_until = now + self._spec.failure_backoff
            return RestartDecision(
                delay=delay, paused=True, pause_started=True, resume_in=self._spec.failure_backoff
            )
        return RestartDecision(delay=delay)

    def resume(self) -> None:
        """Ends the pause; like suture, the supervisor-wide count starts over."""
        self._paused_until = None
        self._intensity.reset()

    def forget(self, child_id: str) -> None:
        """Drops a removed child's history."""
        self._per_child.pop(child_id, None)
