"""One process's CPU time, resident memory and start time from /proc (Linux).

Cheap enough to read at every metrics scrape: one small read of
``/proc/PID/stat`` per process (PSS, which walks the page tables, is
:func:`~poolserve.service.lifecycle.procutil.pss_bytes` and costs more).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

_TICKS = os.sysconf("SC_CLK_TCK")
_PAGE = os.sysconf("SC_PAGE_SIZE")


@dataclass(frozen=True, slots=True)
class ProcStat:
    pid: int
    cpu_seconds: float  # user + system
    rss_bytes: int
    start_ticks: int  # since boot, in clock ticks: with the pid, names one incarnation


def proc_stat(pid: int) -> ProcStat | None:
    """The process's figures, or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: cut after the last ')'.
    fields = raw[raw.rfind(b")") + 2 :].split()
    utime, stime = int(fields[11]), int(fields[12])
    return ProcStat(pid, (utime + stime) / _TICKS, int(fields[21]) * _PAGE, int(fields[19]))
