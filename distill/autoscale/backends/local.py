"""The ``local`` backend: teachers as ``teacher-server`` subprocesses of the autoscaler.

This is the embedded default: on one machine with spare GPUs (or on a laptop, on CPU), the
autoscaler itself starts and stops teacher processes from a command template:

    distill-autoscaler --registry etcd://... --service S --devices cuda:0,cuda:1 \\
        -- teacher-server --model examples.refteacher:build --name ref_teacher

The template (:mod:`~distill.autoscale.backends.template`) may use ``{port}``, ``{device}``,
``{gpu}``, ``{instance_id}``, ``{registry}`` and ``{service}``; the flags are appended when the
template does not set them, so the short form above works. Each teacher gets a free loopback port
and the least used device (at most ``teachers_per_device`` per accelerator; CPU has no limit).

An engine (vLLM, SGLang) runs behind its registrar, whose command wraps the engine's:

    distill-autoscaler ... -- distill register --engine vllm --url http://127.0.0.1:{port} \
        -- python -m vllm.entrypoints.openai.api_server --model DIR --port {port}

The registrar is the child; it writes the record once its engine is healthy, and it is that record
which makes the teacher count as started (:mod:`~distill.autoscale.backends.children`).

Lifecycle: a teacher counts as *starting* until it appears in the registry (teacher-server
registers once its model is loaded and warmed up). Scale-down stops the least loaded teachers
first (ones not registered yet before any), with SIGTERM: teacher-server then refuses new work,
deregisters, finishes what it accepted and exits (a registrar deregisters, lets its engine finish,
then stops it); SIGKILL follows after ``grace`` seconds, to the child's whole process group. A
teacher that exits on its own is a crash: it is logged with the tail of its output and replaced,
with exponential backoff when teachers keep dying young, so a broken template cannot fork-bomb the
machine. ``close()`` stops every process it started (also on Ctrl-C, through the CLI); on Linux
the children also get SIGTERM from the kernel if the autoscaler itself dies (``PR_SET_PDEATHSIG``),
so even a SIGKILLed autoscaler leaves no teacher behind. Teachers are started by
``teacher_server.launch.spawn``, the launcher the examples and benchmarks use as well.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from discovery import keys
from discovery.aio import cancel_and_wait
from distill.autoscale.backends.base import Backend, BackendState
from distill.autoscale.backends.children import Child, free_port, kill_group, registered_id, tail
from distill.autoscale.backends.template import PLACEHOLDERS, check_template, device_index, fill
from distill.autoscale.errors import BackendError
from teacher_server import launch

__all__ = ["PLACEHOLDERS", "LocalBackend"]

log = logging.getLogger("distill.autoscale.local")

# A teacher that dies younger than this counts toward the crash backoff.
_YOUNG = 30.0


class LocalBackend(Backend):
    """Teachers as subprocesses; see the module docstring.

    Args:
        command: the teacher command template (argv list), e.g. ``["teacher-server", "--model", ...]``.
        registry: the registry address the teachers register with (fills ``{registry}``).
        service: the service they register under (fills ``{service}``).
        devices: where teachers run, spread evenly: ``["cuda:0", "cuda:1"]`` or ``["cpu"]``.
        teachers_per_device: most teachers per accelerator (default 1); CPU is never limited.
        grace: seconds between SIGTERM (drain) and SIGKILL.
        start_timeout: seconds after which a teacher that has not registered is reported (once).
        host: the address whose free ports the teachers get.
        log_dir: where each teacher's output goes (``<instance_id>.log``); a temporary directory,
            removed on close, when None.
        env: extra environment variables for the teachers.
        append_flags: append ``--port``/``--device``/... when the template lacks them.
    """

    name = "local"

    def __init__(
        self,
        command: Sequence[str],
        *,
        registry: str,
        service: str,
        devices: Sequence[str] = ("cpu",),
        teachers_per_device: int = 1,
        grace: float = 40.0,
        start_timeout: float = 120.0,
        host: str = "127.0.0.1",
        log_dir: str | os.PathLike[str] | None = None,
        env: Mapping[str, str] | None = None,
        append_flags: bool = True,
        supervise_interval: float = 0.25,
        max_crash_backoff: float = 30.0,
    ) -> None:
        self.service = keys.validate_name("service name", service)
        self.registry = registry
        self.devices = tuple(d.strip() for d in devices if d.strip())
        if not self.devices:
            raise BackendError("--devices is empty; give cpu or cuda:0[,cuda:1...]")
        for d in self.devices:
            if d != "cpu" and not (d.startswith("cuda:") and d[5:].isdigit()) and d not in ("cuda", "mps"):
                raise BackendError(f"unknown device {d!r}; use cpu, cuda:N (comma-separated for several) or mps")
        if len(set(self.devices)) != len(self.devices):
            raise BackendError(f"device listed twice in {','.join(self.devices)}")
        if teachers_per_device < 1:
            raise BackendError(f"teachers_per_device must be at least 1, not {teachers_per_device}")
        if not grace > 0:
            raise BackendError(f"grace must be a positive number of seconds, not {grace}")
        self.teachers_per_device = int(teachers_per_device)
        self.grace = float(grace)
        self.start_timeout = float(start_timeout)
        self.host = host
        self.env = dict(env or {})
        self.supervise_interval = float(supervise_interval)
        self.max_crash_backoff = float(max_crash_backoff)
        self.command = check_template(list(command), append_flags)
        self._own_log_dir = log_dir is None
        self._log_dir_arg = log_dir
        self.log_dir: Path | None = None
        self._children: dict[str, Child] = {}  # running, counted toward the target
        self._draining: dict[str, Child] = {}  # SIGTERMed, waiting to exit
        self._target = 0
        self._next_spawn_at = 0.0
        self._crash_streak = 0
        self._supervisor: asyncio.Task[None] | None = None
        self._started = False
        self._closed = False
        self.crashes = 0  # teachers that exited on their own (for tests and metrics)
        self.stopped: dict[str, int] = {}  # exit codes of the teachers this backend stopped
        self.spawned = 0

    # -- template -----------------------------------------------------------------------------------
    def argv(self, *, port: int, device: str, instance_id: str) -> list[str]:
        """The command for one teacher, placeholders filled in."""
        values = {
            "port": str(port),
            "device": device,
            "gpu": device_index(device),
            "instance_id": instance_id,
            "registry": self.registry,
            "service": self.service,
        }
        return fill(self.command, values)

    # -- Backend ------------------------------------------------------------------------------------
    @property
    def limit(self) -> int | None:
        accelerators = [d for d in self.devices if d != "cpu"]
        if len(accelerators) < len(self.devices):
            return None
        return len(accelerators) * self.teachers_per_device

    async def start(self) -> None:
        if self._started:
            return
        if self._closed:
            raise BackendError("this backend is closed")
        if self._log_dir_arg is None:
            self.log_dir = Path(tempfile.mkdtemp(prefix=f"distill-autoscaler-{self.service}-"))
        else:
            self.log_dir = Path(self._log_dir_arg)
            try:
                self.log_dir.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise BackendError(f"cannot create the teacher log directory {str(self.log_dir)!r}: {e}") from None
        self._started = True
        self._supervisor = asyncio.get_running_loop().create_task(self._supervise(), name="autoscaler-local-supervisor")
        log.info(
            "local backend: teachers run `%s` on %s (logs in %s)",
            " ".join(self.command),
            ",".join(self.devices),
            self.log_dir,
        )

    async def observe(self, teachers: Mapping[str, object]) -> BackendState:
        self._supervise_once()
        now = time.monotonic()
        starting = []
        managed = set(self._children) | set(self._draining)
        for child in (*self._children.values(), *self._draining.values()):
            iid = registered_id(child, teachers, self.host)
            if iid is not None:
                managed.add(iid)
        for child in self._children.values():
            if registered_id(child, teachers, self.host) is not None:
                continue
            starting.append(child.started_at)
            if not child.warned_slow and now - child.started_at > self.start_timeout:
                child.warned_slow = True
                log.warning(
                    "teacher %s (pid %d) has not registered %.0f s after starting; its output (%s):\n%s",
                    child.instance_id,
                    child.proc.pid,
                    now - child.started_at,
                    child.log_path,
                    tail(child.log_path),
                )
        detail = f"{len(self._children)} running"
        if self._draining:
            detail += f", {len(self._draining)} draining"
        return BackendState(
            current=self._target,
            starting=tuple(sorted(starting)),
            managed=frozenset(managed),
            detail=detail,
        )

    async def scale(self, desired: int, teachers: Mapping[str, object]) -> None:
        if not self._started or self._closed:
            raise BackendError("the local backend is not running (start() it first)")
        desired = max(0, int(desired))
        limit = self.limit
        if limit is not None and desired > limit:
            log.warning(
                "asked for %d teachers but %s fit %d; running %d", desired, ",".join(self.devices), limit, limit
            )
            desired = limit
        self._target = desired
        excess = len(self._children) - desired
        if excess > 0:
            for child in self._victims(excess, teachers):
                self._terminate(child, "scale-down")
        self._fill()

    async def stand_down(self) -> None:
        """Leadership lost: the new leader runs its own pool, so drain ours."""
        if self._started and not self._closed and (self._children or self._target):
            log.info("local backend: standing down; draining %d teacher(s)", len(self._children))
            self._target = 0
            for child in list(self._children.values()):
                self._terminate(child, "stand-down")

    async def close(self) -> None:
        """SIGTERM every teacher, wait up to ``grace`` seconds for the drains, SIGKILL the rest."""
        if self._closed:
            return
        self._closed = True
        self._target = 0
        if self._supervisor is not None:
            await cancel_and_wait(self._supervisor)
        for child in list(self._children.values()):
            self._terminate(child, "shutdown")
        deadline = time.monotonic() + self.grace
        while self._draining and time.monotonic() < deadline:
            self._reap_draining(kill_late=False)
            if self._draining:
                await asyncio.sleep(0.05)
        for child in list(self._draining.values()):
            if not child.exited:
                log.warning(
                    "teacher %s (pid %d) did not drain within %.0f s; killing it",
                    child.instance_id,
                    child.proc.pid,
                    self.grace,
                )
                kill_group(child)
        for iid, child in list(self._draining.items()):
            # Reaping a SIGKILLed child is immediate; bounded anyway, off the loop.
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.stopped[iid] = await asyncio.to_thread(child.proc.wait, 5.0)
            kill_group(child)
        self._draining.clear()
        if self._own_log_dir and self.log_dir is not None:
            shutil.rmtree(self.log_dir, ignore_errors=True)

    # -- internals ----------------------------------------------------------------------------------
    @property
    def processes(self) -> dict[str, int]:
        """``instance_id -> pid`` of the running (not draining) teachers."""
        return {iid: c.proc.pid for iid, c in self._children.items()}

    @property
    def draining(self) -> dict[str, int]:
        """``instance_id -> pid`` of the teachers being drained."""
        return {iid: c.proc.pid for iid, c in self._draining.items()}

    def _victims(self, n: int, teachers: Mapping[str, object]) -> list[Child]:
        """The ``n`` teachers to stop: unregistered ones first (newest first: they are furthest from
        being useful), then registered ones from the least loaded."""

        def load_key(child: Child) -> tuple[int, float, float, float]:
            iid = registered_id(child, teachers, self.host)
            entry = None if iid is None else teachers.get(iid)
            load = getattr(entry, "load", None)
            if entry is None:
                return (0, 0.0, 0.0, -child.started_at)
            if load is None:
                return (1, 0.0, 0.0, -child.started_at)
            work = float(getattr(load, "in_flight", 0)) + float(getattr(load, "queue_depth", 0))
            return (2, work, float(getattr(load, "samples_per_s", 0.0)), -child.started_at)

        return sorted(self._children.values(), key=load_key)[:n]

    def _terminate(self, child: Child, why: str) -> None:
        self._children.pop(child.instance_id, None)
        if child.exited:
            return
        log.info(
            "stopping teacher %s (pid %d, %s) for %s: SIGTERM, drain",
            child.instance_id,
            child.proc.pid,
            child.device,
            why,
        )
        with contextlib.suppress(ProcessLookupError):
            child.proc.send_signal(signal.SIGTERM)
        child.term_at = time.monotonic()
        self._draining[child.instance_id] = child

    def _device_for_next(self) -> str | None:
        used = {d: 0 for d in self.devices}
        for child in (*self._children.values(), *self._draining.values()):
            if child.device in used:
                used[child.device] += 1
        free = [d for d in self.devices if d == "cpu" or used[d] < self.teachers_per_device]
        if not free:
            return None
        return min(free, key=lambda d: (used[d], self.devices.index(d)))

    def _fill(self) -> None:
        """Start teachers until the target is met (respecting crash backoff and device slots)."""
        while len(self._children) < self._target and not self._closed:
            if time.monotonic() < self._next_spawn_at:
                return
            device = self._device_for_next()
            if device is None:
                return  # slots still held by draining teachers; the supervisor tries again
            try:
                self._spawn(device)
            except (OSError, BackendError) as e:
                self._crashed_young(time.monotonic())
                log.warning(
                    "cannot start a teacher (%s); trying again in %.1f s", e, self._next_spawn_at - time.monotonic()
                )
                return

    def _spawn(self, device: str) -> Child:
        assert self.log_dir is not None
        instance_id = f"{self.service}-{secrets.token_hex(4)}"
        taken = {c.port for c in (*self._children.values(), *self._draining.values())}
        port = free_port(self.host, taken)
        argv = self.argv(port=port, device=device, instance_id=instance_id)
        log_path = self.log_dir / f"{instance_id}.log"
        # Forks and execs: milliseconds, no waiting on the child. On the loop thread on purpose:
        # PR_SET_PDEATHSIG fires when the *thread* that forked the child exits, and the loop thread
        # lives as long as the autoscaler. Its own session: Ctrl-C reaches the autoscaler, which
        # drains in order.
        proc = launch.spawn(argv, log=log_path, env={"PYTHONUNBUFFERED": "1", **self.env}, pdeathsig=True,
                            new_session=True)
        child = Child(instance_id, device, port, proc, log_path, time.monotonic())
        self._children[instance_id] = child
        self.spawned += 1
        log.info("started teacher %s (pid %d) on %s, port %d", instance_id, proc.pid, device, port)
        return child

    def _reap_draining(self, *, kill_late: bool) -> None:
        now = time.monotonic()
        for iid, child in list(self._draining.items()):
            code = child.proc.poll()
            if code is not None:
                del self._draining[iid]
                kill_group(child)  # whatever the leader left behind (an engine it did not stop)
                self.stopped[iid] = code
                level = logging.INFO if code == 0 else logging.WARNING
                log.log(level, "teacher %s (pid %d) stopped, exit code %d", iid, child.proc.pid, code)
            elif kill_late and child.term_at is not None and now - child.term_at > self.grace:
                log.warning("teacher %s (pid %d) did not drain within %.0f s; SIGKILL", iid, child.proc.pid, self.grace)
                kill_group(child)
                child.term_at = now - self.grace + 5.0  # look again in 5 s

    def _supervise_once(self) -> None:
        if self._closed:
            return
        now = time.monotonic()
        for iid, child in list(self._children.items()):
            code = child.proc.poll()
            if code is None:
                continue
            del self._children[iid]
            kill_group(child)  # a crashed registrar's engine goes with it
            self.crashes += 1
            lived = now - child.started_at
            if lived < _YOUNG:
                self._crashed_young(now)
            else:
                self._crash_streak = 0
            delay = max(0.0, self._next_spawn_at - now)
            log.warning(
                "teacher %s (pid %d, %s) exited with code %d after %.1f s; replacing it%s. Its output (%s):\n%s",
                iid,
                child.proc.pid,
                child.device,
                code,
                lived,
                f" in {delay:.1f} s" if delay else "",
                child.log_path,
                tail(child.log_path),
            )
        self._reap_draining(kill_late=True)
        self._fill()

    def _crashed_young(self, now: float) -> None:
        """Back off before the next start: 0.5 s, doubling per consecutive early death."""
        self._crash_streak += 1
        self._next_spawn_at = now + min(self.max_crash_backoff, 0.5 * 2 ** (self._crash_streak - 1))

    async def _supervise(self) -> None:
        """Reap exits, replace crashed teachers and escalate late drains, also between the
        controller's periods and while it does not lead."""
        while True:
            try:
                self._supervise_once()
            except Exception:  # keep supervising; a bug here must not orphan the teachers
                log.exception("local backend supervisor failed; continuing")
            await asyncio.sleep(self.supervise_interval)
