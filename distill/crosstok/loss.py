"""`CrossTokenizerLoss`: GOLD's matched-vocabulary divergence on the chunks both tokenizers split
alike, ULD's sorted-probability distance on the others, with explicit weights, one module.

Per chunk (`distill.crosstok.align`): a valid chunk of one token on each side with the same piece
gets ``gold_weight · D(p, q)`` on the matched vocabulary (`distill.crosstok.gold`); every other
valid chunk gets ``uld_weight · sum_i |q_sorted(i) - p_sorted(i)|`` (`distill.crosstok.uld`). A chunk
is the aligned unit both sides agree on, so "per token" here means per chunk: ``"token_mean"``
averages over the counted chunks. GOLD's trainer weighs its two parts by the vocabulary overlap
unless told; here both weights are explicit (1 and 1 by default).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from distill.crosstok._select import chunk_rows, later_token_logprobs
from distill.crosstok.align import Alignment, align, chunk_sums
from distill.crosstok.gold import gold_chunks, matched_rows
from distill.crosstok.spans import TextTokens
from distill.crosstok.teacher import TeacherText
from distill.crosstok.uld import sorted_l1_rows
from distill.crosstok.vocab import VocabMap
from distill.losses._common import _check_temperature, _number
from distill.losses.token import Divergence, TokenReduction, _beta, _check_chunk_size, _check_token_reduction

__all__ = ["ChunkLosses", "CrossTokenizerLoss"]


class ChunkLosses:
    """The per-chunk parts of one batch: ``gold`` and ``uld`` ``[B, C]`` (0 where the chunk is not of
    that kind) and the bool masks ``gold_mask``, ``uld_mask`` of the chunks each counts."""

    def __init__(self, gold: Tensor, uld: Tensor, gold_mask: Tensor, uld_mask: Tensor):
        self.gold, self.uld, self.gold_mask, self.uld_mask = gold, uld, gold_mask, uld_mask


class CrossTokenizerLoss(nn.Module):
    """GOLD on the chunks that are one same-piece token on each side, ULD on the others.

    Args:
        vocab: the `VocabMap` of the student's and the teacher's vocabularies.
        divergence: GOLD's divergence: ``"forward_kl"`` (default), ``"reverse_kl"`` (needs the teacher's
            tail) or ``"jsd"`` (with ``beta``), as `distill.losses.token_divergence`.
        beta: the JSD interpolation in ``[0, 1]`` (0 forward KL, 1 reverse KL).
        temperature: softens the student (the teacher's log-probabilities are used as served).
        gold_weight, uld_weight: the weights of the two parts (>= 0).
        student_top_k: ULD compares the teacher's k sorted probabilities with the student's
            `student_top_k` largest (default: the teacher's k).
        reduction: ``"token_mean"`` (over counted chunks), ``"sum"``, or ``"none"`` (``[B, C]``).
        chunk_size: GOLD rows per recomputed chunk (bounds ``[chunk_size, V]`` float32 intermediates).

    ``forward(student_logits, student, teacher, alignment=None, student_loss_mask=None)``:
    ``student_logits`` ``[B, Ts, V]`` from the student run on ``student.ids``; ``student`` the
    `TextTokens` of the texts; ``teacher`` the `TeacherText` of the same texts; the alignment is
    computed when not given; ``student_loss_mask`` ``[B, Ts]`` keeps the chunks whose student tokens
    are all in it (e.g. a completion).
    """

    def __init__(self, vocab: VocabMap, *, divergence: Divergence = "forward_kl", beta: float = 0.5,
                 temperature: float = 1.0, gold_weight: float = 1.0, uld_weight: float = 1.0,
                 student_top_k: int | None = None, reduction: TokenReduction = "token_mean", chunk_size: int = 512):
        super().__init__()
        self.vocab = vocab
        self.divergence: Divergence = divergence
        self.beta = _beta(divergence, beta)
        self.temperature = _check_temperature(temperature)
        self.gold_weight = _weight("gold_weight", gold_weight)
        self.uld_weight = _weight("uld_weight", uld_weight)
        if student_top_k is not None and (isinstance(student_top_k, bool) or int(student_top_k) < 1):
            raise ValueError(f"student_top_k must be an int >= 1 or None, got {student_top_k!r}")
        self.student_top_k = student_top_k
        _check_token_reduction(reduction)
        self.reduction: TokenReduction = reduction
        self.chunk_size = _check_chunk_size(chunk_size)
        self._vocab_on: dict[torch.device, VocabMap] = {}

    def _vocab(self, device: torch.device) -> VocabMap:
        """The vocabulary map on `device`, moved there once."""
        if device not in self._vocab_on:
            self._vocab_on[device] = self.vocab.to(device)
        return self._vocab_on[device]

    def extra_repr(self) -> str:
        return (f"divergence={self.divergence!r}, beta={self.beta}, temperature={self.temperature}, "
                f"gold_weight={self.gold_weight}, uld_weight={self.uld_weight}, "
                f"student_top_k={self.student_top_k}, reduction={self.reduction!r}")

    def chunk_losses(self, student_logits: Tensor, student: TextTokens, teacher: TeacherText,
                     alignment: Alignment | None = None, student_loss_mask: Tensor | None = None) -> ChunkLosses:
        """The unweighted per-chunk GOLD and ULD values and their masks."""
        if alignment is None:
            alignment = align(student.spans, student.mask, teacher.spans, teacher.mask)
        dev = student_logits.device
        if student_logits.dim() != 3 or tuple(student_logits.shape[:2]) != tuple(student.ids.shape):
            raise ValueError(f"student logits {tuple(student_logits.shape)} must be [B, T, V] over the student's "
                             f"tokens {tuple(student.ids.shape)}: run the student on the SpanTokenizer's ids")
        vocab = self._vocab(dev)
        counted = alignment.counted(student_loss_mask).to(dev)
        values, indices = teacher.require_topk()
        gold_mask = gold_chunks(alignment, student.ids, teacher.ids, vocab).to(dev) & counted
        uld_mask = counted & ~gold_mask
        shape = counted.shape
        gold = torch.zeros(shape, dtype=torch.float32, device=dev)
        uld = torch.zeros(shape, dtype=torch.float32, device=dev)
        if self.gold_weight and bool(gold_mask.any()):
            b, ps = chunk_rows(alignment.student_first.to(dev), gold_mask)
            _, pt = chunk_rows(alignment.teacher_first.to(dev), gold_mask)
            bt = b.to(values.device)
            pt = pt.to(values.device)
            tail = None if teacher.topk_tail is None else teacher.topk_tail[bt, pt]
            rows = matched_rows(student_logits[b, ps], values[bt, pt], indices[bt, pt], tail, vocab,
                                temperature=self.temperature, beta=self.beta, chunk_size=self.chunk_size)
            gold = gold.index_put(gold_mask.nonzero(as_tuple=True), rows.to(dev))
        if self.uld_weight and bool(uld_mask.any()):
            uld = uld.index_put(uld_mask.nonzero(as_tuple=True),
                                self._uld_rows(student_logits, student, teacher, alignment, uld_mask))
        return ChunkLosses(gold, uld, gold_mask, uld_mask)

    def _uld_rows(self, student_logits: Tensor, student: TextTokens, teacher: TeacherText, alignment: Alignment,
                  where: Tensor) -> Tensor:
        dev = student_logits.device
        values, _ = teacher.require_topk()
        count = where.shape[1]
        b, ps = chunk_rows(alignment.student_first.to(dev), where)
        _, pt = chunk_rows(alignment.teacher_first.to(dev), where)
        s_scale = later_token_logprobs(student_logits, student.ids, alignment.student_chunk,
                                       alignment.student_first, where, temperature=self.temperature)[where]
        t_scale = torch.zeros(b.shape[0], device=dev)
        if bool((alignment.teacher_count.to(dev)[where] > 1).any()):
            scores = teacher.token_scores().to(dev)
            sums = chunk_sums(scores, alignment.teacher_chunk.to(dev), count)
            t_scale = sums[where] - scores[b, pt + 1]
        bt, ptt = b.to(values.device), pt.to(values.device)
        return sorted_l1_rows(student_logits[b, ps], s_scale, values[bt, ptt], t_scale,
                              temperature=self.temperature, student_top_k=self.student_top_k).to(dev)

    def forward(self, student_logits: Tensor, student: TextTokens, teacher: TeacherText,
                alignment: Alignment | None = None, student_loss_mask: Tensor | None = None) -> Tensor:
        parts = self.chunk_losses(student_logits, student, teacher, alignment, student_loss_mask)
        per_chunk = self.gold_weight * parts.gold + self.uld_weight * parts.uld
        if self.reduction == "none":
            return per_chunk
        if not bool((parts.gold_mask | parts.uld_mask).any()):
            return student_logits.narrow(-1, 0, 0).float().sum()  # 0, attached to the graph, reads nothing
        total = per_chunk.sum()
        if self.reduction == "sum":
            return total
        n = (parts.gold_mask | parts.uld_mask).sum().clamp(min=1)
        return total / n


def _weight(name: str, value: float) -> float:
    w = _number(name, value)
    if not w >= 0.0:
        raise ValueError(f"{name} must be a number >= 0, got {value!r}")
    return w
