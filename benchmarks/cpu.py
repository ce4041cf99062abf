"""CPU accounting for benchmarks: who used the machine's cores during a measurement.

Benchmarks on small shared machines are at the mercy of other processes, so `CpuMeter` splits the
machine's CPU time during a measurement into ours (this process), the servers we started, and
everyone else: a repetition where "foreign" CPU is high is an outlier worth naming. `QuietGate`
waits for the rest of the machine to be quiet before a measurement starts.
"""

from __future__ import annotations

import asyncio
import os
import resource
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

_CLK_TCK = os.sysconf("SC_CLK_TCK")


def _stat_cpu_seconds(raw: str) -> float:
    """user+system CPU seconds from a /proc .../stat line."""
    fields = raw.rsplit(")", 1)[1].split()  # the command name may contain spaces
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK  # utime, stime (fields 14, 15)


def process_cpu_seconds(pid: int) -> float:
    """user+system CPU seconds of a process, all its threads included (0 if it is gone)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return _stat_cpu_seconds(f.read())
    except OSError:
        return 0.0


def tree_cpu_seconds(pid: int) -> float:
    """user+system CPU seconds of a process and of every live process below it (an engine that runs
    its model in a child process, as vLLM does), 0 if it is gone."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", encoding="utf-8", errors="replace") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
        children.setdefault(parent, []).append(int(name))
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        total += process_cpu_seconds(p)
        todo.extend(children.get(p, ()))
    return total


def thread_cpu_seconds(pid: int) -> dict[int, tuple[str, float]]:
    """Per thread of a process: thread id -> (its OS name, user+system CPU seconds); {} if it is gone.
    The teacher names its instance, finishing and stager threads (teacher_server.threads)."""
    out: dict[int, tuple[str, float]] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat", encoding="utf-8", errors="replace") as f:
                raw = f.read()
        except OSError:
            continue  # the thread ended meanwhile
        out[int(tid)] = (raw[raw.find("(") + 1 : raw.rfind(")")], _stat_cpu_seconds(raw))
    return out


def busiest_threads(pid: int, before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]],
                    wall_s: float, top: int = 6) -> list[dict[str, object]]:
    """The `top` threads of `pid` by cores used between two `thread_cpu_seconds` readings; the
    process's main thread (its event loop, in a teacher) is named "main"."""
    usage = sorted((("main" if tid == pid else name, (sec - before.get(tid, (name, 0.0))[1]) / max(wall_s, 1e-9))
                    for tid, (name, sec) in after.items()), key=lambda r: -r[1])
    return [{"name": name, "cores": round(cores, 3)} for name, cores in usage[:top]]


def self_cpu_seconds() -> float:
    """user+system CPU seconds of this process, all threads (the benchmark client's own cost)."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def machine_busy_seconds() -> float:
    """CPU seconds the whole machine spent busy (all cores), from /proc/stat."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            parts = f.readline().split()[1:]
    except OSError:
        return 0.0
    vals = [int(v) for v in parts]
    idle = vals[3] + (vals[4] if len(vals) > 4 else 0)  # idle + iowait
    steal_guest = sum(vals[7:]) if len(vals) > 7 else 0  # steal, guest, guest_nice: not ours
    return (sum(vals) - idle - steal_guest) / _CLK_TCK


@dataclass
class CpuUsage:
    """CPU used during one measurement window, in cores (CPU-seconds per wall second)."""

    wall_s: float
    client_cores: float
    server_cores: float
    foreign_cores: float

    def as_dict(self) -> dict[str, float]:
        return {
            "wall_s": round(self.wall_s, 4),
            "client_cores": round(self.client_cores, 3),
            "server_cores": round(self.server_cores, 3),
            "foreign_cores": round(self.foreign_cores, 3),
        }


@dataclass
class CpuMeter:
    """Snapshot CPU counters at start(); stop() says who used the cores in between.

    client = this process (the load generator, or the in-process model), server = the pids
    given, foreign = the rest of the machine (other people's jobs: the noise to watch).
    """

    server_pids: Sequence[int] = ()
    _t0: float = 0.0
    _self0: float = 0.0
    _servers0: float = 0.0
    _busy0: float = 0.0
    _started: bool = field(default=False, repr=False)

    def _servers(self) -> float:
        return sum(process_cpu_seconds(p) for p in self.server_pids)

    def start(self) -> None:
        self._t0 = time.perf_counter()
        self._self0 = self_cpu_seconds()
        self._servers0 = self._servers()
        self._busy0 = machine_busy_seconds()
        self._started = True

    def stop(self) -> CpuUsage:
        if not self._started:
            raise RuntimeError("CpuMeter.stop() before start()")
        wall = max(time.perf_counter() - self._t0, 1e-9)
        client = self_cpu_seconds() - self._self0
        servers = self._servers() - self._servers0
        busy = machine_busy_seconds() - self._busy0
        foreign = max(0.0, busy - client - servers)
        return CpuUsage(wall, client / wall, servers / wall, foreign / wall)


@dataclass
class QuietGate:
    """Waits until the rest of the machine is quiet before a measurement starts.

    On a small machine shared with other people's jobs, one foreign process taking a core
    halves a 2-thread model's speed (OpenMP threads wait at every barrier for the one that was
    descheduled). The gate samples /proc/stat for `probe_s` and waits while processes other
    than ours use more than `max_foreign_cores`; it gives up per call after `timeout_s` and for
    good once `budget_s` of waiting is spent, so a busy machine slows the run only boundedly.
    """

    own_pids: Sequence[int] = ()
    max_foreign_cores: float = 0.25
    probe_s: float = 0.25
    timeout_s: float = 10.0
    budget_s: float = 60.0
    waited_s: float = 0.0
    gave_up: int = 0

    async def wait(self) -> float:
        """`wait_blocking()` off the event loop, for asyncio benchmarks."""
        return await asyncio.to_thread(self.wait_blocking)

    def wait_blocking(self) -> float:
        """Return the foreign load (cores) seen by the last probe."""
        start = time.monotonic()
        while True:
            meter = CpuMeter(self.own_pids)
            meter.start()
            time.sleep(self.probe_s)
            foreign = meter.stop().foreign_cores
            if foreign <= self.max_foreign_cores:
                break
            spent = time.monotonic() - start
            if spent >= self.timeout_s or self.waited_s + spent >= self.budget_s:
                self.gave_up += 1
                break
        self.waited_s += time.monotonic() - start
        return foreign

    def as_dict(self) -> dict[str, float]:
        return {"max_foreign_cores": self.max_foreign_cores, "waited_s": round(self.waited_s, 2),
                "gave_up": self.gave_up, "budget_s": self.budget_s}


