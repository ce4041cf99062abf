"""Picking the rows the cross-tokenizer losses read: chunk positions on each side, and the
student's log-probabilities of its own tokens."""

from __future__ import annotations

import torch
from torch import Tensor

from distill.losses._common import _check_temperature
from distill.losses.on_policy import _student_token_logprobs


def chunk_rows(first: Tensor, where: Tensor) -> tuple[Tensor, Tensor]:
    """(rows, positions) of the chunks selected by bool ``[B, C]`` `where`: the position ``first - 1``
    of each chunk's first token, which holds the distribution that token was drawn from."""
    b, c = where.nonzero(as_tuple=True)
    return b, first.to(where.device)[b, c] - 1


def first_ids(ids: Tensor, first: Tensor) -> Tensor:
    """``[B, C]``: the id of each chunk's first token (0 where the chunk has none)."""
    return ids.to(first.device).gather(1, first.clamp_min(0))


def later_token_logprobs(student_logits: Tensor, ids: Tensor, chunk: Tensor, first: Tensor, where: Tensor, *,
                         temperature: float) -> Tensor:
    """``[B, C]``: the student's log-probability of the tokens after the first of each chunk `where`
    selects, summed per chunk (0 for a one-token chunk); differentiable. Only those tokens' logit rows
    are read."""
    dev = student_logits.device
    chunk = chunk.to(dev)
    safe = chunk.clamp_min(0)
    index = torch.arange(chunk.shape[1], device=dev).expand_as(chunk)
    later = (chunk >= 0) & where.to(dev).gather(1, safe) & (index > first.to(dev).gather(1, safe))
    b, i = later.nonzero(as_tuple=True)
    out = torch.zeros(where.shape, dtype=torch.float32, device=dev)
    if b.numel() == 0:
        return out
    rows = student_logits[b, i - 1].float() / temperature
    picked = rows.gather(1, ids.to(dev)[b, i].unsqueeze(1)).squeeze(1) - torch.logsumexp(rows, dim=-1)
    return out.index_put((b, chunk[b, i]), picked, accumulate=True)


def student_token_logprobs(student_logits: Tensor, ids: Tensor, temperature: float = 1.0) -> Tensor:
    """float ``[B, T]``: log q(ids[i]) from the logits at ``i - 1`` (0 for token 0); differentiable."""
    t = _check_temperature(temperature)
    if student_logits.dim() != 3 or tuple(student_logits.shape[:2]) != tuple(ids.shape):
        raise ValueError(f"student logits {tuple(student_logits.shape)} must be [B, T, V] over the student's "
                         f"tokens {tuple(ids.shape)}: run the student on the ids the SpanTokenizer returned")
    ids = ids.to(student_logits.device)
    nxt = ids[:, 1:]
    valid = torch.ones_like(nxt, dtype=torch.bool)
    picked = _student_token_logprobs(student_logits[:, :-1], nxt, valid, t)
    return torch.cat([picked.new_zeros(picked.shape[0], 1), picked], dim=1)
