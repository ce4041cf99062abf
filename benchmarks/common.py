"""Shared helpers for every benchmark: the machine, repetitions, CPU accounting, results, servers.

DESIGN.md's benchmark rules are encoded here once so each workload cannot drift from them:
ratios come from one run with the variants interleaved per repetition (`interleave`), the
headline is a median of at least five repetitions (`median`), every result file names the
machine it was measured on (`machine_info`) and lands in benchmarks/results/ (`write_results`).

Benchmarks on small shared machines are at the mercy of other processes, so `CpuMeter` also
splits the machine's CPU time during a measurement into ours (this process), the servers we
started, and everyone else: a repetition where "foreign" CPU is high is an outlier worth naming.

`TeacherProcess` starts `python -m teacher_server` as a subprocess the way an operator would
(through the CLI and its ready file), so the numbers include everything a real deployment pays.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import platform
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, TextIO, TypeVar

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = Path(__file__).resolve().parent / "results"
_CLK_TCK = os.sysconf("SC_CLK_TCK")

T = TypeVar("T")


# ---- the machine ----------------------------------------------------------------------------
def cpu_model() -> str:
    """The CPU's marketing name from /proc/cpuinfo (the platform module only knows the arch)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine_info(torch_threads: int | None = None) -> dict[str, Any]:
    """What a reader needs to compare two result files: OS, interpreter, libraries, CPU, threads.

    Imports torch/grpc/numpy lazily so benchmarks that do not use them stay importable.
    """
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "load_average_at_start": list(os.getloadavg()),
    }
    for mod in ("torch", "grpc", "numpy"):
        try:
            info[f"{mod}_version"] = __import__(mod).__version__
        except ImportError:
            info[f"{mod}_version"] = None
    if torch_threads is None:
        try:
            import torch

            torch_threads = torch.get_num_threads()
        except ImportError:
            pass
    info["torch_threads"] = torch_threads
    info["git"] = git_revision()
    return info


def git_revision() -> dict[str, Any]:
    """The commit measured and whether the tree had local changes: the code is part of the setup."""
    def git(*args: str) -> str:
        try:
            out = subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10, check=False)
        except (OSError, subprocess.TimeoutExpired):
            return ""
        return out.stdout.strip() if out.returncode == 0 else ""

    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": git("rev-parse", "HEAD") or None, "dirty_files": status.splitlines() if status else []}


# ---- repetitions and statistics -------------------------------------------------------------
def median(values: Sequence[float]) -> float:
    """Median, the DESIGN.md headline statistic: robust to the odd repetition a neighbour spoiled."""
    if not values:
        raise ValueError("median of no values")
    return float(statistics.median(values))


def ratio(numerator: float, denominator: float) -> float:
    """numerator / denominator, NaN instead of ZeroDivisionError (a failed variant is still reported)."""
    return numerator / denominator if denominator else float("nan")


def paired_ratios(numerators: Sequence[float], denominators: Sequence[float]) -> list[float]:
    """Per-repetition ratios of two interleaved variants.

    Pairing cancels slow drifts (thermal, a neighbour's job) that hit both variants of a
    repetition alike; their median is the headline ratio.
    """
    if len(numerators) != len(denominators):
        raise ValueError("paired ratios need the same number of repetitions on both sides")
    return [ratio(a, b) for a, b in zip(numerators, denominators, strict=True)]


def interleave(
    reps: int,
    variants: Mapping[str, Callable[[], T]],
    on_result: Callable[[int, str, T], None] | None = None,
    *,
    before: Callable[[], object] | None = None,
    redo_if: Callable[[T], bool] | None = None,
    discarded: dict[str, list[T]] | None = None,
) -> dict[str, list[T]]:
    """Run every variant once per repetition, in the given order (A, B, A, B, ...).

    Running the variants back to back inside each repetition, instead of all A's then all B's,
    is what makes their ratio meaningful on a machine whose speed drifts during the run.
    `before`, `redo_if` and `discarded` work as in `ainterleave` (e.g. `QuietGate.wait_blocking`
    before every measurement, one redo of a measurement another process disturbed).
    """
    results: dict[str, list[T]] = {name: [] for name in variants}
    for rep in range(reps):
        for name, fn in variants.items():
            if before is not None:
                before()
            value = fn()
            if redo_if is not None and redo_if(value):
                if discarded is not None:
                    discarded.setdefault(name, []).append(value)
                if before is not None:
                    before()
                value = fn()
            results[name].append(value)
            if on_result is not None:
                on_result(rep, name, value)
    return results


