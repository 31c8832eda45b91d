"""What a client's stream resets cost its connection (rapid reset, CVE-2023-44487).

A stream the client resets frees its place at once, so the bound on streams
alone does not bound the work a connection makes the router start. Each
reset is weighed by the work the router had started for its call (as nginx,
Go's x/net/http2 and nghttp2 bound the work, not the share of streams reset):
a handler that ran (its request went on to a pool, which is told to drop it)
costs :data:`COST_RUNNING`; a handler made but not yet run (the request came
whole, the reset in the same read) :data:`COST_STARTED`; a call whose request
had not come whole (no handler) :data:`COST_OPENED`. Measured on the router
(bench/rapid_reset.py): about 55, 30 and 15 us of its CPU, beside 20 for a
stream answered at once and 60 for an echo answered. A reset with at most
:data:`EARLY_RESET_SHARE` of the call's timeout left is a client giving up at
its deadline and costs nothing.

The costs come out of a budget of :data:`RESET_BUDGET`, which a call whose
handler answered (not reset) puts :data:`COST_RUNNING` back into, and time
refills at :data:`REFILL_PER_S`, never past the budget. So a client that
cancels up to half of its calls, or a few each second, is never stopped,
whatever else it sends; streams answered at once (unknown methods, refusals)
start no handler, earn nothing and cannot hide resets of costly ones. Past
the budget the connection is sent GOAWAY ENHANCE_YOUR_CALM. (A handler's
answer earns the same whatever it cost: resets paired with calls a handler
answers at once, a ServerLive, are not stopped but paced, one per such call.)
"""

from __future__ import annotations

import inspect
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from poolserve.service.router.http2.call import Call

RESET_BUDGET = 500.0  # resets of running calls a connection may make at once
REFILL_PER_S = 50.0  # what the budget regains each second
COST_RUNNING = 1.0  # the handler ran (forwarded the request): also what an answer earns
COST_STARTED = 0.5  # the handler was made, not yet run
COST_OPENED = 0.1  # headers, no whole request: no handler
EARLY_RESET_SHARE = 0.1  # a reset with at most this share of its timeout left is at its deadline


def reset_cost(call: Call, now: float) -> float:
    """What the client's reset of ``call``, now, costs (0: not early)."""
    if call.finished:  # answered already: the reset only closes the stream
        return 0.0
    if call.deadline is not None and call.deadline - now <= EARLY_RESET_SHARE * call.timeout:
        return 0.0  # giving up at its deadline (it reaches us about when our timer fires)
    task = call.task
    if task is None:
        return COST_OPENED
    if inspect.getcoroutinestate(task.get_coro()) == inspect.CORO_CREATED:  # type: ignore[arg-type]
        return COST_STARTED
    return COST_RUNNING


class ResetBudget:
    """One connection's budget for resets (a token bucket)."""

    __slots__ = ("_at", "level")

    def __init__(self) -> None:
        self.level = RESET_BUDGET
        self._at = time.monotonic()

    def spend(self, cost: float, now: float) -> bool:
        """Takes ``cost``; False once the budget is spent (a flood)."""
        self.level = min(RESET_BUDGET, self.level + (now - self._at) * REFILL_PER_S) - cost
        self._at = now
        return self.level >= 0

    def answered(self, call: Call) -> None:
        """``call`` was answered, not reset: a handler's work paid for."""
        if call.task is not None and self.level < RESET_BUDGET:
            self.level = min(RESET_BUDGET, self.level + COST_RUNNING)
