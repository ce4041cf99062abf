"""The byte alignment of two real tokenizations (`distill.crosstok.align`), the student's spans
(`SpanTokenizer`) and the vocabulary map (`VocabMap`): chunks tile every text's bytes on both
sides, end only where both sides end a token, and cover the same bytes on both sides."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from distill.crosstok import SpanTokenizer, VocabMap, align
from teacher_server.vocab_pieces import vocab_pieces
from tests.tokenizer_models import CORPUS, TEXTS, save_tokenizer


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, SpanTokenizer]:
    root = Path(tmp_path_factory.mktemp("crosstok_tokenizers"))
    return {kind: SpanTokenizer(save_tokenizer(root / kind, kind)) for kind in ("byte_bpe", "unigram")}


def _check_row(text: str, a, r: int, sides: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> None:
    """Every byte covered once per side, boundaries are common token ends, same bytes both sides."""
    size = len(text.encode())
    n = int(a.num_chunks[r])
    ranges = a.chunk_bytes[r, :n].tolist()
    if size == 0:
        assert n == 0
    else:
        assert ranges[0][0] == 0 and ranges[-1][1] == size
        assert all(prev[1] == cur[0] for prev, cur in itertools.pairwise(ranges)), ranges
        assert all(end > start for start, end in ranges), ranges
    ends_per_side = []
    for spans, mask, chunk in sides:
        covered = np.zeros(size, dtype=np.int64)
        ends = set()
        lo = [size] * n
        hi = [0] * n
        for i in range(spans.shape[1]):
            start, end = spans[r, i].tolist()
            c = int(chunk[r, i])
            if mask[r, i] == 0 or start < 0:
                assert c == -1, "added tokens and padding belong to no chunk"
                continue
            assert 0 <= c < n, f"token {i} {start, end} of {text!r} is in no chunk"
            assert ranges[c][0] <= start <= end <= ranges[c][1], f"token {i} {start, end} outside chunk {ranges[c]}"
            covered[start:end] += 1
            if end > start:
                ends.add(end)
                lo[c], hi[c] = min(lo[c], start), max(hi[c], end)
        assert (covered == 1).all(), f"{text!r}: bytes covered {covered.tolist()}"
        assert [[lo[c], hi[c]] for c in range(n)] == ranges, "each chunk's tokens span exactly its bytes"
        ends_per_side.append(ends)
    assert {end for _, end in ranges} == ends_per_side[0] & ends_per_side[1], \
        "the chunk boundaries are exactly the byte offsets where both sides end a token"


def _check_batch(texts: list[str], student: SpanTokenizer, teacher: SpanTokenizer) -> None:
    s, t = student(texts), teacher(texts)
    a = align(s.spans, s.mask, t.spans, t.mask)
    for r, text in enumerate(texts):
        _check_row(text, a, r, [(s.spans, s.mask, a.student_chunk), (t.spans, t.mask, a.teacher_chunk)])
    assert (a.valid == a.exists).all(), "both tokenizers add a BOS, so every chunk has scores on both sides"


_WORDS = sorted({w for line in CORPUS for w in line.split()})
_FRAGMENTS = st.one_of(
    st.characters(min_codepoint=0x21, max_codepoint=0x7E),
    st.characters(min_codepoint=0xA1, max_codepoint=0x7FF),
    st.characters(min_codepoint=0x800, max_codepoint=0xFFFF, exclude_categories=("Cs", "Co", "Cn")),
    st.characters(min_codepoint=0x10000, max_codepoint=0x10FFFF, exclude_categories=("Co", "Cn")),
    st.text(alphabet=" \t\n", min_size=1, max_size=6),
    st.from_regex(r"[0-9]{1,6}", fullmatch=True),
    st.sampled_from(["<s>", "</s>", "<bos>", "<eos>", "<unk>", "<pad>"]),
    st.sampled_from(_WORDS),
)
_TEXT = st.lists(_FRAGMENTS, max_size=14).map("".join)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(texts=st.lists(_TEXT, min_size=1, max_size=3), student_first=st.booleans())
def test_chunks_tile_the_bytes_and_end_where_both_sides_end_a_token(tokenizers, texts, student_first) -> None:
    a, b = tokenizers["byte_bpe"], tokenizers["unigram"]
    _check_batch(texts, *((a, b) if student_first else (b, a)))


def test_the_test_texts_align_both_ways(tokenizers) -> None:
    _check_batch(TEXTS, tokenizers["byte_bpe"], tokenizers["unigram"])
    _check_batch(TEXTS, tokenizers["unigram"], tokenizers["byte_bpe"])


def _one(tokenizers, text: str):
    s, t = tokenizers["byte_bpe"]([text]), tokenizers["unigram"]([text])
    return s, t, align(s.spans, s.mask, t.spans, t.mask)


def test_a_character_split_by_the_byte_level_bpe_is_one_chunk(tokenizers) -> None:
    s, t, a = _one(tokenizers, "✓")
    assert a.chunk_bytes[0, : a.num_chunks[0]].tolist() == [[0, 3]]
    assert a.teacher_count[0, 0] == int(t.mask[0].sum()) - 1, "every teacher token but its BOS is in the chunk"
    assert a.student_count[0, 0] == 3, "the byte-level BPE spells ✓ (3 bytes, not in its corpus) byte by byte"
    assert s.spans[0, 1:].tolist() == [[0, 1], [1, 2], [2, 3]], "its spans are exact to the byte"
    assert a.student_chunk[0].tolist() == [-1, 0, 0, 0]
    _, _, a = _one(tokenizers, "naïve")
    starts = {start for start, _ in a.chunk_bytes[0, : a.num_chunks[0]].tolist()}
    assert 3 not in starts, "no chunk boundary inside ï (bytes 2-3)"


def test_an_unknown_character_is_one_chunk_with_the_unk_token(tokenizers) -> None:
    s, t, a = _one(tokenizers, "x✓x")
    unk = tokenizers["unigram"].tokenizer.unk_token_id
    at = (t.ids[0] == unk).nonzero().squeeze(1).tolist()
    assert len(at) == 1
    c = int(a.teacher_chunk[0, at[0]])
    assert a.chunk_bytes[0, c].tolist() == [1, 4], "the <unk> covers ✓'s three bytes"
    student_in = [i for i in range(s.ids.shape[1]) if a.student_chunk[0, i] == c]
    assert [s.spans[0, i].tolist() for i in student_in] == [[1, 2], [2, 3], [3, 4]]


def test_whitespace_runs_align_run_by_run(tokenizers) -> None:
    text = "a  \t\n\nb"
    _, _, a = _one(tokenizers, text)
    ranges = a.chunk_bytes[0, : a.num_chunks[0]].tolist()
    # byte-level: a, "  ", \t, \n, \n, b; Metaspace: (▁ a), (▁ ▁), \t, "\n\n", b
    assert ranges == [[0, 1], [1, 3], [3, 4], [4, 6], [6, 7]]
    assert a.student_count[0].tolist() == [1, 1, 1, 2, 1]
    assert a.teacher_count[0].tolist() == [2, 2, 1, 1, 1], "the empty-span token after ▁ joins its chunk"


def test_hand_made_spans_empty_tokens_no_bos_and_padding() -> None:
    # student: BOS, "ab" [0,2), "c" [2,3), an empty token at 3, "de" [3,5), padding
    s_spans = torch.tensor([[[-1, -1], [0, 2], [2, 3], [3, 3], [3, 5], [-1, -1]]])
    s_mask = torch.tensor([[1, 1, 1, 1, 1, 0]])
    # teacher, no BOS: "a" [0,1), "bc" [1,3), "d" [3,4), "e" [4,5)
    t_spans = np.array([[[0, 1], [1, 3], [3, 4], [4, 5]]], dtype=np.int32)
    t_mask = np.ones((1, 4), dtype=np.int8)
    a = align(s_spans, s_mask, t_spans, t_mask)
    assert a.num_chunks.tolist() == [2]
    assert a.chunk_bytes[0].tolist() == [[0, 3], [3, 5]]
    assert a.student_chunk[0].tolist() == [-1, 0, 0, 0, 1, -1], "the empty token joins the chunk ending at its end"
    assert a.teacher_chunk[0].tolist() == [0, 0, 1, 1]
    assert a.valid[0].tolist() == [False, True], "teacher token 0 has no score: its chunk is masked out"
    assert a.student_count[0].tolist() == [3, 1] and a.teacher_count[0].tolist() == [2, 2]
    assert a.student_first[0].tolist() == [1, 4] and a.teacher_last[0].tolist() == [1, 3]


def test_rows_of_different_texts_are_refused() -> None:
    spans = torch.tensor([[[-1, -1], [0, 3]]])
    other = torch.tensor([[[-1, -1], [0, 4]]])
    mask = torch.ones(1, 2, dtype=torch.int8)
    with pytest.raises(ValueError, match="same texts"):
        align(spans, mask, other, mask)
    with pytest.raises(ValueError, match=r"\[B, T, 2\]"):
        align(spans[..., :1], mask, spans, mask)


def test_spans_tokenizer_pads_right_and_refuses_a_single_string(tokenizers) -> None:
    tok = tokenizers["unigram"]
    out = tok(["a", "longer text here"])
    assert out.ids.shape == out.mask.shape == out.spans.shape[:2]
    assert out.mask[0].tolist()[:2] == [1, 1] and out.mask[0, -1] == 0
    assert (out.ids[0][out.mask[0] == 0] == tok.pad_id).all()
    assert (out.spans[0][out.mask[0] == 0] == -1).all()
    with pytest.raises(TypeError, match="list of texts"):
        tok("a")


def test_vocab_map_pairs_have_equal_pieces(tokenizers) -> None:
    student = vocab_pieces(tokenizers["byte_bpe"].tokenizer)
    teacher = vocab_pieces(tokenizers["unigram"].tokenizer)
    vm = VocabMap.from_pieces(student, teacher)
    assert vm.student_ids.numel() > 0
    for i, j in zip(vm.student_ids.tolist(), vm.teacher_ids.tolist(), strict=True):
        assert student[i] == teacher[j] and student[i]
    letters = 0
    for ch in "abcdefghijklmnopqrstuvwxyz":
        tid = [j for j, p in enumerate(teacher) if p == ch.encode()]
        sid = [i for i, p in enumerate(student) if p == ch.encode()]
        if tid and sid:
            letters += 1
            assert vm.same_piece(torch.tensor(sid[:1]), torch.tensor(tid[:1])).item(), ch
    assert letters >= 10, "single ASCII letters are in both vocabularies and match"
    unmatched = set(vm.unmatched_teacher().tolist())
    assert all(not teacher[j] or teacher[j] not in set(student) for j in unmatched)
    space_s, space_t = student.index(b" "), teacher.index(b" ")
    assert vm.same_piece(torch.tensor([space_s]), torch.tensor([space_t])).item(), "Ġ and ▁ are both a space"
    assert not vm.same_piece(torch.tensor([-1, 10_000]), torch.tensor([space_t, space_t])).any()


def test_vocab_map_merges_entries_of_one_piece_into_a_class() -> None:
    vm = VocabMap.from_pieces([b"a", b"b", b"c", None, b""], [b"b", b"a", b"a", b"x", b"", None])
    assert vm.num_classes == 2
    assert vm.teacher_class.tolist()[:3] == [vm.student_class[1].item(), vm.student_class[0].item()] * 1 + \
        [vm.student_class[0].item()]
    assert vm.student_class.tolist()[2:] == [-1, -1, -1]
    assert sorted(zip(vm.student_ids.tolist(), vm.teacher_ids.tolist(), strict=True)) == [(0, 1), (0, 2), (1, 0)]
    assert vm.unmatched_teacher().tolist() == [3, 4, 5]
