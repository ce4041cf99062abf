"""``ScoredTargets``: the teacher's exact log-probabilities at chosen token ids, per position, and
the divergences on that support.

On-policy distillation compares the teacher and the student where the student puts its mass,
not only where the teacher does. A teacher-server scores any ids per position
(``SCORE_IDS`` -> ``<OUT>_SCORED_LOGPROBS``), its own top-k (``top_k`` with ``logprobs``) and the
sampled tokens (``token_logprobs`` -> ``<OUT>_TOKEN_LOGPROBS``), all from its full softmax, so
each value is exact. ``ScoredTargets.union`` concatenates such parts into one support per
position: typically the union of the student's top-k, the teacher's top-k and the sampled token.

The divergences are taken on the partition "each id of the support, plus one tail bin for every
other class", for the teacher and the student alike: the student's tail bin is the log-sum-exp of
its logits outside the support (exact, no cancellation), the teacher's is ``1 - sum p`` over the
support. When the support is the whole vocabulary both tails are 0 and the result is the dense
divergence exactly; otherwise it is the divergence of the lumped distributions (never larger than
the dense one). Ids may repeat within a row (a union of overlapping supports: each class counts
once) and negative ids mark empty slots (e.g. the sampled token at a sequence's last position).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from distill.losses._common import _INDEX_DTYPES

__all__ = ["ScoredTargets", "support_rows"]


@dataclass(frozen=True)
class ScoredTargets:
    """Teacher log-probabilities ``logprobs`` ``[..., m]`` at token ids ``ids`` ``[..., m]``.

    The log-probabilities are the teacher's as served (after the teacher's temperature, over its
    full vocabulary); the loss applies its temperature to the student only, so serve with the
    temperature of the loss. ``ids`` < 0 are empty slots; repeated ids count once.
    """

    ids: Tensor
    logprobs: Tensor

    def __post_init__(self) -> None:
        if self.ids.shape != self.logprobs.shape or self.ids.dim() < 2:
            raise ValueError(
                f"ScoredTargets ids {tuple(self.ids.shape)} and logprobs {tuple(self.logprobs.shape)} must have "
                "one shape [..., m] (one row of m ids per position)")
        if self.ids.dtype not in _INDEX_DTYPES:
            raise ValueError(f"ScoredTargets ids must be int64 or int32, got {self.ids.dtype}")
        if not self.logprobs.is_floating_point():
            raise ValueError(f"ScoredTargets logprobs must be floating point, got {self.logprobs.dtype}")

    @property
    def shape(self) -> torch.Size:
        return self.ids.shape

    @classmethod
    def union(cls, *parts: tuple[Tensor, Tensor]) -> ScoredTargets:
        """One support from several ``(ids, logprobs)`` parts with the same positions: e.g.
        ``(score_ids, SCORED_LOGPROBS)``, ``(TOPK_INDICES, TOPK_VALUES)`` (served with ``logprobs``)
        and ``(next_ids.unsqueeze(-1), TOKEN_LOGPROBS.unsqueeze(-1))``, next ids < 0 where none."""
        if not parts:
            raise ValueError("ScoredTargets.union needs at least one (ids, logprobs) part")
        device = parts[0][1].device
        ids = torch.cat([i.to(device=device, dtype=torch.int64) for i, _ in parts], dim=-1)
        logprobs = torch.cat([v.to(device=device, dtype=torch.float32) for _, v in parts], dim=-1)
        return cls(ids, logprobs)

    def rows(self, picked: Tensor | None) -> ScoredTargets:
        """The rows ``picked`` (an index of the flattened positions) of ``[n, m]`` targets."""
        if picked is None:
            return self
        index = picked.to(self.ids.device, non_blocking=True)
        return ScoredTargets(self.ids.index_select(0, index), self.logprobs.index_select(0, index))


def _unique_mask(ids: Tensor) -> Tensor:
    """``[n, m]`` bool: the first occurrence of each non-negative id in its row."""
    key = torch.where(ids >= 0, ids, torch.full_like(ids, -1))
    ordered, order = key.sort(dim=-1)
    first = torch.ones_like(ordered, dtype=torch.bool)
    first[:, 1:] = ordered[:, 1:] != ordered[:, :-1]
    keep_sorted = first & (ordered >= 0)
    return torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)


def _bin_terms(log_p: Tensor, log_q: Tensor, beta: float) -> Tensor:
    """``D_beta`` summed over the bins, with 0 · log 0 = 0 on either side (no NaN, nor NaN
    gradients, where a bin is empty); conventions of ``_divergence.generalized_jsd_rows``."""
    p, q = log_p.exp(), log_q.exp()
    has_p, has_q = p > 0, q > 0
    lp = torch.where(has_p, log_p, torch.zeros_like(log_p))
    lq = torch.where(has_q, log_q, torch.zeros_like(log_q))
    zero = torch.zeros_like(p)
    if beta == 0.0:
        return torch.where(has_p, p * (lp - lq), zero).sum(dim=-1)
    if beta == 1.0:
        return torch.where(has_q, q * (lq - lp), zero).sum(dim=-1)
    empty = ~(has_p | has_q)  # a bin both leave empty: keep -inf out of logaddexp (its gradient is NaN)
    log_m = torch.logaddexp(torch.where(empty, torch.zeros_like(log_p), log_p) + math.log(beta),
                            torch.where(empty, torch.zeros_like(log_q), log_q) + math.log1p(-beta))
    kl_p = torch.where(has_p, p * (lp - log_m), zero).sum(dim=-1)
    kl_q = torch.where(has_q, q * (lq - log_m), zero).sum(dim=-1)
    return beta * kl_p + (1.0 - beta) * kl_q


def support_rows(student: Tensor, targets: ScoredTargets, temperature: float, beta: float) -> Tensor:
    """``D_beta`` per row between ``targets`` ``[n, m]`` and the student's ``[n, V]`` logits at
    ``temperature``, on the support's ids plus one tail bin (module docstring)."""
    z = student / temperature
    ids = targets.ids.to(student.device, torch.int64, non_blocking=True)
    if int(ids.max()) >= z.shape[-1]:
        raise ValueError(f"ScoredTargets ids reach {int(ids.max())}; the student has {z.shape[-1]} classes")
    keep = _unique_mask(ids)
    idx = ids.clamp(min=0)
    lse = torch.logsumexp(z, dim=-1, keepdim=True)
    neg_inf = torch.full(idx.shape, float("-inf"), dtype=z.dtype, device=z.device)
    log_q = torch.where(keep, z.gather(-1, idx) - lse, neg_inf)
    log_p = torch.where(keep, targets.logprobs.to(device=student.device, dtype=z.dtype, non_blocking=True), neg_inf)
    inside = torch.zeros_like(z).scatter_add(-1, idx, keep.to(z.dtype)) > 0
    covered = inside.all(dim=-1, keepdim=True)
    outside = torch.where(covered, torch.zeros_like(z), z.masked_fill(inside, float("-inf")))
    log_q_tail = torch.where(covered, torch.full_like(lse, float("-inf")),
                             torch.logsumexp(outside, dim=-1, keepdim=True) - lse)
    mass = log_p.exp().sum(dim=-1, keepdim=True)
    tiny = torch.finfo(z.dtype).tiny
    log_p_tail = torch.where(covered, torch.full_like(lse, float("-inf")),
                             torch.log((1.0 - mass).clamp(min=tiny)))
    return _bin_terms(torch.cat([log_p, log_p_tail], dim=-1), torch.cat([log_q, log_q_tail], dim=-1), beta)
