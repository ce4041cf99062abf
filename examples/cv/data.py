"""The dataset: scikit-learn's ``load_digits`` (8x8 grayscale digits, 10 classes, 1,797 images).

Why this dataset: it ships inside the scikit-learn wheel, so nothing is downloaded at run time,
and it is small enough that a teacher trains in seconds on two CPU cores.

The train/test split is fixed (``SPLIT_SEED``), whatever seed a training run uses, so every run
is scored on the same 500 test images. Batches are dicts ``{"INPUT": [B,1,8,8] float32 in [0,1],
"label": [B] int64}``: ``INPUT`` is the teacher's input name, so the reader sends that field as is.
"""

from __future__ import annotations

import gzip
import importlib.util
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

SPLIT_SEED = 0
TEST_SIZE = 500
NUM_CLASSES = 10

Batch = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Digits:
    """The fixed split as tensors: images ``[N,1,8,8]`` in ``[0, 1]``, labels ``[N]``."""

    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor


def _digits() -> tuple[np.ndarray, np.ndarray]:
    """``load_digits()``'s ``images`` ``[1797, 8, 8]`` and ``target``, read as it reads them (the CSV
    in scikit-learn's wheel, through ``np.loadtxt``) without importing scikit-learn: its import
    (scipy with it) would be most of the start-up of every process that loads the data, each
    torchrun rank among them. Where the file is not where it ships, ``load_digits`` itself."""
    spec = importlib.util.find_spec("sklearn")
    if spec is None:  # pragma: no cover - an install without the examples extra
        raise ImportError(
            "the CV example needs scikit-learn (its load_digits dataset ships inside the package): "
            "pip install -e '.[examples]'"
        )
    for root in spec.submodule_search_locations or ():
        path = Path(root) / "datasets" / "data" / "digits.csv.gz"
        if path.is_file():
            with gzip.open(path, mode="rt", encoding="utf-8") as f:
                raw = np.loadtxt(f, delimiter=",")
            return raw[:, :-1].reshape(-1, 8, 8), raw[:, -1].astype(int)
    from sklearn.datasets import load_digits  # pragma: no cover - another layout of the package

    digits = load_digits()  # pragma: no cover
    return digits.images, digits.target  # pragma: no cover


def load(test_size: int = TEST_SIZE) -> Digits:
    """Load ``load_digits`` and split it with ``SPLIT_SEED`` (same split on every machine)."""
    images, target = _digits()
    x = torch.tensor(images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(target, dtype=torch.int64)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(SPLIT_SEED))
    test, train = order[:test_size], order[test_size:]
    return Digits(x[train], y[train], x[test], y[test])


def subset(x: torch.Tensor, y: torch.Tensor, size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A class-balanced subset of ``size`` samples (all of them when ``size`` <= 0 or too large).

    Balanced, so that a small labelled budget (e.g. 10 per class) still covers every digit: with a
    plain random draw, some seeds would miss a class and the comparison would measure luck.
    """
    if size <= 0 or size >= len(x):
        return x, y
    g = torch.Generator().manual_seed(seed)
    per_class = max(1, size // NUM_CLASSES)
    picks = []
    for c in range(NUM_CLASSES):
        idx = (y == c).nonzero().flatten()
        picks.append(idx[torch.randperm(len(idx), generator=g)[:per_class]])
    chosen = torch.cat(picks)
    return x[chosen], y[chosen]


def shift(x: torch.Tensor, generator: torch.Generator, max_shift: int = 1) -> torch.Tensor:
    """Translate each image by a random (dy, dx) in ``[-max_shift, max_shift]``, filling with 0.

    The augmentation changes every epoch, which is why the teacher must be *online*: its outputs
    for the shifted images cannot be computed once and cached. That is the mesh's use case.
    """
    if max_shift <= 0:
        return x
    n, _, h, w = x.shape
    m = max_shift
    padded = torch.nn.functional.pad(x, (m, m, m, m))
    dy = torch.randint(0, 2 * m + 1, (n,), generator=generator)
    dx = torch.randint(0, 2 * m + 1, (n,), generator=generator)
    rows = (dy[:, None] + torch.arange(h)[None, :])[:, None, :, None].expand(n, 1, h, w + 2 * m)
    out = padded.gather(2, rows)
    cols = (dx[:, None] + torch.arange(w)[None, :])[:, None, None, :].expand(n, 1, h, w)
    return out.gather(3, cols)


class Batches:
    """A re-iterable loader: each ``iter()`` is one epoch of shuffled, augmented batches.

    Deterministic given ``seed``: epoch ``e`` uses generator ``seed * 1000 + e``, whoever iterates
    it (the reader pulls batches on its own thread; a generator owned by the epoch keeps that
    thread-safe). ``rank``/``world`` give each DDP rank a disjoint slice of every epoch.
    """

    def __init__(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        *,
        batch_size: int,
        seed: int,
        augment: bool = True,
        max_batches: int = 0,
        rank: int = 0,
        world: int = 1,
    ) -> None:
        self.x, self.y = x, y
        self.batch_size = batch_size
        self.seed = seed
        self.augment = augment
        self.max_batches = max_batches
        self.rank, self.world = rank, world
        self.epoch = 0

    def __len__(self) -> int:
        n = (len(self.x) // self.world + self.batch_size - 1) // self.batch_size
        return min(n, self.max_batches) if self.max_batches else n

    def __iter__(self) -> Iterator[Batch]:
        g = torch.Generator().manual_seed(self.seed * 1000 + self.epoch)
        self.epoch += 1
        order = torch.randperm(len(self.x), generator=g)
        per_rank = len(order) // self.world
        order = order[self.rank * per_rank : (self.rank + 1) * per_rank]
        for i, start in enumerate(range(0, len(order), self.batch_size)):
            if self.max_batches and i >= self.max_batches:
                return
            idx = order[start : start + self.batch_size]
            x = shift(self.x[idx], g) if self.augment else self.x[idx]
            yield {"INPUT": x.contiguous(), "label": self.y[idx]}
