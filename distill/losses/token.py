"""Token-level distillation: forward KL, reverse KL and generalized JSD over ``[B, T, V]`` logits.

Conventions (the classifier losses' conventions carry over, with positions in place of samples):

* The divergence is TRL's generalized JSD (``GKDTrainer.generalized_jsd_loss``; Agarwal et al.,
  2024, eq. 1). With ``p`` the teacher's and ``q`` the student's distribution at a position and
  ``m = beta · p + (1 - beta) · q``::

      D_beta(p, q) = beta · KL(p ‖ m) + (1 - beta) · KL(q ‖ m)      for 0 < beta < 1
      D_0 = KL(p ‖ q)   (forward KL, mass-covering; what ``KDLoss`` uses)
      D_1 = KL(q ‖ p)   (reverse KL, mode-seeking)

  The mixture formula tends to 0 at both ends; the ends are defined as the two KLs, as TRL does.
  ``divergence="forward_kl"`` / ``"reverse_kl"`` are ``beta = 0`` / ``beta = 1``;
  ``divergence="jsd"`` takes ``beta`` (0.5 is the symmetric JSD).
* Temperature: ``q = softmax(student / T)``. A dense teacher with ``teacher_kind="logits"`` and a
  ``SparseTargets`` of logits are softened by ``T`` too; teacher *log-probabilities* are the
  teacher's distribution as served (the server applies its temperature) and are not re-softened.
  ``TokenKDLoss`` scales the divergence by ``T²`` (the soft term only, as ``KDLoss``); TRL does not,
  so the two agree at ``T = 1``. ``token_divergence`` returns the bare divergence.
* Top-k targets: the divergence is taken on the partition "each top-k class, plus one tail bin
  for all other classes", for the teacher and the student alike (``SparseTargets``). It equals the
  dense divergence when the teacher has no mass outside the top-k (forward KL, JSD) or when its
  distribution outside has the student's shape; with the true tail it is otherwise smaller than
  the dense one (lumping classes never increases a divergence). The reverse KL needs the
  teacher's tail: without one it is infinite and refused.
* Masking: a position counts if its ``attention_mask`` is non-zero and its label is not
  ``ignore_index`` (either may be omitted). Labels are aligned with the logits by the caller (shift
  them for next-token prediction before calling). Only the positions that count are computed;
  finding them costs one copy of the mask to the host (a device sync) per call.
* Reduction: ``"token_mean"`` sums the divergence over the vocabulary and averages over the
  positions that count; ``"sum"`` sums over them; ``"none"`` returns ``[B, T]`` with 0 at positions
  that do not count. With no position counting, ``"token_mean"`` is 0 (and still differentiable).
* Memory: positions are processed in chunks of ``chunk_size``. Each chunk's softmax and
  divergence are recomputed in the backward pass (activation checkpointing), so a ``[B, T, V]``
  student never has more than one chunk of ``[chunk_size, V]`` float32 intermediates alive, in the
  forward or the backward pass (several of them at the peak; each is ``chunk_size · V · 4`` bytes,
  250 MiB for ``V = 128k`` at the default 512 positions: lower ``chunk_size`` if that is too
  much). Nothing in the chunk is random, so the RNG state is not saved for the recomputation.
  The student logits themselves and their gradient are full size; avoiding those needs the loss
  fused with the output projection, which is not done here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, TypeAlias

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from distill.losses._chunks import Chunks, Recomputed, take_rows
from distill.losses._common import (
    ValueKind,
    _check_kind,
    _check_temperature,
    _compute,
    _compute_dtype,
    _kept_rows,
    _number,
)
from distill.losses._divergence import dense_rows, sparse_rows
from distill.losses.scored import ScoredTargets, support_rows
from distill.losses.sparse import SparseTargets

__all__ = [
    "Divergence",
    "TokenKDLoss",
    "TokenReduction",
    "TokenTeacherTargets",
    "token_divergence",
]

Divergence = Literal["forward_kl", "reverse_kl", "jsd"]
_DIVERGENCES: tuple[str, ...] = ("forward_kl", "reverse_kl", "jsd")
TokenReduction = Literal["token_mean", "sum", "none"]
_TOKEN_REDUCTIONS: tuple[str, ...] = ("token_mean", "sum", "none")

TokenTeacherTargets: TypeAlias = Tensor | SparseTargets | ScoredTargets | None
"""What the token losses accept as the teacher: dense ``[B, T, V]`` values, top-k targets, scored
targets on a support (``distill.losses.scored``), or None."""


def _beta(divergence: str, beta: float) -> float:
    if divergence not in _DIVERGENCES:
        raise ValueError(f"divergence must be one of {', '.join(_DIVERGENCES)}, got {divergence!r}")
    if divergence == "forward_kl":
        return 0.0
    if divergence == "reverse_kl":
        return 1.0
    b = _number("beta", beta)
    if not 0.0 <= b <= 1.0:
        raise ValueError(
            f"beta (the JSD interpolation, 0 = forward KL, 1 = reverse KL) must be in [0, 1], got {beta!r}"
        )
    return b


def _check_chunk_size(chunk_size: int) -> int:
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be an int >= 1 (positions per chunk), got {chunk_size!r}")
    return chunk_size


def _check_token_reduction(reduction: str) -> None:
    if reduction not in _TOKEN_REDUCTIONS:
        raise ValueError(f"reduction must be one of {', '.join(_TOKEN_REDUCTIONS)}, got {reduction!r}")


def _check_inputs(
    student: Tensor,
    teacher: TokenTeacherTargets,
    labels: Tensor | None,
    attention_mask: Tensor | None,
    beta: float,
) -> None:
    if student.dim() < 2 or not student.is_floating_point():
        raise ValueError(
            f"student logits must be floating point of shape [B, T, V] (or [N, V]), got "
            f"{student.dtype} {tuple(student.shape)}"
        )
    positions = tuple(student.shape[:-1])
    if isinstance(teacher, SparseTargets):
        if tuple(teacher.shape[:-1]) != positions or teacher.k > student.shape[-1]:
            raise ValueError(
                f"student logits {tuple(student.shape)} and sparse teacher targets {tuple(teacher.shape)} "
                "do not fit: need [..., k] with the same positions and k <= V"
            )
        if beta == 1.0 and teacher.tail is None and teacher.k < student.shape[-1]:
            raise ValueError(
                "the reverse KL against top-k targets needs the teacher's tail mass: without it the teacher "
                "has no mass outside the top-k and KL(student ‖ teacher) is infinite wherever the student has "
                "some; serve the tail (SparseTargets(..., tail=..., kind='logprobs')), or use divergence='jsd' "
                "with beta < 1"
            )
    elif isinstance(teacher, ScoredTargets):
        if tuple(teacher.shape[:-1]) != positions:
            raise ValueError(
                f"student logits {tuple(student.shape)} and scored teacher targets {tuple(teacher.shape)} "
                "do not fit: need [..., m] with the same positions")
    elif isinstance(teacher, Tensor):
        if not teacher.is_floating_point():
            raise ValueError(f"teacher values must be floating point, got {teacher.dtype}")
        if teacher.shape != student.shape:
            raise ValueError(
                f"student logits {tuple(student.shape)} and teacher values {tuple(teacher.shape)} "
                "must have the same shape [B, T, V]"
            )
    elif teacher is not None:
        raise TypeError(
            "teacher must be a [B, T, V] tensor, SparseTargets or None (the token losses take one teacher; "
            f"average several first), got {type(teacher).__name__}"
        )
    for name, t in (("labels", labels), ("attention_mask", attention_mask)):
        if t is not None and tuple(t.shape) != positions:
            raise ValueError(
                f"{name} {tuple(t.shape)} must have the positions' shape {positions} of student logits "
                f"{tuple(student.shape)}"
            )
    if labels is not None and (labels.is_floating_point() or labels.dtype == torch.bool):
        raise ValueError(f"labels must be integer token ids, got {labels.dtype}")


@dataclass(frozen=True)
class _Spec:
    kind: ValueKind
    temperature: float
    beta: float
    soft_weight: float
    hard_weight: float


def _chunk_loss(
    student: Tensor,
    rows: Tensor | None,
    teacher: Tensor | SparseTargets | ScoredTargets | None,
    labels: Tensor | None,
    spec: _Spec,
) -> Tensor:
    """``soft_weight · D + hard_weight · CE`` for the chunk's positions that count, ``[n]``."""
    s = _compute(take_rows(student, rows))
    loss: Tensor | None = None
    if spec.soft_weight != 0.0 and teacher is not None:
        if isinstance(teacher, SparseTargets):
            tail = None if teacher.tail is None else take_rows(teacher.tail, rows)
            values, indices = take_rows(teacher.values, rows), take_rows(teacher.indices, rows)
            picked = SparseTargets(values, indices, tail, teacher.kind)
            d = sparse_rows(s, picked, spec.temperature, spec.beta)
        elif isinstance(teacher, ScoredTargets):
            d = support_rows(s, teacher.rows(rows), spec.temperature, spec.beta)
        else:
            d = dense_rows(s, take_rows(teacher, rows), spec.kind, spec.temperature, spec.beta)
        loss = spec.soft_weight * d
    if spec.hard_weight != 0.0 and labels is not None:
        y = take_rows(labels, rows).to(s.device, torch.int64, non_blocking=True)
        ce = F.cross_entropy(s, y, reduction="none")
        loss = spec.hard_weight * ce if loss is None else loss + spec.hard_weight * ce
    assert loss is not None
    return loss


