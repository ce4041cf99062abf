"""Which queued requests may share a batch: the batching settings and the rules of a padded
model's batches (length bucket, token budget, padding-efficiency floor, closest lengths), apart
from the queue and the workers that apply them (`teacher_server.batcher`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

from teacher_server.work import Work

QUEUE_SIZE = 512
"""Requests allowed to wait by default (`BatchingConfig.queue_bound`)."""

BY_LENGTH_QUEUE_ROWS = 2048
"""Rows allowed to wait by default where a model batches padded rows by length: four students'
512 (`distill.RouterConfig.by_length_rows`), because such a model needs many rows queued to form
batches of like lengths, and a bound of one student's rows would shed the second student's."""

TYPICAL_LENGTH = 64
"""Positions per sequence the default token budget of a padded model assumes: max_batch_size 256
gives 16,384 tokens a batch, large enough to keep a GPU's kernels full, small enough that its
activations fit beside a 7B teacher's weights (on a GPU `teacher_server.token_budget` caps it to
the free memory)."""


@dataclass(frozen=True)
class BatchingConfig:
    max_batch_size: int = 256  # largest request; the batch bound of models without padded inputs
    max_queue_delay_us: int = 500
    max_queue_size: int | None = None  # requests (rows, once a padded request is split) allowed to wait; `queue_bound`
    enabled: bool = True
    max_batch_tokens: int = 0  # padded models: samples x padded length per batch; 0: max_batch_size x 64
    length_buckets: bool = True  # padded models: batch only requests of one length bucket
    min_padding_efficiency: float = 0.85  # padded models, with length_buckets: useful / computed per batch
    # Padded models: lower that floor by the share of a full batch's device time that the batches'
    # measured fixed cost takes (`teacher_server.batch_cost`), and let a batch smaller than that cost
    # take requests that raise its useful share of device time (`BatchRules.admits`); None: for models
    # on an accelerator, where each forward pass has a fixed cost worth batching away. Not on CPU,
    # where the server's own per-request work shares the instances' cores and the fit would count it
    # as the batches' fixed cost.
    cost_aware_floor: bool | None = None
    # Batches finished (host copies awaited, cut, encoded) off the instance's thread; None: where the
    # model runs on an accelerator (the device computes the next batch meanwhile), not on CPU, where
    # the finishing thread would only compete with the instances for the cores.
    async_outputs: bool | None = None
    # Batches an instance may hold formed and not yet answered (staged, computing, being finished);
    # 0: what its device wants (1 on CPU, 2 with asynchronous outputs, one more with a stager: 3 on a
    # GPU). Fewer batches ahead are formed later, from more queued requests, and so fewer and fuller;
    # more keep the device fed through the host's pauses.
    batches_ahead: int = 0

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
        if self.max_queue_delay_us < 0:
            raise ValueError(f"max_queue_delay_us must be >= 0, got {self.max_queue_delay_us}")
        if self.max_queue_size is not None and self.max_queue_size < 1:
            raise ValueError(f"max_queue_size must be >= 1, got {self.max_queue_size}")
        if not 0 <= self.min_padding_efficiency <= 1:
            raise ValueError(f"min_padding_efficiency must be in 0..1, got {self.min_padding_efficiency}")
        if self.batches_ahead < 0:
            raise ValueError(f"batches_ahead must be >= 0 (0: what the device wants), got {self.batches_ahead}")
        if self.max_batch_tokens < 0:
            raise ValueError(f"max_batch_tokens must be >= 0 (0: the default), got {self.max_batch_tokens}")

    @property
    def token_budget(self) -> int:
        """Positions (samples x padded length) a batch of a padded model may compute; a single
        request larger than this still runs, alone."""
        return self.max_batch_tokens or self.max_batch_size * TYPICAL_LENGTH

    def queue_bound(self, padded: bool) -> int:
        """Requests allowed to wait before the batcher sheds: `max_queue_size`, by default
        `QUEUE_SIZE`, or `BY_LENGTH_QUEUE_ROWS` rows for a model (`padded`: it has padded inputs)
        that batches them by length, whose students keep many rows queued on purpose."""
        if self.max_queue_size is not None:
            return self.max_queue_size
        return BY_LENGTH_QUEUE_ROWS if self.by_length(padded) else QUEUE_SIZE

    def by_length(self, padded: bool) -> bool:
        """Whether a model (`padded`: it has padded inputs) has its rows batched by length. Such a
        teacher says so to students (`protos.kserve.BY_LENGTH_PARAMETER`)."""
        return padded and self.enabled and self.length_buckets


class Candidate(Protocol):
    """A queued request as the rules see it."""

    work: Work


T = TypeVar("T", bound=Candidate)


def bucket(length: int | None) -> int:
    """Power-of-two length bucket: 1, 2, 3..4, 5..8, 9..16, ... share a bucket."""
    return (length - 1).bit_length() if length else 0


def compatible(first: Work, other: Work, buckets: bool = True) -> bool:
    if other.shape_key != first.shape_key:
        return False
    return not buckets or bucket(other.length) == bucket(first.length)


class BatchRules:
    """The fit and choice rules of one batcher's batches."""

    def __init__(self, config: BatchingConfig) -> None:
        self.config = config

    def padding_floor(self, fixed_positions: float = 0.0) -> float:
        """The padding-efficiency floor of a batch, given what one more batch costs the device in
        positions (`BatchCost.fixed_positions`). A full batch at the configured floor spends
        `floor x budget / (budget + fixed)` of its device time on useful positions; the position
        floor falls to that, so a batch pads as much more as its fixed cost makes worthwhile."""
        budget = self.config.token_budget
        return self.config.min_padding_efficiency * budget / (budget + max(fixed_positions, 0.0))

    @staticmethod
    def admits(useful: int, computed: int, new_useful: int, new_computed: int, *, floor: float,
               fixed: float = 0.0) -> bool:
        """Whether a request that takes a batch from `useful` / `computed` positions to `new_useful`
        / `new_computed` may join it: the batch keeps its padding efficiency at `floor` or above;
        or, while the batch computes fewer positions than being a batch costs the device (`fixed`,
        in positions: `BatchCost.fixed_positions`), the request raises the batch's useful share of
        its device time, as a short sequence does for a batch of a few others. The benchmarks page
        (docs/benchmarks.md) has what these rules measured."""
        if new_useful >= floor * new_computed:
            return True
        return computed < fixed and new_useful * (computed + fixed) > useful * (new_computed + fixed)

    def fits(self, samples: int, padded_len: int | None) -> bool:
        """A batch of `samples` fits: padded models within the token budget (padded_len given),
        others within max_batch_size."""
        if padded_len is None:
            return samples <= self.config.max_batch_size
        return samples * padded_len <= self.config.token_budget

    def full(self, batch: Sequence[Candidate]) -> bool:
        """Not even one more sample of the batch's padded length would fit."""
        size = sum(p.work.batch_size for p in batch)
        longest = max(p.work.length or 0 for p in batch) if batch[0].work.length is not None else None
        return not self.fits(size + 1, longest)

    def oldest_first(self, batch: Sequence[Candidate], candidates: list[T],
                      floor: float = 0.0, fixed: float = 0.0) -> tuple[list[T], bool]:
        """Candidates in queue order while they fit, passing over those the batch does not admit
        (`admits`: its padding floor, and the fixed cost of a batch in positions); (taken,
        whether one did not fit)."""
        size = sum(p.work.batch_size for p in batch)
        longest = max(p.work.length or 0 for p in batch)
        useful = sum(p.work.tokens for p in batch)
        taken: list[T] = []
        for p in candidates:
            w = p.work
            padded_len = max(longest, w.length or 0)
            if not self.fits(size + w.batch_size, padded_len if w.length is not None else None):
                return taken, True
            grown = (size + w.batch_size) * padded_len
            if floor and w.length is not None and not self.admits(
                    useful, size * longest, useful + w.tokens, grown, floor=floor, fixed=fixed):
                continue
            taken.append(p)
            size, longest, useful = size + w.batch_size, padded_len, useful + w.tokens
        return taken, False

    def closest_lengths(self, batch: Sequence[Candidate], candidates: list[T],
                         floor: float = 0.0, fixed: float = 0.0) -> list[T]:
        """The run of candidates, consecutive in length order, that fills the batch (the next one
        would not fit, or the batch would not admit it: `admits`): the most samples, then the
        highest useful / computed positions; [] when no run fills it.

        Oldest-first mixes short and long requests and pads them all to the longest; a run of
        neighbouring lengths pads far less. The oldest request is batch[0] whatever is chosen,
        so no request waits for more than the batches ahead of it. Two pointers over the
        sorted candidates: the runs' ends only move forward.
        """
        order = sorted(candidates, key=lambda p: p.work.length or 0)
        n = len(order)
        base_size = sum(p.work.batch_size for p in batch)
        base_longest = max(p.work.length or 0 for p in batch)
        base_useful = sum(p.work.tokens for p in batch)
        sizes, useful = [0], [0]
        for p in order:
            sizes.append(sizes[-1] + p.work.batch_size)
            useful.append(useful[-1] + p.work.tokens)
        best: tuple[int, float, int, int] | None = None  # (samples, efficiency, start, end)
        j = 0
        for i in range(n):
            j = max(j, i)
            while j < n:
                samples = base_size + sizes[j + 1] - sizes[i]
                longest = max(base_longest, order[j].work.length or 0)
                if not self.fits(samples, longest):
                    break
                if floor:
                    before = (samples - order[j].work.batch_size) * (
                        max(base_longest, order[j - 1].work.length or 0) if j > i else base_longest)
                    run_useful = base_useful + useful[j + 1] - useful[i]
                    if not self.admits(run_useful - order[j].work.tokens, before, run_useful, samples * longest,
                                       floor=floor, fixed=fixed):
                        break
                j += 1
            total = base_size + sizes[j] - sizes[i]
            padded_len = max(base_longest, order[j - 1].work.length or 0) if j > i else base_longest
            if j == i or (j == n and self.fits(total + 1, padded_len)):
                continue  # empty, or ran out of candidates before the batch was full
            computed = total * padded_len
            efficiency = (base_useful + useful[j] - useful[i]) / computed
            if best is None or (total, efficiency) > best[:2]:
                best = (total, efficiency, i, j)
        if best is None:
            return []
        picked = set(map(id, order[best[2] : best[3]]))
        return [p for p in candidates if id(p) in picked]  # queue order
