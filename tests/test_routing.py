"""The routing-policy seam: a reader option picks the policy, the router keeps health and limits."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import pytest
import torch

from distill import DistillReader, ReaderOptions
from distill.routing import C, PowerOfTwoChoices, RoundRobin, RouteRequest
from teacher_server import BatchingConfig, ServerConfig
from tests.servers import ServerThread

ROWS = 8  # one chunk per batch: the teachers' max batch size


@pytest.fixture(scope="module")
def two_teachers() -> Iterator[tuple[ServerThread, ServerThread]]:
    def server() -> ServerThread:
        return ServerThread(ServerConfig(model="tests.models:affine", name="affine", device="cpu",
                                         batching=BatchingConfig(max_batch_size=ROWS, max_queue_delay_us=200)))

    with server() as a, server() as b:
        yield a, b


def _batches(n: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [{"X": torch.randn(ROWS, 8, generator=g), "idx": torch.full((ROWS,), i)} for i in range(n)]


def _chunks_per_teacher(reader: DistillReader, n: int) -> dict[str, int]:
    # Every choice among both teachers: wait (bounded) until the pool uses both before the first batch.
    for _ in range(300):
        if reader.stats().teachers_in_use == 2:
            break
        time.sleep(0.1)
    assert reader.stats().teachers_in_use == 2, reader.stats().teachers
    seen = [int(batch["idx"][0]) for batch, out in reader if out["Y"].shape == (ROWS, 4)]
    assert seen == list(range(n)), seen
    return {endpoint: int(t["ok"]) for endpoint, t in reader.stats().teachers["teachers"].items()}


def test_round_robin_through_a_reader_alternates_the_teachers(two_teachers: tuple[ServerThread, ServerThread]) -> None:
    """One chunk in flight at a time (prefetch=1), so both teachers are free at every choice: round
    robin alternates them exactly, which power-of-two choices (random pairs, latency costs) need not."""
    a, b = two_teachers
    with DistillReader(_batches(10), teachers=f"{a.url},{b.url}", inputs=["X"], outputs=["Y"], prefetch=1,
                       hedge_after=None, routing="round_robin") as reader:
        assert reader.options.routing == "round_robin"
        counts = _chunks_per_teacher(reader, 10)
    assert sorted(counts.values()) == [5, 5], counts


@dataclass
class _Last:
    """A policy of the test's own: always the teacher with the greatest key; records what it saw."""

    seen: list[tuple[int, int]]

    def choose(self, candidates: Sequence[C], request: RouteRequest) -> C:
        self.seen.append((len(candidates), request.rows))
        return max(candidates, key=lambda t: t.key)


def test_a_policy_of_ones_own_gets_every_choice(two_teachers: tuple[ServerThread, ServerThread]) -> None:
    a, b = two_teachers
    made: list[_Last] = []

    def factory() -> _Last:
        made.append(_Last([]))
        return made[-1]

    with DistillReader(_batches(6), teachers=f"{a.url},{b.url}", inputs=["X"], outputs=["Y"], prefetch=1,
                       hedge_after=None, routing=factory) as reader:
        counts = _chunks_per_teacher(reader, 6)
    assert len(made) == 1, "one policy per service"
    assert sorted(counts.values()) == [0, 6], counts
    assert made[0].seen and all(rows == ROWS for _, rows in made[0].seen), made[0].seen
    assert max(n for n, _ in made[0].seen) == 2, "the policy chose among both teachers"


def test_the_routing_option_is_checked() -> None:
    with pytest.raises(ValueError, match="routing: must be one of power_of_two, round_robin"):
        ReaderOptions(inputs=["X"], teachers="h:1", routing="fastest")
    with pytest.raises(ValueError, match="routing: must be a policy name"):
        ReaderOptions(inputs=["X"], teachers="h:1", routing=3)  # type: ignore[arg-type]
    assert ReaderOptions(inputs=["X"], teachers="h:1").routing == "power_of_two"


@dataclass
class _Teacher:
    key: str
    in_flight: int = 0
    ewma_s: float = 0.0
    last_result: float = 0.0


def test_round_robin_and_power_of_two_on_their_own() -> None:
    ts = [_Teacher("k2"), _Teacher("k0"), _Teacher("k1")]
    rr = RoundRobin()
    request = RouteRequest("s", 4)
    assert [rr.choose(ts, request).key for _ in range(4)] == ["k0", "k1", "k2", "k0"]
    assert rr.choose(ts[:1], request).key == "k2", "a lone candidate is taken"
    p2c = PowerOfTwoChoices(stale_after_s=3600.0)
    fast, slow = _Teacher("f", ewma_s=0.01, last_result=1e12), _Teacher("s", ewma_s=1.0, last_result=1e12)
    assert {p2c.choose([fast, slow], request).key for _ in range(20)} == {"f"}
