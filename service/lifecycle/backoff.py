"""Restart arithmetic shared by the supervisor and the pool core's respawner:
a failure counter that decays, and a jittered, capped exponential back-off.

Pure: the caller passes the time and the ``random.Random``.
"""

from __future__ import annotations

import math
import random


class DecayingCounter:
    """A count that halves every ``half_life`` seconds.

    Why decay rather than a sliding window: one number per counter, and a
    burst long ago weighs less than a burst now, smoothly.
    """

    def __init__(self, half_life: float) -> None:
        if half_life <= 0:
            raise ValueError("half_life must be positive")
        self.half_life = half_life
        self._value = 0.0
        self._at = 0.0

    def value(self, now: float) -> float:
        elapsed = max(0.0, now - self._at)
        return self._value * math.pow(0.5, elapsed / self.half_life)

    def add(self, now: float, amount: float = 1.0) -> float:
        self._value = self.value(now) + amount
        self._at = now
        return self._value

    def reset(self) -> None:
        self._value = 0.0


def backoff_delay(
    failures: float, *, base: float, cap: float, jitter: float, rng: random.Random
) -> float:
    """The wait before restarting a child with ``failures`` recent failures (>= 1).

    The nominal delay doubles per failure up to ``cap``; jitter shortens it by
    up to that fraction, so ``cap`` stays a true maximum and restarts of many
    children do not line up.
    """
    # Clamp the exponent: beyond 2**64 the cap wins anyway, and floats overflow.
    exponent = min(64.0, max(0.0, failures - 1.0))
    nominal = min(cap, base * math.pow(2.0, exponent))
    return nominal * (1.0 - jitter * rng.random())
