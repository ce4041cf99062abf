"""Process helpers for benchmarks that run a process tree (W4, the soak, the scale simulation).

What /proc says about a process (children, argv, liveness, start time, memory), and
`ReportingChild`: a child that takes commands on stdin and reports JSON lines on stdout. Starting
and stopping teacher servers, the parent-death signal and log tails come from
`teacher_server.launch`, shared with the examples and the autoscaler.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, TextIO

from benchmarks.common import REPO_ROOT
from teacher_server.launch import log_tail, pdeathsig_argv, stop

__all__ = [
    "ReportingChild",
    "child_pids",
    "log_tail",
    "pdeathsig_argv",
    "process_alive",
    "process_cmdline",
    "process_rss_bytes",
    "process_start_monotonic",
]

_CLK_TCK = os.sysconf("SC_CLK_TCK")


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
                stop(self.proc, 5.0)
        if self._thread is not None:
            self._thread.join(5)
        if self._log is not None:
            self._log.close()
            self._log = None

