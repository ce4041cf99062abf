"""Synthetic "who did what to whom" sentences: a documented, seeded generator, no downloads.

The procedure (``generate(n, seed)``), for each sentence, drawing from ``random.Random(seed)``:

1. Draw an *agent* and a different *patient* from 5 animals (cat, dog, fox, owl, bee) and a
   *verb* from 6 (chased, helped, followed, watched, pushed, fed).
2. Make the two noun phrases ``the [ADJ] ANIMAL``; each optional adjective (7 of them) appears
   with probability 1/2.
3. With probability 0.6 bring in a *bystander*, a third animal, in one of six forms (uniformly):
   ``... near the B``; ``... while the B slept``; ``the B saw that ...``; ``the B heard that ...``;
   or a relative clause on the agent's or the patient's noun phrase, ``that the B liked`` or
   ``that feared the B`` (relative clauses use their own verbs: liked, feared, knew).
4. Write the clause in the active voice ``AGENT-NP [ADV] VERB PATIENT-NP`` or, with probability
   1/2, the passive ``PATIENT-NP was VERB by AGENT-NP`` (5 optional adverbs, probability 1/2).
5. With probability 1/2 add a time phrase (yesterday, today, this morning, at night, once) at the
   front or the back.

The label is the triple (agent, patient, verb): 5 x 4 x 6 = 120 classes. The verb can be read off
one word; *which animal did it to which* depends on word order, voice and clause structure, and
the bystander must be ignored. A bag of words cannot tell "the cat chased the dog" from "the dog
chased the cat"; a transformer reads the structure. Sentences (at most 15 words) are token ids
padded with 0 to ``MAX_LEN`` = 16; a batch is ``{"TOKENS": [B,16] int64, "label": [B] int64}``.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass

import torch

ANIMALS = ("cat", "dog", "fox", "owl", "bee")
VERBS = ("chased", "helped", "followed", "watched", "pushed", "fed")
REL_VERBS = ("liked", "feared", "knew")  # verbs of relative clauses only: never the label's verb
ADJECTIVES = ("big", "small", "red", "quick", "lazy", "old", "young")
ADVERBS = ("quickly", "slowly", "quietly", "suddenly", "gladly")
TIMES = ("yesterday", "today", "this morning", "at night", "once")
FUNCTION_WORDS = ("the", "was", "by", "near", "while", "slept", "saw", "heard", "that", "this", "morning", "at",
                  "night")

PAD = 0
MAX_LEN = 16
# A label is (agent, patient, main verb): 5 x 4 x 6 = 120 classes.
LABELS: tuple[tuple[int, int, int], ...] = tuple(
    (a, p, v) for a in range(len(ANIMALS)) for p in range(len(ANIMALS)) if a != p for v in range(len(VERBS))
)
NUM_CLASSES = len(LABELS)  # 120
_LABEL_ID = {t: i for i, t in enumerate(LABELS)}

VOCAB: tuple[str, ...] = ("<pad>", *dict.fromkeys((*ANIMALS, *VERBS, *REL_VERBS, *ADJECTIVES, *ADVERBS, *FUNCTION_WORDS,
                                                    "yesterday", "today", "once")))
TOKEN_ID = {w: i for i, w in enumerate(VOCAB)}

Batch = dict[str, torch.Tensor]


# How a bystander enters the sentence (step 3); drawn uniformly.
_BYSTANDER_FORMS = ("near", "while", "saw", "agent-relative", "patient-relative", "heard")


def _maybe(rng: random.Random, words: tuple[str, ...]) -> list[str]:
    return [rng.choice(words)] if rng.random() < 0.5 else []


def _relative(rng: random.Random, other: str) -> list[str]:
    """``that the OTHER VERB`` (object relative) or ``that VERB the OTHER`` (subject relative)."""
    verb = rng.choice(REL_VERBS)
    return ["that", "the", other, verb] if rng.random() < 0.5 else ["that", verb, "the", other]


def sentence(rng: random.Random) -> tuple[list[str], int]:
    """One sentence (as words) and its label, following steps 1-5 of the module docstring."""
    agent, patient = rng.sample(range(len(ANIMALS)), 2)
    verb_id = rng.randrange(len(VERBS))
    verb = VERBS[verb_id]
    a = ["the", *_maybe(rng, ADJECTIVES), ANIMALS[agent]]
    p = ["the", *_maybe(rng, ADJECTIVES), ANIMALS[patient]]
    form = _BYSTANDER_FORMS[rng.randrange(len(_BYSTANDER_FORMS))] if rng.random() < 0.6 else None
    bystander = ""
    if form is not None:
        bystander = ANIMALS[rng.choice([i for i in range(len(ANIMALS)) if i not in (agent, patient)])]
        if form == "agent-relative":
            a = [*a, *_relative(rng, bystander)]
        elif form == "patient-relative":
            p = [*p, *_relative(rng, bystander)]
    active = rng.random() < 0.5
    words = [*a, *_maybe(rng, ADVERBS), verb, *p] if active else [*p, "was", verb, "by", *a]
    if form == "near":
        words = [*words, "near", "the", bystander]
    elif form == "while":
        words = [*words, "while", "the", bystander, "slept"]
    elif form in ("saw", "heard"):
        words = ["the", bystander, form, "that", *words]
    if rng.random() < 0.5:
        when = rng.choice(TIMES).split()
        words = [*when, *words] if rng.random() < 0.5 else [*words, *when]
    return words, _LABEL_ID[(agent, patient, verb_id)]


def encode(words: list[str]) -> list[int]:
    """Token ids padded with ``PAD`` to ``MAX_LEN`` (sentences are at most 16 words by construction)."""
    ids = [TOKEN_ID[w] for w in words]
    if len(ids) > MAX_LEN:
        raise ValueError(f"sentence of {len(ids)} words exceeds MAX_LEN={MAX_LEN}: {' '.join(words)}")
    return ids + [PAD] * (MAX_LEN - len(ids))


def decode(ids: torch.Tensor) -> str:
    """Token ids back to text (padding dropped), for printing examples."""
    return " ".join(VOCAB[int(i)] for i in ids if int(i) != PAD)


def label_name(label: int) -> str:
    """``"cat chased dog"`` for a label id."""
    agent, patient, verb = LABELS[label]
    return f"{ANIMALS[agent]} {VERBS[verb]} {ANIMALS[patient]}"


@dataclass(frozen=True)
class Sentences:
    """``tokens`` ``[N, MAX_LEN]`` int64 and ``labels`` ``[N]`` int64."""

    tokens: torch.Tensor
    labels: torch.Tensor

    def __len__(self) -> int:
        return len(self.labels)


def generate(n: int, seed: int) -> Sentences:
    """``n`` sentences from ``random.Random(seed)``: same seed, same sentences, on every machine."""
    rng = random.Random(seed)
    rows, labels = [], []
    for _ in range(n):
        words, label = sentence(rng)
        rows.append(encode(words))
        labels.append(label)
    return Sentences(torch.tensor(rows, dtype=torch.int64), torch.tensor(labels, dtype=torch.int64))


# Fixed seeds for the three sets, so every run and every machine uses the same data.
TEACHER_SEED, STUDENT_SEED, TEST_SEED = 101, 202, 303


def teacher_set(n: int = 20_000) -> Sentences:
    """The teacher's (large) training set."""
    return generate(n, TEACHER_SEED)


