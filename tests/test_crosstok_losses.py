"""The cross-tokenizer losses (`distill.crosstok`): GOLD's matched-vocabulary divergence is the
token losses' divergence when both sides share a tokenizer, ULD's sorted-probability distance and
the sampled-token form are what their papers define, everything is zero when the student is the
teacher, positive with gradients otherwise, and masks are respected. The teacher's answer is built
in process (`tests.crosstok_teachers`) from real tiny Llamas with the two real tokenizers."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from distill.crosstok import (
    CrossTokenizerLoss,
    SpanTokenizer,
    TeacherText,
    TextTokens,
    VocabMap,
    align,
    chunk_log_ratio,
    chunk_pg_loss,
    matched_rows,
    sorted_l1_rows,
    teacher_chunk_logprobs,
)
from distill.losses import Divergence, SparseTargets, sampled_token_log_ratio, sampled_token_pg_loss, token_divergence
from teacher_server.vocab_pieces import vocab_pieces
from tests.crosstok_teachers import InProcessTextTeacher
from tests.tokenizer_models import TEXTS, save_text_teacher

K = 16


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, InProcessTextTeacher]:
    root = Path(tmp_path_factory.mktemp("crosstok_models"))
    out = {}
    for name, kind, seed in (("bpe_teacher", "byte_bpe", 0), ("bpe_student", "byte_bpe", 1),
                             ("unigram_teacher", "unigram", 2)):
        save_text_teacher(root / name, kind, seed=seed)
        out[name] = InProcessTextTeacher(root / name)
    return out


def _student(model: InProcessTextTeacher, texts: list[str]):
    tok = SpanTokenizer(model.tokenizer)
    s = tok(texts)
    logits = model.logits(s.ids, s.mask.long()).requires_grad_(True)
    return tok, s, logits


@pytest.fixture(scope="module")
def shared(models):
    """Student and teacher with the same (byte-level) tokenizer, different weights."""
    texts = TEXTS[:5]
    teacher = models["bpe_teacher"]
    answer = teacher.answer(texts, K)
    tok, s, logits = _student(models["bpe_student"], texts)
    assert torch.equal(s.ids, answer["TEXT_IDS"]) and torch.equal(s.spans, answer["TEXT_SPANS"])
    pieces = vocab_pieces(tok.tokenizer)
    vm = VocabMap.from_pieces(pieces, pieces)
    assert vm.num_classes == len({p for p in pieces if p}) == sum(1 for p in pieces if p), "one id per piece"
    return texts, teacher, answer, s, logits, vm


def _shifted_targets(answer) -> SparseTargets:
    return SparseTargets(answer["LOGITS_TOPK_VALUES"][:, :-1], answer["LOGITS_TOPK_INDICES"][:, :-1],
                         answer["LOGITS_TOPK_TAIL"][:, :-1], kind="logprobs")


@pytest.mark.parametrize("divergence", ["forward_kl", "reverse_kl", "jsd"])
def test_gold_on_a_shared_tokenizer_is_the_plain_token_divergence(shared, divergence: Divergence) -> None:
    _texts, _, answer, s, logits, vm = shared
    teacher = TeacherText.from_outputs(answer)
    a = align(s.spans, s.mask, teacher.spans, teacher.mask)
    assert (a.one_to_one == a.exists).all(), "one tokenizer: every chunk is one token on each side"
    loss = CrossTokenizerLoss(vm, divergence=divergence, beta=0.3, reduction="none")
    parts = loss.chunk_losses(logits, s, teacher, a)
    assert (parts.gold_mask == a.valid).all() and not parts.uld_mask.any()
    ref = token_divergence(logits[:, :-1], _shifted_targets(answer), divergence=divergence, beta=0.3,
                           reduction="none")
    b, c = a.valid.nonzero(as_tuple=True)
    got = parts.gold[b, c]
    want = ref[b, a.student_first[b, c] - 1]
    assert got.shape[0] == int(s.mask[:, 1:].sum())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    mean = CrossTokenizerLoss(vm, divergence=divergence, beta=0.3)(logits, s, teacher)
    ref_mean = token_divergence(logits[:, :-1], _shifted_targets(answer), divergence=divergence, beta=0.3,
                                attention_mask=s.mask[:, 1:])
    torch.testing.assert_close(mean, ref_mean, rtol=1e-5, atol=1e-6)
    assert mean.item() > 0
    (g,) = torch.autograd.grad(mean, logits)
    (g_ref,) = torch.autograd.grad(ref_mean, logits)
    torch.testing.assert_close(g, g_ref, rtol=1e-4, atol=1e-7)


def test_everything_is_zero_when_the_student_is_the_teacher(shared) -> None:
    _texts, teacher_model, answer, s, _, vm = shared
    own = teacher_model.logits(s.ids, s.mask.long()).requires_grad_(True)
    teacher = TeacherText.from_outputs(answer)
    divergences: tuple[Divergence, ...] = ("forward_kl", "reverse_kl", "jsd")
    for divergence in divergences:
        value = CrossTokenizerLoss(vm, divergence=divergence)(own, s, teacher)
        assert abs(value.item()) < 1e-5, divergence
    a = align(s.spans, s.mask, teacher.spans, teacher.mask)
    ratio, keep = chunk_log_ratio(own, s.ids, teacher, a)
    assert keep.any() and ratio.abs().max().item() < 1e-4


def test_the_sampled_token_form_on_a_shared_tokenizer_is_the_plain_one(shared) -> None:
    _, _, answer, s, logits, _ = shared
    teacher = TeacherText.from_outputs(answer)
    a = align(s.spans, s.mask, teacher.spans, teacher.mask)
    nxt = torch.cat([s.ids[:, 1:], torch.zeros_like(s.ids[:, :1])], dim=1)
    has_next = torch.cat([s.mask[:, 1:], torch.zeros_like(s.mask[:, :1])], dim=1) != 0
    nxt = torch.where(has_next, nxt, torch.full_like(nxt, -100))
    ratio, keep = chunk_log_ratio(logits, s.ids, teacher, a)
    assert torch.equal(keep, has_next)
    ref = sampled_token_log_ratio(logits, nxt, answer["LOGITS_TOKEN_LOGPROBS"])
    torch.testing.assert_close(ratio, ref, rtol=1e-5, atol=1e-5)
    pg = chunk_pg_loss(logits, s.ids, teacher, a)
    pg_ref = sampled_token_pg_loss(logits, nxt, answer["LOGITS_TOKEN_LOGPROBS"])
    torch.testing.assert_close(pg, pg_ref, rtol=1e-5, atol=1e-6)
    (g,) = torch.autograd.grad(pg, logits)
    (g_ref,) = torch.autograd.grad(pg_ref, logits)
    torch.testing.assert_close(g, g_ref, rtol=1e-4, atol=1e-7)


@pytest.fixture(scope="module")
def crossed(models):
    """A byte-level student against a Unigram teacher."""
    texts = TEXTS[:6]
    teacher_model = models["unigram_teacher"]
    answer = teacher_model.answer(texts, K)
    tok, s, logits = _student(models["bpe_student"], texts)
    vm = VocabMap.from_pieces(vocab_pieces(tok.tokenizer), teacher_model.pieces)
    teacher = TeacherText.from_outputs(answer)
    return texts, teacher_model, teacher, s, logits, vm, align(s.spans, s.mask, teacher.spans, teacher.mask)


def test_across_tokenizers_both_parts_are_positive_with_gradients_where_counted(crossed) -> None:
    _, _, teacher, s, logits, vm, a = crossed
    loss = CrossTokenizerLoss(vm)
    parts = loss.chunk_losses(logits, s, teacher, a)
    assert parts.gold_mask.any() and parts.uld_mask.any()
    assert (parts.gold[parts.gold_mask] > 0).all() and (parts.uld[parts.uld_mask] > 0).all()
    assert (parts.gold_mask | parts.uld_mask).sum() == a.valid.sum()
    value = loss(logits, s, teacher, a)
    assert torch.isfinite(value) and value.item() > 0
    (g,) = torch.autograd.grad(value, logits)
    assert torch.isfinite(g).all()
    used = torch.zeros_like(s.mask, dtype=torch.bool)
    used[:, :-1] = a.student_chunk[:, 1:] >= 0  # position i - 1 reads token i
    assert (g.abs().sum(-1)[used] > 0).all(), "every position a counted chunk reads gets a gradient"
    assert (g[~used] == 0).all(), "padding and the last position get none"


def test_weights_are_explicit_and_a_loss_mask_drops_whole_chunks(crossed) -> None:
    _, _, teacher, s, logits, vm, a = crossed
    parts = CrossTokenizerLoss(vm).chunk_losses(logits, s, teacher, a)
    total = CrossTokenizerLoss(vm, gold_weight=2.0, uld_weight=3.0, reduction="sum")(logits, s, teacher, a)
    torch.testing.assert_close(total, 2.0 * parts.gold.sum() + 3.0 * parts.uld.sum())
    keep = torch.ones_like(s.mask)
    keep[:, : s.ids.shape[1] // 2] = 0
    masked = CrossTokenizerLoss(vm, reduction="none")(logits, s, teacher, a, student_loss_mask=keep)
    counted = a.counted(keep)
    assert counted.sum() < a.valid.sum() and counted.any()
    assert (masked[~counted] == 0).all() and (masked[counted] > 0).all()
    (g,) = torch.autograd.grad(masked.sum(), logits)
    first_counted = int(a.student_first[counted].min())
    assert (g[:, : first_counted - 1] == 0).all(), "positions read only by dropped chunks get no gradient"


def test_uld_of_a_multi_token_chunk_scales_by_the_further_tokens(crossed) -> None:
    _, _, teacher, s, logits, vm, a = crossed
    parts = CrossTokenizerLoss(vm, student_top_k=8).chunk_losses(logits, s, teacher, a)
    both = parts.uld_mask & (a.student_count > 1) & (a.teacher_count > 1)
    b, c = [int(x) for x in both.nonzero()[0]]
    i0, i1 = int(a.student_first[b, c]), int(a.student_last[b, c])
    j0, j1 = int(a.teacher_first[b, c]), int(a.teacher_last[b, c])
    log_q = torch.log_softmax(logits[b].detach().float(), dim=-1)
    q_scale = sum(log_q[i - 1, s.ids[b, i]].item() for i in range(i0 + 1, i1 + 1))
    assert teacher.token_logprobs is not None and teacher.topk_values is not None
    p_scale = sum(teacher.token_logprobs[b, j - 1].item() for j in range(j0 + 1, j1 + 1))
    q = sorted((log_q[i0 - 1].exp() * math.exp(q_scale)).tolist(), reverse=True)[:8]
    p = sorted((teacher.topk_values[b, j0 - 1].exp() * math.exp(p_scale)).tolist(), reverse=True)
    p += [0.0] * (len(q) - len(p))
    q += [0.0] * (len(p) - len(q))
    want = sum(abs(x - y) for x, y in zip(q, p, strict=True))
    assert parts.uld[b, c].item() == pytest.approx(want, rel=1e-4, abs=1e-7)


def test_sorted_l1_is_the_papers_closed_form() -> None:
    student = torch.log(torch.tensor([[0.2, 0.5, 0.3]]))
    teacher = torch.log(torch.tensor([[0.4, 0.6]]))
    zero = torch.zeros(1)
    assert sorted_l1_rows(student, zero, teacher, zero).item() == pytest.approx(0.2)
    assert sorted_l1_rows(student, zero, teacher, zero, student_top_k=3).item() == pytest.approx(0.4)
    half = torch.log(torch.tensor([0.5]))
    assert sorted_l1_rows(student, zero, teacher, half).item() == pytest.approx(0.3), "[.5, .3] against [.3, .2]"
    same = sorted_l1_rows(torch.log(torch.tensor([[0.1, 0.6, 0.3]])), zero, torch.log(torch.tensor([[0.6, 0.3, 0.1]])),
                          zero)
    assert same.item() == pytest.approx(0.0, abs=1e-6), "a permutation of the same probabilities is at distance 0"


def test_matched_classes_add_their_entries_and_the_rest_takes_everything_else() -> None:
    vm = VocabMap.from_pieces([b"a", b"b", b"c", b"d"], [b"a", b"b", b"b", b"x", None])
    z = torch.tensor([[0.3, -0.2, 1.0, 0.1]], requires_grad=True)
    q = torch.softmax(z.detach(), -1)[0].tolist()
    p = torch.tensor([[0.1, 0.2, 0.3, 0.25, 0.15]])
    ids = torch.arange(5).unsqueeze(0)
    full = matched_rows(z, p.log(), ids, None, vm, temperature=1.0, beta=0.0)
    want = (0.1 * math.log(0.1 / q[0]) + 0.5 * math.log(0.5 / q[1]) + 0.4 * math.log(0.4 / (q[2] + q[3])))
    assert full.item() == pytest.approx(want, rel=1e-5)
    top = torch.tensor([[2, 3, 1]])
    part = matched_rows(z, p[:, [2, 3, 1]].log(), top, torch.tensor([0.25]), vm, temperature=1.0, beta=0.0)
    want = 0.5 * math.log(0.5 / q[1]) + 0.5 * math.log(0.5 / (q[0] + q[2] + q[3]))
    assert part.item() == pytest.approx(want, rel=1e-5)
    reverse = matched_rows(z, p[:, [2, 3, 1]].log(), top, torch.tensor([0.25]), vm, temperature=1.0, beta=1.0)
    rest = q[0] + q[2] + q[3]
    assert reverse.item() == pytest.approx(q[1] * math.log(q[1] / 0.5) + rest * math.log(rest / 0.5), rel=1e-5)
    (g,) = torch.autograd.grad(part.sum(), z)
    assert torch.isfinite(g).all() and g.abs().sum() > 0
    with pytest.raises(ValueError, match="tail"):
        matched_rows(z, p[:, [2, 3, 1]].log(), top, None, vm, temperature=1.0, beta=1.0)
    wide = torch.cat([z.detach(), torch.tensor([[2.0]])], dim=1)  # a padded embedding: one more logit
    qw = torch.softmax(wide, -1)[0].tolist()
    got = matched_rows(wide, p.log(), ids, None, vm, temperature=1.0, beta=0.0)
    want = 0.1 * math.log(0.1 / qw[0]) + 0.5 * math.log(0.5 / qw[1]) + 0.4 * math.log(0.4 / (qw[2] + qw[3] + qw[4]))
    assert got.item() == pytest.approx(want, rel=1e-5), "a logit beyond the tokenizer's entries is unmatched"


def test_the_aligned_teacher_scores_are_the_models_on_each_row_alone(crossed) -> None:
    texts, teacher_model, teacher, _s, _, _, a = crossed
    chunk_lp = teacher_chunk_logprobs(teacher, a)
    assert teacher.topk_values is not None and teacher.topk_indices is not None
    checked = 0
    for b in range(2):
        # the row alone, unpadded: a causal model's position t sees the tokens up to t only
        logp = teacher_model.log_probs(teacher.ids[b, : int(teacher.mask[b].sum())].unsqueeze(0))[0]
        for c in range(int(a.num_chunks[b])):
            j0, j1 = int(a.teacher_first[b, c]), int(a.teacher_last[b, c])
            torch.testing.assert_close(logp[j0 - 1].gather(0, teacher.topk_indices[b, j0 - 1]),
                                       teacher.topk_values[b, j0 - 1], rtol=1e-4, atol=1e-4)
            want = sum(logp[j - 1, teacher.ids[b, j]].item() for j in range(j0, j1 + 1))
            assert chunk_lp[b, c].item() == pytest.approx(want, rel=1e-4, abs=1e-4)
            start, end = a.chunk_bytes[b, c].tolist()
            data = texts[b].encode()
            pieces = b"".join(teacher_model.pieces[int(i)] or b"" for i in teacher.ids[b, j0 : j1 + 1])
            if start == 0:
                pieces = pieces.removeprefix(b" ")  # Metaspace puts a space before the text
            assert pieces == data[start:end] or b"<unk>" in pieces, "the chunk's teacher tokens spell its bytes"
            checked += 1
    assert checked >= 10


def test_missing_teacher_outputs_say_what_to_ask_for(shared) -> None:
    _, _, answer, s, logits, vm = shared
    with pytest.raises(KeyError, match="TEXT_SPANS"):
        TeacherText.from_outputs({k: v for k, v in answer.items() if k != "TEXT_SPANS"})
    with pytest.raises(ValueError, match=r"\[B, T, V\]"):
        CrossTokenizerLoss(vm)(logits[:, :-1], s, TeacherText.from_outputs(answer))
    bare = TeacherText.from_outputs({k: answer[k] for k in ("TEXT_IDS", "TEXT_SPANS", "TEXT_MASK")})
    with pytest.raises(ValueError, match="top_k"):
        CrossTokenizerLoss(vm)(logits, s, bare)
    with pytest.raises(ValueError, match="token_logprobs"):
        chunk_pg_loss(logits, s.ids, bare, align(s.spans, s.mask, bare.spans, bare.mask))
    with pytest.raises(ValueError, match="tail"):
        no_tail = TeacherText.from_outputs({k: v for k, v in answer.items() if k != "LOGITS_TOPK_TAIL"})
        CrossTokenizerLoss(vm, divergence="reverse_kl")(logits, s, no_tail)


def test_a_batch_without_chunks_gives_zero_attached_to_the_graph() -> None:
    spans = torch.tensor([[[-1, -1]]])  # one row: the BOS alone (an empty text)
    mask = torch.ones(1, 1, dtype=torch.int8)
    ids = torch.zeros(1, 1, dtype=torch.long)
    teacher = TeacherText(ids, spans, mask, torch.zeros(1, 1, 2), torch.zeros(1, 1, 2, dtype=torch.long), None,
                          torch.zeros(1, 1))
    a = align(spans, mask, spans, mask)
    assert a.num_chunks.tolist() == [0] and a.valid.shape == (1, 0)
    logits = torch.randn(1, 1, 4, requires_grad=True)
    vm = VocabMap.from_pieces([b"a", b"b", b"c", b"d"], [b"a", b"b"])
    for value in (CrossTokenizerLoss(vm)(logits, TextTokens(ids, spans, mask), teacher, a),
                  chunk_pg_loss(logits, ids, teacher, a)):
        assert value.item() == 0.0 and value.requires_grad
        (g,) = torch.autograd.grad(value, logits)
        assert (g == 0).all()
