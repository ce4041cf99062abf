"""Token-level KD losses against the dense formulas computed by hand (plain ``math``)."""

from __future__ import annotations

import math
import warnings
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import distill.losses
from distill.losses import KDLoss, SparseTargets, TeacherTargets, TokenKDLoss, token_divergence

# ---------------------------------------------------------------- plain-Python reference maths


def py_softmax(logits: list[float], t: float = 1.0) -> list[float]:
    m = max(x / t for x in logits)
    exps = [math.exp(x / t - m) for x in logits]
    z = sum(exps)
    return [e / z for e in exps]


def py_kl(p: list[float], q: list[float]) -> float:
    """KL(p || q) with 0 log 0 = 0."""
    return sum(pi * math.log(pi / qi) for pi, qi in zip(p, q, strict=True) if pi > 0)


def py_gjsd(p: list[float], q: list[float], beta: float) -> float:
    """TRL's generalized JSD: beta KL(p||m) + (1-beta) KL(q||m), m = beta p + (1-beta) q; ends are the KLs."""
    if beta == 0:
        return py_kl(p, q)
    if beta == 1:
        return py_kl(q, p)
    m = [beta * pi + (1 - beta) * qi for pi, qi in zip(p, q, strict=True)]
    return beta * py_kl(p, m) + (1 - beta) * py_kl(q, m)


def py_lump(dist: list[float], support: list[int]) -> list[float]:
    """The distribution on the partition: each support class alone, then one tail bin."""
    return [dist[i] for i in support] + [sum(x for i, x in enumerate(dist) if i not in support)]


def t64(x: object) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float64)


# B = 2, T = 3, V = 4
STUDENT = [
    [[0.5, -1.0, 2.0, 0.0], [1.5, 0.25, -0.75, 1.0], [0.0, 0.0, 0.0, 0.0]],
    [[-2.0, 1.0, 0.5, 3.0], [0.3, 0.2, 0.1, -0.4], [2.0, -2.0, 1.0, 0.5]],
]
TEACHER = [
    [[1.0, 0.0, 3.0, -1.0], [-0.5, 2.0, 0.5, 0.0], [4.0, 1.0, 0.0, -2.0]],
    [[0.0, 2.5, 1.0, 2.0], [1.0, -1.0, 0.0, 0.5], [3.0, 0.0, -1.0, 1.0]],
]
MASK = [[1, 1, 0], [1, 0, 1]]
LABELS = [[2, -100, 1], [3, 0, -100]]  # with MASK: positions (0,0), (1,0) count


def py_token_mean(beta: float, t: float, counted: list[tuple[int, int]]) -> float:
    vals = [py_gjsd(py_softmax(TEACHER[b][i], t), py_softmax(STUDENT[b][i], t), beta) for b, i in counted]
    return sum(vals) / len(vals)


BETAS = [0.0, 0.25, 0.5, 0.9, 1.0]

# ---------------------------------------------------------------- dense, hand-computed


def test_two_class_jsd_closed_form() -> None:
    # Teacher p = (3/4, 1/4), student q = (1/2, 1/2), beta = 1/2 -> m = (5/8, 3/8).
    kl_pm = 0.75 * math.log(0.75 / 0.625) + 0.25 * math.log(0.25 / 0.375)
    kl_qm = 0.5 * math.log(0.5 / 0.625) + 0.5 * math.log(0.5 / 0.375)
    expected = 0.5 * kl_pm + 0.5 * kl_qm
    student = t64([[[0.0, 0.0]]])
    teacher = t64([[[math.log(3.0), 0.0]]])
    got = token_divergence(student, teacher, divergence="jsd", beta=0.5)
    assert got.item() == pytest.approx(expected, rel=1e-12)
    # The ends: forward KL(p || q) and reverse KL(q || p).
    fwd = 0.75 * math.log(1.5) + 0.25 * math.log(0.5)
    rev = 0.5 * math.log(0.5 / 0.75) + 0.5 * math.log(0.5 / 0.25)
    assert token_divergence(student, teacher).item() == pytest.approx(fwd, rel=1e-12)
    assert token_divergence(student, teacher, divergence="reverse_kl").item() == pytest.approx(rev, rel=1e-12)


