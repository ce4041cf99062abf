"""Train the CV student (a tiny MLP) with knowledge distillation from served teachers, or without.

    python -m examples.cv.train_student --distill_teachers 127.0.0.1:9898          # KD, fixed teacher
    python -m examples.cv.train_student --distill_registry etcd://127.0.0.1:2379 \\
        --distill_service cv-teacher                                              # KD, from the registry
    python -m examples.cv.train_student --no_kd                                   # the baseline

Both arms use the same seeds, so they start from the same weights and see the same augmented
batches in the same order; only the loss differs: cross-entropy on the labels (no KD), or
``KDLoss(T, alpha)`` on the labels and the teacher's logits for exactly those shifted images.
``--seeds 0,1,2`` runs several seeds and prints their mean; ``--json`` writes the numbers.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import distill
from examples import common
from examples.common import (
    Source,
    StudentResult,
    fit_student,
    parse_seeds,
    print_result,
    seed_everything,
    summarize,
)
from examples.cv import data
from examples.cv.models import StudentMLP


@dataclass(frozen=True)
class StudentConfig:
    """One student run. The defaults are the setting the README measures.

    A small labelled budget (``train_size`` images, balanced over classes) with shift augmentation:
    an MLP has no built-in translation invariance and 200 labels do not teach it much of one; the
    teacher's soft outputs on the very shifted images it sees do.
    """

    seed: int = 0
    epochs: int = 60
    train_size: int = 200
    batch_size: int = 20
    lr: float = 1e-2
    hidden: int = 64
    temperature: float = 4.0
    alpha: float = 0.1
    augment: bool = True
    max_batches: int = 0  # per epoch; 0 = all (smoke runs use a few)


def reader_source(**reader_options: Any) -> Source:
    """Distil through the mesh: the CV teacher's ``INPUT`` in, ``LOGITS`` out; ``reader_options`` say
    where the teachers are (``teachers=`` or ``registry=`` + ``service=``)."""
    return common.reader_source(inputs=["INPUT"], outputs=["LOGITS"], **reader_options)


def train_student(config: StudentConfig, source: Source | None = None, *, progress: bool = False,
                  on_epoch: Callable[[int, float], None] | None = None) -> StudentResult:
    """Train one ``StudentMLP``; with ``source`` (teacher outputs) it distils, without it it does not.

    ``on_epoch(epoch, test_accuracy)`` is called after every epoch (the demo plots from it).
    """
    cfg = config
    seed_everything(cfg.seed)  # fixes the student's initial weights; the loader seeds its own generators
    digits = data.load()
    x, y = data.subset(digits.train_x, digits.train_y, cfg.train_size, seed=cfg.seed)
    loader = data.Batches(x, y, batch_size=cfg.batch_size, seed=cfg.seed, augment=cfg.augment,
                          max_batches=cfg.max_batches)
    return fit_student(StudentMLP(hidden=cfg.hidden), loader, source, seed=cfg.seed, epochs=cfg.epochs, lr=cfg.lr,
                       temperature=cfg.temperature, alpha=cfg.alpha, input_name="INPUT",
                       test=(digits.test_x, digits.test_y),
                       desc=f"student seed {cfg.seed} ({'KD' if source is not None else 'no KD'})",
                       progress=progress, on_epoch=on_epoch)


def build_parser() -> argparse.ArgumentParser:
    d = StudentConfig()
    p = argparse.ArgumentParser(prog="python -m examples.cv.train_student", description=__doc__.split("\n")[0])
    p.add_argument("--no_kd", action="store_true", help="train on hard labels only (the baseline); no teachers")
    p.add_argument("--seeds", type=parse_seeds, default=[0, 1, 2], help="comma-separated seeds (default: 0,1,2)")
    p.add_argument("--epochs", type=int, default=d.epochs, help="epochs per seed (default: %(default)s)")
    p.add_argument("--train_size", type=int, default=d.train_size,
                   help="labelled training images, balanced over the 10 classes; 0 = all 1,297 (default: %(default)s)")
    p.add_argument("--batch_size", type=int, default=d.batch_size, help="(default: %(default)s)")
    p.add_argument("--lr", type=float, default=d.lr, help="Adam learning rate (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=d.temperature, help="KD temperature T (default: %(default)s)")
    p.add_argument("--alpha", type=float, default=d.alpha,
                   help="weight of the hard-label loss; 1 - alpha weighs the soft term (default: %(default)s)")
    p.add_argument("--no_augment", action="store_true", help="no random shifts")
    p.add_argument("--json", type=Path, default=None, help="write per-seed results and the mean here")
    p.add_argument("--progress", action="store_true", help="tqdm progress bars")
    p.add_argument("--smoke", action="store_true", help="a seconds-long run (1 seed, 2 epochs of 3 batches)")
    distill.add_distill_args(p)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    source: Source | None = None
    if not args.no_kd:
        try:
            source = reader_source(**distill.distill_options_from_args(args))
        except ValueError as e:
            parser.error(f"{e} (or pass --no_kd for the baseline)")
    elif args.distill_teachers or args.distill_registry:
        parser.error("--no_kd trains without teachers; drop --distill_teachers / --distill_registry")
    seeds = [args.seeds[0]] if args.smoke else args.seeds
    label = "KD" if source is not None else "no KD"
    results: list[StudentResult] = []
    for seed in seeds:
        cfg = StudentConfig(
            seed=seed, epochs=2 if args.smoke else args.epochs, train_size=args.train_size,
            batch_size=args.batch_size, lr=args.lr, temperature=args.temperature, alpha=args.alpha,
            augment=not args.no_augment, max_batches=3 if args.smoke else 0,
        )
        results.append(train_student(cfg, source, progress=args.progress))
        print_result(results[-1], label)
    summarize(results, label, args.json, config={k: v for k, v in asdict(cfg).items() if k != "seed"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
