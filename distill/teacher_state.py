"""The router's record of one teacher instance: its client, in-flight limit, latency, health and
counters, what its record says it can compute (`offers`), and the few questions asked of it alone
(usable now? a free slot? able to answer these needs? what state, in words?).
The router (`distill.router`) owns these records and changes them on every outcome.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from distill.capabilities import ALL, Needs, Offers, covers
from distill.teacher_client import InferenceClient
from distill.types import TeacherMetadata
from protos.text import TEXT

__all__ = ["TeacherState"]


BASELINE_AFTER = 5  # answers averaged before the latency gradient takes its baseline (until then the limit holds)


@dataclass(eq=False)
class TeacherState:
    """The router's record of one teacher instance: its client, limit, latency, health and counters.
    (Named apart from the losses' teacher outputs: this is a connection's state, not a tensor.)"""

    key: str
    endpoint: str
    client: InferenceClient
    limit: float
    meta: TeacherMetadata | None = None
    in_flight: int = 0
    rows_in_flight: int = 0  # the rows of the calls in flight; a by-length teacher's limit counts these
    ewma_s: float = 0.0
    best_s: float = math.inf  # the lowest `base_s` has been, drifting up slowly: the gradient's baseline
    base_s: float = 0.0  # a slower average of the latencies than `ewma_s`, whose lowest is the baseline
    timed: int = 0  # answers since the latency figures were last started afresh
    last_result: float = 0.0
    streak: int = 0
    ejected_until: float = 0.0
    incompatible: str | None = None
    needs_probe: bool = False
    probing: bool = False
    races_lost: int = 0  # hedge races lost in a row (another teacher answered the chunk first)
    cool_until: float = 0.0  # overloaded: no new chunk before this (still usable)
    overloads: int = 0  # overload answers in a row
    strikes: int = 0  # inputs refused in a row that another teacher then accepted
    checking: bool = False  # a liveness check (a late chunk) is running
    ejections: int = 0
    overloaded_count: int = 0
    removed: bool = False
    ok: int = 0
    errors: int = 0
    samples: int = 0
    last_error: str = ""
    checked: set[tuple[object, ...]] = field(default_factory=set)
    offers: Offers = ALL  # what its registry record declares it can compute (`distill.capabilities`)

    def timed_answer(self, latency_s: float) -> None:
        """Account one answer's latency: `ewma_s` follows it, and from the `BASELINE_AFTER`-th answer
        on `best_s`, the latency gradient's baseline, is the lowest a slower average has been. Never
        the lowest of `ewma_s`: that sits in the lucky tail of the student's own delays, or on a
        first call that was alone at the teacher, and `ewma_s` would then stay above 1.5x it for
        good. The baseline drifts up slowly so one calm spell does not pin the limit forever."""
        self.ewma_s = latency_s if self.ewma_s == 0 else 0.8 * self.ewma_s + 0.2 * latency_s
        self.timed += 1
        if self.timed >= BASELINE_AFTER:
            self.base_s = self.ewma_s if self.timed == BASELINE_AFTER else 0.95 * self.base_s + 0.05 * latency_s
            self.best_s = min(self.best_s * 1.002, self.base_s)

    def forget_latency(self) -> None:
        """Start the latency figures afresh (a teacher back in service, often a new process)."""
        self.ewma_s = self.base_s = 0.0
        self.best_s = math.inf
        self.timed = 0

    def usable(self, now: float) -> bool:
        return (not self.removed and self.meta is not None and self.incompatible is None and not self.needs_probe
                and now >= self.ejected_until)

    def can(self, needs: Needs) -> bool:
        """Whether its offers cover a request's `needs` (`distill.capabilities.covers`). A teacher
        that declares nothing (a static host:port) takes texts when its metadata declares the TEXT
        input (a teacher-server with a tokenizer does); until its metadata is read it may."""
        if needs.text and not self.offers.declared:
            return self.meta is None or TEXT in self.meta.inputs
        return (self.offers.complete and not needs.text) or covers(self.offers, needs)

    @property
    def by_length(self) -> bool:
        """Whether it batches padded rows by length: then `limit` counts rows in flight, not calls."""
        return self.meta is not None and self.meta.batches_by_length

    def has_slot(self) -> bool:
        held = self.rows_in_flight if self.by_length else self.in_flight
        return held < max(1, int(self.limit)) and time.monotonic() >= self.cool_until

    def describe(self) -> str:
        state = (
            "removed" if self.removed else f"incompatible: {self.incompatible}" if self.incompatible
            else f"waiting for metadata ({self.last_error})" if self.meta is None and self.last_error
            else "waiting for metadata" if self.meta is None
            else f"ejected ({self.last_error})" if self.needs_probe or time.monotonic() < self.ejected_until
            else "ok"
        )
        return f"{self.endpoint} [{state}]"
