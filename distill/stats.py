"""What the training loop experiences: samples consumed per second and the share of time it waited.

Written by the training loop's thread, read by the engine thread (to publish StudentDemand) and
by `reader.stats()`; a lock keeps the window consistent between them. `demand_report` and
`reader_stats` turn it, with the routers' view of the teachers, into what the registry and the
user see.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from protos import registry_pb2

if TYPE_CHECKING:
    from distill.router import Router


@dataclass(frozen=True)
class ReaderStats:
    """A snapshot of a reader's counters; `teachers` maps service -> endpoint -> figures."""

    batches: int
    samples: int
    samples_per_s: float  # over the recent window
    wait_fraction: float  # recent window: time the loop waited for teacher outputs / wall time
    in_flight: int  # chunks sent and not answered
    teachers_in_use: int
    fallback_batches: int
    retries: int
    hedges: int
    teachers: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)
    rejected_batches: int = 0  # batches the teachers refused (BatchRejectedError, or hard labels)
    hung_ejections: int = 0  # teachers ejected because a chunk was late and a readiness probe failed
    bundled: int = 0  # chunks sent in a request shared with other batches' chunks (distill.bundles)
    # Batches the pass reads ahead of the training loop now: `prefetch`, or as many as the teachers that
    # batch by length want rows, within `read_ahead_mb`.
    read_ahead: int = 0
    # With a teacher-output store (cache=PATH): samples its lookups found (served without a teacher),
    # samples it lacked (sent to a teacher when there is one), and teacher samples written to it.
    cache_hits: int = 0
    cache_misses: int = 0
    cache_written: int = 0
    # With route_by: rows and tokens sent to each service since the reader started, {service: {"rows": n,
    # "tokens": n}} (tokens: the attention mask's sum, else rows times the padded width).
    routed: dict[str, dict[str, int]] = field(default_factory=dict)
    # Per service, the teachers' fingerprint this reader uses (distill.fingerprints): {service: {"pinned": fp,
    # "refused": replicas refused for another fingerprint, "refused_endpoints": [...], "switches": n}}.
    fingerprints: dict[str, dict[str, Any]] = field(default_factory=dict)


class ConsumptionMeter:
    """Sliding-window rate and wait fraction of the training loop."""

    def __init__(self, window_s: float = 10.0) -> None:
        self._window_s = window_s
        self._lock = threading.Lock()
        self._events: collections.deque[tuple[float, int, float]] = collections.deque()
        # The clock starts with the first batch consumed, not when the reader was built: time spent
        # finding a first teacher (a cold start) is not a rate of zero samples per second.
        self._start: float | None = None
        self.batches = 0
        self.samples = 0

    def record(self, samples: int, waited_s: float) -> None:
        now = time.monotonic()
        with self._lock:
            if self._start is None:
                self._start = now - waited_s
            self.batches += 1
            self.samples += samples
            self._events.append((now, samples, waited_s))
            while self._events and now - self._events[0][0] > self._window_s:
                self._events.popleft()

    def figures(self) -> tuple[float, float]:
        """(samples/s, wait fraction) over the window (or since the start, when younger)."""
        now = time.monotonic()
        with self._lock:
            if self._start is None:
                return 0.0, 0.0
            while self._events and now - self._events[0][0] > self._window_s:
                self._events.popleft()
            span = max(min(self._window_s, now - self._start), 1e-6)
            samples = sum(e[1] for e in self._events)
            waited = sum(e[2] for e in self._events)
        return samples / span, min(1.0, waited / span)


class RoutedRows:
    """Rows and tokens a routing reader sent to each service: totals for `reader.stats()`, and each
    service's share of the rows over a sliding window, which scales the demand it publishes there
    (the autoscaler grows each expert's pool by its own share of the student's samples)."""

    def __init__(self, services: tuple[str, ...], window_s: float = 10.0) -> None:
        self._window_s = window_s
        self._lock = threading.Lock()
        self.rows = dict.fromkeys(services, 0)
        self.tokens = dict.fromkeys(services, 0)
        self._events: collections.deque[tuple[float, dict[str, int]]] = collections.deque()

    def add(self, counts: Mapping[str, tuple[int, int]]) -> None:
        """One batch's (rows, tokens) per service."""
        now = time.monotonic()
        with self._lock:
            for service, (rows, tokens) in counts.items():
                self.rows[service] += rows
                self.tokens[service] += tokens
            self._events.append((now, {s: c[0] for s, c in counts.items()}))
            while self._events and now - self._events[0][0] > self._window_s:
                self._events.popleft()

    def share(self, service: str) -> float:
        """`service`'s share of the rows sent over the window (of all rows sent, before any)."""
        with self._lock:
            events = [e[1] for e in self._events] or [self.rows]
            total = sum(sum(e.values()) for e in events)
            mine = sum(e.get(service, 0) for e in events)
        return mine / total if total else 1.0 / max(1, len(self.rows))

    def counts(self, service: str) -> tuple[int, int]:
        """Rows and tokens routed to `service` since the reader started."""
        with self._lock:
            return self.rows[service], self.tokens[service]

    def snapshot(self) -> dict[str, dict[str, int]]:
        with self._lock:
            return {s: {"rows": self.rows[s], "tokens": self.tokens[s]} for s in self.rows}


def demand_report(student_id: str, meter: ConsumptionMeter, router: Router,
                  share: Callable[[], float] | None = None,
                  routed: Callable[[], tuple[int, int]] | None = None) -> Callable[[], registry_pb2.StudentDemand]:
    """What this student publishes for the autoscaler, sampled when called. With route_by, `share`
    is the service's share of the rows, which scales the samples per second it is asked for, and
    `routed` its rows and tokens so far (what `distill top` shows per teacher)."""

    def demand() -> registry_pb2.StudentDemand:
        rate, wait = meter.figures()
        if share is not None:
            rate *= share()
        rows, tokens = routed() if routed is not None else (0, 0)
        now = time.monotonic()
        return registry_pb2.StudentDemand(
            student_id=student_id, samples_per_s=rate, wait_fraction=wait,
            in_flight=sum(t.in_flight for t in router.teachers.values()),
            teachers_in_use=sum(1 for t in router.teachers.values() if t.usable(now)),
            updated_at=time.time(), rows_routed=rows, tokens_routed=tokens,
        )

    return demand


def reader_stats(meter: ConsumptionMeter, routers: Mapping[str, Router], **counters: Any) -> ReaderStats:
    """`DistillReader.stats()`: the meter's figures, every teacher's, and the engine's counters."""
    rate, wait = meter.figures()
    now = time.monotonic()
    teachers = [t for router in routers.values() for t in router.teachers.values()]
    return ReaderStats(
        batches=meter.batches, samples=meter.samples, samples_per_s=rate, wait_fraction=wait,
        in_flight=sum(t.in_flight for t in teachers), teachers_in_use=sum(1 for t in teachers if t.usable(now)),
        teachers={s: dict(router.snapshot()) for s, router in routers.items()}, **counters,
    )
