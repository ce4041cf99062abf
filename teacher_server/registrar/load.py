"""An engine's Prometheus metrics, read into the TeacherLoad the router and the autoscaler read.

Why from metrics: every engine already counts its running and waiting requests and its cache use
for its own dashboards; the registrar translates them, so an engine joins the mesh unchanged.

    queue_depth    waiting requests
    in_flight      running + waiting
    busy_fraction  the KV-cache / token-pool use (vLLM, SGLang); else compute time per second
                   (teacher-server, Triton); else 1 while anything runs
    samples_per_s  the rate of the finished-requests counter (inferences for KServe engines)

The text is parsed with prometheus_client's parser. A metric the engine does not export leaves its
figure at what is known (0, or "unknown" for in-flight work); a scrape that fails or does not
parse keeps the last figures. Nothing here raises for an engine's metrics.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from protos import registry_pb2

__all__ = ["METRIC_NAMES", "EngineFigures", "LoadTracker", "MetricNames", "read_figures"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MetricNames:
    """The metric families of one engine kind (counters by their name without ``_total``). The
    first name of a tuple the engine exports is used (newer names first)."""

    running: tuple[str, ...]
    waiting: tuple[str, ...]
    in_flight: tuple[str, ...] = ()  # running + waiting in one gauge (teacher-server)
    usage: tuple[str, ...] = ()  # 0..1: cache or token-pool use
    finished: tuple[str, ...] = ()  # counter of answered requests or samples
    compute_us: tuple[str, ...] = ()  # counter of compute microseconds


METRIC_NAMES: dict[str, MetricNames] = {
    "vllm": MetricNames(
        running=("vllm:num_requests_running",), waiting=("vllm:num_requests_waiting",),
        usage=("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"), finished=("vllm:request_success",)),
    "sglang": MetricNames(
        running=("sglang:num_running_reqs",), waiting=("sglang:num_queue_reqs",), usage=("sglang:token_usage",),
        finished=("sglang:num_requests",)),
    "kserve": MetricNames(
        running=(), waiting=("nv_inference_pending_request_count",), in_flight=("teacher_in_flight_request_count",),
        finished=("nv_inference_count",), compute_us=("nv_inference_compute_infer_duration_us",)),
}


@dataclass(frozen=True)
class EngineFigures:
    """One scrape's figures; None where the engine exports no such metric."""

    running: float | None
    waiting: float | None
    in_flight: float | None
    usage: float | None
    finished: float | None
    compute_us: float | None


def _totals(text: str) -> dict[str, float]:
    """Each gauge's and counter's samples summed over their labels, counters under their name
    without ``_total`` (whether or not the TYPE line spells it); histograms, summaries and
    ``_created`` samples are left out."""
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.type in ("histogram", "gaugehistogram", "summary"):
            continue
        for s in family.samples:
            if s.name.endswith("_created"):
                continue
            name = s.name[: -len("_total")] if s.name.endswith("_total") else s.name
            totals[name] = totals.get(name, 0.0) + float(s.value)
    return totals


def read_figures(kind: str, text: str) -> EngineFigures:
    """The figures of an engine of ``kind`` in its metrics ``text``; ValueError when the text is
    not Prometheus' text format."""
    names = METRIC_NAMES[kind]
    totals = _totals(text)

    def first(candidates: Iterable[str]) -> float | None:
        return next((totals[n] for n in candidates if n in totals), None)

    return EngineFigures(first(names.running), first(names.waiting), first(names.in_flight), first(names.usage),
                         first(names.finished), first(names.compute_us))


class LoadTracker:
    """The latest TeacherLoad of one engine, updated from each scrape (rates from counter deltas)."""

    def __init__(self, kind: str, instance_id: str) -> None:
        self.kind = kind
        self.instance_id = instance_id
        self.draining = False
        self.queue_depth = 0
        self.in_flight: int | None = None  # None: the engine's metrics do not say
        self.busy_fraction = 0.0
        self.samples_per_s = 0.0
        self._last: tuple[float, EngineFigures] | None = None
        self.failed_scrapes = 0

    def update(self, text: str | None, now: float | None = None) -> None:
        """Take one scrape's text (None: the scrape failed; the last figures stay)."""
        if text is None:
            self.failed_scrapes += 1
            return
        try:
            figures = read_figures(self.kind, text)
        except ValueError as e:
            self.failed_scrapes += 1
            log.debug("engine metrics do not parse: %s", e)
            return
        now = time.monotonic() if now is None else now
        waiting = int(figures.waiting or 0)
        running = figures.running
        if figures.in_flight is not None:
            in_flight: int | None = int(figures.in_flight)
            running = max(0.0, figures.in_flight - waiting)
        elif running is not None or figures.waiting is not None:
            in_flight = int(running or 0) + waiting
        else:
            in_flight = None
        self.queue_depth, self.in_flight = waiting, in_flight
        self.busy_fraction = self._busy(figures, running, now)
        self.samples_per_s = self._rate(figures, "finished", now)
        self._last = (now, figures)

    def _rate(self, figures: EngineFigures, counter: str, now: float) -> float:
        """Per second of ``counter`` (a field of EngineFigures) since the last scrape; 0 when the
        engine exports no such counter, on the first scrape, and when it went back (a restart)."""
        value: float | None = getattr(figures, counter)
        previous = None if self._last is None else getattr(self._last[1], counter)
        if value is None or previous is None or value < previous:
            return 0.0
        then = self._last[0] if self._last is not None else now
        return float((value - previous) / (now - then)) if now > then else 0.0

    def _busy(self, figures: EngineFigures, running: float | None, now: float) -> float:
        if figures.usage is not None:
            return min(1.0, max(0.0, figures.usage))
        if figures.compute_us is not None:
            return min(1.0, self._rate(figures, "compute_us", now) / 1e6)
        return 1.0 if (running or 0) > 0 else 0.0

    def load(self) -> registry_pb2.TeacherLoad:
        """The TeacherLoad to publish now (cheap: called on the event loop by the registration)."""
        return registry_pb2.TeacherLoad(
            instance_id=self.instance_id, queue_depth=self.queue_depth, in_flight=self.in_flight or 0,
            samples_per_s=self.samples_per_s, busy_fraction=self.busy_fraction, updated_at=time.time(),
            draining=self.draining,
        )
