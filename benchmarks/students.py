"""The benchmarks' student subprocesses: one handle for W4 (autoscale) and the soak.

A student is its own process (no GIL shared with the benchmark, as in a real job) running a
benchmark's worker (``python -m benchmarks.<name> _student ...``). The worker takes commands on
stdin (``go [ARGS...]``, ``stop``, ``quit``; EOF also ends it, so a dead benchmark leaves no
student) and writes JSON lines on stdout: ``{"ev": "ready"}`` once, then every report period
``{"ev": "r", "t": monotonic, <cumulative counters>}``, and ``error``, ``started``, ``stopped``
and ``done`` events. Reports may name a ``session`` (W4 runs several profiles with one set of
students); without one they belong to the session ``""``.

``time.monotonic()`` is one clock for every process on Linux, so the benchmark can line the
reports up with its own samples: `value_at` interpolates a counter at any moment.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.procs import ReportingChild


class StudentProc(ReportingChild):
    """One student subprocess: launch, drive through stdin, keep its reports per session.

    Args:
        index: the student's number (its name is ``student<index>``, its log ``student<index>.log``).
        command: the worker's argv.
        log_dir: where its stderr goes.
        quit_command: sent before EOF when closing (``"quit"`` lets the reader close cleanly); None
            when EOF alone ends the worker.
        close_wait_s: how long `close` waits for the worker to exit before SIGTERM/SIGKILL.
    """

    def __init__(self, index: int, command: Sequence[str], log_dir: Path, *, quit_command: str | None = None,
                 close_wait_s: float = 15.0) -> None:
        super().__init__(f"student{index}", log_dir / f"student{index}.log")
        self.index = index
        self.argv = list(command)
        self.quit_command = quit_command
        self.close_wait_s = close_wait_s
        self.reports: dict[str, list[dict[str, Any]]] = {}  # session -> its "r" events, in order
        self.events: list[dict[str, Any]] = []  # every other event
        self.errors: list[dict[str, Any]] = []  # reader failures the training loop saw
        self.done: dict[str, Any] | None = None  # the final "done" event, when the worker sends one

    def command(self) -> list[str]:
        return list(self.argv)

    def on_event(self, ev: dict[str, Any]) -> None:
        kind = ev.get("ev")
        if kind == "r":
            self.reports.setdefault(str(ev.get("session", "")), []).append(ev)
            return
        self.events.append(ev)
        if kind == "error":
            self.errors.append(ev)
        elif kind == "done":
            self.done = ev

    # -- commands -------------------------------------------------------------------------------
    def go(self, *words: str) -> None:
        """Start training (``go`` and the worker's arguments, e.g. a service and a session name)."""
        self.send(" ".join(("go", *words)))

    def stop_session(self) -> None:
        self.send("stop")

    def close(self, wait_s: float | None = None, quit_command: str | None = None) -> None:
        """The quit command (if any), EOF, then SIGTERM/SIGKILL after `wait_s`; always reaps.

        A student blocked on a pool that is gone would wait for its reader's no-teacher timeout;
        after `wait_s` it gets SIGTERM instead.
        """
        super().close(self.close_wait_s if wait_s is None else wait_s,
                      quit_command if quit_command is not None else self.quit_command)

    # -- what it reported -----------------------------------------------------------------------
    def stopped(self, session: str) -> bool:
        """Whether the worker said the session ended."""
        with self.lock:
            return any(e.get("ev") == "stopped" and e.get("session") == session for e in self.events)

    def last_report(self, session: str = "") -> dict[str, Any] | None:
        with self.lock:
            points = self.reports.get(session)
            return dict(points[-1]) if points else None

    def value_at(self, key: str, t: float, session: str = "") -> float:
        """Counter `key` of `session` at monotonic time `t`, linearly interpolated between reports
        (0 before the first: a session counts from 0 at ``go``; the last value after the last)."""
        with self.lock:
            points = [(float(r["t"]), float(r[key])) for r in self.reports.get(session, ())]
        return interpolate(points, t)

    def counters(self, session: str = "") -> dict[str, Any]:
        """The final counts when the worker is done, else its latest report (empty before any)."""
        with self.lock:
            if self.done is not None:
                return dict(self.done)
        return self.last_report(session) or {}


def interpolate(points: Sequence[tuple[float, float]], t: float) -> float:
    """The value at `t` of a counter sampled at ``(time, value)`` points, in time order."""
    if not points or t < points[0][0]:
        return 0.0
    i = bisect.bisect_right([p[0] for p in points], t)
    if i >= len(points):
        return points[-1][1]
    (t0, v0), (t1, v1) = points[i - 1], points[i]
    return v0 + (v1 - v0) * (t - t0) / max(t1 - t0, 1e-9)


def stop_sessions(students: Sequence[StudentProc]) -> None:
    """End every student's session (an idle student ignores the command; a gone one is skipped)."""
    for st in students:
        st.send_quietly("stop")


def close_students(students: Sequence[StudentProc], wait_s: float = 10.0) -> None:
    """Tell every student to quit first, then reap each: their readers close in parallel."""
    for st in students:
        if st.quit_command is not None:
            st.send_quietly(st.quit_command)
    deadline = time.monotonic() + wait_s
    for st in students:
        st.close(wait_s=max(0.1, deadline - time.monotonic()))
