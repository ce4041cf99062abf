"""The sampled-token form of on-policy distillation: per-token ``log q - log p`` on the tokens
the student itself sampled, as a reward / advantage for a policy-gradient step.

When the student samples ``x[t+1] ~ q(· | x[<=t])`` and the teacher scores it
(``token_logprobs`` on a teacher-server gives ``log p(x[t+1] | x[<=t])`` aligned with the logits
at t), ``log q(x[t+1]) - log p(x[t+1])`` is a one-sample estimate of the reverse KL
``KL(q ‖ p)`` at position t. Its negative is the per-token advantage of on-policy distillation
(as in tinker-cookbook and Agarwal et al.'s GKD with ``beta = 1``): the policy-gradient loss
``-(advantage.detach() · log q(x[t+1]))`` has, in expectation over the sampled token, the gradient
of the reverse KL, and needs one number per token from the teacher (4 bytes in fp32, 2 in fp16).

Alignment follows Hugging Face labels after the shift: ``next_ids[b, t]`` is the token after
position t, ``ignore_index`` where there is none (the last position, padding, the prompt when
only the completion counts).
"""

from __future__ import annotations

import torch
from torch import Tensor

from distill.losses._common import _check_temperature

__all__ = ["sampled_token_log_ratio", "sampled_token_pg_loss", "token_advantages"]


def _valid(next_ids: Tensor, ignore_index: int, attention_mask: Tensor | None) -> Tensor:
    valid = next_ids != ignore_index
    if attention_mask is not None:
        valid &= attention_mask.to(valid.device) != 0
    return valid


def _student_token_logprobs(student_logits: Tensor, next_ids: Tensor, valid: Tensor, temperature: float) -> Tensor:
    """``log q(next_ids)`` per position from ``[B, T, V]`` logits at ``temperature`` (0 where not valid)."""
    if student_logits.shape[:-1] != next_ids.shape:
        raise ValueError(f"next_ids {tuple(next_ids.shape)} must have the positions' shape "
                         f"{tuple(student_logits.shape[:-1])} of the student logits {tuple(student_logits.shape)}")
    z = student_logits.float() / temperature
    ids = torch.where(valid, next_ids, torch.zeros_like(next_ids)).to(z.device, torch.int64).unsqueeze(-1)
    picked = z.gather(-1, ids).squeeze(-1) - torch.logsumexp(z, dim=-1)
    return torch.where(valid.to(z.device), picked, torch.zeros_like(picked))


def sampled_token_log_ratio(student_logits: Tensor, next_ids: Tensor, teacher_token_logprobs: Tensor, *,
                            temperature: float = 1.0, ignore_index: int = -100,
                            attention_mask: Tensor | None = None) -> Tensor:
    """``log q(x[t+1]) - log p(x[t+1])`` per position ``[B, T]``, 0 where not counted;
    differentiable in the student logits. Its mean over the counted positions estimates
    ``KL(q ‖ p)`` per token."""
    t = _check_temperature(temperature)
    valid = _valid(next_ids, ignore_index, attention_mask)
    log_q = _student_token_logprobs(student_logits, next_ids, valid, t)
    log_p = teacher_token_logprobs.to(log_q.device, log_q.dtype)
    return torch.where(valid.to(log_q.device), log_q - log_p, torch.zeros_like(log_q))


def token_advantages(student_token_logprobs: Tensor, teacher_token_logprobs: Tensor,
                     valid: Tensor | None = None) -> Tensor:
    """The per-token advantage ``log p - log q`` (teacher minus student, detached), 0 where not
    ``valid``: the reward of on-policy distillation for a policy-gradient trainer."""
    adv = (teacher_token_logprobs.float() - student_token_logprobs.detach().float().to(teacher_token_logprobs.device))
    return adv if valid is None else torch.where(valid.to(adv.device), adv, torch.zeros_like(adv))


def sampled_token_pg_loss(student_logits: Tensor, next_ids: Tensor, teacher_token_logprobs: Tensor, *,
                          temperature: float = 1.0, ignore_index: int = -100, attention_mask: Tensor | None = None,
                          reduction: str = "token_mean") -> Tensor:
    """The policy-gradient loss ``-(advantage · log q(x[t+1]))`` with the advantage
    ``log p - log q`` detached: in expectation over the student's samples its gradient is that of
    ``KL(q ‖ p)``. ``reduction``: ``"token_mean"`` over the counted positions, ``"sum"``, or
    ``"none"`` (``[B, T]``, 0 where not counted)."""
    if reduction not in ("token_mean", "sum", "none"):
        raise ValueError(f"reduction must be one of token_mean, sum, none, got {reduction!r}")
    t = _check_temperature(temperature)
    valid = _valid(next_ids, ignore_index, attention_mask)
    log_q = _student_token_logprobs(student_logits, next_ids, valid, t)
    adv = token_advantages(log_q, teacher_token_logprobs.to(log_q.device), valid)
    per_token = -(adv * log_q)
    if reduction == "none":
        return per_token
    total = per_token.sum()
    if reduction == "sum":
        return total
    return total / valid.sum().clamp(min=1).to(total.device)
