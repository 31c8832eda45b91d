"""The schedule_policy extension: where a request queues and until when, as Triton reads it.

A request may carry two parameters (Triton's schedule_policy extension):

- ``priority`` (int64 or uint64): 0 or absent means the model's
  ``default_priority_level``; 1 is the highest level, 2 the next, and so on up
  to the model's ``priority_levels``. A negative value, or one past
  ``priority_levels``, is INVALID_ARGUMENT (Triton refuses negative values, and
  quietly demotes values past the last level to the default; we say so instead).
  A model that declares no levels has one: only 0 is valid.
- ``timeout`` (int64, microseconds): the request gives up that long after it
  reaches the pool, or at its own deadline if that comes first; 0 means none.

A model declares its levels in ``parameters.extra``: ``priority_levels`` and
``default_priority_level`` (in ``[1, priority_levels]``, as Triton requires;
the lowest level when left out).

The queue orders by level, then by deadline, then by arrival. A deadline
that came as gRPC's ``grpc-timeout`` header is only so precise, and only ever
later than the client's: grpc-core writes the header with three significant
digits, rounded up, from a deadline it keeps in whole milliseconds, and its
HPACK encoder sends a timeout up to 3% shorter than one it sent before on the
connection as that earlier value (to reuse the table entry). Two calls sent
60 ms apart with equal 20 s timeouts arrived as 20.1 s and 20.0 s, the later
call's deadline first. :func:`deadline_precision` is that uncertainty; the
dispatcher keeps arrival order between deadlines closer than it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from poolserve.service.contract.errors import InvalidInput
from poolserve.service.contract.settings import ConfigError

NO_LEVEL = 1 << 30  # the queue level of a model without priority levels: below every level
CLOCK_S = 0.001  # grpc-core keeps deadlines in whole milliseconds
HPACK_REUSE = 0.03  # grpc-core resends a timeout up to 3% shorter as the longer one


@dataclass(frozen=True, slots=True)
class PriorityLevels:
    levels: int = 0  # 0: the model declares none
    default: int = 0


@dataclass(frozen=True, slots=True)
class Schedule:
    priority: int  # the queue level: 1 is served first
    deadline: float  # absolute, time.monotonic()
    precision: float  # deadlines closer than this keep arrival order


def priority_levels(source: str, extra: Mapping[str, Any]) -> PriorityLevels:
    """A model's levels from its ``parameters.extra``; ConfigError names the field."""
    levels = extra.get("priority_levels", 0)
    if not _is_int(levels) or levels < 0:
        raise ConfigError(
            source, "parameters.extra.priority_levels", f"expected an integer >= 0, got {levels!r}"
        )
    default = extra.get("default_priority_level", levels)
    if levels == 0:
        if default != 0:
            raise ConfigError(
                source,
                "parameters.extra.default_priority_level",
                "needs parameters.extra.priority_levels",
            )
        return PriorityLevels()
    if not _is_int(default) or not 1 <= default <= levels:
        raise ConfigError(
            source,
            "parameters.extra.default_priority_level",
            f"must be in range [1, {levels}], got {default!r}",
        )
    return PriorityLevels(levels, default)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def queue_level(model: str, levels: PriorityLevels, priority: int | None) -> int:
    """The queue level of a request; InvalidInput for a priority the model lacks."""
    if priority is None or priority == 0:
        return levels.default if levels.levels else NO_LEVEL
    if priority < 0:
        raise InvalidInput(f"invalid value for 'priority': {priority}, expected a value >= 0")
    if priority > levels.levels:
        if not levels.levels:
            raise InvalidInput(
                f"invalid value for 'priority': {priority}; model '{model}' declares no "
                "priority levels (parameters.extra.priority_levels), so only 0 is valid"
            )
        raise InvalidInput(
            f"invalid value for 'priority': {priority}; model '{model}' has priority "
            f"levels 1 to {levels.levels}"
        )
    return priority


def request_deadline(deadline: float, now: float, timeout_us: int | None) -> tuple[float, float]:
    """The deadline after the ``timeout`` parameter's cap, and its precision."""
    precision = deadline_precision(deadline - now)
    if timeout_us is None or timeout_us == 0:
        return deadline, precision
    if timeout_us < 0:
        raise InvalidInput(f"invalid value for 'timeout': {timeout_us}, expected microseconds >= 0")
    capped = now + timeout_us / 1e6
    if capped < deadline:
        return capped, CLOCK_S
    return deadline, precision


def deadline_precision(budget_s: float) -> float:
    """How much later than the client's own a deadline that came as a gRPC timeout
    of about ``budget_s`` may be: the 3% of the HPACK encoder's reuse, one unit of
    the header's encoding (1 ms below 1 s, 10 ms below 10 s, 100 ms below 100 s,
    ...) and grpc-core's millisecond clock."""
    budget_s = max(budget_s, 0.0)
    unit = 10.0 ** (math.floor(math.log10(budget_s)) - 2) if budget_s >= 1.0 else CLOCK_S
    return HPACK_REUSE * budget_s + unit + CLOCK_S


def schedule(
    model: str,
    levels: PriorityLevels,
    priority: int | None,
    timeout_us: int | None,
    deadline: float,
    now: float,
) -> Schedule:
    level = queue_level(model, levels, priority)
    capped, precision = request_deadline(deadline, now, timeout_us)
    return Schedule(level, capped, precision)