@dataclass(frozen=True)
class _Chunk:
    """Everything ``_chunk_loss`` needs besides the student rows."""

    rows: Tensor | None
    teacher: Tensor | SparseTargets | ScoredTargets | None
    labels: Tensor | None
    spec: _Spec

    def loss(self, student: Tensor) -> Tensor:
        return _chunk_loss(student, self.rows, self.teacher, self.labels, self.spec)


def _token_loss(
    student: Tensor,
    teacher: TokenTeacherTargets,
    labels: Tensor | None,
    attention_mask: Tensor | None,
    *,
    kind: ValueKind,
    temperature: float,
    beta: float,
    soft_weight: float,
    hard_weight: float,
    ignore_index: int,
    reduction: str,
    chunk_size: int,
) -> Tensor:
    positions = student.shape[:-1]
    valid = torch.ones(positions, dtype=torch.bool, device="cpu")
    if attention_mask is not None:
        valid &= attention_mask.detach().to("cpu") != 0
    if labels is not None:
        valid &= labels.detach().to("cpu") != ignore_index
    valid_flat = valid.reshape(-1)
    n_valid = int(valid_flat.sum())

    others: list[Tensor] = []
    if isinstance(teacher, SparseTargets):
        others = [teacher.values, teacher.indices] + ([] if teacher.tail is None else [teacher.tail.unsqueeze(-1)])
    elif isinstance(teacher, ScoredTargets):
        others = [teacher.ids, teacher.logprobs]
    elif isinstance(teacher, Tensor):
        others = [teacher]
    if labels is not None:
        others.append(labels.unsqueeze(-1))
    plan = Chunks(student, others, chunk_size)
    track = torch.is_grad_enabled() and student.requires_grad
    spec = _Spec(kind, temperature, beta, soft_weight, hard_weight)

    starts: list[Tensor] = []
    parts: list[Tensor] = []
    for start, s_chunk in plan.student_chunks():
        end = start + s_chunk.shape[0]
        local = valid_flat[start:end].nonzero().squeeze(1)
        if local.numel() == 0:
            continue
        rows = None if local.numel() == end - start else local.to(student.device, non_blocking=True)
        t_chunk: Tensor | SparseTargets | ScoredTargets | None = None
        if isinstance(teacher, SparseTargets):
            tail = None if teacher.tail is None else plan.take(teacher.tail.unsqueeze(-1), start, end).squeeze(-1)
            t_chunk = SparseTargets(
                plan.take(teacher.values, start, end), plan.take(teacher.indices, start, end), tail, teacher.kind
            )
        elif isinstance(teacher, ScoredTargets):
            t_chunk = ScoredTargets(plan.take(teacher.ids, start, end), plan.take(teacher.logprobs, start, end))
        elif teacher is not None:
            t_chunk = plan.take(teacher, start, end)
        y_chunk = None if labels is None else plan.take(labels.unsqueeze(-1), start, end).squeeze(-1)
        chunk = _Chunk(rows, t_chunk, y_chunk, spec)
        part = Recomputed.apply(s_chunk, chunk) if track else chunk.loss(s_chunk)
        parts.append(part)
        starts.append(local + start)

    if reduction == "none":
        out = torch.zeros(valid_flat.numel(), dtype=_compute_dtype(student.dtype), device=student.device)
        if parts:
            index = torch.cat(starts).to(student.device, non_blocking=True)
            out = out.index_put((index,), torch.cat(parts))
        return out.reshape(positions)
    if not parts:
        return _compute(student.narrow(-1, 0, 0)).sum()  # 0, attached to the graph, reads nothing
    total = torch.cat(parts).sum()
    return total / n_valid if reduction == "token_mean" else total


