"""The same student loop inside a Hugging Face ``Trainer``: only ``compute_loss`` is overridden.

    python -m examples.llm.hf_trainer --smoke       # needs `accelerate` (transformers.Trainer requires it)
    python -m examples.llm.hf_trainer --steps 100

``DistillTrainer.compute_loss`` asks the teacher function (``examples.llm.student.TeacherFn``:
in process today, the mesh's reader later) for the batch's top-k log-probabilities and returns
``TokenKDLoss`` on the student's logits; everything else (optimizer, schedule, logging, device
placement, checkpoints) is the stock ``Trainer``. The data is the example's ``Collator`` over the
tokenized sequences, so padding is masked exactly as in ``train_student``.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset
from transformers import Trainer, TrainingArguments

from distill.losses import TokenKDLoss
from examples.common import cache_dir, write_json
from examples.llm import models
from examples.llm.common import evaluate, load_splits, quiet, use_all_cores
from examples.llm.data import Collator
from examples.llm.student import InProcessTeacher, TeacherFn, kd_loss
from examples.llm.tokenizer import load_tokenizer


class SequenceDataset(Dataset[dict[str, list[int]]]):
    """Token sequences as ``{"input_ids": [...]}`` items (what ``Trainer`` hands to its collator)."""

    def __init__(self, sequences: list[list[int]]) -> None:
        self.sequences = sequences

    def __len__(self) -> int:
        return len(self.sequences)

    def __getitem__(self, i: int) -> dict[str, list[int]]:
        return {"input_ids": self.sequences[i]}


class DistillTrainer(Trainer):
    """A ``Trainer`` whose loss is ``TokenKDLoss`` against the teacher function's top-k targets."""

    def __init__(self, *args: Any, teacher: TeacherFn | None, kd: TokenKDLoss, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.teacher = teacher
        self.kd = kd

    def compute_loss(
        self, model: nn.Module, inputs: dict[str, Any], return_outputs: bool = False,
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> Any:
        targets = self.teacher(inputs) if self.teacher is not None else None
        outputs = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"])
        loss = kd_loss(self.kd, outputs.logits, targets, inputs)
        return (loss, outputs) if return_outputs else loss


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m examples.llm.hf_trainer", description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=100, help="optimizer steps (default: %(default)s)")
    p.add_argument("--k", type=int, default=16, help="teacher top-k per position (default: %(default)s)")
    p.add_argument("--alpha", type=float, default=0.5, help="hard-label weight (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed (default: %(default)s)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: one per core)")
    p.add_argument("--teacher", type=Path, default=None, help="teacher directory (default: the cache's llm/teacher)")
    p.add_argument("--out", type=Path, default=None, help="results JSON (default: <cache>/llm/hf_trainer.json)")
    p.add_argument("--smoke", action="store_true", help="smoke teacher and student, 15 steps, for tests")
    args = p.parse_args(argv)
    quiet()
    use_all_cores(args.threads or (1 if args.smoke else 0))
    try:
        import accelerate  # noqa: F401
    except ImportError:
        print("transformers.Trainer needs the `accelerate` package: pip install accelerate", file=sys.stderr)
        return 2
    teacher_path = args.teacher or models.teacher_dir(smoke=args.smoke)
    teacher_model = models.load_teacher(teacher_path)
    tok = load_tokenizer(teacher_path)
    seq_len = int(teacher_model.config.max_position_embeddings)
    splits = load_splits(tok, seq_len, smoke=args.smoke)
    pad_id = int(tok.pad_token_id)
    steps = 15 if args.smoke else args.steps
    torch.manual_seed(args.seed)
    student = models.build("student-smoke" if args.smoke else "student", len(tok), max_len=seq_len,
                           pad_token_id=pad_id)
    with tempfile.TemporaryDirectory(prefix="distill-llm-trainer-") as tmp:
        training_args = TrainingArguments(
            output_dir=tmp, max_steps=steps, per_device_train_batch_size=8 if args.smoke else 16,
            learning_rate=3e-3, lr_scheduler_type="cosine", warmup_steps=max(1, steps // 20), weight_decay=0.01,
            logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=args.seed,
            remove_unused_columns=False, disable_tqdm=True, dataloader_num_workers=0,
        )
        trainer = DistillTrainer(
            model=student, args=training_args, train_dataset=SequenceDataset(splits.train),
            data_collator=Collator(pad_id), teacher=InProcessTeacher(teacher_model, k=args.k),
            kd=TokenKDLoss(alpha=args.alpha),
        )
        trainer.train()
        losses = [float(e["loss"]) for e in trainer.state.log_history if "loss" in e]
    window = max(1, min(5, len(losses) // 4))
    first, last = sum(losses[:window]) / window, sum(losses[-window:]) / window
    m = evaluate(student, splits.eval_subset(16 if args.smoke else 256), pad_id)
    print(f"Trainer + TokenKDLoss: train loss {first:.3f} -> {last:.3f} in {steps} steps; held-out perplexity "
          f"{m.perplexity:.2f}, next-token accuracy {m.accuracy:.4f}")
    out = args.out or cache_dir() / "llm" / "hf_trainer.json"
    write_json(out, {"first_loss": first, "last_loss": last, "steps": steps, "perplexity": m.perplexity,
                     "accuracy": m.accuracy, "finite": all(math.isfinite(x) for x in losses)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
