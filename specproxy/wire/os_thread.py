"""Give the calling OS thread its Python thread's name.

Python before 3.14 leaves every thread named after the process, so ``top -H``, ``perf`` and
``/proc/PID/task/TID/comm`` cannot tell the measuring worker from the SQLite writer; the native relay
thread names itself the same way (``pthread_setname_np`` in ``_pump.c``). Linux keeps 15 bytes of a name.
"""

from __future__ import annotations

import ctypes
import sys
import threading

_PR_SET_NAME = 15
_libc = None
if sys.platform.startswith("linux"):
    try:
        _libc = ctypes.CDLL(None, use_errno=True)
    except OSError:  # no libc to ask: threads keep the process's name
        _libc = None


def name_os_thread() -> None:
    """Call first thing in a thread's target. A failure leaves the OS name as it was (names are for people)."""
    if _libc is not None:
        _libc.prctl(_PR_SET_NAME, threading.current_thread().name.encode()[:15], 0, 0, 0)