@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("t", [1.0, 2.5])
def test_dense_masked_token_mean_hand_computed(beta: float, t: float) -> None:
    all_pos = [(b, i) for b in range(2) for i in range(3)]
    got = token_divergence(t64(STUDENT), t64(TEACHER), divergence="jsd", beta=beta, temperature=t)
    assert got.item() == pytest.approx(py_token_mean(beta, t, all_pos), rel=1e-12)
    masked = token_divergence(
        t64(STUDENT), t64(TEACHER), divergence="jsd", beta=beta, temperature=t, attention_mask=torch.tensor(MASK)
    )
    assert masked.item() == pytest.approx(py_token_mean(beta, t, [(0, 0), (0, 1), (1, 0), (1, 2)]), rel=1e-12)
    both = token_divergence(
        t64(STUDENT), t64(TEACHER), divergence="jsd", beta=beta, temperature=t,
        attention_mask=torch.tensor(MASK), labels=torch.tensor(LABELS),
    )
    assert both.item() == pytest.approx(py_token_mean(beta, t, [(0, 0), (1, 0)]), rel=1e-12)


def test_named_divergences_are_the_jsd_ends() -> None:
    s, tr = t64(STUDENT), t64(TEACHER)
    assert token_divergence(s, tr, divergence="forward_kl").item() == pytest.approx(
        token_divergence(s, tr, divergence="jsd", beta=0.0).item(), rel=1e-14
    )
    assert token_divergence(s, tr, divergence="reverse_kl").item() == pytest.approx(
        token_divergence(s, tr, divergence="jsd", beta=1.0).item(), rel=1e-14
    )
    # beta is ignored for the named KLs
    assert token_divergence(s, tr, divergence="forward_kl", beta=0.7).item() == pytest.approx(
        token_divergence(s, tr).item(), rel=1e-14
    )


def test_reductions() -> None:
    s, tr, mask = t64(STUDENT), t64(TEACHER), torch.tensor(MASK)
    none = token_divergence(s, tr, divergence="jsd", attention_mask=mask, reduction="none")
    assert none.shape == (2, 3)
    assert none[0, 2].item() == 0.0 and none[1, 1].item() == 0.0
    for b in range(2):
        for i in range(3):
            if MASK[b][i]:
                want = py_gjsd(py_softmax(TEACHER[b][i]), py_softmax(STUDENT[b][i]), 0.5)
                assert none[b, i].item() == pytest.approx(want, rel=1e-12)
    total = token_divergence(s, tr, divergence="jsd", attention_mask=mask, reduction="sum")
    assert total.item() == pytest.approx(none.sum().item(), rel=1e-12)
    mean = token_divergence(s, tr, divergence="jsd", attention_mask=mask)
    assert mean.item() == pytest.approx(total.item() / 4, rel=1e-12)


def test_no_counted_position_is_zero_and_differentiable() -> None:
    s = t64(STUDENT).requires_grad_(True)
    loss = token_divergence(s, t64(TEACHER), attention_mask=torch.zeros(2, 3))
    assert loss.item() == 0.0
    loss.backward()
    assert s.grad is not None and torch.count_nonzero(s.grad) == 0


def test_dense_logprobs_are_used_as_sent() -> None:
    # The teacher served log-probabilities at temperature 2; the loss softens the student only.
    s = t64(STUDENT)
    logprobs = torch.log_softmax(t64(TEACHER) / 2.0, dim=-1).to(torch.float16)
    got = token_divergence(s, logprobs, temperature=2.0, teacher_kind="logprobs")
    ref = token_divergence(s, t64(TEACHER), temperature=2.0)  # logits softened by the loss: the same p
    assert got.item() == pytest.approx(ref.item(), rel=2e-3)
    # At T = 1 logits and log-probabilities are interchangeable (a shift does not change a softmax).
    lp1 = torch.log_softmax(t64(TEACHER), dim=-1)
    assert token_divergence(s, lp1, teacher_kind="logprobs").item() == pytest.approx(
        token_divergence(s, t64(TEACHER)).item(), rel=1e-12
    )


