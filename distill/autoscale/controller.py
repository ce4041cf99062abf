"""The controller: every period, read the registry, ask the policy, apply through a backend.

One controller per service acts at a time (the registry's :class:`~discovery.election.Election`,
on etcd :class:`~discovery.etcd.election.LeaderElection`);
the others wait and take over when the leader goes away. While leading, each period:

1. the teacher set comes from a registry watch (kept current in the background, loads included);
   student demand is read once (a failed read is how an unreachable registry shows);
2. the backend reports the pool it runs (target count, teachers not registered yet);
3. :func:`~distill.autoscale.policy.decide` turns that into a desired count and a reason;
4. the decision is logged (every change, and every change of the reason's kind) and exported as
   Prometheus metrics, and the backend is told the new count if it differs.

Another writer (an HPA, ``kubectl scale``, a GitOps sync) may resize a shared pool such as a
Deployment. The controller notices when the backend's count is not the one it last wrote (or last
saw), logs it once with the backend's detail (which names the writer where the backend can tell),
counts it in ``distill_autoscaler_external_changes_total`` and does not fight it: it holds the
count the other writer set for the policy's down window (decisions say ``cause=external``) and only
then acts again. Two sizers of one pool are a configuration error this cannot fix, but holding
keeps them from flapping the pool against each other every period.

Missing data never shrinks the pool: with the registry down the policy holds the current count
(and the local backend still replaces teachers that crash). If the outage outlasts the leader
lease, the controller stops deciding but keeps its pool; it lets go of the pool only once it sees
*another* controller in the leader key, and resumes its own lease if etcd kept it. A new term of
leadership starts with an empty policy history, so a controller that just took over observes for
a full stabilisation window before it scales down.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import json
import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from discovery.aio import Backoff, StateLog, bounded, cancel_and_wait, describe
from discovery.base import Registry, RegistryError, TeacherSet
from discovery.election import Election
from distill.autoscale.backends.base import Backend, BackendState
from distill.autoscale.errors import BackendError, BackendUnavailableError, PolicyConfigError
from distill.autoscale.metrics import AutoscalerMetrics
from distill.autoscale.policy import Decision, PolicyConfig, PolicyState, ScaleSnapshot, decide

__all__ = ["Controller", "ControllerConfig", "default_identity"]

log = logging.getLogger("distill.autoscale")


def default_identity() -> str:
    """``host-pid``: unique per controller process, readable in the leader key."""
    return f"{socket.gethostname()}-{os.getpid()}"


@dataclass(frozen=True)
class ControllerConfig:
    """How the controller runs (the policy's knobs are in :class:`PolicyConfig`).

    Attributes:
        service: the teacher service to size.
        period: seconds between decisions.
        identity: this controller's name in the leader key.
        election_ttl: lease seconds of the leadership; a dead leader is replaced within about this.
        election_poll: seconds between a waiting controller's looks at the leader key.
        registry_timeout: seconds allowed for one registry read.
        metrics_port: serve Prometheus metrics on this port (0: a free one; None: do not serve).
        metrics_host: the address the metrics server binds.
    """

    service: str
    period: float = 1.0
    identity: str = dataclasses.field(default_factory=default_identity)
    election_ttl: float = 5.0
    election_poll: float = 0.5
    registry_timeout: float = 3.0
    metrics_port: int | None = None
    metrics_host: str = "0.0.0.0"

    def __post_init__(self) -> None:
        for name in ("period", "election_ttl", "election_poll", "registry_timeout"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and value > 0):
                raise PolicyConfigError(f"{name} must be a positive number of seconds, not {value!r}")
        if self.election_ttl < 2:
            raise PolicyConfigError(
                f"election_ttl must be at least 2 s (etcd leases are whole seconds), not {self.election_ttl}"
            )
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise PolicyConfigError(f"metrics_port must be in 0..65535, not {self.metrics_port}")


class Controller:
    """Keeps one service's teacher pool sized to its students; see the module docstring.

    The registry must keep shared state (etcd: the election lives there); the caller owns it and closes
    it after the controller. The controller owns the backend and closes it. Use::

        async with Controller(registry, backend, PolicyConfig(...), ControllerConfig("svc")) as c:
            await c.wait()          # runs until cancelled or closed

    ``on_decision`` (optional) is called on the event loop with every decision and the backend
    state it was taken on: a hook for benchmarks and dashboards.
    """

    def __init__(
        self,
        registry: Registry,
        backend: Backend,
        policy: PolicyConfig,
        config: ControllerConfig,
        *,
        metrics: AutoscalerMetrics | None = None,
        on_decision: Callable[[Decision, BackendState], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.registry = registry
        self.backend = backend
        self.policy = policy
        self.config = config
        self.service = config.service
        self.metrics = metrics if metrics is not None else AutoscalerMetrics(config.service)
        self.election: Election = registry.election(
            config.service,
            identity=config.identity,
            ttl=config.election_ttl,
            poll_interval=config.election_poll,
            call_timeout=config.registry_timeout,
        )
        self._on_decision = on_decision
        self._clock = clock
        self._state = PolicyState()
        self._teachers: TeacherSet | None = None
        self._first_snapshot = asyncio.Event()
        self._run_task: asyncio.Task[None] | None = None
        self._follow_task: asyncio.Task[None] | None = None
        self._closed = False
        self._registry_log = StateLog(log)
        self._backend_log = StateLog(log)
        self._last_cause: tuple[str, str] | None = None
        self._published: tuple[object, ...] | None = None
        self._published_at = 0.0
        # Counts the backend may report without another writer being involved: the last one written
        # or seen (both, after a write whose outcome is unknown). None: adopt whatever comes next.
        self._expected: frozenset[int] | None = None
        self._hold_until = float("-inf")
        self.decisions: collections.deque[Decision] = collections.deque(maxlen=1000)
        # The last count written that landed (action, from, to, cause, reason, at: wall time), published
        # with every decision: a reader polling the record sees each scale even when the next
        # period's decision has already replaced the one that made it.
        self.last_scale: dict[str, Any] | None = None

    # -- lifecycle ----------------------------------------------------------------------------------
    @property
    def is_leader(self) -> bool:
        return self.election.is_leader

    @property
    def teachers(self) -> TeacherSet | None:
        """The newest teacher snapshot the controller has (None before the first)."""
        return self._teachers

    async def start(self) -> Controller:
        """Start the backend (its configuration errors raise here), the metrics server and the
        campaign/decision loop."""
        if self._run_task is not None:
            return self
        limit = self.backend.limit
        if limit is not None and limit < self.policy.upper:
            if limit < self.policy.min_teachers:
                raise PolicyConfigError(
                    f"--min {self.policy.min_teachers} teachers do not fit: the {self.backend.name} backend has room "
                    f"for {limit} (one per device and --teachers-per-device)"
                )
            log.info("the %s backend has room for %d teachers; capping --max there", self.backend.name, limit)
            self.policy = dataclasses.replace(self.policy, max_teachers=limit)
        await self.backend.start()
        try:
            if self.config.metrics_port is not None:
                self.metrics.serve(self.config.metrics_port, self.config.metrics_host)
        except OSError as e:
            await self.backend.close()
            raise BackendError(f"cannot serve metrics on port {self.config.metrics_port}: {e}") from None
        self.metrics.leader.set(0)
        self._run_task = asyncio.get_running_loop().create_task(self._run(), name=f"autoscaler-{self.service}")
        return self

    async def wait(self) -> None:
        """Wait until the controller stops (it only stops by close() or a bug, which raises here)."""
        if self._run_task is None:
            raise RuntimeError("the controller is not started")
        await asyncio.shield(self._run_task)

    async def close(self) -> None:
        """Stop deciding, resign the leadership, close the backend (stopping what it started) and
        the metrics server. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for task in (self._run_task, self._follow_task):
            if task is not None:
                await cancel_and_wait(task)
        await self.election.close()
        self.metrics.leader.set(0)
        await self.backend.close()
        await asyncio.to_thread(self.metrics.close)

    async def __aenter__(self) -> Controller:
        return await self.start()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    # -- loops --------------------------------------------------------------------------------------
    async def _run(self) -> None:
        while True:
            await self.election.campaign(on_follow=self._another_leads)
            self.metrics.leader.set(1)
            log.info("autoscaler of %r: leading as %s", self.service, self.config.identity)
            self._state = PolicyState()  # a new term observes a full window before scaling down
            self._last_cause = None
            self._expected, self._hold_until = None, float("-inf")
            self.metrics.external_hold.set(0)
            await self._lead()
            self.metrics.leader.set(0)
            log.warning(
                "autoscaler of %r: no longer leading; the pool stays as it is until a leader is known",
                self.service,
            )

    async def _another_leads(self, holder: str) -> None:
        """Someone else leads now: let go of what this controller manages (the local backend
        drains its processes; a Deployment is left to the new leader)."""
        await self.backend.stand_down()

    async def _lead(self) -> None:
        """Decide every period while leading; return when leadership is lost."""
        if self._follow_task is None or self._follow_task.done():
            self._follow_task = asyncio.get_running_loop().create_task(
                self._follow(), name=f"autoscaler-watch-{self.service}"
            )
        # Give the watch a moment to deliver its first snapshot, so that a fresh leader does not
        # start by reporting the registry as unreachable.
        with contextlib.suppress(TimeoutError, asyncio.TimeoutError):
            await bounded(self._first_snapshot.wait(), self.config.registry_timeout)
        next_tick = self._clock()
        while self.election.is_leader:
            await self._tick()
            next_tick += self.config.period
            delay = next_tick - self._clock()
            if delay < 0:  # a slow tick (registry timeout): do not try to catch up
                next_tick, delay = self._clock(), 0.0
            lost = asyncio.ensure_future(self.election.wait_lost())
            try:
                await asyncio.wait([lost], timeout=delay)
            finally:
                lost.cancel()

    async def _follow(self) -> None:
        """Keep ``self._teachers`` at the newest teacher snapshot (records and loads)."""
        backoff = Backoff(cap=5.0)
        while True:
            watch = self.registry.watch(self.service)
            try:
                async with watch:
                    async for snapshot in watch:
                        self._teachers = snapshot
                        self._first_snapshot.set()
                        backoff.reset()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # RegistryUnavailableError at first contact, or a bug: retry
                log.debug("watch of %r ended (%s); watching again", self.service, describe(e))
            await asyncio.sleep(backoff.next_delay())

    async def _read_demand(self) -> tuple[list[object], str | None]:
        try:
            demand = await bounded(self.registry.demand(self.service), self.config.registry_timeout + 1.0)
        except (RegistryError, ConnectionError, TimeoutError, asyncio.TimeoutError) as e:
            return [], describe(e)
        return list(demand), None

    async def _tick(self) -> None:
        demand, error = await self._read_demand()
        teachers = self._teachers
        if error is None and teachers is None:
            error = "no teacher snapshot from the registry yet"
        if error is None:
            self._registry_log.change(
                "up",
                logging.INFO if self._registry_log.state else logging.DEBUG,
                "autoscaler of %r: registry reachable",
                self.service,
            )
            self.metrics.registry_up.set(1)
        else:
            self._registry_log.change(
                "down",
                logging.WARNING,
                "autoscaler of %r: registry unreachable (%s); holding the teacher count",
                self.service,
                error,
            )
            self.metrics.registry_up.set(0)
        view = teachers if teachers is not None else TeacherSet()
        try:
            state = await self.backend.observe(view)
        except BackendUnavailableError as e:
            self._backend_log.change("down", logging.WARNING, "autoscaler of %r: %s; holding", self.service, e)
            return
        self._backend_log.change(
            "up",
            logging.INFO if self._backend_log.state else logging.DEBUG,
            "autoscaler of %r: %s backend reachable",
            self.service,
            self.backend.name,
        )
        self._notice_external(state)
        managed = state.managed
        snapshot = ScaleSnapshot.from_registry(
            state.current,
            view,
            demand,
            starting=state.starting,
            managed=None if managed is None else managed.__contains__,
        )
        if error is not None:
            snapshot = dataclasses.replace(snapshot, error=error)
        now = self._clock()
        decision = decide(snapshot, self.policy, self._state, now)
        self._state = decision.new_state
        if now < self._hold_until:
            decision = self._held(decision, state, now)
        else:
            self.metrics.external_hold.set(0)
        self.decisions.append(decision)
        self._log(decision, state)
        ready = sum(1 for t in snapshot.teachers if not t.draining)
        self.metrics.record(decision, current=state.current, ready=ready, starting=len(state.starting))
        if self._on_decision is not None:
            try:
                self._on_decision(decision, state)
            except Exception:
                log.exception("on_decision hook failed")
        if decision.desired != state.current and self.election.is_leader:
            await self._scale(decision, state, view)
        await self._publish(decision, state)

    async def _scale(self, decision: Decision, state: BackendState, view: TeacherSet) -> None:
        """Write the decided count; a scale that landed becomes the record's ``last_scale``."""
        try:
            await self.backend.scale(decision.desired, view)
        except BackendUnavailableError as e:
            # The write may or may not have landed (a timeout): either count is ours next period.
            self._expected = frozenset({state.current, decision.desired})
            self._backend_log.change("down", logging.WARNING, "autoscaler of %r: %s; will retry", self.service, e)
            return
        self._expected = frozenset({decision.desired})
        direction = "up" if decision.desired > state.current else "down"
        self.metrics.scaled(direction)
        self.last_scale = {"action": direction, "from": state.current, "to": decision.desired,
                           "cause": decision.cause, "reason": decision.reason, "at": time.time()}

    def _notice_external(self, state: BackendState) -> None:
        """Start a hold when the backend's count is not one this controller wrote or last saw."""
        expected, self._expected = self._expected, frozenset({state.current})
        if expected is None or state.current in expected:
            return
        window = self.policy.down_window
        self._hold_until = self._clock() + window
        self.metrics.external_change()
        self.metrics.external_hold.set(1 if window > 0 else 0)
        ours = " or ".join(str(n) for n in sorted(expected))
        log.warning(
            "autoscaler of %r: another writer changed the teacher count to %d (this controller last had %s) "
            "[%s]; not fighting it: holding %d for the %g s down window before acting again. If an HPA, "
            "kubectl scale or a GitOps sync also sizes this pool, leave the sizing to one of them",
            self.service,
            state.current,
            ours,
            state.detail or state.current,
            state.current,
            window,
        )

    def _held(self, decision: Decision, state: BackendState, now: float) -> Decision:
        """The policy's decision, overruled to a hold while another writer's count stands."""
        self.metrics.external_hold.set(1)
        wanted = "" if decision.action == "hold" else f" (the policy would {decision.reason})"
        return dataclasses.replace(
            decision,
            desired=state.current,
            action="hold",
            cause="external",
            reason=f"hold {state.current}: another writer set this count; acting again in "
            f"{self._hold_until - now:.0f} s{wanted}",
        )

    async def _publish(self, decision: Decision, state: BackendState) -> None:
        """The last decision as JSON at <autoscaler prefix>decision (read by `distill top`): on every
        change, and every 10 s so its age shows the controller is alive. Bound to the leader lease."""
        fingerprint = (decision.action, decision.cause, decision.desired, state.current, None if self.last_scale is None
                       else self.last_scale["at"])
        now = time.monotonic()
        if fingerprint == self._published and now - self._published_at < 10.0:
            return
        record = {
            "action": decision.action, "cause": decision.cause, "current": state.current,
            "desired": decision.desired, "needed": decision.needed, "demand": round(decision.demand, 1),
            "capacity": round(decision.capacity, 1), "reason": decision.reason, "at": time.time(),
        }
        if self.last_scale is not None:
            record["last_scale"] = self.last_scale
        try:
            if await self.election.publish("decision", json.dumps(record).encode()):
                self._published, self._published_at = fingerprint, now
        except Exception as e:  # an unreachable etcd is already reported; never stop deciding for this
            log.debug("could not publish the decision: %s", describe(e))

    def _log(self, decision: Decision, state: BackendState) -> None:
        key = (decision.action, decision.cause)
        level = logging.INFO if decision.action != "hold" or key != self._last_cause else logging.DEBUG
        self._last_cause = key
        log.log(level, "autoscaler of %r: %s [%s]", self.service, decision.reason, state.detail or state.current)
