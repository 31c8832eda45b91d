"""The two Linux prctl calls process supervision needs, through ctypes.

Kept apart so that both sides use them: the supervisor as the root
(PR_SET_CHILD_SUBREAPER), a supervised child through
:func:`poolserve.service.lifecycle.child.die_with_parent` (PR_SET_PDEATHSIG; the
spawn trampoline of :mod:`poolserve.supervisor.process` makes the same call
without importing anything of ours).
"""

from __future__ import annotations

import ctypes
import os

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
PR_GET_CHILD_SUBREAPER = 37

# Resolved at import, so the pre-exec hook (run between fork and exec) only
# makes the call; libc is already loaded in every CPython process.
_libc = ctypes.CDLL(None, use_errno=True)
_prctl = _libc["prctl"]  # item access: a private function object, argtypes stay ours
_prctl.restype = ctypes.c_int
_prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
_prctl_get = _libc["prctl"]
_prctl_get.restype = ctypes.c_int
_prctl_get.argtypes = [
    ctypes.c_int,
    ctypes.POINTER(ctypes.c_int),
    ctypes.c_ulong,
    ctypes.c_ulong,
    ctypes.c_ulong,
]


def prctl(option: int, arg: int = 0) -> int:
    """Calls prctl(2); raises OSError on failure."""
    result = int(_prctl(option, arg, 0, 0, 0))
    if result < 0:
        errno = ctypes.get_errno()
        raise OSError(errno, os.strerror(errno))
    return result


def set_pdeathsig(signal_number: int) -> None:
    """Asks the kernel to send ``signal_number`` to us when our parent dies.

    The kernel ties this to the *thread* that forked us: fork from the main
    thread (or one that lives as long as the process).
    """
    prctl(PR_SET_PDEATHSIG, signal_number)


def set_child_subreaper(enabled: bool = True) -> None:
    prctl(PR_SET_CHILD_SUBREAPER, 1 if enabled else 0)


def is_child_subreaper() -> bool:
    flag = ctypes.c_int(0)
    result = int(_prctl_get(PR_GET_CHILD_SUBREAPER, ctypes.byref(flag), 0, 0, 0))
    if result < 0:
        errno = ctypes.get_errno()
        raise OSError(errno, os.strerror(errno))
    return flag.value != 0
