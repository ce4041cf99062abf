"""Train the NLP teacher (a 2-layer transformer encoder) on 20,000 generated sentences; cache it.

    python -m examples.nlp.train_teacher            # ~25 s on 2 CPU cores, ~99% test accuracy
    python -m examples.nlp.train_teacher --smoke    # a few batches, for tests

The teacher gets a generous budget (20,000 labelled sentences), the student later only 600: the
usual situation where distillation pays (a big model trained once, many small ones from it).
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
from examples.nlp import data
from examples.nlp.models import TransformerTeacher, parameter_count
from examples.nlp.teacher import FILES, weights_path


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
    epochs: int = 5,
    sentences: int = 20_000,
    seed: int = 0,
    batch_size: int = 64,
    lr: float = 2e-3,
    max_batches: int = 0,
    progress: bool = True,
) -> TeacherResult:
    """AdamW with a one-cycle schedule (10% warm-up); saves the state dict and a JSON summary."""
    seed_everything(seed)
    train, test = data.teacher_set(sentences), data.test_set()
    model = TransformerTeacher()
    loader = data.Batches(train, batch_size=batch_size, seed=seed, max_batches=max_batches)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=max(1, epochs * len(loader)),
                                                pct_start=0.1)
    loss_fn = nn.CrossEntropyLoss()
    bar = progress_bar(epochs, "teacher", progress)
    started = time.perf_counter()
    for _ in range(epochs):
        model.train()
        for batch in loader:
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model(batch["TOKENS"]), batch["label"])
            loss.backward()
            opt.step()
            sched.step()
        if bar is not None:
            bar.set_postfix(loss=f"{loss.item():.3f}", test_acc=f"{accuracy(model, test.tokens, test.labels):.3f}")
            bar.update()
    if bar is not None:
        bar.close()
    seconds = time.perf_counter() - started
    acc = accuracy(model.eval(), test.tokens, test.labels)
    FILES.save(model, out, {"test_accuracy": acc, "epochs": epochs, "sentences": sentences, "seed": seed,
                            "seconds": round(seconds, 2), "parameters": parameter_count(model),
                            "model": "TransformerTeacher"})
    return TeacherResult(out, acc, epochs, seconds)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m examples.nlp.train_teacher", description=__doc__.split("\n")[0])
    p.add_argument("--epochs", type=int, default=5, help="(default: %(default)s)")
    p.add_argument("--sentences", type=int, default=20_000, help="training sentences (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="initialisation and data order (default: %(default)s)")
    p.add_argument("--out", type=Path, default=None, help=f"weights file (default: {weights_path()})")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--smoke", action="store_true", help="a seconds-long run (1 epoch of 5 batches), for tests")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    out = args.out or weights_path()
    epochs, max_batches = (1, 5) if args.smoke else (args.epochs, 0)
    print(f"training the NLP teacher (TransformerTeacher, {parameter_count(TransformerTeacher()):,} parameters) "
          f"for {epochs} epoch(s) on {args.sentences:,} generated sentences...")
    result = train_teacher(out, epochs=epochs, sentences=args.sentences, seed=args.seed, max_batches=max_batches,
                           progress=not (args.no_progress or args.smoke))
    print(f"teacher test accuracy {result.test_accuracy:.4f} after {result.epochs} epoch(s), "
          f"{result.seconds:.1f} s; weights: {result.weights}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
