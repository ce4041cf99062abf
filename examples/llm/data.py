"""The LLM example's corpus: the Python standard library's own source files.

Why this corpus: it ships with every Python installation, so the example needs no download and no
dataset package. It is real text (code, comments and docstrings, several MB), and it is the same
on every machine with the same Python version (it differs between versions: the README says
which one the figures were measured on).

* Files: ``*.py`` under ``sysconfig.get_paths()["stdlib"]``, sorted by relative path, without
  ``site-packages`` (installed packages differ per machine) and without test directories (large
  generated data and deliberately malformed files).
* Split: by file, fixed: a file is held out when the first byte of the SHA-256 of its relative
  path is below ``HELD_OUT_BYTE`` (about 5 %). A hash rather than a position so the split of a
  file does not change when files are added or removed elsewhere in the tree.
* Sequences: each file is tokenized, followed by the end-of-text token, and cut into pieces of at
  most ``seq_len`` tokens (the last piece of a file is shorter), so batches have variable lengths
  and ``Collator`` pads them.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

IGNORE_INDEX = -100
"""The label of padding positions (what ``transformers`` models and ``TokenKDLoss`` skip)."""

HELD_OUT_BYTE = 13
"""A file is held out when ``sha256(relative path)[0] < HELD_OUT_BYTE``: 13/256, about 5 % of files."""

_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "__pycache__", "idle_test"})


class Encoder(Protocol):
    """What ``encode_files`` needs of a tokenizer (a ``PreTrainedTokenizerFast`` is one)."""

    eos_token_id: Any

    def __call__(self, text: list[str], add_special_tokens: bool = ...) -> Any: ...


def stdlib_root() -> Path:
    """The directory of this interpreter's standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def is_held_out(relative: str) -> bool:
    """Whether a file (its path relative to the corpus root, '/'-separated) is in the held-out split."""
    return hashlib.sha256(relative.encode("utf-8")).digest()[0] < HELD_OUT_BYTE


@dataclass(frozen=True)
class Corpus:
    """The corpus files, split: paths relative to ``root``, each list sorted."""

    root: Path
    train: tuple[str, ...]
    held_out: tuple[str, ...]

    def read(self, relative: str) -> str:
        """A file's text (UTF-8; undecodable bytes replaced, so no file is ever refused)."""
        return (self.root / relative).read_text(encoding="utf-8", errors="replace")

    def texts(self, split: str) -> Iterator[str]:
        """The texts of one split (``"train"`` or ``"held_out"``), in sorted file order."""
        if split not in ("train", "held_out"):
            raise ValueError(f"split must be 'train' or 'held_out', got {split!r}")
        for relative in self.train if split == "train" else self.held_out:
            yield self.read(relative)


def load_corpus(root: Path | None = None, *, max_files: int = 0) -> Corpus:
    """The sorted ``*.py`` files under ``root`` (default: the standard library), split by file.

    ``max_files`` > 0 keeps only the first that many files of each split (smoke runs): the split
    stays the same, only shorter.
    """
    base = root if root is not None else stdlib_root()
    if not base.is_dir():
        raise FileNotFoundError(f"corpus root {base} is not a directory: pass root= a directory holding *.py files")
    files: list[str] = []
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]  # prune: site-packages alone can be huge
        rel = Path(dirpath).relative_to(base)
        files.extend((rel / f).as_posix() for f in filenames if f.endswith(".py"))
    files.sort()
    train = [f for f in files if not is_held_out(f)]
    held_out = [f for f in files if is_held_out(f)]
    if max_files > 0:
        train, held_out = train[:max_files], held_out[:max_files]
    if not train or not held_out:
        raise ValueError(f"corpus under {base} has {len(train)} training and {len(held_out)} held-out files; need both")
    return Corpus(base, tuple(train), tuple(held_out))


def encode_files(tokenizer: Encoder, texts: Sequence[str], seq_len: int, *, min_len: int = 2) -> list[list[int]]:
    """Tokenize documents and cut each (with an end-of-text token appended) into sequences of <= ``seq_len``.

    Pieces shorter than ``min_len`` are dropped: a one-token sequence has no next token to predict.
    """
    if seq_len < min_len:
        raise ValueError(f"seq_len must be >= {min_len}, got {seq_len}")
    eos = tokenizer.eos_token_id
    if not isinstance(eos, int):
        raise ValueError("the tokenizer needs an eos_token (end of text) to separate documents")
    out: list[list[int]] = []
    chunk = 256  # documents per tokenizer call: the Rust tokenizer batches them across threads
    for i in range(0, len(texts), chunk):
        encoded = tokenizer(list(texts[i : i + chunk]), add_special_tokens=False)["input_ids"]
        for ids in encoded:
            doc = [*ids, eos]
            out.extend(piece for j in range(0, len(doc), seq_len) if len(piece := doc[j : j + seq_len]) >= min_len)
    return out


