"""Threads of the server's own, named where the operating system sees them.

Python (before 3.14) names a thread only in its own bookkeeping, so `top -H`, `/proc/PID/task`
and profilers show every thread of a teacher as "python". The model instances, their finishing
stages and stagers name their OS threads (`instance-0`, `finish-0`, `stager-0`), so what each one
costs can be read from outside the process (benchmarks/cpu.py `thread_cpu_seconds`).
"""

from __future__ import annotations

import ctypes
import sys
from concurrent.futures import ThreadPoolExecutor

_PR_SET_NAME = 15  # prctl(2): the calling thread's name, at most 15 bytes
_LIBC: ctypes.CDLL | None = None


def name_this_thread(name: str) -> None:
    """Give the calling thread `name` (cut to 15 bytes) where the OS shows it; a no-op off Linux."""
    global _LIBC
    if not sys.platform.startswith("linux"):
        return
    try:
        if _LIBC is None:
            _LIBC = ctypes.CDLL(None, use_errno=True)
        _LIBC.prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)
    except (OSError, AttributeError):
        pass  # a libc without prctl: the thread keeps its name


def named_executor(name: str) -> ThreadPoolExecutor:
    """A one-thread executor whose thread carries `name`, in Python and in the OS."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix=name, initializer=name_this_thread,
                              initargs=(name,))
