"""The LLM example's tokenizer: byte-level BPE trained with Hugging Face ``tokenizers`` on the corpus.

    python -m examples.llm.tokenizer                  # train (or load) the cached 4096-token tokenizer
    python -m examples.llm.tokenizer --vocab-size 8192

Byte-level, as GPT-2's: every byte has a token, so any text encodes and decodes back exactly
(no unknown token). Trained on the training split only (the held-out files never shape the
vocabulary), with two special tokens, end-of-text (between documents) and padding.

Why cache it: training takes tens of seconds on the full corpus, and the teacher, the student and
(later) the teacher server must all use the very same vocabulary. It is saved as a
``PreTrainedTokenizerFast`` directory under ``<cache>/llm/tokenizer-<vocab>/`` and copied next to
each model by ``save_pretrained``; it is loaded from local files only (nothing is downloaded).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from examples.common import cache_dir
from examples.llm.data import Corpus, load_corpus

EOS = "<|endoftext|>"
PAD = "<|pad|>"
DEFAULT_VOCAB = 4096


def tokenizer_dir(vocab_size: int = DEFAULT_VOCAB, *, smoke: bool = False) -> Path:
    """Where the tokenizer of this vocabulary size is cached (smoke runs use their own directory)."""
    return cache_dir() / "llm" / (f"tokenizer-{vocab_size}" + ("-smoke" if smoke else ""))


def train_tokenizer(corpus: Corpus, vocab_size: int = DEFAULT_VOCAB) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE of ``vocab_size`` tokens (special tokens included) on the training split."""
    if vocab_size < 256 + 2:
        raise ValueError(f"vocab_size must be >= 258 (256 bytes + 2 special tokens), got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus.texts("train"), trainer=trainer, length=len(corpus.train))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=PAD, bos_token=EOS, unk_token=None)


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerFast:
    """A tokenizer saved by ``save_pretrained``, from local files only."""
    directory = Path(path)
    if not (directory / "tokenizer.json").is_file():
        raise FileNotFoundError(
            f"no tokenizer at {directory}: run `python -m examples.llm.tokenizer` (or train_teacher) first"
        )
    return PreTrainedTokenizerFast.from_pretrained(str(directory), local_files_only=True)


def get_tokenizer(
    vocab_size: int = DEFAULT_VOCAB, *, corpus: Corpus | None = None, smoke: bool = False, retrain: bool = False,
) -> PreTrainedTokenizerFast:
    """The cached tokenizer, trained and saved first if there is none (or ``retrain``).

    ``smoke`` trains on the first few files of each split into its own cache directory, in seconds.
    """
    directory = tokenizer_dir(vocab_size, smoke=smoke)
    if not retrain and (directory / "tokenizer.json").is_file():
        return load_tokenizer(directory)
    if corpus is None:
        from examples.llm.common import SMOKE_FILES

        corpus = load_corpus(max_files=SMOKE_FILES if smoke else 0)
    tok = train_tokenizer(corpus, vocab_size)
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = directory.with_name(f"{directory.name}.tmp")
    tok.save_pretrained(str(tmp))
    if directory.exists():
        for f in directory.iterdir():
            f.unlink()
        directory.rmdir()
    tmp.replace(directory)  # a concurrent reader sees the old directory or the new one, never half of one
    return tok


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m examples.llm.tokenizer", description=__doc__.split("\n")[0])
    p.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB,
                   help="tokens, special ones included (default: %(default)s)")
    p.add_argument("--retrain", action="store_true", help="train again even if a cached tokenizer exists")
    p.add_argument("--smoke", action="store_true", help="train on a few files only, for tests")
    args = p.parse_args(argv)
    started = time.perf_counter()
    tok = get_tokenizer(args.vocab_size, smoke=args.smoke, retrain=args.retrain)
    sample = 'def greet(name: str) -> str:\n    """Say hello."""\n    return f"hello {name}"\n'
    ids = tok(sample, add_special_tokens=False)["input_ids"]
    print(f"tokenizer: {len(tok)} tokens at {tokenizer_dir(args.vocab_size, smoke=args.smoke)} "
          f"({time.perf_counter() - started:.1f} s); sample: {len(sample)} chars -> {len(ids)} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
