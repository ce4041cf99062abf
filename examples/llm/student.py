"""The LLM example's student side: the teacher's top-k log-probabilities, and one KD training step.

The seam: the student loop takes its teacher as a function ``TeacherFn``,
``batch -> SparseTargets | None``, the teacher's top-k for every position of the batch
(``[B, T, k]``). Today that function is ``InProcessTeacher``: the teacher model runs in this process
on its device. When the teacher server serves Hugging Face models and padded variable-length
batches, a function backed by ``distill.DistillReader`` (the mesh) replaces it, with no change to
the loop: it returns the same ``SparseTargets`` (or None when no teacher answered in time, which
``TokenKDLoss`` turns into the plain hard-label loss).

What the mesh will send per position is exactly what ``InProcessTeacher`` produces: ``k``
log-probabilities as float16 and their ``k`` token ids as int32, plus the tail mass (the
probability outside the top-k); the values are computed on the teacher's device as
``topk(log_softmax(logits / T))``, over the full vocabulary, the only place the temperature is
exact.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from distill.losses import SparseTargets, TokenKDLoss

TeacherFn = Callable[[dict[str, Tensor]], SparseTargets | None]
"""The student loop's teacher: a padded batch in, the teacher's top-k per position out (or None)."""

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


class InProcessTeacher:
    """A ``TeacherFn`` running the teacher model in this process (to be replaced by the mesh's reader)."""

    def __init__(self, teacher: nn.Module, *, k: int = 16, temperature: float = 1.0) -> None:
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        self.teacher = teacher.eval()
        self.k = k
        self.temperature = temperature

    def __call__(self, batch: dict[str, Tensor]) -> SparseTargets:
        return teacher_topk(self.teacher, batch, k=self.k, temperature=self.temperature)


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
