"""The LLM example's student side: where the teacher's top-k comes from, and one KD training step.

The seam is ``TargetSource``: given the student's loader, it yields ``(batch, targets)`` pairs,
``targets`` the teacher's top-k for every position of the batch (``SparseTargets`` ``[B, T, k]``)
or None (no KD, or no teacher answered, which ``TokenKDLoss`` turns into the plain hard-label
loss). Three sources fit it and the training loop does not know which one it has:

* ``ReaderTeacher``: the mesh. ``distill.DistillReader`` iterates the loader, asks the teacher
  servers (or, offline, a teacher-output store) for each batch's top-k, and the outputs become
  ``SparseTargets``. The default.
* ``InProcessTeacher``: the teacher model in this process (the reference the mesh is checked
  against; also a ``TeacherFn`` for the ``Trainer`` example, which asks per batch).
* ``NoTeacher``: the no-KD baseline.

What a teacher sends per position is the same in every source: ``k`` log-probabilities as
float16 and their ``k`` token ids as int32, plus the tail mass (the probability outside the
top-k), computed on the teacher's device as ``topk(log_softmax(logits / T))`` over the full
vocabulary, the only place the temperature is exact.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from distill.losses import SparseTargets, TokenKDLoss

Batch = dict[str, Tensor]
TeacherFn = Callable[[Batch], SparseTargets | None]
"""A per-batch teacher: a padded batch in, the teacher's top-k per position out (or None)."""

OUTPUT = "LOGITS"
"""The teacher's per-position logits, as the teacher server declares a served causal LM."""


class TargetSource(Protocol):
    """Where a training run's teacher targets come from (see the module docstring)."""

    name: str

    def pairs(self, loader: Iterable[Batch]) -> Iterator[tuple[Batch, SparseTargets | None]]:
        """Each batch of one pass over ``loader``, in order, with its targets (None: none)."""
        ...

WIRE_VALUE_DTYPE = torch.float16
WIRE_INDEX_DTYPE = torch.int32


def bytes_per_token(vocab_size: int, k: int) -> dict[str, int]:
    """Teacher bytes on the wire per token: full vocabulary in float32, vs top-k float16 values + int32 ids.

    The top-k figure includes the float16 tail mass (one value per position).
    """
    itemsize_v = torch.tensor([], dtype=WIRE_VALUE_DTYPE).element_size()
    itemsize_i = torch.tensor([], dtype=WIRE_INDEX_DTYPE).element_size()
    return {"full_fp32": vocab_size * 4, "topk_fp16_int32": k * (itemsize_v + itemsize_i) + itemsize_v}


@torch.no_grad()
def teacher_topk(teacher: nn.Module, batch: dict[str, Tensor], *, k: int, temperature: float = 1.0) -> SparseTargets:
    """The teacher's top-k log-probabilities at ``temperature`` for every position, in wire dtypes.

    Runs on the teacher's device; the result comes back on the batch's device, values float16 and
    ids int32 as the mesh ships them (so the in-process numbers are those a served teacher gives).
    """
    device = next(teacher.parameters()).device
    logits = teacher(input_ids=batch["input_ids"].to(device), attention_mask=batch["attention_mask"].to(device)).logits
    logprobs = torch.log_softmax(logits.float() / temperature, dim=-1)
    values, indices = logprobs.topk(k, dim=-1)
    tail = (1.0 - values.exp().sum(-1)).clamp_min(0.0)
    out = batch["input_ids"].device
    return SparseTargets(values.to(out, WIRE_VALUE_DTYPE), indices.to(out, WIRE_INDEX_DTYPE),
                         tail=tail.to(out, WIRE_VALUE_DTYPE), kind="logprobs")


class NoTeacher:
    """The no-KD baseline: every batch with no targets."""

    name = "none"

    def pairs(self, loader: Iterable[Batch]) -> Iterator[tuple[Batch, SparseTargets | None]]:
        for batch in loader:
            yield batch, None


def targets_from_outputs(outputs: Mapping[str, Tensor] | None, output: str = OUTPUT) -> SparseTargets | None:
    """A reader's top-k outputs (``<OUT>_TOPK_VALUES / _INDICES / _TAIL``) as ``SparseTargets``.

    None stays None (a batch no teacher answered, with ``fallback="hard_labels"``). The values are
    log-probabilities: the reader asks for them (``logprobs=True``) rather than trusting a server's default.
    """
    if outputs is None:
        return None
    return SparseTargets(outputs[f"{output}_TOPK_VALUES"], outputs[f"{output}_TOPK_INDICES"],
                         tail=outputs.get(f"{output}_TOPK_TAIL"), kind="logprobs")


class ReaderTeacher:
    """Targets through ``distill.DistillReader``: teacher servers (``teachers=``) or a
    teacher-output store alone (``cache=``, ``cache_mode="read"``); ``options`` are its keywords.

    One reader per pass (``pairs`` call), closed when the pass ends or the consumer stops early.
    """

    def __init__(self, name: str, options: Mapping[str, Any]) -> None:
        self.name = name
        self.options = dict(options)

    def pairs(self, loader: Iterable[Batch]) -> Iterator[tuple[Batch, SparseTargets | None]]:
        from distill import DistillReader

        with DistillReader(loader, **self.options) as reader:
            for batch, outputs in reader:
                yield batch, targets_from_outputs(outputs)


class InProcessTeacher:
    """The teacher model in this process: a ``TeacherFn`` and a ``TargetSource`` (the reference)."""

    name = "inprocess"

    def __init__(self, teacher: nn.Module, *, k: int = 16, temperature: float = 1.0) -> None:
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        self.teacher = teacher.eval()
        self.k = k
        self.temperature = temperature

    def __call__(self, batch: Batch) -> SparseTargets:
        return teacher_topk(self.teacher, batch, k=self.k, temperature=self.temperature)

    def pairs(self, loader: Iterable[Batch]) -> Iterator[tuple[Batch, SparseTargets | None]]:
        for batch in loader:
            yield batch, self(batch)


def shift(targets: SparseTargets) -> SparseTargets:
    """Targets of positions ``0..T-2`` (the ones with a next token), aligned with shifted labels."""
    tail = None if targets.tail is None else targets.tail[:, :-1]
    return SparseTargets(targets.values[:, :-1], targets.indices[:, :-1], tail=tail, kind=targets.kind)


def kd_loss(loss_fn: TokenKDLoss, student_logits: Tensor, targets: SparseTargets | None,
            batch: dict[str, Tensor]) -> Tensor:
    """``TokenKDLoss`` for next-token prediction: logits at ``t`` against the label at ``t + 1``.

    ``targets`` None (no KD, or no teacher answered) gives the plain next-token cross-entropy.
    """
    labels = batch["labels"][:, 1:].to(student_logits.device)
    mask = batch["attention_mask"][:, 1:].to(student_logits.device)
    teacher = None if targets is None else shift(targets)
    return loss_fn(student_logits[:, :-1], teacher, labels=labels, attention_mask=mask)