# ---------------------------------------------------------------- chunking


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_chunk_size_changes_nothing(beta: float) -> None:
    g = torch.Generator().manual_seed(3)
    teacher = torch.randn(3, 7, 11, generator=g, dtype=torch.float64)
    mask = (torch.rand(3, 7, generator=g) > 0.3).long()
    values, grads = [], []
    for chunk in (1, 2, 5, 21, 1000):
        s = torch.randn(3, 7, 11, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
        s.requires_grad_(True)
        loss = token_divergence(s, teacher, divergence="jsd", beta=beta, attention_mask=mask, chunk_size=chunk)
        loss.backward()
        assert s.grad is not None
        values.append(loss.item())
        grads.append(s.grad)
    for v, gr in zip(values[1:], grads[1:], strict=True):
        assert v == pytest.approx(values[0], rel=1e-12)
        torch.testing.assert_close(gr, grads[0], rtol=1e-10, atol=1e-14)


def test_shifted_student_view_equals_its_copy() -> None:
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(2, 6, 9, generator=g, dtype=torch.float64, requires_grad=True)
    teacher = torch.randn(2, 6, 9, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 9, (2, 6), generator=g)
    kd = TokenKDLoss("jsd", beta=0.3, temperature=2.0, alpha=0.4, chunk_size=4)
    shifted = kd(logits[:, :-1], teacher[:, :-1], labels[:, 1:])  # not viewable as [N, V]
    copied = kd(logits[:, :-1].detach().clone(), teacher[:, :-1].clone(), labels[:, 1:].clone())
    assert shifted.item() == pytest.approx(copied.item(), rel=1e-12)
    shifted.backward()
    assert logits.grad is not None
    assert torch.count_nonzero(logits.grad[:, -1]) == 0 and torch.count_nonzero(logits.grad[:, :-1]) > 0


def test_forward_pass_keeps_no_softmax_alive() -> None:
    # Everything saved for backward is a view of the inputs or smaller than one row: the chunks'
    # softmaxes are recomputed in the backward pass, not kept for all positions.
    g = torch.Generator().manual_seed(6)
    b, t, v = 2, 16, 50
    student = torch.randn(b, t, v, generator=g, requires_grad=True)
    dense = torch.randn(b, t, v, generator=g)
    lp = torch.log_softmax(dense, dim=-1)
    values, indices = lp.topk(5, dim=-1)
    sparse = SparseTargets(values, indices, 1 - values.exp().sum(-1), "logprobs")
    labels = torch.randint(0, v, (b, t), generator=g)
    inputs = {x.untyped_storage().data_ptr() for x in (student, dense, values, indices, sparse.tail, labels)}
    cases = [(student[:, :-1], dense[:, :-1], labels[:, 1:]), (student, sparse, labels)]
    for student_in, teacher, labels_in in cases:
        saved: list[torch.Tensor] = []

        def pack(x: torch.Tensor, saved: list[torch.Tensor] = saved) -> torch.Tensor:
            saved.append(x)
            return x

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
            loss = TokenKDLoss("jsd", alpha=0.5, chunk_size=4)(student_in, teacher, labels_in)
        assert saved
        for x in saved:
            assert x.untyped_storage().data_ptr() in inputs or x.numel() < v, (x.shape, x.dtype)
        loss.backward()


# ---------------------------------------------------------------- sparse top-k


@pytest.mark.parametrize("beta", BETAS)
def test_sparse_with_k_equal_v_equals_dense(beta: float) -> None:
    g = torch.Generator().manual_seed(7)
    s = torch.randn(2, 4, 6, generator=g, dtype=torch.float64)
    teacher = torch.randn(2, 4, 6, generator=g, dtype=torch.float64) * 2
    values, indices = teacher.topk(6, dim=-1)
    perm = torch.randperm(6, generator=g)
    sparse = SparseTargets(values[..., perm], indices[..., perm].to(torch.int32))
    dense = token_divergence(s, teacher, divergence="jsd", beta=beta, temperature=1.5)
    got = token_divergence(s, sparse, divergence="jsd", beta=beta, temperature=1.5)
    assert got.item() == pytest.approx(dense.item(), rel=1e-12)


@pytest.mark.parametrize("beta", [0.0, 0.25, 0.5, 0.9])
def test_sparse_equals_dense_when_the_teacher_mass_is_inside_the_top_k(beta: float) -> None:
    # Teacher logits -inf outside its top 3 of 6: p is 0 there, exactly what sparse targets without a
    # tail (or with a tail of 0) say. Sparse == dense for the forward KL and the JSD. (The reverse KL
    # is infinite for such a teacher in the dense formula too: it is tested with a tail below.)
    g = torch.Generator().manual_seed(8)
    s = torch.randn(2, 5, 6, generator=g, dtype=torch.float64)
    raw = torch.randn(2, 5, 6, generator=g, dtype=torch.float64)
    values, indices = raw.topk(3, dim=-1)
    teacher = torch.full_like(raw, float("-inf")).scatter(-1, indices, values)
    t = 2.0
    dense = token_divergence(s, teacher, divergence="jsd", beta=beta, temperature=t)
    assert torch.isfinite(dense)
    no_tail = token_divergence(s, SparseTargets(values, indices), divergence="jsd", beta=beta, temperature=t)
    assert no_tail.item() == pytest.approx(dense.item(), rel=1e-12)
    lp = torch.log_softmax(values / t, dim=-1)
    zero_tail = SparseTargets(lp, indices, torch.zeros(2, 5, dtype=torch.float64), "logprobs")
    got = token_divergence(s, zero_tail, divergence="jsd", beta=beta, temperature=t)
    assert got.item() == pytest.approx(dense.item(), rel=1e-12)


@pytest.mark.parametrize("beta", BETAS)
def test_tail_bin_is_exact_when_the_rest_has_the_students_shape(beta: float) -> None:
    # Off the top-k the teacher's distribution is proportional to the student's: lumping the rest
    # into one bin then loses nothing, so the sparse divergence with a tail equals the dense one
    # (reverse KL included).
    g = torch.Generator().manual_seed(9)
    t, k, v = 1.5, 3, 8
    s = torch.randn(2, 4, v, generator=g, dtype=torch.float64)
    indices = torch.stack([torch.randperm(v, generator=g)[:k] for _ in range(8)]).reshape(2, 4, k)
    teacher = (s + 0.7 * t).scatter(-1, indices, torch.randn(2, 4, k, generator=g, dtype=torch.float64) * 3)
    p = torch.softmax(teacher / t, dim=-1)
    lp = torch.log(p.gather(-1, indices))
    tail = 1 - p.gather(-1, indices).sum(-1)
    sparse = SparseTargets(lp.to(torch.float64), indices, tail, "logprobs")
    dense = token_divergence(s, teacher, divergence="jsd", beta=beta, temperature=t)
    got = token_divergence(s, sparse, divergence="jsd", beta=beta, temperature=t)
    assert got.item() == pytest.approx(dense.item(), rel=1e-10)


def test_sparse_tail_hand_computed() -> None:
    # V = 5, k = 2; teacher log-probabilities of classes 3 and 0, tail mass 0.2.
    t = 2.0
    student = [1.0, -0.5, 0.0, 2.0, 0.5]
    support = [3, 0]
    p_top = [0.5, 0.3]
    q = py_softmax(student, t)
    p_bins = [*p_top, 0.2]
    q_bins = py_lump(q, support)
    st_ = SparseTargets(t64([[[math.log(x) for x in p_top]]]), torch.tensor([[support]]), t64([[0.2]]), "logprobs")
    for beta in BETAS:
        want = py_gjsd(p_bins, q_bins, beta)
        got = token_divergence(t64([[student]]), st_, divergence="jsd", beta=beta, temperature=t)
        assert got.item() == pytest.approx(want, rel=1e-12)
    # Without a tail: the teacher's bins are renormalised and its tail bin is 0.
    st0 = SparseTargets(t64([[[math.log(x) for x in p_top]]]), torch.tensor([[support]]), kind="logprobs")
    p0 = [0.5 / 0.8, 0.3 / 0.8, 0.0]
    for beta in (0.0, 0.5):
        got = token_divergence(t64([[student]]), st0, divergence="jsd", beta=beta, temperature=t)
        assert got.item() == pytest.approx(py_gjsd(p0, q_bins, beta), rel=1e-12)


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 10_000), st.sampled_from(BETAS), st.integers(1, 5))
def test_tail_bin_never_exceeds_the_dense_divergence(seed: int, beta: float, k: int) -> None:
    # Lumping classes is a deterministic channel; every divergence here shrinks under it.
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(1, 3, 6, generator=g, dtype=torch.float64) * 2
    teacher = torch.randn(1, 3, 6, generator=g, dtype=torch.float64) * 2
    lp = torch.log_softmax(teacher, dim=-1)
    values, indices = lp.topk(k, dim=-1)
    sparse = SparseTargets(values, indices, 1 - values.exp().sum(-1), "logprobs")
    dense = token_divergence(s, teacher, divergence="jsd", beta=beta, reduction="none")
    lumped = token_divergence(s, sparse, divergence="jsd", beta=beta, reduction="none")
    assert bool((lumped <= dense + 1e-12).all())
    assert bool((lumped >= -1e-12).all())


