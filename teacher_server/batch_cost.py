"""What a batch of a padded model costs its device: a fixed part and a part per computed position,
fitted from the batches the server has run.

The padding floor (`BatchingConfig.min_padding_efficiency`) trades padding against forward passes.
Counted in positions alone it assumes a pass costs nothing beyond them, but a GPU pays tens of
milliseconds a forward pass whatever its size (launches, synchronisation, the host between
batches). Where too few short sequences are queued at once to fill the token budget at the floor,
the server then runs many small batches, each paying that fixed cost. `BatchCost` measures the two
parts, and the batcher lowers the floor by the share of a full
batch's time the fixed part takes (`BatchRules.padding_floor`) and lets a batch still smaller than
its fixed cost is worth take any request that raises its useful share of device time
(`BatchRules.admits`), so a device with a large fixed cost runs fewer, fuller batches, and one
without keeps the floor as set.

The fit is robust, not least squares: a warm-up batch (cuDNN/cuBLAS set-up, a first allocation)
or a pause of the host would otherwise tilt it for a whole window. Theil-Sen: the slope is the
median of the slopes between pairs of batches of clearly different sizes, the intercept the median
of what each batch leaves over that slope.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

import numpy as np

WINDOW = 64
"""Batches the fit keeps (seconds of a busy GPU), so it follows a changed device (another instance
started, memory grown tight) without being swayed by one batch."""

MIN_BATCHES = 12
"""Batches needed before the fit is used; until then the floor is the configured one."""

MIN_SPREAD = 1.25
"""Two batches enter the slope only if one computed at least this many times the other's positions:
pairs of nearly equal size give slopes that are mostly noise."""

REFIT_EVERY = 4
"""Batches between fits (a fit of 64 batches takes tens of microseconds, on the event loop)."""


@dataclass(frozen=True)
class CostFit:
    """seconds(batch) ~ fixed_s + per_position_s x computed positions."""

    fixed_s: float
    per_position_s: float
    batches: int

    @property
    def fixed_positions(self) -> float:
        """The fixed cost in positions' worth of device time: how many more positions a batch
        could compute for what being one more batch costs."""
        return self.fixed_s / self.per_position_s if self.per_position_s > 0 else 0.0


@dataclass(frozen=True)
class BatchCostFigures:
    """A padded model's fitted batch cost (zeros until known) and the padding floor in use, for the metrics."""

    fixed_s: float
    per_position_s: float
    padding_floor: float


class BatchCost:
    """The running fit of one batcher's batches (all its instances: they share the device)."""

    def __init__(self, window: int = WINDOW, min_batches: int = MIN_BATCHES) -> None:
        if min_batches < 2 or window < min_batches:
            raise ValueError(f"need window >= min_batches >= 2, got window={window}, min_batches={min_batches}")
        self._min_batches = min_batches
        self._positions: collections.deque[int] = collections.deque(maxlen=window)
        self._seconds: collections.deque[float] = collections.deque(maxlen=window)
        self._since_fit = 0
        self._fit: CostFit | None = None

    def observe(self, positions: int, seconds: float) -> None:
        """One batch ran: it computed `positions` (padding included) and held the device for
        `seconds` that no earlier batch on the device held (`BatchResult.device_ns`)."""
        if positions <= 0 or seconds <= 0:
            return
        self._positions.append(positions)
        self._seconds.append(seconds)
        self._since_fit += 1
        if len(self._positions) >= self._min_batches and (self._fit is None or self._since_fit >= REFIT_EVERY):
            self._since_fit = 0
            self._fit = fit(np.asarray(self._positions, dtype=np.float64),
                            np.asarray(self._seconds, dtype=np.float64)) or self._fit

    @property
    def current(self) -> CostFit | None:
        """The last fit; None until enough batches of different sizes have run."""
        return self._fit

    @property
    def fixed_positions(self) -> float:
        """The fixed cost of a batch in positions (0 until it is known, or if the fit finds none)."""
        return self._fit.fixed_positions if self._fit is not None else 0.0


def fit(positions: np.ndarray, seconds: np.ndarray) -> CostFit | None:
    """Theil-Sen fit of seconds against positions; None when the batches' sizes are too alike to
    tell the parts apart or the slope is not positive. A negative intercept (a device faster per
    position on large batches than on small ones) counts as no fixed cost."""
    i, j = np.triu_indices(len(positions), k=1)
    lo, hi = np.minimum(positions[i], positions[j]), np.maximum(positions[i], positions[j])
    keep = hi >= MIN_SPREAD * lo
    if np.count_nonzero(keep) < len(positions):
        return None
    i, j = i[keep], j[keep]
    slope = float(np.median((seconds[j] - seconds[i]) / (positions[j] - positions[i])))
    if not slope > 0:
        return None
    intercept = float(np.median(seconds - slope * positions))
    return CostFit(max(intercept, 0.0), slope, len(positions))
