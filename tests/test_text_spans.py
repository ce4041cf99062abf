"""Byte spans and vocabulary pieces of two real tokenizers (`teacher_server.text_spans`,
`teacher_server.vocab_pieces`): spans tile each text's bytes, added special tokens have none, a
byte-level BPE's spans are its tokens' own bytes, and its pieces are GPT-2's byte table."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from teacher_server.text_spans import NO_SPAN, byte_spans, char_to_byte
from teacher_server.vocab_pieces import vocab_pieces
from tests.tokenizer_models import KINDS, TEXTS, save_tokenizer


@pytest.fixture(scope="module", params=sorted(KINDS))
def tokenizer(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    return save_tokenizer(Path(tmp_path_factory.mktemp(request.param)), request.param)


def _gpt2_byte_decoder() -> dict[str, int]:
    """The byte-level alphabet's character of each byte (GPT-2's table), inverted."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


def test_char_to_byte_counts_each_characters_utf8_length() -> None:
    assert char_to_byte("aé中🙂").tolist() == [0, 1, 3, 6, 10]
    assert char_to_byte("").tolist() == [0]


@pytest.mark.parametrize("text", TEXTS)
def test_spans_tile_the_text_and_added_tokens_have_none(tokenizer, text: str) -> None:
    enc = tokenizer(text, return_offsets_mapping=True, return_special_tokens_mask=True)
    spans = byte_spans(text, enc["offset_mapping"], enc["special_tokens_mask"])
    added = np.asarray(enc["special_tokens_mask"], dtype=bool)
    assert added[0], "both tokenizers add a BOS token"
    assert (spans[added] == NO_SPAN).all()
    real = spans[~added]
    assert real[0, 0] == 0 and real[-1, 1] == len(text.encode())
    assert (real[1:, 0] == real[:-1, 1]).all(), "each token starts where the previous one ended"
    assert (real[:, 1] >= real[:, 0]).all()


def test_byte_level_spans_are_exact_with_pieces_and_whole_characters_without(tmp_path: Path) -> None:
    tokenizer = save_tokenizer(tmp_path, "byte_bpe")
    decoder = _gpt2_byte_decoder()
    split = 0
    for text in TEXTS:
        data = text.encode()
        enc = tokenizer(text, return_offsets_mapping=True, return_special_tokens_mask=True)
        added = enc["special_tokens_mask"]
        pieces = [None if s else bytes(decoder[c] for c in t)
                  for t, s in zip(tokenizer.convert_ids_to_tokens(enc["input_ids"]), added, strict=True)]
        exact = byte_spans(text, enc["offset_mapping"], added, pieces)
        for (start, end), piece in zip(exact, pieces, strict=True):
            assert piece is None or data[start:end] == piece, f"{text!r}: span {start, end} is not {piece!r}"
        rounded = byte_spans(text, enc["offset_mapping"], added)
        on_chars = set(char_to_byte(text).tolist())
        assert set(rounded[1:, 1].tolist()) <= on_chars, "without pieces, spans end between characters"
        split += int((rounded != exact).any())
    assert split >= 2, "the multi-byte texts have tokens holding part of a character"


def test_a_literal_special_tokens_text_has_a_span(tmp_path: Path) -> None:
    tokenizer = save_tokenizer(tmp_path, "byte_bpe")
    text = "a literal <s> in the middle"
    enc = tokenizer(text, return_offsets_mapping=True, return_special_tokens_mask=True)
    spans = byte_spans(text, enc["offset_mapping"], enc["special_tokens_mask"])
    at = [i for i, t in enumerate(enc["input_ids"]) if t == tokenizer.bos_token_id]
    assert len(at) == 2 and spans[at[0]].tolist() == [NO_SPAN, NO_SPAN]
    start, end = spans[at[1]]
    assert text.encode()[start:end].strip() == b"<s>"


def test_bad_offsets_are_refused_with_what_to_pass() -> None:
    with pytest.raises(ValueError, match="outside the text"):
        byte_spans("ab", [(0, 1), (1, 5)])
    with pytest.raises(ValueError, match="one mark per token"):
        byte_spans("ab", [(0, 1), (1, 2)], [0])
    with pytest.raises(ValueError, match="one piece"):
        byte_spans("ab", [(0, 1), (1, 2)], [0, 0], [b"a"])
    assert (byte_spans("ab", [(0, 0)], [1]) == NO_SPAN).all()
    assert byte_spans("ab", [(0, 1), (1, 2)], [0, 0], [b"a", b"x"]).tolist() == [[0, 1], [1, 2]], \
        "pieces that are not the text's bytes fall back to the offsets"


def test_byte_level_pieces_are_gpt2s_bytes_and_added_tokens_their_text(tmp_path: Path) -> None:
    tokenizer = save_tokenizer(tmp_path, "byte_bpe")
    decoder = _gpt2_byte_decoder()
    pieces = vocab_pieces(tokenizer)
    assert len(pieces) == len(tokenizer)
    for token, i in tokenizer.get_vocab().items():
        want = token.encode() if i in tokenizer.all_special_ids else bytes(decoder[c] for c in token)
        assert pieces[i] == want, f"id {i} ({token!r})"
    for text in TEXTS:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert b"".join(pieces[i] or b"?" for i in ids) == text.encode()


def test_metaspace_pieces_write_spaces_and_fall_back_to_offsets(tmp_path: Path) -> None:
    tokenizer = save_tokenizer(tmp_path, "unigram")
    pieces = vocab_pieces(tokenizer)
    assert pieces[tokenizer.convert_tokens_to_ids("▁")] == b" "
    assert pieces[tokenizer.unk_token_id] == b"<unk>"
    text = TEXTS[0]
    enc = tokenizer(text, return_offsets_mapping=True, return_special_tokens_mask=True)
    with_pieces = byte_spans(text, enc["offset_mapping"], enc["special_tokens_mask"],
                             [pieces[i] for i in enc["input_ids"]])
    assert (with_pieces == byte_spans(text, enc["offset_mapping"], enc["special_tokens_mask"])).all(), \
        "pieces that add a leading space are not the text's bytes: the offsets decide"