def test_reverse_kl_on_top_k_without_tail_is_refused() -> None:
    s = torch.zeros(1, 2, 5)
    targets = SparseTargets(torch.zeros(1, 2, 3), torch.tensor([[[0, 1, 2], [2, 3, 4]]]))
    with pytest.raises(ValueError, match="needs the teacher's tail mass"):
        token_divergence(s, targets, divergence="reverse_kl")
    with pytest.raises(ValueError, match="needs the teacher's tail mass"):
        TokenKDLoss("jsd", beta=1.0)(s, targets)
    assert torch.isfinite(token_divergence(s, targets, divergence="jsd", beta=0.99))
    full = SparseTargets(torch.zeros(1, 2, 5), torch.arange(5).expand(1, 2, 5))
    assert token_divergence(s, full, divergence="reverse_kl").item() == pytest.approx(0.0, abs=1e-7)


def test_half_precision_wire_targets() -> None:
    g = torch.Generator().manual_seed(10)
    s = torch.randn(2, 3, 40, generator=g).to(torch.bfloat16).requires_grad_(True)
    lp = torch.log_softmax(torch.randn(2, 3, 40, generator=g) * 4, dim=-1)
    values, indices = lp.topk(8, dim=-1)
    tail = 1 - values.exp().sum(-1)
    wire = SparseTargets(values.half(), indices.to(torch.int32), tail.to(torch.bfloat16), "logprobs")
    exact = SparseTargets(values.double(), indices, tail.double(), "logprobs")
    loss = token_divergence(s, wire, divergence="jsd")
    ref = token_divergence(s.detach().double(), exact, divergence="jsd")
    assert loss.dtype == torch.float32
    assert loss.item() == pytest.approx(ref.item(), rel=2e-2)
    loss.backward()
    assert s.grad is not None and s.grad.dtype == torch.bfloat16


