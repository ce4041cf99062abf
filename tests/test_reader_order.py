"""Ordered delivery against a real teacher server: an answered batch that waits for an earlier,
slower one lends its read-ahead slot, so the slow batch holds back no later calls, and the reader
still reads at most twice `prefetch` batches ahead of the training loop (`distill.readahead`).

The straggler is released by calls, not by a clock: the teacher's model holds the first batch
until it has seen the rows of the batches that must have been sent meanwhile, and records what it
had seen when it let go."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import torch

from distill import DistillReader
from distill.router import RouterConfig
from teacher_server import BatchingConfig, ServerConfig
from tests.models import Affine
from tests.servers import ServerThread

ROWS = 4  # rows per batch, and the teacher's max batch: two batches never share a forward pass
GATE_S = 20.0  # the longest the straggler waits for the batches behind it (only when they never come)


class GateLog:
    """What the gated teacher saw: the marks (column 0 of each row: the batch's index + 1) of every
    forward pass, and those seen when the first batch (mark 1) was let go."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.seen: set[int] = set()
        self.expect: set[int] = set()
        self.released_with: set[int] | None = None

    def reset(self, expect: set[int]) -> None:
        with self.cond:
            self.seen, self.expect, self.released_with = set(), set(expect), None


GATE = GateLog()


class Gate(Affine):
    """Affine that holds the pass whose rows carry mark 1 until the marks in `GATE.expect` have all
    been seen (by this or another instance), at most GATE_S seconds."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        marks = set(x[:, 0].round().int().tolist())
        with GATE.cond:
            GATE.seen |= marks
            GATE.cond.notify_all()
            if 1 in marks:
                GATE.cond.wait_for(lambda: GATE.expect <= GATE.seen, timeout=GATE_S)
                GATE.released_with = set(GATE.seen)
        return super().forward(x)


def gate() -> Gate:
    return Gate()


@pytest.fixture(scope="module")
def gated() -> Iterator[ServerThread]:
    """Two model instances: one holds the straggler while the other answers the rest."""
    cfg = ServerConfig(model="tests.test_reader_order:gate", name="gate", device="cpu", instances=2,
                       batching=BatchingConfig(max_batch_size=ROWS, max_queue_delay_us=200))
    with ServerThread(cfg) as server:
        yield server


def _batches(n: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    batches = []
    for i in range(n):
        x = torch.randn(ROWS, 8, generator=g)
        x[:, 0] = i + 1  # the batch's mark
        batches.append({"X": x, "idx": torch.full((ROWS,), i)})
    return batches


class CountingLoader:
    """The batches, noting for each how many the training loop had taken when it was read."""

    def __init__(self, batches: list[dict[str, torch.Tensor]]) -> None:
        self.batches = batches
        self.taken = 0  # advanced by the training loop
        self.taken_at_read: list[int] = []

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        for batch in self.batches:
            self.taken_at_read.append(self.taken)
            yield batch


def _reader(server: ServerThread, loader: CountingLoader, prefetch: int, ordered: bool = True) -> DistillReader:
    # A fixed in-flight limit, no hedging, one request per batch: the calls started are the batches read.
    return DistillReader(loader, teachers=server.url, inputs=["X"], outputs=["Y"], prefetch=prefetch, ordered=ordered,
                         bundle=False, hedge_after=None, timeout=60.0,
                         router=RouterConfig(initial_limit=8, min_limit=8, max_limit=16))


def test_a_slow_first_batch_holds_back_none_of_the_calls_behind_it(gated: ServerThread) -> None:
    """prefetch 4, the first batch held at the teacher: the seven answered batches behind it lend
    their slots (up to 4), so batches 1..7 all reach the teacher before batch 0 is answered; and
    every batch still comes out once, in loader order, with its outputs."""
    prefetch, n = 4, 12
    data = _batches(n)
    GATE.reset(expect=set(range(2, 2 * prefetch + 1)))  # the marks of batches 1 .. 2 * prefetch - 1
    loader = CountingLoader(data)
    model = Affine()
    seen = []
    with _reader(gated, loader, prefetch) as reader:
        for batch, teacher in reader:
            loader.taken += 1
            seen.append(int(batch["idx"][0]))
            with torch.inference_mode():
                assert torch.allclose(teacher["Y"], model(batch["X"]), atol=1e-5), f"batch {seen[-1]} has wrong outputs"
    assert seen == list(range(n)), f"lost, duplicated or reordered batches: {seen}"
    assert GATE.released_with == set(range(1, 2 * prefetch + 1)), (
        f"the teacher saw only the marks {sorted(GATE.released_with or ())} before it answered the first batch: "
        "answered batches waiting for it kept their read-ahead slots")
    # The bound: batch i is read only once the training loop took i - 2 * prefetch + 1 batches (one
    # less here: the loop counts a batch after next() returned it, the reader when it hands it over).
    late = [(i, taken) for i, taken in enumerate(loader.taken_at_read) if taken < i - 2 * prefetch]
    assert not late, f"batches read more than 2 x prefetch ahead of the training loop (batch, taken): {late}"


def test_unordered_delivery_is_not_held_back_either(gated: ServerThread) -> None:
    """With ordered=False the answered batches go to the training loop at once and free their
    slots as it takes them: the same batches reach the teacher before batch 0 is answered."""
    prefetch, n = 4, 8
    data = _batches(n)
    GATE.reset(expect=set(range(2, n + 1)))
    loader = CountingLoader(data)
    seen = []
    with _reader(gated, loader, prefetch, ordered=False) as reader:
        for batch, _ in reader:
            loader.taken += 1
            seen.append(int(batch["idx"][0]))
    assert sorted(seen) == list(range(n)), f"lost or duplicated batches: {seen}"
    assert GATE.released_with == set(range(1, n + 1))
