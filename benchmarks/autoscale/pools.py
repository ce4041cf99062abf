"""The teachers of one W4 run: an autoscaled pool (the ``distill-autoscaler`` CLI with the local
backend) or a fixed one, what the benchmark sees of their processes, and what the registry says:
registrations (`Watcher`) and the autoscaler's decisions (`DecisionFollower`, from the JSON record
the controller publishes in etcd, the one ``distill top`` shows).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.autoscale.settings import MODEL_NAME, MODEL_REF, TEACHER_MS_ENV, Settings
from benchmarks.common import REPO_ROOT
from benchmarks.procs import child_pids, log_tail, process_alive, process_cmdline, process_start_monotonic
from teacher_server import launch


def teacher_args(s: Settings) -> list[str]:
    """What every teacher runs, autoscaled or fixed: W1's emulated teacher on one CPU thread, one
    instance (the emulated accelerator runs one batch at a time, like one GPU)."""
    return ["--model", MODEL_REF, "--name", MODEL_NAME, "--device", "cpu", "--threads", str(s.server_threads),
            "--instances", "1",
            "--max-batch-size", str(s.batch), "--max-queue-delay-us", str(s.max_queue_delay_us),
            "--log-level", "WARNING"]


def teacher_env(s: Settings) -> dict[str, str]:
    return {**os.environ, TEACHER_MS_ENV: str(s.teacher_ms), "PYTHONUNBUFFERED": "1"}


@dataclass
class TeacherLife:
    """One teacher process from spawn to exit, on the benchmark's monotonic clock."""

    instance_id: str
    pid: int
    spawned: float
    registered: float | None = None
    deregistered: float | None = None
    exited: float | None = None


class Pool:
    """The teachers of one run: started by the autoscaler, or a fixed set started here."""

    kind = "pool"

    def __init__(self) -> None:
        self.lives: dict[int, TeacherLife] = {}  # pid -> life

    def own_pids(self) -> list[int]:
        return [pid for pid, life in self.lives.items() if life.exited is None]

    def candidate_pids(self) -> dict[int, str]:
        """pid -> instance id of the live teacher processes."""
        raise NotImplementedError

    def poll(self) -> None:
        """Note spawns and exits (called every 0.1 s; spawn times come from /proc, exact)."""
        now = time.monotonic()
        live = self.candidate_pids()
        for pid, iid in live.items():
            if pid not in self.lives:
                self.lives[pid] = TeacherLife(iid, pid, process_start_monotonic(pid) or now)
        for pid, life in self.lives.items():
            if life.exited is None and (pid not in live or not process_alive(pid)):
                life.exited = now

    def alive(self) -> int:
        return sum(1 for life in self.lives.values() if life.exited is None)

    def life_of(self, instance_id: str) -> TeacherLife | None:
        return next((lf for lf in self.lives.values() if lf.instance_id == instance_id), None)


def _instance_id(cmdline: Sequence[str]) -> str | None:
    for i, tok in enumerate(cmdline):
        if tok == "--instance-id" and i + 1 < len(cmdline):
            return cmdline[i + 1]
        if tok.startswith("--instance-id="):
            return tok.split("=", 1)[1]
    return None


