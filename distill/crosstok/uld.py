"""ULD's sorted-probability distance, on the chunks where the two tokenizations differ.

From Boizard et al., "Towards Cross-Tokenizer Distillation: the Universal Logit Distillation Loss
for LLMs" (2024): with vocabularies that share no index, the Wasserstein-1 distance between the two
next-token distributions, under a cost of 1 between any two different entries and a uniform support,
has a closed form: sort each distribution's probabilities in decreasing order, pad the shorter with
zeros, and sum the absolute differences, ``sum_i |q_sorted(i) - p_sorted(i)|``. It compares the shape
of the distributions (how peaked), not which entry has which mass, and needs no vocabulary map.

How it is applied here: a chunk holds one or more tokens on each side. Each side's distribution for
the chunk is the one its first token was drawn from (the teacher's top-k log-probabilities at
``j - 1``, the student's softmax at ``i - 1``), scaled by the probability of the chunk's further tokens
given the text before them (the sum of their log-probabilities: the teacher's ``token_logprobs``, the
student's own), as TRL's GOLD trainer merges the distributions of a multi-token span; with one token
on each side the scale is 1. The teacher sends only its top-k, so the sum runs over the teacher's k
sorted probabilities against the student's `student_top_k` largest (k by default): mass beyond the
top-k is left out on both sides (with k the full vocabulary this is the paper's form). The teacher's
probabilities are used as served, not renormalised over the top-k.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["sorted_l1_rows"]


def sorted_l1_rows(student_rows: Tensor, student_log_scale: Tensor, teacher_values: Tensor,
                   teacher_log_scale: Tensor, *, temperature: float = 1.0, student_top_k: int | None = None) -> Tensor:
    """``[n]``: ``sum_i |q_sorted(i) - p_sorted(i)|`` per row, differentiable in the student.

    Args:
        student_rows: ``[n, V]`` student logits at the chunks' first positions.
        student_log_scale: ``[n]`` log-probability of the chunk's further student tokens (0 for one token).
        teacher_values: ``[n, k]`` teacher top-k log-probabilities at the chunks' first positions.
        teacher_log_scale: ``[n]`` log-probability of the chunk's further teacher tokens.
        temperature: softens the student's logits (the teacher's are used as served).
        student_top_k: how many of the student's largest probabilities to compare (default k).
    """
    k = teacher_values.shape[-1]
    ks = k if student_top_k is None else int(student_top_k)
    if ks < 1:
        raise ValueError(f"student_top_k must be >= 1, got {student_top_k!r}")
    log_q = torch.log_softmax(student_rows.float() / temperature, dim=-1)
    ks = min(ks, log_q.shape[-1])
    q = torch.exp(log_q.topk(ks, dim=-1).values + student_log_scale.to(log_q.device).unsqueeze(1))
    p_log = teacher_values.detach().to(log_q.device, torch.float32).sort(dim=-1, descending=True).values
    p = torch.exp(p_log + teacher_log_scale.detach().to(log_q.device, torch.float32).unsqueeze(1))
    width = max(ks, k)
    q = F.pad(q, (0, width - ks))
    p = F.pad(p, (0, width - k))
    return (q - p).abs().sum(dim=-1)
