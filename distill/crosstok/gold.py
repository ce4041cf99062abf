"""GOLD's matched-vocabulary divergence, on the chunks that are one token on each side.

From TRL's GOLD trainer (General Online Logit Distillation, Hugging Face, 2025), the "hybrid" part
of its ULD loss: where teacher and student took the same step (a chunk of one token on each side,
with the same piece), their next-token distributions, both conditioned on the same text, are
compared directly on the entries both vocabularies have (`VocabMap`), with the token losses'
divergence (forward KL by default, reverse KL or generalized JSD; `distill.losses.token`).

What it assumes, and how a top-k teacher is read: the teacher's distribution of token ``j`` is its
top-k log-probabilities at position ``j - 1`` (plus the tail mass outside them when served), the
student's is its softmax at its own position ``i - 1``. The divergence is taken on the partition
"each matched class among the teacher's top-k, plus one rest bin": the rest holds the teacher's
unmatched top-k entries and its tail, and the student's mass on every class not in the teacher's
top-k and on its unmatched entries. Several entries of one piece add up into one class on each
side. Without a tail the teacher's top-k are renormalised (its mass outside them is unknown), as
`SparseTargets` does, and the reverse KL, infinite then, is refused. With one tokenizer on both
sides every class is one id and the divergence is exactly the token losses' on the same targets.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from distill.crosstok._select import first_ids
from distill.crosstok.align import Alignment
from distill.crosstok.vocab import VocabMap, _lookup
from distill.losses._chunks import Recomputed
from distill.losses._divergence import generalized_jsd_rows
from distill.losses.sparse import SparseTargets

__all__ = ["gold_chunks", "matched_rows"]

_EMPTY = -1.0e4
"""The log-probability both sides get in a bin that holds nothing (a repeated class, a rest with no
entries): exp of it is 0 in float32, and being equal on both sides it adds nothing to any divergence."""


def gold_chunks(alignment: Alignment, student_ids: Tensor, teacher_ids: Tensor, vocab: VocabMap) -> Tensor:
    """bool ``[B, C]``: the valid chunks of one token on each side with the same piece."""
    s = alignment.student_first
    t = alignment.teacher_first
    one = alignment.one_to_one
    return one & vocab.same_piece(first_ids(student_ids, s), first_ids(teacher_ids.to(s.device), t))


def _fit(student_class: Tensor, width: int) -> Tensor:
    """The student's classes for `width` logits: a model's output may have more entries than its
    tokenizer (padded embeddings); those extra entries are unmatched."""
    if width <= student_class.numel():
        return student_class[:width]
    return torch.cat([student_class, torch.full((width - student_class.numel(),), -1, dtype=student_class.dtype,
                                                 device=student_class.device)])


def _student_classes(z: Tensor, student_class: Tensor, classes: int) -> Tensor:
    """``[n, classes]``: the log of the summed softmax mass of each class's entries (exact: each
    class's sum is taken relative to its own largest entry)."""
    lse = torch.logsumexp(z, dim=-1, keepdim=True)
    dump = torch.where(student_class >= 0, student_class, torch.full_like(student_class, classes))
    idx = dump.unsqueeze(0).expand_as(z)
    top = torch.full((z.shape[0], classes + 1), float("-inf"), dtype=z.dtype, device=z.device)
    top = top.scatter_reduce(1, idx, z.detach(), "amax")
    shifted = torch.exp(z - top.gather(1, idx))
    sums = torch.zeros_like(top).index_add(1, dump, shifted)
    return (torch.log(sums) + top - lse)[:, :classes]


@dataclass(frozen=True)
class _Targets:
    """The teacher's rows of one batch of GOLD positions, in bins."""

    classes: Tensor  # [n, k] the class of each top-k entry, -1 unmatched
    active: Tensor  # [n, k] the first entry of its class (a bin)
    log_bins: Tensor  # [n, k] teacher log-mass of each active bin
    log_rest: Tensor  # [n] teacher log-mass of the rest bin

    def take(self, start: int, end: int) -> _Targets:
        return _Targets(self.classes[start:end], self.active[start:end], self.log_bins[start:end],
                        self.log_rest[start:end])