def token_divergence(
    student_logits: Tensor,
    teacher: Tensor | SparseTargets | ScoredTargets,
    *,
    divergence: Divergence = "forward_kl",
    beta: float = 0.5,
    temperature: float = 1.0,
    teacher_kind: ValueKind = "logits",
    attention_mask: Tensor | None = None,
    labels: Tensor | None = None,
    ignore_index: int = -100,
    reduction: TokenReduction = "token_mean",
    chunk_size: int = 512,
) -> Tensor:
    """The bare per-token divergence (no ``T²``) between a teacher and ``[B, T, V]`` student logits.

    Args:
        student_logits: ``[B, T, V]`` (or ``[N, V]``) logits, any float dtype; computed in float32 or wider.
        teacher: dense ``[B, T, V]`` values (``teacher_kind`` says logits or log-probabilities),
            ``SparseTargets`` of shape ``[B, T, k]`` (which carries its own kind and optional tail), or
            ``ScoredTargets`` ``[B, T, m]`` (exact teacher log-probabilities on a support plus a tail bin).
        divergence: ``"forward_kl"`` ``KL(p ‖ q)``, ``"reverse_kl"`` ``KL(q ‖ p)``, or ``"jsd"``
            (generalized JSD with ``beta``; module docstring).
        beta: the JSD interpolation in ``[0, 1]``, used with ``divergence="jsd"`` only.
        temperature: ``T > 0``; softens the student, and teacher logits (not log-probabilities).
        teacher_kind: what a dense ``teacher`` tensor holds, ``"logits"`` or ``"logprobs"``.
        attention_mask: ``[B, T]``; positions with 0 do not count.
        labels: ``[B, T]`` token ids aligned with the logits; positions equal to ``ignore_index``
            do not count (the ids themselves are not used here).
        reduction: ``"token_mean"``, ``"sum"`` or ``"none"`` (``[B, T]``, 0 where not counted).
        chunk_size: positions per chunk; bounds the float32 intermediates to ``[chunk_size, V]``.
    """
    t = _check_temperature(temperature)
    b = _beta(divergence, beta)
    _check_kind(teacher_kind, "teacher_kind")
    _check_token_reduction(reduction)
    _check_chunk_size(chunk_size)
    if teacher is None:
        raise ValueError("token_divergence needs teacher outputs; use TokenKDLoss for the hard-label fallback")
    _check_inputs(student_logits, teacher, labels, attention_mask, b)
    return _token_loss(
        student_logits, teacher, labels, attention_mask, kind=teacher_kind, temperature=t, beta=b,
        soft_weight=1.0, hard_weight=0.0, ignore_index=ignore_index, reduction=reduction, chunk_size=chunk_size,
    )


