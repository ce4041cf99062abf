"""Prometheus metrics of the autoscaler, on their own ``CollectorRegistry``.

Its own registry, not the process-global one: two controllers in one process (tests, or one per
service) must not collide, and the page shows only what the autoscaler means to export.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest, start_http_server

from distill.autoscale.policy import Decision

__all__ = ["AutoscalerMetrics"]

log = logging.getLogger("distill.autoscale.metrics")


class AutoscalerMetrics:
    """Gauges and counters of one controller; :meth:`serve` exposes them on ``/metrics``.

    ``distill_autoscaler_desired_teachers``, ``..._current_teachers`` (what the backend runs or was
    asked for), ``..._ready_teachers`` (registered, not draining), ``..._starting_teachers``,
    ``..._demand_samples_per_second`` (estimated), ``..._served_samples_per_second``,
    ``..._capacity_samples_per_second`` (ready teachers x measured capacity),
    ``..._teacher_capacity_samples_per_second`` (per teacher), ``..._student_wait_fraction``,
    ``..._teacher_busy_fraction``, ``..._leader`` (1 while leading), ``..._registry_up``,
    ``..._decisions_total{action}``, ``..._scale_events_total{direction}``,
    ``..._external_changes_total`` (times another writer changed the count) and
    ``..._external_hold`` (1 while the controller holds off after such a change); every series
    carries a ``service`` label.
    """

    def __init__(self, service: str, registry: CollectorRegistry | None = None) -> None:
        self.service = service
        self.registry = registry if registry is not None else CollectorRegistry()
        r, lbl = self.registry, ["service"]

        def gauge(name: str, doc: str) -> Any:
            return Gauge(f"distill_autoscaler_{name}", doc, lbl, registry=r).labels(service)

        self.desired = gauge("desired_teachers", "Teacher count the policy wants (managed teachers).")
        self.current = gauge("current_teachers", "Managed teachers the backend runs or was asked to run.")
        self.ready = gauge("ready_teachers", "Teachers registered and not draining (managed or not).")
        self.starting = gauge("starting_teachers", "Managed teachers started but not registered yet.")
        self.demand = gauge("demand_samples_per_second", "Estimated student demand (consumption / (1 - wait)).")
        self.served = gauge("served_samples_per_second", "Samples per second the students consumed.")
        self.capacity = gauge("capacity_samples_per_second", "Ready teachers times measured per-teacher capacity.")
        self.teacher_capacity = gauge("teacher_capacity_samples_per_second", "Measured capacity of one teacher.")
        self.wait = gauge("student_wait_fraction", "Mean share of time students waited for teacher outputs.")
        self.busy = gauge("teacher_busy_fraction", "Mean share of time the ready teachers computed.")
        self.leader = gauge("leader", "1 while this controller leads its service, else 0.")
        self.registry_up = gauge("registry_up", "1 when the last registry read succeeded, else 0.")
        self._decisions = Counter(
            "distill_autoscaler_decisions", "Policy decisions by action.", [*lbl, "action"], registry=r
        )
        self.external_hold = gauge(
            "external_hold", "1 while the controller holds off because another writer changed the count, else 0."
        )
        self._external_changes = Counter(
            "distill_autoscaler_external_changes",
            "Times another writer (an HPA, kubectl scale, a GitOps sync) changed the teacher count.",
            lbl,
            registry=r,
        ).labels(service)
        self._scale_events = Counter(
            "distill_autoscaler_scale_events", "Applied changes of the teacher count.", [*lbl, "direction"], registry=r
        )
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self.port: int | None = None

    def record(self, decision: Decision, *, current: int, ready: int, starting: int) -> None:
        """Export one decision and the pool it was taken on."""
        self.desired.set(decision.desired)
        self.current.set(current)
        self.ready.set(ready)
        self.starting.set(starting)
        self.demand.set(decision.demand)
        self.served.set(decision.served)
        self.teacher_capacity.set(decision.capacity)
        self.capacity.set(decision.capacity * ready)
        if "stall" in decision.figures:
            self.wait.set(decision.figures["stall"])
            self.busy.set(decision.figures["busy"])
        self._decisions.labels(self.service, decision.action).inc()

    def scaled(self, direction: str) -> None:
        self._scale_events.labels(self.service, direction).inc()

    def external_change(self) -> None:
        """Count one change of the teacher count by another writer."""
        self._external_changes.inc()

    @property
    def external_changes(self) -> float:
        """Changes by another writer counted so far."""
        value = self.registry.get_sample_value("distill_autoscaler_external_changes_total", {"service": self.service})
        return float(value or 0.0)

    def render(self) -> bytes:
        """The exposition text (what ``/metrics`` serves)."""
        return bytes(generate_latest(self.registry))

    def serve(self, port: int, host: str = "0.0.0.0") -> int:
        """Serve ``/metrics`` on ``host:port`` (0: a free port) from a daemon thread; return the port."""
        self._server, self._thread = start_http_server(port, addr=host, registry=self.registry)
        self.port = int(self._server.server_port)
        log.info("autoscaler metrics on http://%s:%d/metrics", host, self.port)
        return self.port

    def close(self) -> None:
        """Stop serving (blocks briefly while the server thread finishes its current request)."""
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
        if self._thread is not None:
            self._thread.join(5.0)
            self._thread = None
