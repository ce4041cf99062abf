"""Two real tokenizers of different kinds, trained here with `tokenizers` on one small corpus, and
tiny random Llamas that use them: the parts of the cross-tokenizer tests.

* `byte_bpe`: a byte-level BPE (every byte is a token, so any text encodes; a character of several
  UTF-8 bytes may be split across tokens) whose post-processor adds `<s>` in front;
* `unigram`: a Unigram model over Metaspace pieces (`▁` marks a space; characters the corpus lacks
  become `<unk>`) with `<bos>` added in front.

Both are saved as `PreTrainedTokenizerFast` directories, so `AutoTokenizer.from_pretrained(DIR)` and
`teacher-server --model hf:DIR` load them. `TEXTS` are the texts the tests score: Unicode of 2-4
bytes a character, runs of spaces, tabs and newlines, digits, and a literal special token.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Distillation moves what a large teacher knows into a small student.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9, 10, 42, 365, 2026 and 3.14159.",
    "Café, naïve, façade, déjà vu, über, smörgåsbord.",
    "Ελληνικά γράμματα και λέξεις.",
    "中文的句子没有空格。数字123也在这里。",
    "Emoji: 🙂 🚀 and 🧪 in a sentence.",
    "    indented code\n\tand a tab\n\n\nthree newlines",
    "def score(text):\n    return teacher(text)  # spaces   in   runs",
    "A student learns from the teacher's log-probabilities, token by token.",
]
"""The training corpus of both tokenizers (repeated with variations by `_corpus`)."""

TEXTS = [
    "The teacher scores text in its own tokens.",
    "Café déjà vu: naïve façades, 中文句子, Ελληνικά!",
    "tabs\tand   runs    of  spaces\n\nnewlines",
    "digits 1234567890 and 3.14159 or 2026-11-28",
    "emoji 🙂🚀 and unseen ✓ ∑ ☃ characters",
    "a literal <s> in the middle",
    "x",
    " leading and trailing spaces  ",
]
"""Texts with the cases alignment must get right (multi-byte characters split across byte-level
tokens, characters one tokenizer does not know, whitespace runs, digits, a special token's text)."""


def _corpus() -> list[str]:
    """CORPUS with enough variation that both trainers find merges across words."""
    lines = []
    for i in range(20):
        for line in CORPUS:
            lines.append(line if i % 2 == 0 else line.lower())
            lines.append(f"{line} {i} {i * 37}")
    return lines


def byte_bpe(vocab_size: int = 320) -> Any:
    """A byte-level BPE of `vocab_size` entries with `<pad>` 0, `<s>` 1, `</s>` 2; adds `<s>` in front."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_corpus(), trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return tok


def unigram(vocab_size: int = 400) -> Any:
    """A Unigram model of `vocab_size` entries over Metaspace pieces with `<pad>` 0, `<bos>` 1,
    `<eos>` 2, `<unk>` 3; adds `<bos>` in front."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    tok = tokenizers.Tokenizer(models.Unigram())
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.UnigramTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "<bos>", "<eos>", "<unk>"],
                                      unk_token="<unk>", show_progress=False)
    tok.train_from_iterator(_corpus(), trainer)
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 1)])
    return tok


KINDS = {"byte_bpe": (byte_bpe, {"pad_token": "<pad>", "bos_token": "<s>", "eos_token": "</s>"}),
         "unigram": (unigram, {"pad_token": "<pad>", "bos_token": "<bos>", "eos_token": "<eos>",
                               "unk_token": "<unk>"})}


def save_tokenizer(directory: Path, kind: str) -> Any:
    """Train the `kind` tokenizer ("byte_bpe" or "unigram") and save it in `directory` as a fast
    tokenizer; returns the loaded `PreTrainedTokenizerFast`."""
    import transformers

    build, specials = KINDS[kind]
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=build(), **specials)
    fast.save_pretrained(str(directory))
    return transformers.AutoTokenizer.from_pretrained(str(directory), local_files_only=True)


def save_text_teacher(directory: Path, kind: str, seed: int = 0, context: int = 128) -> Any:
    """A tiny random Llama whose vocabulary is the `kind` tokenizer's, saved with that tokenizer in
    `directory` (an `hf:DIR` teacher that accepts text); returns the tokenizer."""
    import transformers

    tokenizer = save_tokenizer(directory, kind)
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=context,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(seed)
    transformers.LlamaForCausalLM(config).eval().save_pretrained(str(directory))
    return tokenizer
