"""Byte spans of a tokenization: where each token sits in the UTF-8 bytes of its text.

Teacher and student tokenize the same text differently; both sides describe their tokens by byte
spans computed here, by one rule, so that the student side can align the two by bytes
(`distill.crosstok`). Bytes, not characters: byte-level tokenizers split a character of several
bytes across tokens, and a byte offset means the same thing to every tokenizer and language.

The rule (`byte_spans`): the spans of a text's tokens *tile* its bytes. A tokenizer's own offsets
(characters, from a fast tokenizer's `offset_mapping`) may overlap (pieces of one character; a
Metaspace `▁` and the word after it) or leave gaps (whitespace a pre-tokenizer drops). So, in token
order, each token ends at the furthest byte any token up to it has reached, and starts where the
previous one ended: the first starts at byte 0, the last ends at the text's end, a gap belongs to
the token after it, and a token wholly inside bytes already covered gets an empty span at the point
reached. Every byte is then covered by exactly one token. Special tokens the tokenizer adds (BOS,
EOS: `special_tokens_mask` 1) have no text: their span is (-1, -1). A special token's literal text
in the input is an ordinary token with a span.

Character offsets round a token that holds part of a character out to whole characters. When the
bytes each token stands for are known (`pieces`, e.g. from a byte-level vocabulary) and together
they are exactly the text's bytes, the spans are those bytes instead, exact to the byte.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

NO_SPAN = -1
"""The start and end of the span of a token the tokenizer added (no bytes of the text)."""


def char_to_byte(text: str) -> np.ndarray:
    """int64 [len(text) + 1]: the byte offset in `text.encode()` at which each character starts,
    and the byte length at the end."""
    data = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
    starts = np.flatnonzero((data & 0xC0) != 0x80)  # a UTF-8 continuation byte is 10xxxxxx
    return np.append(starts, data.size).astype(np.int64)


def byte_spans(text: str, offsets: Sequence[tuple[int, int]] | np.ndarray,
               special: Sequence[int] | np.ndarray | None = None,
               pieces: Sequence[bytes | None] | None = None) -> np.ndarray:
    """int32 [T, 2]: the tiling byte span [start, end) of each of the T tokens of `text`.

    `offsets` are the tokenizer's character offsets of each token (a fast tokenizer's
    `offset_mapping`); `special` marks the tokens the tokenizer added (its `special_tokens_mask`),
    whose spans are (-1, -1); `pieces`, when given, are the bytes each token stands for (None where
    unknown). The rule is the module's."""
    chars = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
    count = chars.shape[0]
    spans = np.full((count, 2), NO_SPAN, dtype=np.int32)
    added = np.zeros(count, dtype=bool) if special is None else np.asarray(special, dtype=bool)
    if added.shape != (count,):
        raise ValueError(f"special marks {added.shape[0]} tokens and offsets {count}; pass one mark per token")
    real = np.flatnonzero(~added)
    if real.size == 0:
        return spans
    if pieces is not None and len(pieces) != count:
        raise ValueError(f"{len(pieces)} pieces for {count} tokens; pass one piece (or None) per token")
    exact = _exact_ends(text, pieces, real) if pieces is not None else None
    if exact is not None:
        spans[real, 0] = np.concatenate(([0], exact[:-1]))
        spans[real, 1] = exact
        return spans
    c2b = char_to_byte(text)
    if chars[real].max() > len(text) or chars[real].min() < 0:
        raise ValueError(f"a token's character offsets lie outside the text of {len(text)} characters; "
                         "pass the offsets the tokenizer returned for this text")
    ends = np.maximum.accumulate(c2b[chars[real, 1]])
    ends[-1] = c2b[-1]
    starts = np.concatenate(([0], ends[:-1]))
    spans[real, 0] = starts
    spans[real, 1] = ends
    return spans


def _exact_ends(text: str, pieces: Sequence[bytes | None], real: np.ndarray) -> np.ndarray | None:
    """The byte ends of the real tokens when their pieces are exactly the text's bytes, else None."""
    own = [pieces[i] for i in real.tolist()]
    if any(p is None for p in own):
        return None
    data = text.encode("utf-8")
    if b"".join(p for p in own if p is not None) != data:
        return None
    return np.cumsum([len(p) for p in own if p is not None]).astype(np.int64)