async def ainterleave(
    reps: int,
    variants: Mapping[str, Callable[[], Awaitable[T]]],
    on_result: Callable[[int, str, T], None] | None = None,
    *,
    before: Callable[[], Awaitable[object]] | None = None,
    redo_if: Callable[[T], bool] | None = None,
    discarded: dict[str, list[T]] | None = None,
) -> dict[str, list[T]]:
    """`interleave` for coroutine variants, with an optional quiet gate and one redo.

    `before` runs before every measurement (e.g. `QuietGate.wait`); a measurement for which
    `redo_if` is true (e.g. another process took a core meanwhile) is measured once more and
    the first attempt goes to `discarded`, so the JSON still shows what was thrown away. The
    same rule applies to every variant, so the gate cannot favour one side of a ratio.
    """
    results: dict[str, list[T]] = {name: [] for name in variants}
    for rep in range(reps):
        for name, fn in variants.items():
            if before is not None:
                await before()
            value = await fn()
            if redo_if is not None and redo_if(value):
                if discarded is not None:
                    discarded.setdefault(name, []).append(value)
                if before is not None:
                    await before()
                value = await fn()
            results[name].append(value)
            if on_result is not None:
                on_result(rep, name, value)
    return results


# ---- CPU accounting -------------------------------------------------------------------------
def process_cpu_seconds(pid: int) -> float:
    """user+system CPU seconds of a process, all its threads included (0 if it is gone)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            raw = f.read()
    except OSError:
        return 0.0
    fields = raw.rsplit(")", 1)[1].split()  # the command name may contain spaces
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK  # utime, stime (fields 14, 15)


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


# ---- results --------------------------------------------------------------------------------
def write_results(name: str, data: Mapping[str, Any]) -> Path:
    """Write benchmarks/results/<name>.json atomically (a crashed run never leaves half a file)."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=False, default=_json_default) + "\n", encoding="utf-8")
    tmp.replace(path)
    return path


def _json_default(obj: object) -> Any:
    if hasattr(obj, "as_dict"):
        return obj.as_dict()
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"cannot serialise {type(obj).__name__} to JSON")


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A plain-text table with right-aligned numbers, for terminals and pasted reports."""
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]

    def line(row: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True)))

    return "\n".join([line(headers), "  ".join("-" * w for w in widths), *(line(r) for r in cells)])


def _cell(v: object) -> str:
    if isinstance(v, float):
        if math.isnan(v):
            return "n/a"
        return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3f}"
    return str(v)


# ---- signals --------------------------------------------------------------------------------
@contextlib.contextmanager
def sigterm_raises() -> Iterator[None]:
    """Turn SIGTERM into SystemExit while the block runs, so `finally:` clauses stop our servers.

    Ctrl-C already raises KeyboardInterrupt; a plain SIGTERM would otherwise kill the benchmark
    and orphan the teacher-server subprocesses it started.
    """

    def handler(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


# ---- teacher-server subprocesses ------------------------------------------------------------
class ServerStartError(RuntimeError):
    """The teacher server exited or never wrote its ready file; the message has its log's tail."""


