"""The student's tokenization of texts with each token's byte span, padded into tensors.

The student aligns its tokens with a teacher's by bytes (`distill.crosstok.align`), so it describes
its own tokens by the rule the teacher uses (`teacher_server.text_spans.byte_spans`): spans tile the
text's UTF-8 bytes, tokens the tokenizer added (BOS, EOS) have none (-1, -1). Where the tokens'
pieces (`teacher_server.vocab_pieces.vocab_pieces`) add up to the text's bytes, the spans are those
pieces, exact to the byte; otherwise they come from the tokenizer's character offsets.

Rows are padded on the right whatever the tokenizer's `padding_side`: the losses read the student's
logits at position ``i - 1`` for token ``i``, as the teacher's scores sit at ``j - 1`` for its token
``j`` (the text contract), and right padding keeps a row's tokens at the same positions in both.
Texts are never truncated: a cut text would cover fewer bytes than the teacher's tokens of the
whole text, and the alignment refuses rows whose two sides cover different byte lengths.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from teacher_server.text_spans import NO_SPAN, byte_spans
from teacher_server.vocab_pieces import vocab_pieces

__all__ = ["SpanTokenizer", "TextTokens"]


@dataclass(frozen=True)
class TextTokens:
    """A batch of tokenized texts, padded on the right to the longest row.

    Attributes:
        ids: int64 ``[B, T]`` token ids (the tokenizer's specials included; the pad id after a row's end).
        spans: int32 ``[B, T, 2]`` each token's byte span [start, end) in its row's UTF-8 text;
            (-1, -1) for tokens the tokenizer added and for padding.
        mask: int8 ``[B, T]``: 1 for a row's tokens (specials included), 0 for padding.
    """

    ids: Tensor
    spans: Tensor
    mask: Tensor


class SpanTokenizer:
    """A transformers fast tokenizer that also returns each token's byte span.

    The vocabulary's pieces are read once here (`vocab_pieces`), so a batch costs the tokenizer's own
    call plus one pass over its tokens.
    """

    def __init__(self, tokenizer: Any, pieces: Sequence[bytes | None] | None = None):
        if not getattr(tokenizer, "is_fast", False):
            raise TypeError(
                f"SpanTokenizer needs a fast tokenizer (its offsets give the byte spans), got "
                f"{type(tokenizer).__name__}; load it with AutoTokenizer.from_pretrained(..., use_fast=True)"
            )
        self.tokenizer = tokenizer
        self.pieces: list[bytes | None] = list(vocab_pieces(tokenizer) if pieces is None else pieces)
        pad = tokenizer.pad_token_id
        self.pad_id = int(pad) if pad is not None else 0

    def __call__(self, texts: Sequence[str], *, add_special_tokens: bool = True) -> TextTokens:
        """Tokenize `texts` (one row each) with the tokenizer's specials, spans and mask."""
        if isinstance(texts, str):
            raise TypeError("SpanTokenizer takes a list of texts (one per row), got one str; wrap it in a list")
        enc = self.tokenizer(list(texts), add_special_tokens=add_special_tokens, return_offsets_mapping=True,
                             return_special_tokens_mask=True, padding=False, truncation=False)
        rows = len(texts)
        width = max((len(ids) for ids in enc["input_ids"]), default=0)
        ids = np.full((rows, width), self.pad_id, dtype=np.int64)
        spans = np.full((rows, width, 2), NO_SPAN, dtype=np.int32)
        mask = np.zeros((rows, width), dtype=np.int8)
        size = len(self.pieces)
        for r, text in enumerate(texts):
            row_ids = enc["input_ids"][r]
            n = len(row_ids)
            pieces = [self.pieces[i] if 0 <= i < size else None for i in row_ids]
            ids[r, :n] = row_ids
            spans[r, :n] = byte_spans(text, enc["offset_mapping"][r], enc["special_tokens_mask"][r], pieces)
            mask[r, :n] = 1
        return TextTokens(torch.from_numpy(ids), torch.from_numpy(spans), torch.from_numpy(mask))
