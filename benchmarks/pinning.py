"""Cores for the server side and for the load generator, kept apart on one machine.

On a machine with cores to spare, a serving benchmark can give the servers (and the in-process
baselines they are compared with) a set of cores of their own and run its load generator on
others, so that the client's CPU is not charged to the server. Linux gives each thread its own
affinity and a new thread or child process the affinity of the thread that made it, so:
`on_cores(cpus)` sets the calling thread's for a block (servers launched and baseline threads
started inside it keep it), and `pin_process(cpus)` moves every thread this process has now (the
event loop, gRPC's own threads) to the load generator's cores.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator


class CpuListError(ValueError):
    """A core list that cannot be used here; the message says which cores this process may use."""


def parse_cpu_list(text: str) -> tuple[int, ...]:
    """`"0-3,6"` as (0, 1, 2, 3, 6), the notation of `taskset -c` and cgroup cpusets."""
    cpus: set[int] = set()
    for raw in text.split(","):
        part = raw.strip()
        lo, dash, hi = part.partition("-")
        try:
            first, last = int(lo), int(hi if dash else lo)
        except ValueError:
            raise CpuListError(f"{text!r} is not a core list: write it as taskset -c does, e.g. 0-3,6") from None
        if first < 0 or last < first:
            raise CpuListError(f"{part!r} in {text!r} is not a range of core numbers (first-last, first <= last)")
        cpus.update(range(first, last + 1))
    return tuple(sorted(cpus))


def parse_split(server_text: str, client_text: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """`--server-cpus` and `--client-cpus` as core tuples, both empty when neither is given;
    CpuListError for lists that cannot be used here (one without the other, shared, not ours)."""
    if not server_text and not client_text:
        return (), ()
    server = parse_cpu_list(server_text) if server_text else ()
    client = parse_cpu_list(client_text) if client_text else ()
    check_split(server, client)
    return server, client


def check_split(server: Iterable[int], client: Iterable[int]) -> None:
    """Both sets usable by this process and apart; CpuListError otherwise."""
    server, client = set(server), set(client)
    allowed = os.sched_getaffinity(0)
    if not server or not client:
        raise CpuListError("give both --server-cpus and --client-cpus, or neither")
    outside = (server | client) - allowed
    if outside:
        raise CpuListError(f"cores {sorted(outside)} are not among this process's {_ranges(allowed)}")
    shared = server & client
    if shared:
        raise CpuListError(f"cores {sorted(shared)} are in both --server-cpus and --client-cpus; keep them apart")


@contextlib.contextmanager
def on_cores(cpus: Iterable[int]) -> Iterator[None]:
    """The calling thread runs on `cpus` inside the block, and on what it had before after it."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, set(cpus))
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def pin_process(cpus: Iterable[int]) -> None:
    """Every thread of this process that exists now runs on `cpus` (the calling one included)."""
    wanted = set(cpus)
    for task in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(task), wanted)


def _ranges(cpus: Iterable[int]) -> str:
    """(0, 1, 2, 5) as "0-2,5"."""
    out: list[str] = []
    for c in sorted(cpus):
        if out and out[-1].split("-")[-1] == str(c - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{c}"
        else:
            out.append(str(c))
    return ",".join(out)