class Collator:
    """Pads a list of token sequences into ``input_ids``, ``attention_mask`` and ``labels`` (right padding).

    ``labels`` are the input ids (a causal LM shifts them itself, and so does the example's loss)
    with ``IGNORE_INDEX`` on padding, so padding never counts in a loss or a metric. Accepts lists
    of ids or ``{"input_ids": [...]}`` dicts (what a ``datasets``-style dataset yields).

    ``pad_to`` > 0 pads every batch to that width instead of its longest sequence: a sample's
    teacher outputs ``[T, k]`` then have the same shape in every batch it lands in, which a
    teacher-output store needs (its rows have one shape per sample). With right padding and a
    causal model the real positions' outputs do not change.
    """

    def __init__(self, pad_id: int, pad_to: int = 0) -> None:
        self.pad_id = int(pad_id)
        self.pad_to = int(pad_to)

    def __call__(self, sequences: Sequence[Sequence[int] | dict[str, Any]]) -> dict[str, torch.Tensor]:
        rows = [list(s["input_ids"]) if isinstance(s, dict) else list(s) for s in sequences]
        if not rows or any(len(r) == 0 for r in rows):
            raise ValueError("Collator needs a non-empty list of non-empty sequences")
        longest = max(len(r) for r in rows)
        if self.pad_to and longest > self.pad_to:
            raise ValueError(f"a sequence of {longest} tokens does not fit pad_to={self.pad_to}")
        width = self.pad_to or longest
        input_ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            input_ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
            attention_mask[i, : len(r)] = 1
        labels = input_ids.masked_fill(attention_mask == 0, IGNORE_INDEX)
        return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


class Batches:
    """Padded batches over sequences, in a seeded shuffled order that changes each epoch (iteration).

    The same seed gives the same batches in the same order: KD and no-KD runs see identical data.
    ``max_batches`` > 0 stops each pass early (smoke runs, time-bounded runs).
    """

    def __init__(
        self, sequences: Sequence[list[int]], collator: Collator, *, batch_size: int, seed: int,
        shuffle: bool = True, max_batches: int = 0,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.sequences = sequences
        self.collator = collator
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.max_batches = max_batches
        self._gen = torch.Generator().manual_seed(seed)

    def __len__(self) -> int:
        n = -(-len(self.sequences) // self.batch_size)
        return min(n, self.max_batches) if self.max_batches > 0 else n

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        n = len(self.sequences)
        order = torch.randperm(n, generator=self._gen).tolist() if self.shuffle else list(range(n))
        for b in range(len(self)):
            idx = order[b * self.batch_size : (b + 1) * self.batch_size]
            yield self.collator([self.sequences[i] for i in idx])


class TrainBatches:
    """Exactly ``steps`` padded batches for one training run, over as many seeded shuffled passes as
    it takes (each pass a new permutation, as ``Batches`` makes them), each batch with ``index``:
    its sequences' positions in ``sequences``, the sample keys of a teacher-output store.

    One pass of this loader is the whole run, so a ``DistillReader`` over it reads ahead across
    epoch boundaries and is never left mid-pass. ``plan()`` gives the same index batches without
    collating: what to record into a store before the students train from it.
    """

    def __init__(self, sequences: Sequence[list[int]], collator: Collator, *, batch_size: int, seed: int,
                 steps: int) -> None:
        if batch_size < 1 or steps < 1:
            raise ValueError(f"batch_size and steps must be >= 1, got {batch_size} and {steps}")
        if not sequences:
            raise ValueError("TrainBatches needs sequences")
        self.sequences = sequences
        self.collator = collator
        self.batch_size = batch_size
        self.seed = seed
        self.steps = steps

    def __len__(self) -> int:
        return self.steps

    def plan(self) -> list[list[int]]:
        """The sequence indices of every batch, in order (a pure function of the seed)."""
        gen = torch.Generator().manual_seed(self.seed)
        n = len(self.sequences)
        per_pass = -(-n // self.batch_size)
        out: list[list[int]] = []
        while len(out) < self.steps:
            order = torch.randperm(n, generator=gen).tolist()
            for b in range(min(per_pass, self.steps - len(out))):
                out.append(order[b * self.batch_size : (b + 1) * self.batch_size])
        return out

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        for idx in self.plan():
            batch = self.collator([self.sequences[i] for i in idx])
            batch["index"] = torch.tensor(idx, dtype=torch.int64)
            yield batch


class IndexBatches:
    """Padded batches of the given sequence indices, in the given order, each with ``index`` (what
    ``distill record`` reads to fill a store with exactly the samples the students will see)."""

    def __init__(self, sequences: Sequence[list[int]], collator: Collator, indices: Sequence[int], *,
                 batch_size: int) -> None:
        self.sequences = sequences
        self.collator = collator
        self.indices = list(indices)
        self.batch_size = batch_size

    def __len__(self) -> int:
        return (len(self.indices) + self.batch_size - 1) // self.batch_size

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        for b in range(len(self)):
            idx = self.indices[b * self.batch_size : (b + 1) * self.batch_size]
            batch = self.collator([self.sequences[i] for i in idx])
            batch["index"] = torch.tensor(idx, dtype=torch.int64)
            yield batch