# ---------------------------------------------------------------- gradients


@pytest.mark.parametrize("beta", [0.0, 0.4, 1.0])
def test_gradcheck_dense(beta: float) -> None:
    g = torch.Generator().manual_seed(11)
    s = torch.randn(2, 3, 4, generator=g, dtype=torch.float64, requires_grad=True)
    teacher = torch.randn(2, 3, 4, generator=g, dtype=torch.float64)
    mask = torch.tensor(MASK)
    assert torch.autograd.gradcheck(
        lambda x: token_divergence(
            x, teacher, divergence="jsd", beta=beta, temperature=1.7, attention_mask=mask, chunk_size=2
        ),
        (s,),
    )


@pytest.mark.parametrize("beta", [0.0, 0.4, 1.0])
def test_gradcheck_sparse_with_tail(beta: float) -> None:
    g = torch.Generator().manual_seed(12)
    s = torch.randn(2, 3, 6, generator=g, dtype=torch.float64, requires_grad=True)
    lp = torch.log_softmax(torch.randn(2, 3, 6, generator=g, dtype=torch.float64), dim=-1)
    values, indices = lp.topk(2, dim=-1)
    sparse = SparseTargets(values, indices, 1 - values.exp().sum(-1), "logprobs")
    assert torch.autograd.gradcheck(
        lambda x: token_divergence(x, sparse, divergence="jsd", beta=beta, temperature=1.3, chunk_size=4),
        (s,),
    )


def test_gradcheck_sparse_logits_without_tail_and_module_mix() -> None:
    g = torch.Generator().manual_seed(13)
    s = torch.randn(2, 3, 5, generator=g, dtype=torch.float64, requires_grad=True)
    values, indices = torch.randn(2, 3, 5, generator=g, dtype=torch.float64).topk(3, dim=-1)
    labels = torch.tensor(LABELS)
    kd = TokenKDLoss("jsd", beta=0.5, temperature=2.0, alpha=0.3, chunk_size=2)
    assert torch.autograd.gradcheck(lambda x: kd(x, SparseTargets(values, indices), labels), (s,))


def test_gradient_reaches_the_student_only() -> None:
    s = t64(STUDENT).requires_grad_(True)
    teacher = t64(TEACHER).requires_grad_(True)
    values = torch.randn(2, 3, 2, dtype=torch.float64, requires_grad=True)
    sparse = SparseTargets(values, torch.tensor([[[0, 1]] * 3] * 2))
    (TokenKDLoss("jsd")(s, teacher) + TokenKDLoss("jsd")(s, sparse)).backward()
    assert teacher.grad is None and values.grad is None
    assert s.grad is not None and torch.count_nonzero(s.grad) > 0


