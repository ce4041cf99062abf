"""Divergences over scored targets (the teacher's exact log-probs on a support plus a tail bin)
and the sampled-token form of on-policy distillation."""

from __future__ import annotations

import pytest
import torch

from distill.losses import (
    ScoredTargets,
    TokenKDLoss,
    sampled_token_log_ratio,
    sampled_token_pg_loss,
    token_advantages,
    token_divergence,
)
from distill.losses._divergence import generalized_jsd_rows

B, T, V = 2, 5, 11
DIVERGENCES = [("forward_kl", 0.5), ("reverse_kl", 0.5), ("jsd", 0.3)]


def _logits(seed: int) -> torch.Tensor:
    return torch.randn(B, T, V, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 2


def _teacher_logprobs(temperature: float) -> torch.Tensor:
    return torch.log_softmax(_logits(1) / temperature, dim=-1)


def _whole_vocabulary(logp: torch.Tensor) -> ScoredTargets:
    """Every class once per position in a shuffled order, plus repeats and empty slots."""
    g = torch.Generator().manual_seed(2)
    perm = torch.stack([torch.randperm(V, generator=g) for _ in range(B * T)]).view(B, T, V)
    extra = perm[..., :3]  # repeats: the union of overlapping supports
    empty = torch.full((B, T, 2), -1)
    ids = torch.cat([perm, extra, empty], dim=-1)
    values = torch.cat([logp.gather(-1, perm), logp.gather(-1, extra), torch.zeros(B, T, 2, dtype=logp.dtype)], -1)
    return ScoredTargets(ids, values)


@pytest.mark.parametrize(("divergence", "beta"), DIVERGENCES)
def test_on_the_whole_vocabulary_it_is_the_dense_divergence(divergence: str, beta: float) -> None:
    temperature = 2.0
    logp = _teacher_logprobs(temperature)
    s1 = _logits(3).requires_grad_(True)
    s2 = _logits(3).requires_grad_(True)
    scored = token_divergence(s1, _whole_vocabulary(logp), divergence=divergence, beta=beta,  # type: ignore[arg-type]
                              temperature=temperature, reduction="none", chunk_size=3)
    dense = token_divergence(s2, logp, divergence=divergence, beta=beta, temperature=temperature,  # type: ignore[arg-type]
                             teacher_kind="logprobs", reduction="none")
    assert torch.allclose(scored, dense, atol=1e-10)
    assert (dense > 1e-3).all()
    scored.sum().backward()
    dense.sum().backward()
    assert s1.grad is not None and s2.grad is not None
    assert torch.allclose(s1.grad, s2.grad, atol=1e-10)


@pytest.mark.parametrize(("divergence", "beta"), DIVERGENCES)
def test_on_a_partial_support_it_is_the_lumped_divergence(divergence: str, beta: float) -> None:
    """Support {2, 5, 7} (given as the union of two overlapping parts): the divergence of the
    distributions over the bins {2}, {5}, {7}, {everything else}."""
    logp = _teacher_logprobs(1.0)
    student = _logits(4)
    a = torch.tensor([2, 5]).expand(B, T, 2)
    b = torch.tensor([5, 7]).expand(B, T, 2)
    targets = ScoredTargets.union((a, logp.gather(-1, a)), (b, logp.gather(-1, b)))
    got = token_divergence(student, targets, divergence=divergence, beta=beta, reduction="none")  # type: ignore[arg-type]
    support = torch.tensor([2, 5, 7])
    rest = torch.tensor([i for i in range(V) if i not in (2, 5, 7)])

    def lumped(lp: torch.Tensor) -> torch.Tensor:
        return torch.cat([lp[..., support], torch.logsumexp(lp[..., rest], dim=-1, keepdim=True)], dim=-1)

    b_ = {"forward_kl": 0.0, "reverse_kl": 1.0}.get(divergence, beta)
    want = generalized_jsd_rows(lumped(logp), lumped(torch.log_softmax(student, -1)), b_)
    assert torch.allclose(got.double(), want, atol=1e-6)
    dense = token_divergence(student, logp, divergence=divergence, beta=beta, teacher_kind="logprobs",  # type: ignore[arg-type]
                             reduction="none")
    assert (got <= dense + 1e-9).all()  # lumping classes never increases a divergence


def test_token_kd_loss_takes_scored_targets_with_masks() -> None:
    logp = _teacher_logprobs(1.0)
    targets = _whole_vocabulary(logp)
    labels = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(5))
    labels[0, -1] = -100
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, :2] = 0
    student = _logits(6).float()
    loss = TokenKDLoss("reverse_kl", chunk_size=4)(student, ScoredTargets(targets.ids, targets.logprobs.float()),
                                                   labels, mask)
    per = token_divergence(student, logp.float(), divergence="reverse_kl", teacher_kind="logprobs", reduction="none")
    counted = (labels != -100) & (mask != 0)
    assert torch.allclose(loss, per[counted].mean(), atol=1e-5)
    with pytest.raises(ValueError, match="same positions"):
        token_divergence(student, ScoredTargets(targets.ids[:, :2], targets.logprobs[:, :2]))
    with pytest.raises(ValueError, match="the student has 11 classes"):
        token_divergence(student, ScoredTargets(torch.full((B, T, 1), V), torch.zeros(B, T, 1)))


