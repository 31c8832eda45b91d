"""The limits a process that runs models enforces on its own (a worker, or a
pool server for its inline models), from the server's settings.

Workers are forked from their pool's zygote, or exec'd as fresh interpreters
(``start_method: "spawn"``); neither reads ``settings.json`` again. So the
pool server calls :func:`configure` once, before its zygote exists: a forked
process inherits :data:`LIMITS` with its memory, a spawned one reads them back
from its environment when this module is first imported.

Standard library only (the contract layer).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, fields

ENV = "POOLSERVE_WORKER_LIMITS"  # not a settings field: load_server_settings ignores it
MIB = 1024 * 1024


@dataclass
class WorkerLimits:
    # A reply (its tensors not in shared memory), and the inputs a request reads
    # from shared memory together, are at most this (setting max_message_size):
    # checked before the bytes are allocated, not after.
    max_message_size: int = 64 * MIB
    # The router's slabs a worker keeps mapped, by their sizes (slab_mapped_bytes).
    slab_mapped_bytes: int = 512 * MIB


LIMITS = WorkerLimits()


def configure(max_message_size: int, slab_mapped_bytes: int, *, export: bool = True) -> None:
    """Sets this process's limits; ``export``: its environment's too, for the
    processes it execs (a pool server's spawned workers)."""
    LIMITS.max_message_size = max_message_size
    LIMITS.slab_mapped_bytes = slab_mapped_bytes
    if export:
        os.environ[ENV] = json.dumps(asdict(LIMITS))


def _from_environ() -> None:
    raw = os.environ.get(ENV)
    if not raw:
        return
    try:
        values = json.loads(raw)
    except ValueError:
        return  # not ours to judge here: the defaults hold
    for f in fields(WorkerLimits):
        value = values.get(f.name) if isinstance(values, dict) else None
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            setattr(LIMITS, f.name, value)


_from_environ()
