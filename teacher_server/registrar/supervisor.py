"""The registrar's loop: an engine's record is in the registry exactly while the engine is healthy.

    waiting   probe the engine (backoff up to 5 s; no overall limit unless --ready-timeout) until
              it answers every readiness check; the record does not exist yet
    serving   the record is registered (a lease of --ttl s); every --probe-interval the health
              check runs and the metrics are read into the load; --unhealthy-after failed checks
              in a row withdraw the record, and the loop waits again
    stopping  at SIGTERM/SIGINT: the load says draining, the record is withdrawn first (students
              stop routing), the engine's in-flight work is awaited (running + waiting, read from
              its metrics) for at most --drain-timeout s, then the engine child (if any) is stopped

An engine child that exits on its own ends the loop at once: the record is withdrawn as the loop
leaves, and :class:`EngineExitedError` says how it exited. The registry is never a reason to stop:
registration retries in the background while etcd is unreachable.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass

from discovery.aio import Backoff, StateLog, cancel_and_wait
from discovery.base import Registration, Registry
from discovery.signals import StopSignals
from protos import registry_pb2
from teacher_server.registrar.child import EngineChild
from teacher_server.registrar.errors import EngineExitedError, EngineNotReady, ReadyTimeoutError
from teacher_server.registrar.load import LoadTracker
from teacher_server.registrar.probe import Probe

__all__ = ["Registrar", "RegistrarOptions", "default_instance_id"]

log = logging.getLogger("teacher_server.registrar")

MAX_PROBE_BACKOFF_S = 5.0
DRAIN_POLL_S = 0.25


def default_instance_id(service: str, kind: str) -> str:
    return f"{service}-{kind}-{uuid.uuid4().hex[:12]}"


@dataclass(frozen=True)
class RegistrarOptions:
    """What the loop does when; see the module docstring (defaults are the command's)."""

    service: str
    instance_id: str
    ttl: float = 10.0
    probe_interval: float = 1.0
    unhealthy_after: int = 3
    ready_timeout: float | None = None
    drain_timeout: float = 30.0
    stop_grace: float = 30.0


class Registrar:
    """Registers ``probe``'s engine in ``registry`` while it is healthy; :meth:`run` until stopped."""

    def __init__(self, registry: Registry, probe: Probe, options: RegistrarOptions,
                 child: EngineChild | None = None) -> None:
        self.registry = registry
        self.probe = probe
        self.options = options
        self.child = child
        self.tracker = LoadTracker(probe.address.kind, options.instance_id)
        self.started_at = time.time()
        self.registrations = 0
        self._state = StateLog(log)

    async def run(self, stop: StopSignals) -> int:
        """Until a stop signal (then 0, after the drain) or the engine child's own exit
        (:class:`EngineExitedError`); :class:`ReadyTimeoutError` when --ready-timeout passes first."""
        stopped = asyncio.ensure_future(stop.wait())
        try:
            if self.child is not None:
                self.child.start()
            ready_by = (None if self.options.ready_timeout is None
                        else time.monotonic() + self.options.ready_timeout)
            while not stop.stopped:
                record = await self._wait_ready(stopped, ready_by)
                ready_by = None  # the limit is on the first start only: an engine that restarts is waited for
                if record is None:
                    break
                if await self._serve(record, stopped):
                    break
            return 0
        finally:
            await cancel_and_wait(stopped)
            if self.child is not None:
                await self.child.stop(self.options.stop_grace)
            await self.probe.close()

    def _check_child(self) -> None:
        code = None if self.child is None else self.child.returncode()
        if code is not None:
            raise EngineExitedError(f"the engine exited on its own with status {code}; its record is withdrawn. "
                                    "Read its output above, fix it and start the registrar again")

    async def _pause(self, stopped: asyncio.Future[None], seconds: float) -> None:
        await asyncio.wait([stopped], timeout=max(0.0, seconds))

    async def _wait_ready(self, stopped: asyncio.Future[None],
                          ready_by: float | None) -> registry_pb2.TeacherRecord | None:
        """The engine's record once it is ready; None at a stop signal."""
        backoff = Backoff(initial=0.5, cap=MAX_PROBE_BACKOFF_S)
        where = self.probe.address.base_url or self.probe.address.endpoint
        while not stopped.done():
            self._check_child()
            try:
                record = await self.probe.ready()
            except EngineNotReady as e:
                self._state.change(f"waiting: {e.reason}", logging.INFO, "waiting for the %s engine at %s: %s",
                                   self.probe.address.kind, where, e.reason)
                if ready_by is not None and time.monotonic() >= ready_by:
                    raise ReadyTimeoutError(
                        f"the {self.probe.address.kind} engine at {where} was not ready within "
                        f"--ready-timeout {self.options.ready_timeout:g} s (last: {e.reason}); check that it "
                        "started and the --url, or raise --ready-timeout") from None
                delay = backoff.next_delay()
                if ready_by is not None:
                    delay = min(delay, max(0.0, ready_by - time.monotonic()))
                await self._pause(stopped, delay)
                continue
            record.instance_id = self.options.instance_id
            record.started_at = self.started_at
            return record
        return None

    async def _serve(self, record: registry_pb2.TeacherRecord, stopped: asyncio.Future[None]) -> bool:
        """Hold the registration while the engine is healthy. True: stopped (drained); False: the
        engine stopped answering and its record is withdrawn."""
        await self._scrape()
        o = self.options
        async with self.registry.register(o.service, record, ttl=o.ttl, load=self.tracker.load) as reg:
            self.registrations += 1
            self._state.change("registered", logging.INFO, "engine ready: registered %s (%s, model %s) as %s",
                               record.endpoint, record.protocol, record.model_name, reg.key)
            failures = 0
            while True:
                await self._pause(stopped, o.probe_interval)
                if stopped.done():
                    await self._drain(reg)
                    return True
                self._check_child()
                try:
                    await self.probe.healthy()
                    failures = 0
                except EngineNotReady as e:
                    failures += 1
                    if failures >= o.unhealthy_after:
                        self._state.change("withdrawn", logging.WARNING, "engine unhealthy (%d failed checks, last: "
                                           "%s): record withdrawn until it is ready again", failures, e.reason)
                        return False
                    continue
                await self._scrape()

    async def _scrape(self) -> None:
        self.tracker.update(await self.probe.metrics())

    async def _drain(self, reg: Registration) -> None:
        """Draining load, withdraw, then wait for the engine's in-flight work (bounded)."""
        self.tracker.draining = True
        await reg.deregister()
        log.info("stopping: record withdrawn; waiting up to %g s for the engine's in-flight work",
                 self.options.drain_timeout)
        end = time.monotonic() + self.options.drain_timeout
        while True:
            text = await self.probe.metrics()
            self.tracker.update(text)
            in_flight = self.tracker.in_flight
            if text is None or in_flight is None:
                log.info("the engine's metrics do not say what is in flight (none read, or no such metric); "
                         "not waiting")
                return
            if in_flight == 0:
                log.info("drained: nothing in flight")
                return
            if time.monotonic() >= end:
                log.warning("--drain-timeout %g s passed with %d request(s) in flight", self.options.drain_timeout,
                            in_flight)
                return
            if self.child is not None and self.child.returncode() is not None:
                return
            await asyncio.sleep(DRAIN_POLL_S)
