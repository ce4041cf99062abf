"""The sampled-token form of on-policy distillation across tokenizers: per chunk, the teacher's
log-probability of the chunk's text against the student's, as per-token log-ratios / advantages.

With one tokenizer, on-policy distillation scores the tokens the student sampled:
``log q(x) - log p(x)`` per token estimates the reverse KL ``KL(q ‖ p)`` (`distill.losses.on_policy`).
Across tokenizers a student token has no teacher token of its own, but a chunk does: both sides
spell the same bytes with their own tokens, so ``log q(chunk) - log p(chunk)`` (each the sum of its
tokens' log-probabilities; the teacher's from ``token_logprobs``, at ``j - 1`` for its token ``j``)
is the same estimate for that piece of text.

The chunk's log-ratio is spread evenly over its student tokens: each gets ``1/n`` of it. Then the
values still sum to the chunk's (so over a sequence they sum to ``log q(text) - log p(text)``, and
their mean over tokens is the same per-token estimate as with one tokenizer), a one-token chunk
gets exactly the one-tokenizer value, and every token of a longer chunk gets a learning signal
(putting it all on the last token would leave the others none).

Layout: as `distill.losses.sampled_token_pg_loss`, position ``t`` holds the value of token ``t + 1``
(aligned with the logits that predicted it); positions whose token is in no counted chunk hold 0.
"""

from __future__ import annotations

import torch
from torch import Tensor

from distill.crosstok._select import student_token_logprobs
from distill.crosstok.align import Alignment, chunk_sums
from distill.crosstok.teacher import TeacherText

__all__ = ["chunk_log_ratio", "chunk_pg_loss", "teacher_chunk_logprobs"]


def _spread(per_chunk: Tensor, alignment: Alignment, counted: Tensor) -> tuple[Tensor, Tensor]:
    """(per-position values ``[B, Ts]``, bool counted positions): each chunk's value / its student
    token count on its student tokens, shifted to the position before each token."""
    dev = per_chunk.device
    chunk = alignment.student_chunk.to(dev)
    rows, count = per_chunk.shape
    dump = torch.where(chunk >= 0, chunk, torch.full_like(chunk, count))  # column `count`: no chunk
    n = torch.cat([alignment.student_count.to(dev).clamp_min(1), chunk.new_ones(rows, 1)], dim=1)
    value = (torch.cat([per_chunk, per_chunk.new_zeros(rows, 1)], dim=1) / n).gather(1, dump)
    keep = torch.cat([counted.to(dev), counted.new_zeros(rows, 1).to(dev)], dim=1).gather(1, dump)
    value = torch.where(keep, value, torch.zeros_like(value))
    pad = torch.zeros_like(value[:, :1])
    return torch.cat([value[:, 1:], pad], dim=1), torch.cat([keep[:, 1:], pad.bool()], dim=1)


def chunk_log_ratio(student_logits: Tensor, student_ids: Tensor, teacher: TeacherText, alignment: Alignment, *,
                    temperature: float = 1.0, student_loss_mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(``[B, Ts]`` per-position ``(log q(chunk) - log p(chunk)) / n``, differentiable in the student
    logits; bool ``[B, Ts]`` the positions that count). Its mean over the counted positions
    estimates ``KL(q ‖ p)`` per token."""
    log_q = student_token_logprobs(student_logits, student_ids, temperature)
    count = alignment.valid.shape[1]
    dev = log_q.device
    q_chunk = chunk_sums(log_q, alignment.student_chunk.to(dev), count)
    p_chunk = chunk_sums(teacher.token_scores().to(dev), alignment.teacher_chunk.to(dev), count)
    return _spread(q_chunk - p_chunk, alignment, alignment.counted(student_loss_mask))


def chunk_pg_loss(student_logits: Tensor, student_ids: Tensor, teacher: TeacherText, alignment: Alignment, *,
                  temperature: float = 1.0, student_loss_mask: Tensor | None = None,
                  reduction: str = "token_mean") -> Tensor:
    """The policy-gradient loss ``-(advantage · log q(x[t+1]))`` with the advantage the detached
    ``-chunk_log_ratio``: the cross-tokenizer twin of `distill.losses.sampled_token_pg_loss`, equal
    to it when both sides tokenize alike. ``reduction``: ``"token_mean"`` over the counted positions,
    ``"sum"``, or ``"none"`` (``[B, Ts]``, 0 where not counted)."""
    if reduction not in ("token_mean", "sum", "none"):
        raise ValueError(f"reduction must be one of token_mean, sum, none, got {reduction!r}")
    ratio, keep = chunk_log_ratio(student_logits, student_ids, teacher, alignment, temperature=temperature,
                                  student_loss_mask=student_loss_mask)
    log_q = student_token_logprobs(student_logits, student_ids, temperature)
    own = torch.cat([log_q[:, 1:], torch.zeros_like(log_q[:, :1])], dim=1)
    per_token = torch.where(keep, ratio.detach() * own, torch.zeros_like(own))
    if reduction == "none":
        return per_token
    total = per_token.sum()
    return total if reduction == "sum" else total / keep.sum().clamp(min=1)


def teacher_chunk_logprobs(teacher: TeacherText, alignment: Alignment) -> Tensor:
    """float ``[B, C]``: the teacher's log-probability of each chunk's tokens given the text before
    the chunk (the sum of its tokens' scores, token ``j``'s sent at ``j - 1``); 0 past a row's chunks."""
    scores = teacher.token_scores()
    return chunk_sums(scores, alignment.teacher_chunk.to(scores.device), alignment.valid.shape[1])