class AutoscaledPool(Pool):
    """``python -m distill.autoscale`` with the local backend, as an operator would run it."""

    kind = "autoscaled"

    def __init__(self, registry: str, service: str, s: Settings, log_dir: Path) -> None:
        super().__init__()
        self.service = service
        self.settings = s
        self.log_path = log_dir / f"autoscaler-{service}.log"
        self.teacher_log_dir = log_dir / f"teachers-{service}"
        from discovery.local_etcd import free_port

        self.metrics_port = free_port()
        self.argv = [
            sys.executable, "-m", "distill.autoscale", "--registry", registry, "--service", service,
            "--backend", "local", "--min", str(s.min_teachers), "--max", str(s.max_teachers),
            "--target-utilisation", str(s.target_utilisation), "--busy-threshold", str(s.busy_threshold),
            "--stall-threshold", str(s.stall_threshold), "--up-window", str(s.up_window_s),
            "--down-window", str(s.down_window_s), "--max-step", str(s.max_step), "--period", str(s.period_s),
            "--metrics-port", str(self.metrics_port), "--metrics-host", "127.0.0.1", "--grace", str(s.grace_s),
            "--log-dir", str(self.teacher_log_dir), "--log-level", s.autoscaler_log_level,
            "--", sys.executable, "-m", "teacher_server", *teacher_args(s),
        ]  # fmt: skip
        self.proc: subprocess.Popen[bytes] | None = None
        self.exit_code: int | None = None

    def launch(self) -> None:
        # Own session (Ctrl-C reaches the benchmark only, which stops the pool in order) and the
        # parent-death signal (a SIGKILLed benchmark leaves no autoscaler, hence no teachers).
        self.proc = launch.spawn(self.argv, log=self.log_path, env=teacher_env(self.settings), cwd=REPO_ROOT,
                                 pdeathsig=True, new_session=True)

    def candidate_pids(self) -> dict[int, str]:
        if self.proc is None:
            return {}
        found = {}
        for pid in child_pids(self.proc.pid):
            iid = _instance_id(process_cmdline(pid))
            if iid is not None and process_alive(pid):
                found[pid] = iid
        return found

    def check(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"the autoscaler exited with {self.proc.returncode}:\n{log_tail(self.log_path)}")

    def scrape(self) -> dict[str, float]:
        """The autoscaler's own gauges (``distill_autoscaler_*`` with only the service label)."""
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        try:
            with urllib.request.urlopen(url, timeout=0.4) as resp:
                text = resp.read().decode()
        except OSError:
            return {}
        figures: dict[str, float] = {}
        label = f'{{service="{self.service}"}} '
        for line in text.splitlines():
            if line.startswith("distill_autoscaler_") and label in line:
                name, value = line.split(label, 1)
                with contextlib.suppress(ValueError):
                    figures[name.removeprefix("distill_autoscaler_")] = float(value)
        return figures

    def close(self) -> None:
        """SIGTERM: the autoscaler drains its teachers (``--grace``) and exits; SIGKILL what is left.

        Leftover teachers (an autoscaler that had to be SIGKILLed) are SIGKILLed by pid, after
        checking that the pid still runs the teacher we saw (pids are reused).
        """
        if self.proc is not None:
            self.exit_code = launch.stop(self.proc, self.settings.grace_s + 15)
        for pid, life in self.lives.items():
            if process_alive(pid) and _instance_id(process_cmdline(pid)) == life.instance_id:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


class FixedPool(Pool):
    """The right-sized pool without an autoscaler: N teacher-server subprocesses, started up front."""

    kind = "fixed"

    def __init__(self, registry: str, service: str, s: Settings, stack: contextlib.ExitStack) -> None:
        super().__init__()
        self.service = service
        self.servers = [
            launch.TeacherProcess([*teacher_args(s), "--port", "0", "--registry", registry, "--service", service,
                                   "--instance-id", f"{service}-{i}"], label=f"fixed-teacher-{i}",
                                  env=teacher_env(s), cwd=REPO_ROOT, stop_grace=20.0)
            for i in range(s.pool_size)
        ]
        self._stack = stack

    def launch(self) -> None:
        launch.start_all(self._stack, self.servers)

    def candidate_pids(self) -> dict[int, str]:
        return {p.pid: f"{self.service}-{i}" for i, p in enumerate(self.servers)
                if p.proc is not None and p.proc.poll() is None}

    def check(self) -> None:
        for p in self.servers:
            if p.proc is not None and p.proc.poll() is not None:
                raise RuntimeError(f"{p.label} exited with {p.proc.returncode}:\n{p.log_tail()}")

    def scrape(self) -> dict[str, float]:
        return {}


