"""Which teacher takes a chunk: the routing policy, the router's one override point.

The router (``distill.router``) keeps each teacher's health and in-flight limit and hands a
policy only the teachers that may take the chunk now (usable, a free slot, not excluded); the
policy picks one. Ray Serve's request router has the same seam (``choose_replicas(candidates,
request)``); tuning values are named class attributes, overridable per instance.

A policy is selected with ``DistillReader(..., routing=...)``: a name from `POLICIES`, or a
callable that returns a new policy (one per teacher service, so a policy may keep state).
Writing one:

    class Fastest:
        def choose(self, candidates, request):
            return min(candidates, key=lambda t: t.ewma_s or float("inf"))

    DistillReader(loader, teachers=..., inputs=[...], routing=Fastest)
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

__all__ = ["POLICIES", "Candidate", "PowerOfTwoChoices", "RoundRobin", "RouteRequest", "RoutingPolicy",
           "make_policy", "policy_spec"]


class Candidate(Protocol):
    """What a policy may read of a teacher (the router's ``TeacherState``)."""

    @property
    def key(self) -> str:
        """The teacher's identity in its service (its registry key)."""

    @property
    def in_flight(self) -> int:
        """Chunks sent to it and not answered."""

    @property
    def ewma_s(self) -> float:
        """Its recent chunk latency (an exponential moving average), seconds; 0 before its first answer."""

    @property
    def last_result(self) -> float:
        """``time.monotonic()`` of its last answer (0: none yet)."""


C = TypeVar("C", bound=Candidate)


@dataclass(frozen=True)
class RouteRequest:
    """The chunk being routed: its service and how many rows it carries."""

    service: str
    rows: int


class RoutingPolicy(Protocol):
    def choose(self, candidates: Sequence[C], request: RouteRequest) -> C:
        """One of `candidates` (never empty: the router asks only when some teacher may take it)."""


class PowerOfTwoChoices:
    """Two candidates at random, the one with the lower expected completion time ((in_flight + 1) x
    latency estimate): a slow teacher gets less work without the herd effect of always picking the
    single best. An idle teacher's estimate goes stale after `stale_after_s` without an answer and
    then counts at most the pool's median, so a teacher whose last answers were slow (a cold start,
    a passing hiccup) is tried again instead of starving of the very work that would correct its
    estimate. The price is about one chunk per `stale_after_s` on a teacher that really is slow,
    which hedging bounds."""

    stale_after_s: float = 1.0
    unknown_latency_s: float = 1.0  # the estimate of every teacher while none has answered yet

    def __init__(self, stale_after_s: float | None = None) -> None:
        if stale_after_s is not None:
            self.stale_after_s = stale_after_s

    def choose(self, candidates: Sequence[C], request: RouteRequest) -> C:
        if len(candidates) == 1:
            return candidates[0]
        known = [t.ewma_s for t in candidates if t.ewma_s > 0]
        default = sorted(known)[(len(known) - 1) // 2] if known else self.unknown_latency_s  # the lower median
        a, b = random.sample(list(candidates), 2)
        stale_before = time.monotonic() - self.stale_after_s

        def cost(t: Candidate) -> float:
            estimate = t.ewma_s or default
            if t.in_flight == 0 and t.last_result < stale_before:
                estimate = min(estimate, default)
            return (t.in_flight + 1) * estimate

        return a if cost(a) <= cost(b) else b


class RoundRobin:
    """Each chunk to the next candidate in turn (by teacher key), whatever their speed: an even
    spread of work over identical teachers, and a baseline to measure a smarter policy against."""

    def __init__(self) -> None:
        self._last = ""

    def choose(self, candidates: Sequence[C], request: RouteRequest) -> C:
        ordered = sorted(candidates, key=lambda t: t.key)
        chosen = next((t for t in ordered if t.key > self._last), ordered[0])
        self._last = chosen.key
        return chosen


POLICIES: dict[str, Callable[[], RoutingPolicy]] = {
    "power_of_two": PowerOfTwoChoices,
    "round_robin": RoundRobin,
}
"""The policies a reader can name (``routing="round_robin"``)."""

PolicySpec = str | Callable[[], RoutingPolicy]


def policy_spec(spec: PolicySpec) -> PolicySpec:
    """The ``routing`` option's rule: a name from `POLICIES`, or a callable making a policy."""
    if isinstance(spec, str):
        if spec not in POLICIES:
            raise ValueError(f"must be one of {', '.join(POLICIES)}, or a callable returning a policy, got {spec!r}")
        return spec
    if not callable(spec):
        raise ValueError(f"must be a policy name ({', '.join(POLICIES)}) or a callable returning a policy, "
                         f"got {spec!r}")
    return spec


def make_policy(spec: PolicySpec, stale_after_s: float | None = None) -> RoutingPolicy:
    """A new policy for one service's router; `stale_after_s` tunes power-of-two choices."""
    if spec == "power_of_two":
        return PowerOfTwoChoices(stale_after_s)
    factory = POLICIES[spec] if isinstance(spec, str) else spec
    policy = factory()
    if not callable(getattr(policy, "choose", None)):
        raise TypeError(f"routing={spec!r} made {policy!r}, which has no choose(candidates, request) method")
    return policy
