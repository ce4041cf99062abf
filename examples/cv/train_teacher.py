"""Train the CV teacher (a CNN) on all training digits and save its weights in the cache.

    python -m examples.cv.train_teacher            # ~10 s on 2 CPU cores, ~98.6% test accuracy
    python -m examples.cv.train_teacher --smoke    # one short epoch, for tests

The weights go to ``examples.cv.teacher.weights_path()`` (or ``--out``), with a JSON summary
beside them; ``examples.cv.teacher:build`` serves them.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from examples.common import accuracy, progress_bar, seed_everything
from examples.cv import data
from examples.cv.models import TeacherCNN, parameter_count
from examples.cv.teacher import FILES, weights_path


@dataclass(frozen=True)
class TeacherResult:
    """What a teacher training run produced."""

    weights: Path
    test_accuracy: float
    epochs: int
    seconds: float


def train_teacher(
    out: Path,
    *,
    epochs: int = 15,
    seed: int = 0,
    batch_size: int = 64,
    lr: float = 3e-3,
    max_batches: int = 0,
    progress: bool = True,
) -> TeacherResult:
    """Train ``TeacherCNN`` with shift augmentation (Adam, cosine schedule); save weights + summary."""
    seed_everything(seed)
    digits = data.load()
    model = TeacherCNN()
    loader = data.Batches(digits.train_x, digits.train_y, batch_size=batch_size, seed=seed, max_batches=max_batches)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(1, epochs * len(loader)))
    loss_fn = nn.CrossEntropyLoss()
    started = time.perf_counter()
    bar = progress_bar(epochs, "teacher", progress)
    for _ in range(epochs):
        model.train()
        for batch in loader:
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model(batch["INPUT"]), batch["label"])
            loss.backward()
            opt.step()
            sched.step()
        acc = accuracy(model, digits.test_x, digits.test_y)
        if bar is not None:
            bar.set_postfix(loss=f"{loss.item():.3f}", test_acc=f"{acc:.3f}")
            bar.update()
    if bar is not None:
        bar.close()
    seconds = time.perf_counter() - started
    acc = accuracy(model.eval(), digits.test_x, digits.test_y)
    FILES.save(model, out, {"test_accuracy": acc, "epochs": epochs, "seed": seed, "seconds": round(seconds, 2),
                            "parameters": parameter_count(model), "model": "TeacherCNN"})
    return TeacherResult(out, acc, epochs, seconds)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m examples.cv.train_teacher", description=__doc__.split("\n")[0])
    p.add_argument("--epochs", type=int, default=15, help="training epochs (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed for initialisation and data order (default: 0)")
    p.add_argument("--out", type=Path, default=None, help=f"weights file (default: {weights_path()})")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--smoke", action="store_true", help="a seconds-long run (1 epoch of 5 batches), for tests")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    out = args.out or weights_path()
    epochs, max_batches = (1, 5) if args.smoke else (args.epochs, 0)
    print(f"training the CV teacher (TeacherCNN, {parameter_count(TeacherCNN()):,} parameters) "
          f"for {epochs} epoch(s) on load_digits...")
    result = train_teacher(out, epochs=epochs, seed=args.seed, max_batches=max_batches,
                           progress=not (args.no_progress or args.smoke))
    print(f"teacher test accuracy {result.test_accuracy:.4f} after {result.epochs} epoch(s), "
          f"{result.seconds:.1f} s; weights: {result.weights}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
