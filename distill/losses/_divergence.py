"""Per-row divergences between a teacher and a student distribution, dense or over top-k bins.

Every function here takes rows ``[n, C]`` already on one device and in the compute dtype and
returns ``[n]``; masking, chunking and reductions are the callers' business.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from distill.losses._common import ValueKind
from distill.losses.sparse import SparseTargets


def generalized_jsd_rows(log_p: Tensor, log_q: Tensor, beta: float) -> Tensor:
    """``D_beta(p, q)`` summed over the last dimension, in TRL's convention.

    ``p`` is the teacher, ``q`` the student, ``m = beta p + (1 - beta) q``:
    ``D_beta = beta KL(p ‖ m) + (1 - beta) KL(q ‖ m)`` for ``0 < beta < 1``; ``beta = 0`` is the
    forward KL ``KL(p ‖ q)`` and ``beta = 1`` the reverse KL ``KL(q ‖ p)`` (the mixture formula
    itself goes to 0 at both ends; TRL defines the ends as the two KLs, and so do we).
    ``p`` may have zeros (``log_p = -inf``): they contribute nothing to ``KL(p ‖ ·)``.
    """
    p = log_p.exp()
    log_p0 = torch.where(p > 0, log_p, torch.zeros_like(log_p))  # 0 · log 0 = 0, and no NaN
    if beta == 0.0:
        return (p * (log_p0 - log_q)).sum(dim=-1)
    q = log_q.exp()
    if beta == 1.0:
        return (q * (log_q - log_p)).sum(dim=-1)
    log_m = torch.logaddexp(log_p + math.log(beta), log_q + math.log1p(-beta))
    kl_p = (p * (log_p0 - log_m)).sum(dim=-1)
    kl_q = (q * (log_q - log_m)).sum(dim=-1)
    return beta * kl_p + (1.0 - beta) * kl_q


def dense_rows(student: Tensor, teacher: Tensor, kind: ValueKind, temperature: float, beta: float) -> Tensor:
    """The divergence of dense rows: ``teacher`` logits (softened by ``T``) or log-probabilities
    (used as sent; renormalised, which is exact for normalised input and absorbs fp16 rounding)."""
    log_q = torch.log_softmax(student / temperature, dim=-1)
    t = teacher.detach().to(device=student.device, dtype=student.dtype, non_blocking=True)
    log_p = torch.log_softmax(t / temperature if kind == "logits" else t, dim=-1)
    return generalized_jsd_rows(log_p, log_q, beta)


def sparse_rows(student: Tensor, targets: SparseTargets, temperature: float, beta: float) -> Tensor:
    """The divergence on the partition "each top-k class, plus one tail bin" (see ``SparseTargets``).

    ``targets`` holds rows ``[n, k]`` matching ``student`` ``[n, C]``. With ``k = C`` there is no
    tail bin (a given tail is dropped). Without a tail the teacher's tail bin is 0; the forward KL
    then needs no student tail bin, and the reverse KL is infinite (refused by the callers).
    """
    z = student / temperature
    idx = targets.indices.to(student.device, torch.int64, non_blocking=True)
    k, c = idx.shape[-1], z.shape[-1]
    if k == c and targets.tail is not None:
        targets = targets.without_tail()
    log_p, log_p_tail = targets.log_probs(temperature)
    log_p = log_p.to(device=student.device, dtype=student.dtype, non_blocking=True)
    lse = torch.logsumexp(z, dim=-1, keepdim=True)
    log_q = z.gather(-1, idx) - lse
    if k == c or (log_p_tail is None and beta == 0.0):
        return generalized_jsd_rows(log_p, log_q, beta)
    outside = z.scatter(-1, idx, float("-inf"))
    log_q_tail = torch.logsumexp(outside, dim=-1, keepdim=True) - lse
    if log_p_tail is None:
        log_p_tail_col = torch.full_like(log_q_tail, float("-inf"))
    else:
        log_p_tail_col = log_p_tail.to(device=student.device, dtype=student.dtype, non_blocking=True).unsqueeze(-1)
    return generalized_jsd_rows(
        torch.cat([log_p, log_p_tail_col], dim=-1), torch.cat([log_q, log_q_tail], dim=-1), beta
    )