class TeacherProcess:
    """A `python -m teacher_server` subprocess, ready when its --ready-file appears.

    Use as a context manager: the server is stopped (SIGTERM, which drains, then SIGKILL after
    `stop_timeout_s`) on exit whatever happened, including KeyboardInterrupt. Its log goes to
    a file rather than a pipe, so a chatty server can never block on a full pipe mid-benchmark.
    """

    def __init__(
        self,
        args: Sequence[str],
        *,
        label: str = "teacher",
        ready_timeout_s: float = 120.0,
        stop_timeout_s: float = 20.0,
        python: str = sys.executable,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.args = list(args)
        self.label = label
        self.ready_timeout_s = ready_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.python = python
        self.env = dict(os.environ if env is None else env)
        self.proc: subprocess.Popen[bytes] | None = None
        self.ready: dict[str, Any] = {}
        self.exit_code: int | None = None
        self._tmp = tempfile.TemporaryDirectory(prefix=f"bench-{label}-")
        self.log_path = Path(self._tmp.name) / "server.log"
        self._log_file: Any = None
        self._ready_deadline = 0.0

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    @property
    def endpoint(self) -> str:
        """host:port to dial, from the ready file."""
        return str(self.ready["endpoint"])

    @property
    def command(self) -> list[str]:
        ready_file = str(Path(self._tmp.name) / "ready.json")
        return [self.python, "-m", "teacher_server", *self.args, "--ready-file", ready_file]

    def start(self) -> TeacherProcess:
        """Launch and wait for the ready file; raise ServerStartError with the log tail on failure."""
        self.launch()
        return self.wait_ready()

    def launch(self) -> None:
        """Spawn the process without waiting for it; `wait_ready()` does the rest of `start()`.

        Split so that several servers can import torch and load their models at the same time
        (`start_all`), which on a small machine halves the benchmark's set-up time.
        """
        self._log_file = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            self.command, cwd=REPO_ROOT, env=self.env, stdin=subprocess.DEVNULL,
            stdout=self._log_file, stderr=subprocess.STDOUT,
        )
        self._ready_deadline = time.monotonic() + self.ready_timeout_s

    def wait_ready(self) -> TeacherProcess:
        """Wait for the ready file of a launched server; ServerStartError with the log tail on failure."""
        if self.proc is None:
            raise RuntimeError("wait_ready() before launch()")
        ready_file = Path(self._tmp.name) / "ready.json"
        deadline = self._ready_deadline
        while True:
            if ready_file.exists():
                self.ready = json.loads(ready_file.read_text(encoding="utf-8"))
                return self
            code = self.proc.poll()
            if code is not None:
                self.stop()
                raise ServerStartError(f"{self.label} exited with {code} before ready:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                self.stop()
                raise ServerStartError(f"{self.label} not ready after {self.ready_timeout_s:.0f}s:\n{self.log_tail()}")
            time.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL now, no drain: what a crashed host or an OOM kill looks like to students.

        stop() / cleanup() afterwards only reap the process (its exit code is then -9).
        """
        proc = self.proc
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()

    def stop(self) -> int | None:
        """SIGTERM (drain), wait, SIGKILL if it hangs; idempotent. Returns the exit code."""
        proc = self.proc
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                proc.wait()
        if proc is not None:
            self.exit_code = proc.returncode
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        return self.exit_code

    def log_tail(self, lines: int = 30) -> str:
        return log_tail(self.log_path, lines)

    def cleanup(self) -> None:
        """Stop the process and remove its temporary directory (log and ready file)."""
        self.stop()
        self._tmp.cleanup()

    def __enter__(self) -> TeacherProcess:
        try:
            return self.start()
        except BaseException:
            self.cleanup()
            raise

    def __exit__(self, *exc: object) -> None:
        self.cleanup()


def start_all(stack: contextlib.ExitStack, servers: Sequence[TeacherProcess]) -> list[TeacherProcess]:
    """Start several servers at once and hand each one's cleanup to `stack`.

    All are launched before any is waited for, so their start-up (imports, model load) overlaps.
    The cleanups are registered first, so an error or Ctrl-C while any server is still starting
    stops every one of them when `stack` unwinds.
    """
    for server in servers:
        stack.callback(server.cleanup)
    for server in servers:
        server.launch()
    for server in servers:
        server.wait_ready()
    return list(servers)


# ---- process helpers (W4 and any benchmark that runs a process tree) -------------------------
# A tiny shim that asks the kernel to SIGTERM the real command when its parent dies, then execs
# it. `-S` skips site, so it costs ~10 ms. PR_SET_PDEATHSIG = 1; the getppid check closes the race
# of a parent that died before the prctl.
_PDEATHSIG_SHIM = (
    "import ctypes,os,signal,sys\n"
    "ctypes.CDLL(None,use_errno=True).prctl(1,int(signal.SIGTERM),0,0,0)\n"
    "if os.getppid()!=int(sys.argv[1]): os._exit(1)\n"
    "os.execvp(sys.argv[2],sys.argv[2:])\n"
)


def pdeathsig_argv(argv: Sequence[str]) -> list[str]:
    """`argv` wrapped so that the process gets SIGTERM if this benchmark dies (Linux only).

    `finally:` clauses stop what a benchmark started on errors, Ctrl-C and SIGTERM, but not on
    SIGKILL or an OOM kill; then nothing would stop a long-running child. The kernel can: the
    signal fires when the *thread* that spawned the child exits, so spawn from the main thread.
    Elsewhere the command is returned unchanged.
    """
    if not sys.platform.startswith("linux"):
        return list(argv)
    return [sys.executable, "-S", "-c", _PDEATHSIG_SHIM, str(os.getpid()), *argv]


def child_pids(pid: int) -> list[int]:
    """Direct children of a process, from /proc (empty if it is gone or /proc lacks `children`).

    Lets a benchmark count what another process (an autoscaler) started without asking it.
    """
    found: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children", encoding="ascii") as f:
                found.extend(int(p) for p in f.read().split())
        except (OSError, ValueError):
            continue
    return sorted(set(found))


def process_cmdline(pid: int) -> list[str]:
    """The argv of a process (empty if it is gone): to recognise a child, and to make sure a pid
    was not reused by someone else's process before signalling it."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            raw = f.read()
    except OSError:
        return []
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def process_alive(pid: int) -> bool:
    """True while the process exists and is not a zombie (exited, not yet reaped by its parent)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            raw = f.read()
    except OSError:
        return False
    return raw.rsplit(")", 1)[1].split()[0] != "Z"


def process_start_monotonic(pid: int) -> float | None:
    """When a process started, on the `time.monotonic()` clock (None if it is gone).

    /proc gives the start in clock ticks since boot (CLOCK_BOOTTIME); the offset between the two
    clocks converts it. It times a spawn exactly even when the benchmark only notices the process
    a sampling period later.
    """
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            raw = f.read()
    except OSError:
        return None
    start_ticks = int(raw.rsplit(")", 1)[1].split()[19])  # field 22, starttime
    offset = time.clock_gettime(time.CLOCK_BOOTTIME) - time.monotonic()
    return start_ticks / _CLK_TCK - offset


def stop_process(proc: subprocess.Popen[Any], *, term_timeout_s: float = 20.0, sig: int = signal.SIGTERM) -> int:
    """Signal `proc` (SIGTERM: drain), wait, SIGKILL when it hangs; returns the exit code.

    Idempotent, and safe to call from `finally:`: a process that already exited is only reaped.
    """
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(sig)
        try:
            proc.wait(term_timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait()
    return int(proc.returncode)


def process_rss_bytes(pid: int) -> int | None:
    """Resident set size of a process in bytes, from /proc/<pid>/status (None if it is gone).

    VmRSS, not /proc/<pid>/statm: it needs no page-size arithmetic and is what `ps` and
    Prometheus' process_resident_memory_bytes report, so soak figures compare with both.
    """
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        return None
    return None


def log_tail(path: Path, lines: int = 30) -> str:
    """The last `lines` lines of a child's log, for error messages."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


class ReportingChild:
    """A benchmark's child process (a student) that takes commands on stdin, one per line, and
    reports JSON lines on stdout; stderr goes to its log.

    A thread reads stdout and hands every event to :meth:`on_event` under ``lock`` (subclasses
    keep what they need); ``{"ev": "ready"}`` sets ``ready``. The child runs in its own session,
    so Ctrl-C reaches the benchmark only, which then stops its children in order.
    """

    def __init__(self, name: str, log_path: Path) -> None:
        self.name = name
        self.log_path = log_path
        self.proc: subprocess.Popen[str] | None = None
        self.ready = threading.Event()
        self.lock = threading.Lock()
        self._log: TextIO | None = None
        self._thread: threading.Thread | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def command(self) -> list[str]:
        """The child's argv."""
        raise NotImplementedError

    def launch(self) -> None:
        self._log = self.log_path.open("w", encoding="utf-8")
        self.proc = subprocess.Popen(
            pdeathsig_argv(self.command()), cwd=REPO_ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=self._log, text=True, bufsize=1, env={**os.environ, "PYTHONUNBUFFERED": "1"},
            start_new_session=True,
        )
        self._thread = threading.Thread(target=self._read, name=f"{self.name}-stdout", daemon=True)
        self._thread.start()

    def on_event(self, ev: dict[str, Any]) -> None:
        """One event from the child (called with ``lock`` held)."""

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:  # ends at the child's EOF
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            with self.lock:
                self.on_event(ev)
            if ev.get("ev") == "ready":
                self.ready.set()

    def wait_ready(self, deadline: float) -> None:
        """Until the child said ready; RuntimeError with its log if it exits or `deadline` passes."""
        while not self.ready.wait(0.1):
            if self.proc is None or self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} did not get ready:\n{log_tail(self.log_path)}")

    def send(self, line: str) -> None:
        assert self.proc is not None and self.proc.stdin is not None
        try:
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError) as e:
            raise RuntimeError(f"{self.name} is gone ({e}):\n{log_tail(self.log_path)}") from None

    def send_quietly(self, line: str) -> None:
        """`send` for clean-up paths: a child that is already gone needs no command."""
        with contextlib.suppress(RuntimeError, AssertionError):
            self.send(line)

    def close(self, wait_s: float, quit_command: str | None = None) -> None:
        """`quit_command` (if any), EOF on stdin, then SIGTERM/SIGKILL if the child hangs past
        `wait_s`; always reaps."""
        if self.proc is not None:
            if quit_command is not None:
                self.send_quietly(quit_command)
            if self.proc.stdin is not None:
                with contextlib.suppress(OSError):
                    self.proc.stdin.close()
            try:
                self.proc.wait(wait_s)
            except subprocess.TimeoutExpired:
                stop_process(self.proc, term_timeout_s=5)
        if self._thread is not None:
            self._thread.join(5)
        if self._log is not None:
            self._log.close()
            self._log = None