class TokenKDLoss(nn.Module):
    """``alpha · CE(student, labels) + (1 - alpha) · T² · D_beta(p_T, q_T)`` per token, as one module.

    The token-level counterpart of ``KDLoss`` (conventions in this module's docstring):
    ``forward(student_logits, teacher, labels=None, attention_mask=None)`` with ``student_logits``
    ``[B, T, V]``, ``teacher`` a dense ``[B, T, V]`` tensor (``teacher_kind``), ``SparseTargets``
    ``[B, T, k]``, or None. ``labels`` ``[B, T]`` (aligned with the logits, ``ignore_index`` where
    no loss is wanted) both mask positions and give the hard term; the CE is at ``T = 1``. With
    teacher None (the reader's hard-label fallback) the loss is the plain per-token CE, not
    scaled by ``alpha``, as in ``KDLoss``.

    Args:
        divergence: ``"forward_kl"`` (default), ``"reverse_kl"`` or ``"jsd"`` (with ``beta``).
        beta: JSD interpolation in ``[0, 1]``, TRL's convention (0 forward KL, 1 reverse KL).
        temperature: ``T > 0``.
        alpha: hard-label weight in ``[0, 1]``; ``1 - alpha`` weighs the ``T²``-scaled divergence.
        teacher_kind: what a dense teacher tensor holds: ``"logits"`` or ``"logprobs"``.
        ignore_index: the label value of positions that do not count.
        reduction: ``"token_mean"`` (default), ``"sum"`` or ``"none"``.
        chunk_size: positions per chunk (memory bound ``[chunk_size, V]`` float32 intermediates).

    ``valid`` (``[B]`` bool, the reader's ``teacher["VALID_ROWS"]`` with ``nonfinite="mask"``)
    leaves the sequences it marks False out of the soft term: their teacher values (inf, NaN) are
    never read, the soft term's token mean is over the valid sequences' positions, and with no
    valid sequence it is 0, not NaN. The hard term counts every sequence, as without it.
    """

    def __init__(
        self,
        divergence: Divergence = "forward_kl",
        *,
        beta: float = 0.5,
        temperature: float = 1.0,
        alpha: float = 0.0,
        teacher_kind: ValueKind = "logits",
        ignore_index: int = -100,
        reduction: TokenReduction = "token_mean",
        chunk_size: int = 512,
    ):
        super().__init__()
        self.beta = _beta(divergence, beta)
        self.divergence: Divergence = divergence
        self.temperature = _check_temperature(temperature)
        a = _number("alpha", alpha)
        if not 0.0 <= a <= 1.0:
            raise ValueError(f"alpha (the hard-label weight) must be in [0, 1], got {alpha!r}")
        self.alpha = a
        _check_kind(teacher_kind, "teacher_kind")
        self.teacher_kind: ValueKind = teacher_kind
        self.ignore_index = int(ignore_index)
        _check_token_reduction(reduction)
        self.reduction: TokenReduction = reduction
        self.chunk_size = _check_chunk_size(chunk_size)

    def extra_repr(self) -> str:
        return (
            f"divergence={self.divergence!r}, beta={self.beta}, temperature={self.temperature}, "
            f"alpha={self.alpha}, teacher_kind={self.teacher_kind!r}, reduction={self.reduction!r}, "
            f"chunk_size={self.chunk_size}"
        )

    def forward(
        self,
        student_logits: Tensor,
        teacher: TokenTeacherTargets,
        labels: Tensor | None = None,
        attention_mask: Tensor | None = None,
        valid: Tensor | None = None,
    ) -> Tensor:
        _check_inputs(student_logits, teacher, labels, attention_mask, self.beta)
        keep = _kept_rows(valid, student_logits.shape[0], "the student logits")
        t = self.temperature
        if teacher is None:
            if labels is None:
                raise ValueError(
                    "TokenKDLoss got no teacher outputs (teacher=None, the hard-label fallback) and no labels; "
                    "pass labels to train on hard labels when no teacher is available"
                )
            soft_w, hard_w = 0.0, 1.0
        else:
            if self.alpha > 0 and labels is None:
                raise ValueError(
                    f"TokenKDLoss with alpha={self.alpha} needs labels for the hard-label term; "
                    "pass labels, or use alpha=0 for pure distillation"
                )
            soft_w, hard_w = (1.0 - self.alpha) * t * t, self.alpha
        if teacher is None or keep is None or soft_w == 0.0:
            return self._loss(student_logits, teacher, labels, attention_mask, soft_w, hard_w)
        # The soft term over the valid sequences' positions only, the hard term over all of them.
        assert valid is not None
        rows = valid.detach().to("cpu").reshape(-1, *([1] * (student_logits.dim() - 2)))
        counted = rows.expand(student_logits.shape[:-1])
        if attention_mask is not None:
            counted = counted & (attention_mask.detach().to("cpu") != 0)
        soft = self._loss(student_logits, teacher, labels, counted, soft_w, 0.0)
        if hard_w == 0.0:
            return soft
        return soft + self._loss(student_logits, None, labels, attention_mask, 0.0, hard_w)

    def _loss(self, student_logits: Tensor, teacher: TokenTeacherTargets, labels: Tensor | None,
              attention_mask: Tensor | None, *weights: float) -> Tensor:
        """`_token_loss` with this module's settings and `weights` (soft, hard)."""
        soft_w, hard_w = weights
        return _token_loss(
            student_logits, teacher, labels, attention_mask, kind=self.teacher_kind, temperature=self.temperature,
            beta=self.beta, soft_weight=soft_w, hard_weight=hard_w, ignore_index=self.ignore_index,
            reduction=self.reduction, chunk_size=self.chunk_size,
        )