class Watcher:
    """Follows the service in the registry: registrations (exact times), loads, student demand."""

    def __init__(self, registry: Any, service: str) -> None:
        self.registry = registry
        self.service = service
        self.current: dict[str, Any] = {}
        self.events: list[tuple[float, str, str]] = []  # (monotonic, instance id, registered|deregistered|draining)
        self._draining: set[str] = set()

    async def follow(self) -> None:
        watch = self.registry.watch(self.service)
        async with watch:
            async for snapshot in watch:
                now = time.monotonic()
                for iid in snapshot:
                    if iid not in self.current:
                        self.events.append((now, iid, "registered"))
                    load = snapshot[iid].load
                    if load is not None and load.draining and iid not in self._draining:
                        self._draining.add(iid)
                        self.events.append((now, iid, "draining"))
                for iid in self.current:
                    if iid not in snapshot:
                        self.events.append((now, iid, "deregistered"))
                self.current = dict(snapshot.items())

    def ready(self) -> int:
        return sum(1 for iid, e in self.current.items() if iid not in self._draining
                   and not (e.load is not None and e.load.draining))


class DecisionFollower:
    """The autoscaler's decisions as it publishes them in etcd (``<service>/autoscaler/decision``).

    The controller writes its last decision there as JSON (what ``distill top`` shows) on every
    change of action, cause, desired or current count, and every 10 s. One decision per period
    (1 s), so a poll several times per period sees every record; each carries its wall-clock time
    (``at``), which puts it on the benchmark's monotonic clock to the millisecond.
    """

    def __init__(self, registry: Any, service: str, poll_s: float = 0.1, call_timeout_s: float = 1.0) -> None:
        self.registry = registry
        self.service = service
        self.poll_s = poll_s
        self.call_timeout_s = call_timeout_s
        self.records: list[dict[str, Any]] = []  # each with "t": monotonic time of the decision
        self._last: tuple[Any, ...] | None = None
        self._scale_at: object = None  # the `at` of the last `last_scale` seen

    async def follow(self) -> None:
        """Poll until cancelled; an etcd hiccup skips a poll (the record stays until replaced)."""
        wall_minus_mono = time.time() - time.monotonic()
        while True:
            try:
                record = await asyncio.wait_for(self.registry.autoscaler_decision(self.service),
                                                self.call_timeout_s)
            except Exception:  # etcd busy or the call timed out: the next poll reads it again
                record = None
            if record is not None:
                with contextlib.suppress(ValueError, TypeError, KeyError):
                    self._note(record, wall_minus_mono)
            await asyncio.sleep(self.poll_s)

    def _note(self, record: dict[str, Any], wall_minus_mono: float) -> None:
        scaled = record.get("last_scale")
        if isinstance(scaled, dict) and scaled.get("at") != self._scale_at:
            self._scale_at = scaled.get("at")
            own = (record["action"], record["current"], record["desired"]) == (
                scaled["action"], scaled["from"], scaled["to"])
            if not own:  # the decision that scaled was replaced between two polls: its record, rebuilt
                self._note({"action": scaled["action"], "cause": scaled.get("cause", ""), "current": scaled["from"],
                            "desired": scaled["to"], "reason": scaled.get("reason", ""), "at": scaled["at"]},
                           wall_minus_mono)
        fingerprint = (record["action"], record["cause"], record["desired"], record["current"])
        if fingerprint == self._last:
            return  # the 10 s heartbeat of an unchanged decision
        self._last = fingerprint
        self.records.append({**record, "t": float(record["at"]) - wall_minus_mono})

    def decisions(self, t0: float) -> list[dict[str, Any]]:
        """Every published decision on the profile's clock (``t`` seconds after ``t0``), in the
        shape the analysis reads: action, from (the current count), desired, cause and reason."""
        out = []
        for r in self.records:
            reason = str(r.get("reason", ""))
            out.append({"t": round(r["t"] - t0, 3), "kind": "decision", "action": r["action"],
                        "from": int(r["current"]), "desired": int(r["desired"]), "cause": r["cause"],
                        "reason": reason.split(": ", 1)[1] if ": " in reason else reason})
        return out
