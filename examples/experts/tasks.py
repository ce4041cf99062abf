"""The two tasks, their vocabulary and their batches: multi-digit addition and word-list reversal.

Every problem is a prompt and an answer with one right value, so a student's greedy answer is
checked by exact match:

* ``add``: ``47+85=`` -> ``132`` (operands of 1 to ``DIGITS`` digits, the sum written plainly).
* ``rev``: ``rev c a h =`` -> ``h a c`` (3 to 6 words of the fixed list ``WORDS``, one token each).

One vocabulary serves both: padding, end of answer, the digits, the words (letters) and the
separators ``+ = rev``. A problem is held out when a digest of its prompt falls in the first
``HELD_OUT_PERCENT`` of 100 buckets: training never draws it, evaluation draws only such problems.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass

import torch
from torch import Tensor

PAD, EOS = 0, 1
DIGITS = 2
WORDS = tuple("abcdefgh")
_SYMBOLS = ("<pad>", "<eos>", *"0123456789", "+", "=", "rev", *WORDS)
VOCAB = {s: i for i, s in enumerate(_SYMBOLS)}
VOCAB_SIZE = len(_SYMBOLS)
TASKS = ("add", "rev")
MAX_LEN = 16  # the longest problem: rev + 6 words + = + 6 words + <eos>
HELD_OUT_PERCENT = 10


@dataclass(frozen=True)
class Problem:
    task: str
    prompt: tuple[str, ...]
    answer: tuple[str, ...]

    @property
    def held_out(self) -> bool:
        digest = hashlib.sha256(" ".join(self.prompt).encode()).digest()
        return digest[0] * 100 // 256 < HELD_OUT_PERCENT


def make(task: str, rng: random.Random) -> Problem:
    """One random problem of ``task`` (held out or not)."""
    if task == "add":
        a, b = (rng.randrange(10 ** rng.randint(1, DIGITS)) for _ in range(2))
        return Problem(task, (*str(a), "+", *str(b), "="), tuple(str(a + b)))
    if task == "rev":
        words = [rng.choice(WORDS) for _ in range(rng.randint(3, 6))]
        return Problem(task, ("rev", *words, "="), tuple(reversed(words)))
    raise ValueError(f"task must be one of {TASKS}, got {task!r}")


def draw(task: str, n: int, rng: random.Random, *, held_out: bool) -> list[Problem]:
    """``n`` problems of ``task`` from the training side (``held_out=False``) or the held-out side."""
    found: list[Problem] = []
    for _ in range(200 * n):  # the held-out side is a tenth of the problems: this bound is never met
        p = make(task, rng)
        if p.held_out == held_out:
            found.append(p)
            if len(found) == n:
                return found
    raise RuntimeError(f"drew fewer than {n} {task} problems; the held-out rule leaves too few")


def encode(symbols: tuple[str, ...]) -> list[int]:
    return [VOCAB[s] for s in symbols]


def decode(ids: list[int]) -> tuple[str, ...]:
    """Symbols up to the first ``<eos>`` (padding dropped)."""
    out: list[str] = []
    for i in ids:
        if i == EOS:
            break
        if i != PAD:
            out.append(_SYMBOLS[i])
    return tuple(out)


def batch(problems: list[Problem]) -> dict[str, Tensor]:
    """Prompt + answer + ``<eos>``, right-padded to the longest: ``input_ids``, ``attention_mask``,
    ``labels`` (the next token at each answer-predicting position, -100 elsewhere), ``task``
    (index into ``TASKS``) and ``prompt_len``."""
    n, width = len(problems), max(len(p.prompt) + len(p.answer) + 1 for p in problems)
    ids = torch.full((n, width), PAD, dtype=torch.long)
    labels = torch.full((n, width), -100, dtype=torch.long)
    prompt_len = torch.zeros(n, dtype=torch.long)
    for row, p in enumerate(problems):
        seq = encode(p.prompt) + encode(p.answer) + [EOS]
        ids[row, :len(seq)] = torch.tensor(seq)
        start = len(p.prompt)
        labels[row, start - 1:len(seq) - 1] = ids[row, start:len(seq)]
        prompt_len[row] = start
    return {"input_ids": ids, "attention_mask": (ids != PAD).long(), "labels": labels,
            "task": torch.tensor([TASKS.index(p.task) for p in problems]), "prompt_len": prompt_len}


def mixed_batches(steps: int, size: int, seed: int, tasks: tuple[str, ...] = TASKS) -> list[dict[str, Tensor]]:
    """``steps`` training batches of ``size`` problems, the tasks in equal shares in every batch."""
    rng = random.Random(seed)
    share = size // len(tasks)
    return [batch([p for t in tasks for p in draw(t, share, rng, held_out=False)]) for _ in range(steps)]


def subset(b: dict[str, Tensor], rows: Tensor) -> dict[str, Tensor]:
    """The rows ``rows`` of a batch, every field."""
    return {k: v[rows] for k, v in b.items()}
