"""How many cores this process may use: its affinity, bounded by a cgroup v2 CPU quota.

``sched_getaffinity`` counts the cores the scheduler may put us on; a
container limited by a CPU quota (``docker --cpus 2``, a Kubernetes CPU
limit) still sees every core of the host there, and is throttled past its
quota. cgroup v2 writes the quota in ``cpu.max`` as ``QUOTA PERIOD`` (in
microseconds; ``max``: none). The quota that binds is the smallest along the
process's cgroup and its ancestors (``/proc/self/cgroup``'s ``0::/path``
under ``/sys/fs/cgroup``; in a container with its own cgroup namespace that
path is ``/``, and ``/sys/fs/cgroup/cpu.max`` is the container's).

:func:`usable_cores` is the one count ``routers: auto`` and the
``threads_per_worker`` warning use.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")


def affinity_cores() -> int:
    """The cores this process may run on (its affinity), else os.cpu_count()."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def parse_cpu_max(text: str) -> float | None:
    """Cores a ``cpu.max`` line allows (quota / period), None for ``max`` or a
    line it cannot read."""
    fields = text.split()
    if not fields or fields[0] == "max":
        return None
    try:
        quota = int(fields[0])
        period = int(fields[1]) if len(fields) > 1 else 100_000
    except ValueError:
        return None
    if quota <= 0 or period <= 0:
        return None
    return quota / period


def _own_cgroup(proc_cgroup: Path) -> str:
    """The v2 path of this process's cgroup (``/`` when it cannot tell)."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return "/"
    for line in lines:
        if line.startswith("0::"):
            return line[3:].strip() or "/"
    return "/"


def cgroup_cpu_quota(root: Path | None = None, proc_cgroup: Path | None = None) -> float | None:
    """The smallest cgroup v2 CPU quota over this process's cgroup and its
    ancestors, in cores; None when none is set (or there is no cgroup v2).
    ``root``, ``proc_cgroup``: :data:`CGROUP_ROOT`, :data:`PROC_CGROUP` unless given."""
    root = root or CGROUP_ROOT
    path = _own_cgroup(proc_cgroup or PROC_CGROUP).strip("/")
    parts = path.split("/") if path else []
    quotas: list[float] = []
    for depth in range(len(parts), -1, -1):
        cpu_max = root.joinpath(*parts[:depth], "cpu.max")
        try:
            quota = parse_cpu_max(cpu_max.read_text())
        except (OSError, UnicodeDecodeError):
            continue
        if quota is not None:
            quotas.append(quota)
    return min(quotas) if quotas else None


def usable_cores(root: Path | None = None, proc_cgroup: Path | None = None) -> int:
    """The cores this process may use: its affinity, and no more than its
    cgroup's CPU quota rounded up (1.5 cores of quota: 2), at least one."""
    cores = affinity_cores()
    quota = cgroup_cpu_quota(root, proc_cgroup)
    if quota is not None:
        cores = min(cores, max(1, math.ceil(quota)))
    return cores
