"""KD losses against numbers computed by hand (plain ``math``), not by torch's own functions."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from distill import KDLoss, SparseTargets
from distill.losses import average_teachers, kd_kl_div, soft_targets

# ---------------------------------------------------------------- plain-Python reference maths


def py_softmax(logits: list[float], t: float = 1.0) -> list[float]:
    m = max(x / t for x in logits)
    exps = [math.exp(x / t - m) for x in logits]
    z = sum(exps)
    return [e / z for e in exps]


def py_kl(p: list[float], q: list[float]) -> float:
    """KL(p || q) with 0 log 0 = 0."""
    return sum(pi * (math.log(pi) - math.log(qi)) for pi, qi in zip(p, q, strict=True) if pi > 0)


def py_ce(logits: list[float], label: int) -> float:
    return -math.log(py_softmax(logits)[label])


def py_soft_term(student: list[list[float]], teacher_p: list[list[float]], t: float) -> float:
    """T^2 * batch mean of KL(p || softmax(s / T))."""
    kls = [py_kl(p, py_softmax(s, t)) for s, p in zip(student, teacher_p, strict=True)]
    return t * t * sum(kls) / len(kls)


def py_hard_term(student: list[list[float]], labels: list[int]) -> float:
    return sum(py_ce(s, y) for s, y in zip(student, labels, strict=True)) / len(labels)


def tensor(rows: list[list[float]], dtype: torch.dtype = torch.float64) -> torch.Tensor:
    return torch.tensor(rows, dtype=dtype)


STUDENT3 = [[0.5, -1.0, 2.0], [1.5, 0.25, -0.75]]
TEACHER3 = [[1.0, 0.0, 3.0], [-0.5, 2.0, 0.5]]
LABELS3 = [2, 1]


# ---------------------------------------------------------------- hand-computed examples


def test_two_class_closed_form() -> None:
    # Student [0, 0] -> q = (1/2, 1/2) at any T. Teacher [2 ln 3, 0] at T = 2 -> [ln 3, 0] -> p = (3/4, 1/4).
    t = 2.0
    kl = 0.75 * math.log(0.75 / 0.5) + 0.25 * math.log(0.25 / 0.5)
    ce = math.log(2.0)  # -log(1/2) for either label, always at T = 1
    expected = 0.5 * ce + 0.5 * t * t * kl
    loss = KDLoss(temperature=t, alpha=0.5)(
        tensor([[0.0, 0.0]]), tensor([[2 * math.log(3.0), 0.0]]), torch.tensor([0])
    )
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    assert expected == pytest.approx(0.5 * 0.693147 + 0.5 * 4 * 0.130812, abs=1e-5)  # the numbers by hand


def test_three_class_batch_hand_computed() -> None:
    t, alpha = 3.0, 0.25
    p = [py_softmax(row, t) for row in TEACHER3]
    hard = py_hard_term(STUDENT3, LABELS3)
    soft = py_soft_term(STUDENT3, p, t)
    kd = KDLoss(temperature=t, alpha=alpha)
    loss = kd(tensor(STUDENT3), tensor(TEACHER3), torch.tensor(LABELS3))
    assert loss.item() == pytest.approx(alpha * hard + (1 - alpha) * soft, rel=1e-12)

    # float32 inputs give float32 results, same value to float precision
    loss32 = kd(tensor(STUDENT3, torch.float32), tensor(TEACHER3, torch.float32), torch.tensor(LABELS3))
    assert loss32.dtype == torch.float32
    assert loss32.item() == pytest.approx(alpha * hard + (1 - alpha) * soft, rel=1e-5)


def test_reductions_sum_and_none() -> None:
    t, alpha = 2.0, 0.5
    per_sample = [
        alpha * py_ce(s, y) + (1 - alpha) * t * t * py_kl(py_softmax(tr, t), py_softmax(s, t))
        for s, tr, y in zip(STUDENT3, TEACHER3, LABELS3, strict=True)
    ]
    args = (tensor(STUDENT3), tensor(TEACHER3), torch.tensor(LABELS3))
    none = KDLoss(t, alpha, reduction="none")(*args)
    assert none.shape == (2,)
    assert none.tolist() == pytest.approx(per_sample, rel=1e-12)
    assert KDLoss(t, alpha, reduction="sum")(*args).item() == pytest.approx(sum(per_sample), rel=1e-12)
    assert KDLoss(t, alpha)(*args).item() == pytest.approx(sum(per_sample) / 2, rel=1e-12)


# ---------------------------------------------------------------- temperature and alpha


@pytest.mark.parametrize("t", [0.5, 1.0, 2.0, 7.0])
def test_alpha_one_is_cross_entropy_independent_of_temperature(t: float) -> None:
    loss = KDLoss(temperature=t, alpha=1.0)(tensor(STUDENT3), tensor(TEACHER3), torch.tensor(LABELS3))
    assert loss.item() == pytest.approx(py_hard_term(STUDENT3, LABELS3), rel=1e-12)


@pytest.mark.parametrize("t", [0.5, 1.0, 2.0, 7.0])
def test_alpha_zero_is_t_squared_kl(t: float) -> None:
    # No labels needed; the value is T^2 times the KL at temperature T.
    loss = KDLoss(temperature=t, alpha=0.0)(tensor(STUDENT3), tensor(TEACHER3))
    kl_t = py_soft_term(STUDENT3, [py_softmax(r, t) for r in TEACHER3], t) / (t * t)
    assert loss.item() == pytest.approx(t * t * kl_t, rel=1e-12)


def test_t_squared_multiplies_the_soft_term_only() -> None:
    labels = torch.tensor(LABELS3)
    hard = py_hard_term(STUDENT3, LABELS3)
    for t in (1.0, 4.0):
        loss = KDLoss(temperature=t, alpha=0.5)(tensor(STUDENT3), tensor(TEACHER3), labels).item()
        soft = py_soft_term(STUDENT3, [py_softmax(r, t) for r in TEACHER3], t)
        assert loss - 0.5 * soft == pytest.approx(0.5 * hard, rel=1e-12)


def test_large_temperature_soft_term_tends_to_logit_matching() -> None:
    # Hinton et al.: as T grows, T^2 KL -> (1 / 2C) sum ((s - mean s) - (t - mean t))^2 per sample.
    s, tr = STUDENT3[0], TEACHER3[0]
    c = len(s)
    sc = [x - sum(s) / c for x in s]
    tc = [x - sum(tr) / c for x in tr]
    limit = sum((a - b) ** 2 for a, b in zip(sc, tc, strict=True)) / (2 * c)
    loss = KDLoss(temperature=1000.0, alpha=0.0)(tensor([s]), tensor([tr]))
    assert loss.item() == pytest.approx(limit, rel=1e-3)


def test_alpha_one_still_checks_teacher_shape() -> None:
    with pytest.raises(ValueError, match=r"\(2, 3\).*\(2, 4\)"):
        KDLoss(alpha=1.0)(torch.zeros(2, 3), torch.zeros(2, 4), torch.tensor([0, 1]))


# ---------------------------------------------------------------- multi-teacher


def test_multi_teacher_averages_probabilities_not_logits() -> None:
    t = 2.0
    t1 = [[4.0, 0.0, 0.0], [0.0, 1.0, 0.0]]
    t2 = [[0.0, 0.0, 4.0], [2.0, 0.0, -2.0]]
    p = [
        [(a + b) / 2 for a, b in zip(py_softmax(r1, t), py_softmax(r2, t), strict=True)]
        for r1, r2 in zip(t1, t2, strict=True)
    ]
    expected = py_soft_term(STUDENT3, p, t)
    kd = KDLoss(temperature=t, alpha=0.0)
    for teachers in ([tensor(t1), tensor(t2)], (tensor(t1), tensor(t2))):
        assert kd(tensor(STUDENT3), teachers).item() == pytest.approx(expected, rel=1e-12)

    # Logit averaging is a different target (geometric mean), available explicitly.
    logit_avg = [[(a + b) / 2 for a, b in zip(r1, r2, strict=True)] for r1, r2 in zip(t1, t2, strict=True)]
    by_logits = kd(tensor(STUDENT3), average_teachers([tensor(t1), tensor(t2)])).item()
    assert by_logits == pytest.approx(py_soft_term(STUDENT3, [py_softmax(r, t) for r in logit_avg], t))
    assert by_logits != pytest.approx(expected, rel=1e-3)


def test_single_teacher_list_equals_tensor() -> None:
    kd = KDLoss(temperature=3.0, alpha=0.5)
    args = (tensor(STUDENT3), torch.tensor(LABELS3))
    assert kd(args[0], [tensor(TEACHER3)], args[1]).item() == pytest.approx(
        kd(args[0], tensor(TEACHER3), args[1]).item(), rel=1e-12
    )


def test_average_teachers_is_mean_of_logits_in_float32() -> None:
    a = torch.tensor([[1.0, 2.0]], dtype=torch.float16)
    b = torch.tensor([[3.0, -2.0]], dtype=torch.bfloat16)
    avg = average_teachers([a, b])
    assert avg.dtype == torch.float32
    assert avg.tolist() == [[2.0, 0.0]]
    with pytest.raises(ValueError, match="non-empty"):
        average_teachers([])
    with pytest.raises(ValueError, match=r"\(1, 2\).*\(1, 3\)"):
        average_teachers([a, torch.zeros(1, 3)])


# ---------------------------------------------------------------- sparse top-k


def test_sparse_with_k_equal_c_equals_dense() -> None:
    g = torch.Generator().manual_seed(0)
    student = torch.randn(5, 7, generator=g, dtype=torch.float64)
    teacher = torch.randn(5, 7, generator=g, dtype=torch.float64) * 3
    labels = torch.randint(0, 7, (5,), generator=g)
    values, indices = teacher.topk(7, dim=1)
    kd = KDLoss(temperature=2.5, alpha=0.3)
    dense = kd(student, teacher, labels)
    sparse = kd(student, SparseTargets(values, indices), labels)
    assert sparse.item() == pytest.approx(dense.item(), rel=1e-12)
    # Order within a row does not matter.
    perm = torch.randperm(7, generator=g)
    shuffled = SparseTargets(values[:, perm], indices[:, perm].to(torch.int32))
    assert kd(student, shuffled, labels).item() == pytest.approx(dense.item(), rel=1e-12)


def test_sparse_with_k_less_than_c_hand_computed() -> None:
    t = 2.0
    student = [[1.0, 0.0, -1.0, 2.0], [0.5, 0.5, 3.0, -2.0]]
    values = [[3.0, 1.0], [4.0, 2.5]]  # teacher logits of its top two classes
    indices = [[3, 0], [2, 1]]
    expected = 0.0
    for s, v, idx in zip(student, values, indices, strict=True):
        p = py_softmax(v, t)  # renormalised over the top-k support
        q = py_softmax(s, t)  # student over all C classes
        expected += sum(pk * (math.log(pk) - math.log(q[i])) for pk, i in zip(p, idx, strict=True))
    expected = t * t * expected / 2

    targets = SparseTargets(tensor(values), torch.tensor(indices))
    kd = KDLoss(temperature=t, alpha=0.0)
    assert kd(tensor(student), targets).item() == pytest.approx(expected, rel=1e-12)
    # The same as a dense teacher distribution with zeros off the support.
    dense_p = targets.to_dense(4, t)
    assert dense_p.tolist()[0][1] == 0.0
    assert kd_kl_div(tensor(student), dense_p, t).item() == pytest.approx(expected, rel=1e-12)


def test_sparse_mixed_with_dense_teacher() -> None:
    t = 1.5
    student = [[1.0, 0.0, -1.0]]
    dense_teacher = [[0.0, 2.0, 1.0]]
    p_sparse = [0.0, 0.0, 0.0]
    for pk, i in zip(py_softmax([2.0, 1.0], t), [0, 2], strict=True):
        p_sparse[i] = pk
    p = [(a + b) / 2 for a, b in zip(py_softmax(dense_teacher[0], t), p_sparse, strict=True)]
    expected = py_soft_term(student, [p], t)
    teachers = [tensor(dense_teacher), SparseTargets(tensor([[2.0, 1.0]]), torch.tensor([[0, 2]]))]
    loss = KDLoss(temperature=t, alpha=0.0)(tensor(student), teachers)
    assert loss.item() == pytest.approx(expected, rel=1e-12)


def test_sparse_from_outputs() -> None:
    outputs = {
        "LOGITS_TOPK_VALUES": torch.tensor([[2.0, 1.0]], dtype=torch.float16),
        "LOGITS_TOPK_INDICES": torch.tensor([[4, 1]], dtype=torch.int32),
    }
    st_ = SparseTargets.from_outputs(outputs, "LOGITS")
    assert st_.k == 2
    assert st_.indices.dtype == torch.int32
    assert st_.probs(1.0).dtype == torch.float32
    loss = KDLoss(alpha=0.0)(torch.zeros(1, 5, requires_grad=True), st_)
    assert torch.isfinite(loss)
    with pytest.raises(KeyError, match="OUT_TOPK_VALUES, OUT_TOPK_INDICES"):
        SparseTargets.from_outputs(outputs, "OUT")


@pytest.mark.parametrize(
    ("values", "indices", "match"),
    [
        (torch.zeros(2, 3), torch.zeros(2, 2, dtype=torch.int64), "same shape"),
        (torch.zeros(3), torch.zeros(3, dtype=torch.int64), r"shape \[N, k\]"),
        (torch.zeros(2, 0), torch.zeros(2, 0, dtype=torch.int64), "k >= 1"),
        (torch.zeros(2, 2), torch.zeros(2, 2), "int64 or int32"),
        (torch.zeros(2, 2, dtype=torch.int64), torch.zeros(2, 2, dtype=torch.int64), "floating point"),
    ],
)
def test_sparse_targets_validation(values: torch.Tensor, indices: torch.Tensor, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SparseTargets(values, indices)


def test_sparse_shape_mismatch_with_student() -> None:
    kd = KDLoss(alpha=0.0)
    with pytest.raises(ValueError, match=r"\(2, 3\).*\(2, 4\)"):
        kd(torch.zeros(2, 3), SparseTargets(torch.zeros(2, 4), torch.zeros(2, 4, dtype=torch.int64)))
    with pytest.raises(ValueError, match=r"\(2, 3\).*\(1, 2\)"):
        kd(torch.zeros(2, 3), SparseTargets(torch.zeros(1, 2), torch.zeros(1, 2, dtype=torch.int64)))


# ---------------------------------------------------------------- gradients and dtypes


def test_gradient_reaches_student_only_and_is_t_times_q_minus_p() -> None:
    t = 2.0
    student = tensor(STUDENT3).requires_grad_(True)
    teacher = tensor(TEACHER3).requires_grad_(True)
    KDLoss(temperature=t, alpha=0.0)(student, teacher).backward()
    assert teacher.grad is None
    assert student.grad is not None
    # d/ds [T^2 KL(p || softmax(s/T))] / N = T (q - p) / N
    n = len(STUDENT3)
    expected = [
        [t * (qi - pi) / n for qi, pi in zip(py_softmax(s, t), py_softmax(tr, t), strict=True)]
        for s, tr in zip(STUDENT3, TEACHER3, strict=True)
    ]
    for got_row, want_row in zip(student.grad.tolist(), expected, strict=True):
        assert got_row == pytest.approx(want_row, rel=1e-10, abs=1e-14)


def test_gradient_with_sparse_and_multi_teacher_does_not_touch_teachers() -> None:
    student = torch.randn(3, 4, requires_grad=True)
    dense = torch.randn(3, 4, requires_grad=True)
    values = torch.randn(3, 2, requires_grad=True)
    sparse = SparseTargets(values, torch.tensor([[0, 1], [2, 3], [1, 0]]))
    loss = KDLoss(alpha=0.5)(student, [dense, sparse], torch.tensor([0, 1, 2]))
    loss.backward()
    assert dense.grad is None and values.grad is None
    assert student.grad is not None and torch.count_nonzero(student.grad) > 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_teacher_is_computed_in_float32(dtype: torch.dtype) -> None:
    # exp(30) overflows fp16 (max 65504); the loss must still be finite and match float32.
    teacher32 = torch.tensor([[30.0, 0.0, -10.0], [1.0, 2.0, 3.0]])
    student = torch.tensor([[2.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    kd = KDLoss(temperature=1.0, alpha=0.0)
    ref = kd(student, teacher32)
    half = kd(student, teacher32.to(dtype))
    assert half.dtype == torch.float32
    assert torch.isfinite(half)
    assert half.item() == pytest.approx(ref.item(), rel=1e-2)
    assert soft_targets(teacher32.to(dtype), 1.0).dtype == torch.float32


def test_half_precision_student_gets_float32_loss_and_half_grad() -> None:
    student = torch.tensor([[2.0, 1.0, 0.0]], dtype=torch.float16, requires_grad=True)
    loss = KDLoss(alpha=0.5)(student, torch.tensor([[0.0, 1.0, 2.0]], dtype=torch.bfloat16), torch.tensor([1]))
    assert loss.dtype == torch.float32
    loss.backward()
    assert student.grad is not None and student.grad.dtype == torch.float16


# ---------------------------------------------------------------- torch's formulation and helpers


@pytest.mark.parametrize("t", [1.0, 4.0])
def test_matches_torch_kl_div_batchmean_times_t_squared(t: float) -> None:
    g = torch.Generator().manual_seed(1)
    s = torch.randn(8, 10, generator=g)
    tr = torch.randn(8, 10, generator=g) * 2
    ref = F.kl_div(F.log_softmax(s / t, dim=1), F.softmax(tr / t, dim=1), reduction="batchmean") * t * t
    assert KDLoss(temperature=t, alpha=0.0)(s, tr).item() == pytest.approx(ref.item(), rel=1e-5)
    assert kd_kl_div(s, soft_targets(tr, t), t).item() == pytest.approx(ref.item(), rel=1e-5)
    labels = torch.randint(0, 10, (8,), generator=g)
    mixed = KDLoss(temperature=t, alpha=0.4)(s, tr, labels)
    assert mixed.item() == pytest.approx((0.4 * F.cross_entropy(s, labels) + 0.6 * ref).item(), rel=1e-5)


def test_soft_targets_is_a_detached_distribution() -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0]], requires_grad=True)
    p = soft_targets(logits, 2.0)
    assert not p.requires_grad
    assert p.tolist()[0] == pytest.approx(py_softmax([1.0, 2.0, 3.0], 2.0))


@settings(max_examples=30, deadline=None)
@given(
    st.lists(st.floats(-20, 20), min_size=2, max_size=6),
    st.floats(0.1, 10.0),
)
def test_soft_term_is_nonnegative_and_zero_on_agreement(logits: list[float], t: float) -> None:
    s = tensor([logits])
    kd = KDLoss(temperature=t, alpha=0.0)
    assert kd(s, s + 5.0).item() == pytest.approx(0.0, abs=1e-9)  # a shift is the same distribution
    assert kd(s, s.flip(1)).item() >= -1e-12


# ---------------------------------------------------------------- hard-label fallback and errors


def test_teacher_none_is_unweighted_cross_entropy() -> None:
    hard = py_hard_term(STUDENT3, LABELS3)
    for alpha in (0.0, 0.3, 1.0):
        loss = KDLoss(temperature=4.0, alpha=alpha)(tensor(STUDENT3), None, torch.tensor(LABELS3))
        assert loss.item() == pytest.approx(hard, rel=1e-12)
    with pytest.raises(ValueError, match="no labels"):
        KDLoss(alpha=0.0)(tensor(STUDENT3), None)


def test_labels_required_when_alpha_positive() -> None:
    with pytest.raises(ValueError, match=r"alpha=0\.5 needs labels"):
        KDLoss(alpha=0.5)(tensor(STUDENT3), tensor(TEACHER3))


@pytest.mark.parametrize("t", [0, -1.0, float("nan"), float("inf")])
def test_bad_temperature(t: float) -> None:
    with pytest.raises(ValueError, match="temperature must be a finite number > 0"):
        KDLoss(temperature=t)


@pytest.mark.parametrize("alpha", [-0.1, 1.1, float("nan")])
def test_bad_alpha(alpha: float) -> None:
    with pytest.raises(ValueError, match=r"alpha .* must be in \[0, 1\]"):
        KDLoss(alpha=alpha)


def test_bad_types_and_reduction() -> None:
    with pytest.raises(TypeError, match="temperature must be a number"):
        KDLoss(temperature="4")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="alpha must be a number"):
        KDLoss(alpha=True)
    with pytest.raises(ValueError, match="batchmean"):
        KDLoss(reduction="mean")  # type: ignore[arg-type]


def test_shape_mismatch_names_both_shapes() -> None:
    kd = KDLoss(alpha=0.0)
    with pytest.raises(ValueError, match=r"student logits \(2, 3\) and teacher logits \(3, 3\)"):
        kd(torch.zeros(2, 3), torch.zeros(3, 3))
    with pytest.raises(ValueError, match=r"student logits \(2, 3\) and teacher 1 logits \(2, 5\)"):
        kd(torch.zeros(2, 3), [torch.zeros(2, 3), torch.zeros(2, 5)])
    with pytest.raises(ValueError, match=r"shape \[N, C\], got \(2, 3, 4\)"):
        kd(torch.zeros(2, 3, 4), torch.zeros(2, 3, 4))
    with pytest.raises(ValueError, match=r"labels \(3,\) must have shape \[N\] = \(2,\)"):
        KDLoss(alpha=0.5)(torch.zeros(2, 3), torch.zeros(2, 3), torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="integer class ids"):
        KDLoss(alpha=0.5)(torch.zeros(2, 3), torch.zeros(2, 3), torch.tensor([0.0, 1.0]))


def test_bad_teacher_values() -> None:
    kd = KDLoss(alpha=0.0)
    with pytest.raises(ValueError, match="empty list of teachers"):
        kd(torch.zeros(2, 3), [])
    with pytest.raises(TypeError, match="teacher must be"):
        kd(torch.zeros(2, 3), {"LOGITS": torch.zeros(2, 3)})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="floating point"):
        kd(torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"teacher probabilities \(2, 4\)"):
        kd_kl_div(torch.zeros(2, 3), torch.zeros(2, 4), 1.0)


def test_repr_shows_settings() -> None:
    assert "temperature=4.0, alpha=0.5, reduction='batchmean'" in repr(KDLoss())