def _teacher_bins(values: Tensor, indices: Tensor, tail: Tensor | None, teacher_class: Tensor) -> _Targets:
    log_p, log_tail = SparseTargets(values, indices, tail, "logprobs").log_probs()
    cls = _lookup(teacher_class, indices.to(teacher_class.device).long()).to(log_p.device)
    matched = cls >= 0
    same = (cls.unsqueeze(2) == cls.unsqueeze(1)) & matched.unsqueeze(2)  # [n, k, k]
    k = cls.shape[1]
    first = same.to(torch.int8).argmax(dim=-1)
    active = matched & (first == torch.arange(k, device=cls.device))
    log_bins = torch.logsumexp(torch.where(same, log_p.unsqueeze(1), float("-inf")), dim=-1)
    rest = torch.where(matched, torch.full_like(log_p, float("-inf")), log_p)
    if log_tail is not None:
        rest = torch.cat([rest, log_tail.unsqueeze(1)], dim=1)
    return _Targets(cls, active, log_bins, torch.logsumexp(rest, dim=-1))


@dataclass(frozen=True)
class _GoldChunk:
    targets: _Targets
    student_class: Tensor
    classes: int
    temperature: float
    beta: float

    def loss(self, student: Tensor) -> Tensor:
        z = student.float() / self.temperature
        t = self.targets
        cls = _student_classes(z, self.student_class.to(z.device), self.classes)
        safe = t.classes.clamp_min(0).to(z.device)
        log_q_bins = cls.gather(1, safe)
        in_bins = torch.zeros(z.shape[0], self.classes + 1, dtype=torch.bool, device=z.device)
        in_bins.scatter_(1, torch.where(t.active, safe, torch.full_like(safe, self.classes)), True)
        in_bins[:, self.classes] = False
        sc = self.student_class.to(z.device)
        id_in = in_bins.gather(1, torch.where(sc >= 0, sc, self.classes).unsqueeze(0).expand_as(z))
        log_q_rest = torch.logsumexp(z.masked_fill(id_in, float("-inf")), dim=-1) - torch.logsumexp(z, dim=-1)
        empty = torch.full_like(log_q_bins, _EMPTY)
        log_q = torch.cat([torch.where(t.active, log_q_bins, empty),
                           log_q_rest.clamp_min(_EMPTY).unsqueeze(1)], dim=1)
        log_p = torch.cat([torch.where(t.active, t.log_bins.to(z.device), empty),
                           t.log_rest.to(z.device).clamp_min(_EMPTY).unsqueeze(1)], dim=1)
        return generalized_jsd_rows(log_p, log_q, self.beta)


def matched_rows(student_rows: Tensor, values: Tensor, indices: Tensor, tail: Tensor | None, vocab: VocabMap, *,
                 temperature: float, beta: float, chunk_size: int = 512) -> Tensor:
    """The matched-vocabulary divergence ``[n]`` of `n` student logit rows ``[n, V_student]`` against
    the teacher's top-k rows (``[n, k]`` log-probabilities and teacher ids, tail ``[n]`` or None).

    Rows are processed `chunk_size` at a time, each recomputed in the backward pass, so the float32
    intermediates stay at a few ``[chunk_size, V_student]``."""
    if beta == 1.0 and tail is None:
        raise ValueError("the reverse KL on the matched vocabulary needs the teacher's tail mass (without it the "
                         "teacher has no mass outside its top-k); ask for <OUT>_TOPK_TAIL, or use "
                         "divergence='jsd' with beta < 1")
    student_class = _fit(vocab.student_class, student_rows.shape[-1])
    targets = _teacher_bins(values, indices, tail, vocab.teacher_class)
    track = torch.is_grad_enabled() and student_rows.requires_grad
    parts = []
    for start in range(0, student_rows.shape[0], chunk_size):
        end = min(start + chunk_size, student_rows.shape[0])
        chunk = _GoldChunk(targets.take(start, end), student_class, vocab.num_classes, temperature, beta)
        rows = student_rows[start:end]
        parts.append(Recomputed.apply(rows, chunk) if track else chunk.loss(rows))
    if not parts:
        return student_rows.new_zeros(0, dtype=torch.float32)
    return torch.cat(parts)
