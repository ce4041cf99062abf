"""The cross-tokenizer example's data: texts, not token ids, and two tokenizers of different sizes.

A teacher and a student with different tokenizers can only share *text*: the training sample is a
piece of a corpus file, and each side tokenizes it itself (the student here, the teacher in its
server). The corpus is the LLM example's (the Python standard library's source, split by file,
`examples.llm.data`).

* Pieces (`text_pieces`): each file cut at line ends into pieces of at most `max_bytes` UTF-8
  bytes (a longer line is cut at character boundaries). Bytes, because both tokenizers are
  byte-level: a piece of `n` bytes is at most `n` tokens on either side, so with the BOS every
  piece fits a model of `max_bytes + 1` positions (`context`) and no piece is ever truncated,
  which bits per byte needs (every byte of a held-out piece is scored).
* Tokenizers (`get_tokenizer`): byte-level BPEs trained by `examples.llm.tokenizer.train_tokenizer`
  on the training split, with a post-processor that puts `<|endoftext|>` in front of every text
  (`add_special_tokens=True`, which is how a teacher server tokenizes a text): the first byte of a
  piece is then predicted from that BOS, so every text token has a score on both sides.
* Batches (`plan`, `TextCollator`): the same pieces in the same seeded order for every arm; each
  arm's collator tokenizes them with its own tokenizer.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from tokenizers import processors
from transformers import PreTrainedTokenizerFast

import protos.text
from examples.common import cache_dir
from examples.llm.common import SMOKE_FILES
from examples.llm.data import IGNORE_INDEX, Corpus, load_corpus
from examples.llm.tokenizer import EOS, load_tokenizer, train_tokenizer

TEXT = protos.text.TEXT
"""The batch field holding the pieces' texts (a list of str), named as the teacher's text input."""


def context(max_bytes: int) -> int:
    """Positions a model needs for a piece of ``max_bytes`` bytes: one token per byte at most, and the BOS."""
    return max_bytes + 1


def text_pieces(texts: Iterable[str], max_bytes: int) -> list[str]:
    """Each text cut at line ends into pieces of at most ``max_bytes`` UTF-8 bytes, in order.

    Lines are kept whole while they fit; a line longer than ``max_bytes`` is cut at character
    boundaries. No piece is empty, and the pieces of a text joined are the text.
    """
    if max_bytes < 4:
        raise ValueError(f"max_bytes must be >= 4 (one character of UTF-8 at most), got {max_bytes}")
    pieces: list[str] = []
    for text in texts:
        current: list[str] = []
        size = 0
        for line in _cut_long(text.splitlines(keepends=True), max_bytes):
            n = len(line.encode("utf-8"))
            if size + n > max_bytes and current:
                pieces.append("".join(current))
                current, size = [], 0
            current.append(line)
            size += n
        if current:
            pieces.append("".join(current))
    return pieces


def _cut_long(lines: Iterable[str], max_bytes: int) -> Iterator[str]:
    for line in lines:
        if len(line.encode("utf-8")) <= max_bytes:
            yield line
            continue
        part: list[str] = []
        size = 0
        for ch in line:
            n = len(ch.encode("utf-8"))
            if size + n > max_bytes:
                yield "".join(part)
                part, size = [], 0
            part.append(ch)
            size += n
        if part:
            yield "".join(part)


def spread(items: Sequence[str], n: int) -> list[str]:
    """``n`` items spread evenly over ``items`` (all of them when ``n`` <= 0 or larger)."""
    if n <= 0 or n >= len(items):
        return list(items)
    step = len(items) / n
    return [items[int(i * step)] for i in range(n)]


def load_texts(*, quick: bool) -> Corpus:
    """The corpus (the LLM example's), the first few files of each split when ``quick``."""
    return load_corpus(max_files=SMOKE_FILES if quick else 0)


def tokenizer_dir(vocab_size: int, *, quick: bool) -> Path:
    """Where the tokenizer of this size is cached (quick runs have their own, trained on fewer files)."""
    return cache_dir() / "crosstok" / (f"tokenizer-{vocab_size}" + ("-quick" if quick else ""))


def with_bos(tok: PreTrainedTokenizerFast) -> PreTrainedTokenizerFast:
    """``tok`` made to put its end-of-text token in front of every text it encodes with special tokens."""
    eos = tok.eos_token_id
    if not isinstance(eos, int):
        raise ValueError("the tokenizer needs an eos_token to use as the BOS of every text")
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{EOS} $A", pair=f"{EOS} $A {EOS} $B", special_tokens=[(EOS, eos)])
    return tok


def get_tokenizer(vocab_size: int, corpus: Corpus, *, quick: bool) -> PreTrainedTokenizerFast:
    """The cached byte-level BPE of ``vocab_size`` entries, trained on ``corpus``'s training split first
    if there is none; it adds the BOS (``with_bos``)."""
    directory = tokenizer_dir(vocab_size, quick=quick)
    if (directory / "tokenizer.json").is_file():
        return load_tokenizer(directory)
    tok = with_bos(train_tokenizer(corpus, vocab_size))
    tmp = directory.with_name(f"{directory.name}.tmp")
    tok.save_pretrained(str(tmp))
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp.replace(directory)  # another run sees no tokenizer or a whole one
    return load_tokenizer(directory)


def plan(count: int, *, batch_size: int, steps: int, seed: int) -> list[list[int]]:
    """The piece indices of ``steps`` batches: seeded shuffled passes over ``count`` pieces, as many as it takes."""
    if count < 1 or batch_size < 1 or steps < 1:
        raise ValueError(f"need pieces, batch_size and steps >= 1, got {count}, {batch_size}, {steps}")
    gen = torch.Generator().manual_seed(seed)
    out: list[list[int]] = []
    while len(out) < steps:
        order = torch.randperm(count, generator=gen).tolist()
        out.extend(order[i : i + batch_size] for i in range(0, count, batch_size))
    return out[:steps]


class TextCollator:
    """Texts → ``{TEXT, input_ids, attention_mask, labels}`` with one tokenizer (BOS in front, right padding).

    ``labels`` are the ids with ``IGNORE_INDEX`` on padding: a causal LM's loss shifts them, so the
    BOS is never a target and every text token is. ``TEXT`` keeps the texts for a teacher that
    tokenizes them itself.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerFast, max_len: int) -> None:
        self.tokenizer = tokenizer
        self.max_len = int(max_len)

    def __call__(self, texts: Sequence[str]) -> dict[str, Any]:
        enc = self.tokenizer(list(texts), add_special_tokens=True, padding=True, return_tensors="pt")
        ids, mask = enc["input_ids"], enc["attention_mask"]
        if ids.shape[1] > self.max_len:
            raise ValueError(f"a text tokenized to {ids.shape[1]} tokens, over the models' {self.max_len} "
                             "positions: cut the pieces shorter (max_bytes) or use byte-level tokenizers")
        return {TEXT: list(texts), "input_ids": ids, "attention_mask": mask,
                "labels": ids.masked_fill(mask == 0, IGNORE_INDEX)}


def batches(pieces: Sequence[str], collator: TextCollator, order: Sequence[Sequence[int]]) -> Iterator[dict[str, Any]]:
    """The collated batches of ``order`` (a ``plan``), lazily."""
    for idx in order:
        yield collator([pieces[i] for i in idx])
