"""Classifier-style distillation: ``KDLoss`` on ``[N, C]`` logits, one row per sample.

Per-token losses over ``[B, T, V]`` live in ``distill.losses.token``. Conventions, in one place so
that every function below agrees with them:

* The soft term is ``T² · KL(p_T ‖ q_T)``, where ``p_T`` is the teacher's distribution at
  temperature ``T`` and ``q_T = softmax(student / T)``. The ``T²`` keeps the soft term's gradient
  on the same scale as the hard term's as ``T`` changes (Hinton et al., 2015): the gradient of the
  KL w.r.t. the student logits shrinks as ``1/T²``. It multiplies the soft term only; the
  cross-entropy on hard labels is always computed at ``T = 1``.
* ``KDLoss`` mixes the two as ``alpha · CE + (1 - alpha) · T² · KL``: ``alpha = 1`` is plain
  supervised training, ``alpha = 0`` pure distillation.
* Reductions follow ``torch.nn.functional.kl_div``'s ``"batchmean"``: the per-sample loss (the KL
  summed over classes; the CE of that sample) is averaged over the batch. ``"sum"`` sums it and
  ``"none"`` returns the per-sample vector. Torch's ``"mean"`` (divide by ``N·C``) is refused:
  it silently shrinks the loss by the class count and is not the KL divergence.
* Logits are ``[N, C]`` (class dimension last). Arithmetic runs in at least float32: teachers may
  send fp16/bf16 logits over the wire and their ``exp`` overflows or loses mass in half precision.
  The result is float32 (float64 if the student is float64).
* Teacher outputs are treated as constants: they are detached and moved to the student's device,
  so gradients reach the student logits only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeAlias

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from distill.losses._common import (
    Reduction,
    _check_reduction,
    _check_temperature,
    _compute,
    _compute_dtype,
    _kept_rows,
    _number,
    _reduce,
)
from distill.losses._divergence import sparse_rows
from distill.losses.sparse import SparseTargets

__all__ = [
    "KDLoss",
    "TeacherTargets",
    "average_teachers",
    "kd_kl_div",
    "soft_targets",
]

TeacherTargets: TypeAlias = Tensor | SparseTargets | Sequence[Tensor | SparseTargets] | None
"""What ``KDLoss`` accepts as the teacher: logits, top-k targets, several of those, or None."""


def _check_student(student_logits: Tensor) -> None:
    if student_logits.dim() != 2:
        raise ValueError(f"student logits must have shape [N, C], got {tuple(student_logits.shape)}")
    if not student_logits.is_floating_point():
        raise ValueError(f"student logits must be floating point, got {student_logits.dtype}")


def _check_same_shape(student_logits: Tensor, teacher: Tensor, what: str = "teacher logits") -> None:
    if teacher.shape != student_logits.shape:
        raise ValueError(
            f"student logits {tuple(student_logits.shape)} and {what} {tuple(teacher.shape)} "
            "must have the same shape [N, C]"
        )


def _check_sparse(student_logits: Tensor, targets: SparseTargets) -> None:
    n, c = student_logits.shape
    if targets.values.dim() != 2 or targets.shape[0] != n or targets.k > c:
        raise ValueError(
            f"student logits {tuple(student_logits.shape)} and sparse teacher targets "
            f"{tuple(targets.shape)} do not fit: need [N, k] with the same N and k <= C "
            "(per-token targets go to TokenKDLoss)"
        )


def soft_targets(teacher_logits: Tensor, temperature: float) -> Tensor:
    """The teacher's softened distribution ``softmax(teacher_logits / T)`` as a constant.

    Detached and in at least float32, so half-precision logits from the wire neither overflow nor
    carry gradients back into anything.
    """
    _check_temperature(temperature)
    return torch.softmax(_compute(teacher_logits.detach()) / temperature, dim=-1)


def average_teachers(outputs: Sequence[Tensor]) -> Tensor:
    """The mean of several teachers' logits (float32 or wider), for users who want logit averaging.

    ``KDLoss`` given a list of teachers averages their *probabilities* instead (see ``KDLoss``);
    pass ``average_teachers(outputs)`` as a single teacher to distil from the averaged logits,
    i.e. the normalised geometric mean of the teachers' distributions.
    """
    if isinstance(outputs, Tensor) or len(outputs) == 0:
        raise ValueError("average_teachers needs a non-empty sequence of logit tensors")
    first = outputs[0]
    for i, t in enumerate(outputs[1:], start=1):
        if t.shape != first.shape:
            raise ValueError(
                f"teacher 0 logits {tuple(first.shape)} and teacher {i} logits {tuple(t.shape)} "
                "must have the same shape"
            )
    dtype = _compute_dtype(first.dtype)
    return torch.stack([t.detach().to(device=first.device, dtype=dtype) for t in outputs]).mean(dim=0)


def kd_kl_div(
    student_logits: Tensor,
    teacher_probs: Tensor,
    temperature: float,
    reduction: Reduction = "batchmean",
) -> Tensor:
    """The distillation soft term ``T² · KL(teacher_probs ‖ softmax(student_logits / T))``.

    ``teacher_probs`` is a distribution over the same ``[N, C]`` classes (already at temperature
    ``T``, e.g. from ``soft_targets``); zeros are allowed and contribute nothing (``0 · log 0 = 0``),
    which is what makes top-k and averaged targets exact. The ``T²`` is included because this is
    the KD term, not a bare KL; divide by ``T²`` for the plain divergence.
    """
    _check_temperature(temperature)
    _check_reduction(reduction)
    _check_student(student_logits)
    _check_same_shape(student_logits, teacher_probs, "teacher probabilities")
    s = _compute(student_logits)
    p = _compute(teacher_probs.detach(), like=s)
    log_q = torch.log_softmax(s / temperature, dim=-1)
    per_sample = (torch.xlogy(p, p) - p * log_q).sum(dim=-1)
    return _reduce(per_sample, reduction) * (temperature * temperature)


def _sparse_kd(student_logits: Tensor, targets: SparseTargets, temperature: float, reduction: str) -> Tensor:
    per_sample = sparse_rows(_compute(student_logits), targets, temperature, beta=0.0)
    return _reduce(per_sample, reduction) * (temperature * temperature)


class KDLoss(nn.Module):
    """``alpha · CE(student, labels) + (1 - alpha) · T² · KL(p_T ‖ q_T)`` as one module.

    ``forward(student_logits, teacher, labels=None)`` accepts as ``teacher``:

    * a ``[N, C]`` tensor of teacher logits (any float dtype; computed in float32 or wider);
    * a ``SparseTargets`` of top-k logits or log-probabilities, with or without a tail bin
      (conventions in ``SparseTargets``; log-probabilities are used as sent, ``T`` then softens
      the student only);
    * a list/tuple of those, one per teacher: the targets are the *average of the teachers'
      softened probabilities* ``mean_i softmax(t_i / T)`` (sparse teachers count as zero off
      their support; a sparse teacher with a tail cannot be averaged, its tail has no class
      ids). A probability average is the ensemble's predictive distribution: every
      class any teacher finds plausible keeps mass, and a teacher whose logits happen to have a
      larger scale does not dominate. Averaging logits instead gives the normalised geometric
      mean, which is sharper where teachers agree and can suppress a class one teacher is sure of;
      pass ``average_teachers(outputs)`` as a single teacher if that is what you want;
    * ``None``: the reader's ``fallback="hard_labels"`` yields batches without teacher outputs
      when no teacher is reachable; the loss is then the plain cross-entropy, *not* scaled by
      ``alpha``, so those batches still train at full strength (with ``alpha = 0`` a weighted CE
      would be zero). ``labels`` are required in that case.

    ``labels`` (``[N]`` class ids) are needed when ``alpha > 0`` or the teacher is None; with
    ``alpha = 1`` the teacher is shape-checked but not used.

    ``valid`` (``[N]`` bool, the reader's ``teacher["VALID_ROWS"]`` with ``nonfinite="mask"``)
    leaves the rows it marks False out of the soft term: their teacher values (inf, NaN) are never
    read, the soft term's mean is over the valid rows (``"none"``: 0 at the others), and with no
    valid row it is 0, not NaN. The hard term counts every row, as without it.

    Args:
        temperature: ``T > 0``; softens both distributions in the soft term only.
        alpha: weight of the hard-label CE in ``[0, 1]``; ``1 - alpha`` weighs the soft term.
        reduction: ``"batchmean"`` (default), ``"sum"`` or ``"none"`` (per-sample losses).
    """

    def __init__(self, temperature: float = 4.0, alpha: float = 0.5, reduction: Reduction = "batchmean"):
        super().__init__()
        t = _check_temperature(temperature)
        a = _number("alpha", alpha)
        if not 0.0 <= a <= 1.0:
            raise ValueError(f"alpha (the hard-label weight) must be in [0, 1], got {alpha!r}")
        _check_reduction(reduction)
        self.temperature = t
        self.alpha = a
        self.reduction: Reduction = reduction

    def extra_repr(self) -> str:
        return f"temperature={self.temperature}, alpha={self.alpha}, reduction={self.reduction!r}"

    def forward(self, student_logits: Tensor, teacher: TeacherTargets, labels: Tensor | None = None,
                valid: Tensor | None = None) -> Tensor:
        _check_student(student_logits)
        teachers = self._teacher_list(student_logits, teacher)
        keep = _kept_rows(valid, student_logits.shape[0], "the student logits")
        if teachers is None:
            if labels is None:
                raise ValueError(
                    "KDLoss got no teacher outputs (teacher=None, the hard-label fallback) and no labels; "
                    "pass labels to train on hard labels when no teacher is available"
                )
            return self._cross_entropy(student_logits, labels)

        if self.alpha > 0 and labels is None:
            raise ValueError(
                f"KDLoss with alpha={self.alpha} needs labels for the hard-label term; "
                "pass labels, or use alpha=0 for pure distillation"
            )
        loss: Tensor | None = None
        if self.alpha > 0:
            assert labels is not None
            loss = self.alpha * self._cross_entropy(student_logits, labels)
        if self.alpha < 1:
            soft = (1.0 - self.alpha) * self._valid_soft(student_logits, teachers, keep)
            loss = soft if loss is None else loss + soft
        assert loss is not None
        return loss

    def _teacher_list(self, student_logits: Tensor, teacher: TeacherTargets) -> list[Tensor | SparseTargets] | None:
        if teacher is None:
            return None
        items: list[Tensor | SparseTargets]
        if isinstance(teacher, (Tensor, SparseTargets)):
            items = [teacher]
        elif isinstance(teacher, (list, tuple)):
            if not teacher:
                raise ValueError(
                    "KDLoss got an empty list of teachers; pass None for the hard-label fallback"
                )
            items = list(teacher)
        else:
            raise TypeError(
                "teacher must be a logits tensor, SparseTargets, a list/tuple of those, or None; "
                f"got {type(teacher).__name__}"
            )
        for i, t in enumerate(items):
            what = "teacher logits" if len(items) == 1 else f"teacher {i} logits"
            if isinstance(t, SparseTargets):
                _check_sparse(student_logits, t)
            elif isinstance(t, Tensor):
                if not t.is_floating_point():
                    raise ValueError(f"{what} must be floating point, got {t.dtype}")
                _check_same_shape(student_logits, t, what)
            else:
                raise TypeError(
                    f"teacher {i} must be a logits tensor or SparseTargets, got {type(t).__name__}"
                )
        return items

    def _cross_entropy(self, student_logits: Tensor, labels: Tensor) -> Tensor:
        if labels.shape != student_logits.shape[:1]:
            raise ValueError(
                f"labels {tuple(labels.shape)} must have shape [N] = {tuple(student_logits.shape[:1])} "
                f"to match student logits {tuple(student_logits.shape)}"
            )
        if labels.is_floating_point() or labels.dtype == torch.bool:
            raise ValueError(f"labels must be integer class ids, got {labels.dtype}")
        s = _compute(student_logits)
        per_sample = F.cross_entropy(s, labels.to(s.device, torch.int64, non_blocking=True), reduction="none")
        return _reduce(per_sample, self.reduction)

    def _valid_soft(self, student_logits: Tensor, teachers: list[Tensor | SparseTargets],
                    keep: Tensor | None) -> Tensor:
        """The soft term over the rows `keep` indexes (None: all)."""
        if keep is None:
            return self._soft(student_logits, teachers)
        n = student_logits.shape[0]
        if keep.numel() == 0:  # 0 (per row with "none"), attached to the graph, reading nothing
            zero = _compute(student_logits.narrow(-1, 0, 0)).sum(dim=-1)
            return zero if self.reduction == "none" else zero.sum()
        keep = keep.to(student_logits.device, non_blocking=True)
        soft = self._soft(student_logits.index_select(0, keep), [_rows(t, keep) for t in teachers])
        if self.reduction != "none":
            return soft
        return soft.new_zeros(n).index_put((keep,), soft)

    def _soft(self, student_logits: Tensor, teachers: list[Tensor | SparseTargets]) -> Tensor:
        t = self.temperature
        if len(teachers) == 1 and isinstance(teachers[0], SparseTargets):
            # Gather instead of scattering to [N, C]: same value, k/C of the work on the targets.
            return _sparse_kd(student_logits, teachers[0], t, self.reduction)
        c = student_logits.shape[1]
        dtype, device = _compute_dtype(student_logits.dtype), student_logits.device
        probs = [
            (x.to_dense(c, t) if isinstance(x, SparseTargets) else soft_targets(x, t)).to(
                device=device, dtype=dtype, non_blocking=True
            )
            for x in teachers
        ]
        p = probs[0] if len(probs) == 1 else torch.stack(probs).mean(dim=0)
        return kd_kl_div(student_logits, p, t, self.reduction)


def _rows(teacher: Tensor | SparseTargets, keep: Tensor) -> Tensor | SparseTargets:
    """The rows `keep` indexes of one teacher's targets."""
    if isinstance(teacher, Tensor):
        return teacher.index_select(0, keep.to(teacher.device))
    at = keep.to(teacher.values.device)
    tail = None if teacher.tail is None else teacher.tail.index_select(0, at)
    return SparseTargets(teacher.values.index_select(0, at), teacher.indices.index_select(0, at), tail, teacher.kind)
