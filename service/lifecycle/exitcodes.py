"""The exit-code protocol between a supervised process and its supervisor,
and wait statuses decoded the way people read them.

A child process tells its supervisor what to do next through its exit code:

- 0 (``EXIT_OK``): a normal return; a PERMANENT child is restarted, a
  TRANSIENT or TEMPORARY one is not.
- 2 (``EXIT_CONFIG``): invalid configuration, a restart cannot help; the
  whole tree stops and the root exits with 2.
- 3 (``EXIT_UNRECOVERABLE``): this child cannot work (a model that cannot
  load); it is not restarted and its status says ``failed``; the others keep
  running.
- any other code, or death by a signal: a failure, restarted by policy.

Light to import (no asyncio), so that child processes use the constants.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass

EXIT_OK = 0
EXIT_CONFIG = 2
EXIT_UNRECOVERABLE = 3


@dataclass(frozen=True)
class ExitStatus:
    """How one process ended: ``code`` or ``signal`` (neither: the status was lost)."""

    pid: int
    code: int | None = None
    signal: int | None = None
    core_dumped: bool = False

    @classmethod
    def from_wait_status(cls, pid: int, status: int) -> ExitStatus:
        if os.WIFSIGNALED(status):
            return cls(pid, signal=os.WTERMSIG(status), core_dumped=os.WCOREDUMP(status))
        return cls(pid, code=os.waitstatus_to_exitcode(status))

    @property
    def signal_name(self) -> str | None:
        if self.signal is None:
            return None
        try:
            return signal.Signals(self.signal).name
        except ValueError:
            return f"signal {self.signal}"

    def describe(self) -> str:
        """'exited with code 1', 'killed by SIGKILL', 'killed by SIGSEGV (core dumped)'."""
        if self.signal is not None:
            core = " (core dumped)" if self.core_dumped else ""
            return f"killed by {self.signal_name}{core}"
        if self.code is None:
            return "ended with an unknown status (reaped elsewhere)"
        return f"exited with code {self.code}"

    def __str__(self) -> str:
        return f"pid {self.pid} {self.describe()}"
