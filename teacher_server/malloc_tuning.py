"""Fixed glibc malloc thresholds for a serving process, so a batch's working memory stays mapped
from one batch to the next.

By default glibc serves a block above its mmap threshold with a mapping of its own, and gives
the free memory at the top of a heap back to the kernel once it passes the trim threshold; both
thresholds follow the largest block freed so far (the trim threshold at twice it). A teacher
allocates and frees the same memory every batch (received requests, the batch's inputs, the
forward pass's activations, the encoded answers), so with those defaults the kernel maps and
zeroes the same pages again for every batch: page faults on the event loop and on the model
instance's thread, in the path of every request. Fixed thresholds keep that memory: blocks up to
`MMAP_THRESHOLD` come from the heap, and up to `TRIM_THRESHOLD` of free memory stays at the top of
each heap (glibc keeps one heap per arena, a few per process).

The cost is that memory: after a peak, a process holds up to `TRIM_THRESHOLD` of freed memory per
arena instead of returning it. Blocks above `MMAP_THRESHOLD` (a large model's full logits) still
come and go as mappings of their own, so one large answer is not held afterwards.

`serve()` (and so `teacher-server`) applies this at start unless told not to
(``malloc_tuning=False``, ``--no-malloc-tuning``). It never overrides an allocator configured from
outside the process: glibc's ``MALLOC_*_`` variables, ``GLIBC_TUNABLES`` with ``glibc.malloc``
settings, or another allocator preloaded with ``LD_PRELOAD`` (a library whose name says malloc:
jemalloc, tcmalloc, mimalloc).
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["MMAP_THRESHOLD", "TRIM_THRESHOLD", "MallocTuning", "glibc_version", "tune_malloc"]

MMAP_THRESHOLD = 32 << 20  # the largest glibc accepts on 64-bit (half its heap size)
TRIM_THRESHOLD = 256 << 20

# mallopt() parameters (glibc's malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

# Environment variables that configure glibc's allocator from outside the process.
OUTSIDE_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_",
                    "MALLOC_ARENA_MAX")


@dataclass(frozen=True)
class MallocTuning:
    """Whether the thresholds were set, and in words what was set or why not (for the log)."""

    applied: bool
    detail: str


def glibc_version() -> str | None:
    """glibc's version ("2.36"), or None where the C library is another (musl, macOS)."""
    try:
        found = os.confstr("CS_GNU_LIBC_VERSION")
    except (AttributeError, ValueError, OSError):
        return None
    if not found or not found.startswith("glibc "):
        return None
    return found.split(" ", 1)[1]


def tune_malloc(environ: Mapping[str, str] | None = None) -> MallocTuning:
    """Set glibc's mmap and trim thresholds to `MMAP_THRESHOLD` and `TRIM_THRESHOLD` for this
    process (see the module's docstring), unless the allocator is configured from outside it or is
    not glibc's. Setting them also ends glibc's own adjustment of both."""
    env = os.environ if environ is None else environ
    version = glibc_version()
    if version is None:
        return MallocTuning(False, "left as it is: the C library is not glibc")
    outside = [name for name in OUTSIDE_SETTINGS if env.get(name)]
    if "glibc.malloc" in env.get("GLIBC_TUNABLES", ""):
        outside.append("GLIBC_TUNABLES")
    if "malloc" in env.get("LD_PRELOAD", ""):  # libjemalloc, libtcmalloc, libmimalloc
        outside.append("LD_PRELOAD")
    if outside:
        return MallocTuning(False, f"left as set from outside the process ({', '.join(outside)})")
    mallopt = ctypes.CDLL(None).mallopt
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    if mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) != 1 or mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) != 1:
        return MallocTuning(False, f"left as it is: glibc {version} refused the thresholds")
    return MallocTuning(True, f"glibc {version}: blocks up to {MMAP_THRESHOLD >> 20} MiB from the heap, up to "
                              f"{TRIM_THRESHOLD >> 20} MiB freed kept per arena (--no-malloc-tuning: glibc's "
                              "defaults)")