def student_set(n: int = 1_000) -> Sentences:
    """The student's (small) labelled training set; disjoint seed from the teacher's."""
    return generate(n, STUDENT_SEED)


def test_set(n: int = 2_000) -> Sentences:
    """Held-out sentences every model is scored on."""
    return generate(n, TEST_SEED)


class Batches:
    """A re-iterable loader: each ``iter()`` is one shuffled epoch (generator ``seed * 1000 + epoch``).

    ``rank``/``world`` give each DDP rank a disjoint slice of every epoch.
    """

    def __init__(self, data: Sentences, *, batch_size: int, seed: int, max_batches: int = 0,
                 rank: int = 0, world: int = 1) -> None:
        self.data = data
        self.batch_size = batch_size
        self.seed = seed
        self.max_batches = max_batches
        self.rank, self.world = rank, world
        self.epoch = 0

    def __len__(self) -> int:
        n = (len(self.data) // self.world + self.batch_size - 1) // self.batch_size
        return min(n, self.max_batches) if self.max_batches else n

    def __iter__(self) -> Iterator[Batch]:
        g = torch.Generator().manual_seed(self.seed * 1000 + self.epoch)
        self.epoch += 1
        order = torch.randperm(len(self.data), generator=g)
        per_rank = len(order) // self.world
        order = order[self.rank * per_rank : (self.rank + 1) * per_rank]
        for i, start in enumerate(range(0, len(order), self.batch_size)):
            if self.max_batches and i >= self.max_batches:
                return
            idx = order[start : start + self.batch_size]
            yield {"TOKENS": self.data.tokens[idx], "label": self.data.labels[idx]}
