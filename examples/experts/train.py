"""Training on reference answers and the held-out measure shared by teachers and students.

``fit`` is the whole training loop of every run: ``steps`` batches, AdamW at a constant rate
after a linear warm-up, gradients clipped at 1. What differs between runs is the loss of a step
(``StepLoss``): cross-entropy on the reference answers, or a distillation loss on the teachers'
outputs. ``accuracy`` is the exact match of greedy answers on held-out problems, per task.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from examples.experts.models import greedy
from examples.experts.tasks import MAX_LEN, TASKS, decode, draw, encode

StepLoss = Callable[[nn.Module, Any], Tensor]
"""The loss of one step: given the model and the step's item (a batch, or a batch with its targets)."""

WARMUP = 50


def answer_ce(model: nn.Module, b: dict[str, Tensor]) -> Tensor:
    """Cross-entropy of the reference answer (and its ``<eos>``) given the prompt."""
    logits = model(b["input_ids"])
    return F.cross_entropy(logits.flatten(0, 1), b["labels"].flatten(), ignore_index=-100)


def fit(model: nn.Module, items: Iterable[Any], loss: StepLoss, *, lr: float) -> list[float]:
    """One pass over ``items``, one optimizer step each; returns the losses."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / WARMUP))
    model.train()
    losses: list[float] = []
    for item in items:
        value = loss(model, item)
        opt.zero_grad(set_to_none=True)
        value.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(float(value.detach()))
    return losses


def held_out(n: int, seed: int = 12345) -> dict[str, list]:
    """``n`` held-out problems per task, the same for every run."""
    rng = random.Random(seed)
    return {t: draw(t, n, rng, held_out=True) for t in TASKS}


def accuracy(model: nn.Module, problems: dict[str, list]) -> dict[str, float]:
    """Per task, the share of problems whose greedy answer (up to ``<eos>``) is exactly the reference."""
    result: dict[str, float] = {}
    for task, ps in problems.items():
        answers = greedy(model, [encode(p.prompt) for p in ps], MAX_LEN)
        result[task] = sum(decode(a) == p.answer for a, p in zip(answers, ps, strict=True)) / len(ps)
    return result
