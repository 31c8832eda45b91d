"""The live sequences of an inline sequence model (``parallel_workers: 0``):
the same rules as on workers (:mod:`poolserve.service.poolcore.sequences`),
with the model's one thread as the one place every sequence lives.

A request of an unknown or expired sequence without ``sequence_start`` is
InvalidInput; a start beyond ``max_sequences`` is RESOURCE_EXHAUSTED; a
sequence idle past ``idle_timeout_s``, or whose end request ran, is released
and the model's ``sequence_ended`` hook runs on its thread (after what it
runs now), so the model can drop its state.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from poolserve.service.contract.sequence import (
    SequenceControl,
    SequencePolicy,
    admit_new,
    sequence_id,
)

Ended = Callable[[int | str, str], None]  # (sequence id, reason "end" or "timeout")


class InlineSequences:
    def __init__(self, model: str, policy: SequencePolicy, ended: Ended) -> None:
        self.model = model
        self.policy = policy
        self.ended = ended
        self.live: dict[int | str, asyncio.TimerHandle] = {}  # each with its idle timer

    def route(self, control: SequenceControl) -> None:
        """Admits this request of its sequence, or raises why not."""
        ident = sequence_id(self.model, control)
        timer = self.live.get(ident)
        if timer is None:
            admit_new(self.model, self.policy, control, len(self.live))
        else:
            timer.cancel()
        loop = asyncio.get_running_loop()
        self.live[ident] = loop.call_later(
            self.policy.idle_timeout_s, self._release, ident, "timeout"
        )

    def ran(self, control: SequenceControl) -> None:
        """A request of the sequence was answered: an end request ends it."""
        if control.id is not None and control.end:
            self._release(control.id, "end")

    def _release(self, ident: int | str, reason: str) -> None:
        timer = self.live.pop(ident, None)
        if timer is None:
            return
        timer.cancel()
        self.ended(ident, reason)

    def close(self) -> None:
        for timer in self.live.values():
            timer.cancel()
        self.live.clear()
