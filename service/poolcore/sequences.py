"""The live sequences of one sequence model in a pool: which worker holds each.

A sequence's requests all run on the worker that ran its start (its state
lives there): :meth:`Sequences.route` answers that worker, or places a new
sequence on the live worker holding the fewest. A request of an unknown or
expired sequence without ``sequence_start`` is InvalidInput; a start beyond
``max_sequences`` is RESOURCE_EXHAUSTED; a sequence whose worker died is
lost (its next request says so, and it is forgotten: a new start may reuse
its id). A sequence idle past ``idle_timeout_s``, or whose end request ran,
is released and its worker told (a SEQUENCE_END notice, after the jobs
already pinned to it), so the model can drop its state. A worker retired by a
rolling reload keeps serving the sequences it holds (on the model it had)
and exits once they all ended or idled out; new sequences go to fresh workers.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

from poolserve.service.contract.errors import Unavailable
from poolserve.service.contract.sequence import (
    SequenceControl,
    SequencePolicy,
    admit_new,
    sequence_id,
)
from poolserve.service.poolcore.dispatcher import Dispatcher
from poolserve.service.poolcore.jobs import Worker, WorkerState


@dataclass(eq=False)
class Live:
    ident: int | str
    worker: Worker
    timer: asyncio.TimerHandle | None = None


class Sequences:
    def __init__(self, model: str, policy: SequencePolicy, dispatcher: Dispatcher) -> None:
        self.model = model
        self.policy = policy
        self.dispatcher = dispatcher
        self.live: dict[int | str, Live] = {}

    def route(self, control: SequenceControl) -> tuple[Worker, str]:
        """The worker that runs this request, and the sequence's name for messages."""
        ident = sequence_id(self.model, control)
        name = f"{ident!r}"
        held = self.live.get(ident)
        if held is not None and held.worker.state is WorkerState.DEAD:
            self._forget(held)
            if not control.start:
                raise Unavailable(
                    f"sequence {name} of model '{self.model}' is lost: worker pid "
                    f"{held.worker.pid} that held its state died; start it again"
                )
            held = None
        if held is None:
            admit_new(self.model, self.policy, control, len(self.live))
            held = Live(ident, self._least_loaded(name))
            self.live[ident] = held
            self.dispatcher.hold_sequences(held.worker, 1)
        self._touch(held)
        return held.worker, name

    def ran(self, control: SequenceControl) -> None:
        """A request of the sequence was answered: an end request ends it."""
        held = None if control.id is None else self.live.get(control.id)
        if held is not None and control.end:
            self._release(held, "end")

    def _least_loaded(self, name: str) -> Worker:
        counts: dict[int, int] = {}
        for held in self.live.values():
            counts[held.worker.pid] = counts.get(held.worker.pid, 0) + 1
        candidates = [
            w
            for w in self.dispatcher.workers()
            if w.state in (WorkerState.IDLE, WorkerState.BUSY) and not w.retiring
        ]
        if not candidates:
            raise Unavailable(f"no live worker to start sequence {name} of model '{self.model}'")
        return min(
            candidates, key=lambda w: (counts.get(w.pid, 0), w.state is not WorkerState.IDLE)
        )

    def _touch(self, held: Live) -> None:
        if held.timer is not None:
            held.timer.cancel()
        loop = asyncio.get_running_loop()
        held.timer = loop.call_later(self.policy.idle_timeout_s, self._release, held, "timeout")

    def _release(self, held: Live, reason: str) -> None:
        if self.live.get(held.ident) is not held:
            return
        body = json.dumps({"model": self.model, "id": held.ident, "reason": reason}).encode()
        self.dispatcher.notify_sequence_end(held.worker, body, f"{held.ident!r}", self.model)
        self._forget(held)  # after the notice is pinned: a retiring worker waits for it

    def _forget(self, held: Live) -> None:
        if held.timer is not None:
            held.timer.cancel()
            held.timer = None
        if self.live.get(held.ident) is held:
            del self.live[held.ident]
            self.dispatcher.hold_sequences(held.worker, -1)
