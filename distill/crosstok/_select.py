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
    return torch.cat([torch.zeros_like(picked[:, :1]), picked], dim=1)