# ---------------------------------------------------------------- the module


def test_module_mixes_hard_and_soft_with_t_squared() -> None:
    t, alpha = 2.0, 0.3
    s, tr, labels, mask = t64(STUDENT), t64(TEACHER), torch.tensor(LABELS), torch.tensor(MASK)
    counted = [(0, 0), (1, 0)]
    ce = sum(-math.log(py_softmax(STUDENT[b][i])[LABELS[b][i]]) for b, i in counted) / 2
    soft = py_token_mean(0.5, t, counted)
    kd = TokenKDLoss("jsd", beta=0.5, temperature=t, alpha=alpha)
    got = kd(s, tr, labels, mask)
    assert got.item() == pytest.approx(alpha * ce + (1 - alpha) * t * t * soft, rel=1e-12)
    none = TokenKDLoss("jsd", beta=0.5, temperature=t, alpha=alpha, reduction="none")(s, tr, labels, mask)
    assert none.shape == (2, 3) and none.sum().item() == pytest.approx(2 * got.item(), rel=1e-12)


def test_module_teacher_none_is_unweighted_token_cross_entropy() -> None:
    s, labels = t64(STUDENT), torch.tensor(LABELS)
    counted = [(b, i) for b in range(2) for i in range(3) if LABELS[b][i] != -100]
    ce = sum(-math.log(py_softmax(STUDENT[b][i])[LABELS[b][i]]) for b, i in counted) / len(counted)
    for alpha in (0.0, 0.5):
        assert TokenKDLoss(alpha=alpha, temperature=4.0)(s, None, labels).item() == pytest.approx(ce, rel=1e-12)
    with pytest.raises(ValueError, match="no labels"):
        TokenKDLoss()(s, None)
    with pytest.raises(ValueError, match=r"alpha=0\.5 needs labels"):
        TokenKDLoss(alpha=0.5)(s, t64(TEACHER))


def test_validation_messages() -> None:
    s = torch.zeros(2, 3, 4)
    unknown: Any = "kl"
    two_teachers: Any = [s, s]
    with pytest.raises(ValueError, match=r"\(2, 3, 4\) and teacher values \(2, 3, 5\)"):
        token_divergence(s, torch.zeros(2, 3, 5))
    with pytest.raises(ValueError, match=r"sparse teacher targets \(2, 2, 2\)"):
        token_divergence(s, SparseTargets(torch.zeros(2, 2, 2), torch.zeros(2, 2, 2, dtype=torch.int64)))
    with pytest.raises(ValueError, match=r"attention_mask \(2, 4\) must have the positions' shape \(2, 3\)"):
        token_divergence(s, s, attention_mask=torch.ones(2, 4))
    with pytest.raises(ValueError, match="integer token ids"):
        token_divergence(s, s, labels=torch.zeros(2, 3))
    with pytest.raises(ValueError, match="divergence must be one of"):
        token_divergence(s, s, divergence=unknown)
    with pytest.raises(ValueError, match=r"beta .* must be in \[0, 1\]"):
        TokenKDLoss("jsd", beta=1.5)
    with pytest.raises(ValueError, match="chunk_size must be an int >= 1"):
        TokenKDLoss(chunk_size=0)
    with pytest.raises(ValueError, match="reduction must be one of token_mean"):
        TokenKDLoss(reduction=unknown)
    with pytest.raises(ValueError, match="teacher_kind must be 'logits' or 'logprobs'"):
        TokenKDLoss(teacher_kind=unknown)
    with pytest.raises(TypeError, match="token losses take one teacher"):
        TokenKDLoss()(s, two_teachers)
    assert "divergence='jsd', beta=0.5" in repr(TokenKDLoss("jsd"))


# ---------------------------------------------------------------- SparseTargets additions