# ---- the sampled-token form -----------------------------------------------------------------------
def test_the_log_ratio_is_student_minus_teacher_at_the_sampled_tokens() -> None:
    student = _logits(7)
    teacher = _teacher_logprobs(1.0)
    next_ids = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(8))
    next_ids[:, -1] = -100
    token_lp = teacher.gather(-1, next_ids.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    ratio = sampled_token_log_ratio(student, next_ids, token_lp)
    want = (torch.log_softmax(student, -1) - teacher).gather(-1, next_ids.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    assert torch.allclose(ratio[:, :-1].double(), want[:, :-1], atol=1e-5)
    assert (ratio[:, -1] == 0).all()
    adv = token_advantages(torch.log_softmax(student, -1).gather(-1, next_ids.clamp(min=0).unsqueeze(-1)).squeeze(-1),
                           token_lp, next_ids != -100)
    assert torch.allclose(adv, -ratio.to(adv.dtype), atol=1e-5)


def test_the_policy_gradient_is_the_reverse_kl_gradient_in_expectation() -> None:
    """Over every possible sampled token, weighted by the student's probability of sampling it,
    the policy-gradient loss's gradient equals the gradient of KL(q || p) exactly."""
    temperature = 1.5
    student = torch.randn(1, 1, V, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    teacher = torch.log_softmax(torch.randn(1, 1, V, generator=torch.Generator().manual_seed(10),
                                            dtype=torch.float64), -1)
    q = torch.softmax(student / temperature, -1).detach()
    expected = torch.zeros_like(student)
    for x in range(V):
        s = student.clone().requires_grad_(True)
        ids = torch.tensor([[x]])
        loss = sampled_token_pg_loss(s, ids, teacher[..., x], temperature=temperature)
        (g,) = torch.autograd.grad(loss, s)
        expected += q[0, 0, x] * g
    s = student.clone().requires_grad_(True)
    kl = token_divergence(s, teacher, divergence="reverse_kl", temperature=temperature, teacher_kind="logprobs")
    (dense,) = torch.autograd.grad(kl, s)
    assert torch.allclose(expected, dense.to(expected.dtype), atol=1e-5)


def test_the_policy_gradient_loss_counts_only_the_valid_positions() -> None:
    student = _logits(11).requires_grad_(True)
    next_ids = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(12))
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1] = 0
    teacher_lp = torch.full((B, T), -2.0)
    per = sampled_token_pg_loss(student, next_ids, teacher_lp, attention_mask=mask, reduction="none")
    assert (per[1] == 0).all() and (per[0] != 0).all()
    mean = sampled_token_pg_loss(student, next_ids, teacher_lp, attention_mask=mask)
    assert torch.allclose(mean, per[0].mean())
    mean.backward()
    assert student.grad is not None and (student.grad[1] == 0).all()
    with pytest.raises(ValueError, match="reduction"):
        sampled_token_pg_loss(student, next_ids, teacher_lp, reduction="mean")