def test_sparse_targets_tail_and_kind_validation() -> None:
    v, i = torch.zeros(2, 3, 4), torch.zeros(2, 3, 4, dtype=torch.int64)
    unknown: Any = "probs"
    with pytest.raises(ValueError, match="kind='logprobs'"):
        SparseTargets(v, i, torch.zeros(2, 3))
    with pytest.raises(ValueError, match=r"tail \(2, 4\) must have the values' shape"):
        SparseTargets(v, i, torch.zeros(2, 4), "logprobs")
    with pytest.raises(ValueError, match="kind must be 'logits' or 'logprobs'"):
        SparseTargets(v, i, kind=unknown)
    st_ = SparseTargets(v, i, torch.full((2, 3), 0.5), "logprobs")
    with pytest.raises(ValueError, match="without_tail"):
        st_.to_dense(8)
    assert st_.without_tail().to_dense(8).shape == (2, 3, 8)
    # exp(0) = 1 for each of 4 classes plus a tail of 0.5: renormalised to 1/4.5 and 0.5/4.5
    torch.testing.assert_close(st_.probs(), torch.full((2, 3, 4), 1 / 4.5))


def test_sparse_from_outputs_picks_up_the_tail() -> None:
    outputs = {
        "LOGITS_TOPK_VALUES": torch.log(torch.tensor([[[0.5, 0.25]]], dtype=torch.float16)),
        "LOGITS_TOPK_INDICES": torch.tensor([[[3, 1]]], dtype=torch.int32),
        "LOGITS_TOPK_TAIL": torch.tensor([[0.25]], dtype=torch.bfloat16),
    }
    st_ = SparseTargets.from_outputs(outputs, "LOGITS", kind="logprobs")
    assert st_.tail is not None and st_.kind == "logprobs" and st_.k == 2
    assert torch.isfinite(TokenKDLoss("reverse_kl")(torch.zeros(1, 1, 6), st_))


def test_teacher_alias_is_renamed_with_a_deprecation_warning() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        old = distill.losses.Teacher
    assert old is TeacherTargets
    assert any(issubclass(w.category, DeprecationWarning) and "TeacherTargets" in str(w.message) for w in caught)
    assert "Teacher" not in distill.losses.__all__
    with pytest.raises(AttributeError):
        _ = distill.losses.NoSuchName


# ---------------------------------------------------------------- KDLoss with the new targets


def test_kdloss_takes_logprobs_with_a_tail() -> None:
    t = 2.0
    student = [[1.0, -0.5, 0.0, 2.0, 0.5], [0.0, 1.0, 2.0, 3.0, 4.0]]
    support = [[3, 0], [4, 1]]
    p_top = [[0.5, 0.3], [0.6, 0.1]]
    tails = [0.2, 0.3]
    expected = 0.0
    for s, idx, p, tail in zip(student, support, p_top, tails, strict=True):
        expected += py_kl([*p, tail], py_lump(py_softmax(s, t), idx))
    expected = t * t * expected / 2
    targets = SparseTargets(t64(p_top).log(), torch.tensor(support), t64(tails), "logprobs")
    loss = KDLoss(temperature=t, alpha=0.0)(t64(student), targets)
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    # The per-token loss agrees with the classifier one on [N, V] rows (up to the T² factor).
    per_token = token_divergence(t64(student), targets, temperature=t)
    assert (t * t * per_token).item() == pytest.approx(expected, rel=1e-12)


def test_kdloss_refuses_per_token_and_tail_averaging() -> None:
    per_token = SparseTargets(torch.zeros(2, 3, 2), torch.zeros(2, 3, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match="TokenKDLoss"):
        KDLoss(alpha=0.0)(torch.zeros(2, 4), per_token)
    tailed = SparseTargets(torch.zeros(2, 2), torch.tensor([[0, 1], [2, 3]]), torch.full((2,), 0.5), "logprobs")
    with pytest.raises(ValueError, match="without_tail"):
        KDLoss(alpha=0.0)(torch.zeros(2, 4), [torch.zeros(2, 4), tailed])


def test_reverse_kl_with_an_underflowed_tail_stays_finite() -> None:
    # A tail of exactly 0 (fp16 underflow) counts as the smallest normal float: large but finite.
    s = torch.randn(1, 3, 6, generator=torch.Generator().manual_seed(14), requires_grad=True)
    targets = SparseTargets(
        torch.log(torch.tensor([[[0.5, 0.5]] * 3], dtype=torch.float16)),
        torch.tensor([[[0, 1]] * 3]),
        torch.zeros(1, 3, dtype=torch.float16),
        "logprobs",
    )
    loss = token_divergence(s, targets, divergence="reverse_kl", reduction="none")
    assert loss.shape == (1, 3) and bool(torch.isfinite(loss).all()) and bool((loss > 1.0).all())
    loss.sum().backward()
    assert s.grad is not None and bool(torch.isfinite(s.grad).all())
