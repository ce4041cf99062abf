"""The LLM example (examples/llm) in smoke mode: corpus, tokenizer, teacher, student, Trainer loop.

Real runs, small: the tokenizer is trained on a few standard-library files, the smoke teacher and
student are tiny Llama models trained for a few dozen steps, all into a temporary cache. The
assertions are on what the runs produced (round trips, losses that fall, finite KD losses).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from distill.losses import TokenKDLoss
from examples.common import CACHE_ENV
from examples.llm import models
from examples.llm import train_student as llm_student
from examples.llm import train_teacher as llm_teacher
from examples.llm.data import IGNORE_INDEX, Batches, Collator, encode_files, is_held_out, load_corpus
from examples.llm.student import InProcessTeacher, bytes_per_token, kd_loss
from examples.llm.tokenizer import get_tokenizer, load_tokenizer, tokenizer_dir

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A private cache dir for this module (tokenizer, teacher and results are written there)."""
    path = tmp_path_factory.mktemp("llm-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(CACHE_ENV, str(path))
        mp.delenv(models.TEACHER_ENV, raising=False)
        yield path


@pytest.fixture(scope="module")
def smoke_teacher(cache: Path) -> Path:
    """The smoke teacher, trained once for the module."""
    assert llm_teacher.main(["--smoke"]) == 0
    return models.teacher_dir(smoke=True)


def test_corpus_is_sorted_deterministic_and_split_by_file() -> None:
    a, b = load_corpus(), load_corpus()
    assert a == b
    assert list(a.train) == sorted(a.train) and list(a.held_out) == sorted(a.held_out)
    assert not set(a.train) & set(a.held_out)
    assert all(is_held_out(f) for f in a.held_out) and not any(is_held_out(f) for f in a.train)
    assert 0.01 < len(a.held_out) / (len(a.train) + len(a.held_out)) < 0.15
    assert not any(part in ("site-packages", "test", "tests") for f in a.train for part in f.split("/")[:-1])
    assert "os.py" in a.train + a.held_out


def test_collator_pads_variable_lengths() -> None:
    batch = Collator(pad_id=7)([[1, 2, 3], [4], {"input_ids": [5, 6]}])
    assert batch["input_ids"].tolist() == [[1, 2, 3], [4, 7, 7], [5, 6, 7]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0], [1, 1, 0]]
    assert batch["labels"].tolist() == [[1, 2, 3], [4, IGNORE_INDEX, IGNORE_INDEX], [5, 6, IGNORE_INDEX]]
    with pytest.raises(ValueError, match="non-empty"):
        Collator(pad_id=0)([[1], []])


def test_batches_same_seed_same_order() -> None:
    seqs = [[i, i + 1] for i in range(20)]
    first = [b["input_ids"].tolist() for b in Batches(seqs, Collator(0), batch_size=4, seed=3)]
    again = [b["input_ids"].tolist() for b in Batches(seqs, Collator(0), batch_size=4, seed=3)]
    other = [b["input_ids"].tolist() for b in Batches(seqs, Collator(0), batch_size=4, seed=4)]
    assert first == again and first != other
    assert sorted(row for b in first for row in b) == seqs


def test_tokenizer_round_trips_and_reloads(cache: Path) -> None:
    tok = get_tokenizer(512, smoke=True)
    assert len(tok) == 512 and tok.eos_token_id is not None and tok.pad_token_id is not None
    text = 'def f(x: int) -> str:\n\t"""Ünïcode ✓ and tabs."""\n    return str(x)  # 🐍\n'
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text
    assert len(ids) < len(text.encode("utf-8"))  # merges learned: fewer tokens than bytes
    reloaded = load_tokenizer(tokenizer_dir(512, smoke=True))
    assert reloaded(text, add_special_tokens=False)["input_ids"] == ids
    seqs = encode_files(tok, [text * 10], seq_len=16)
    assert all(2 <= len(s) <= 16 for s in seqs) and seqs[-1][-1] == tok.eos_token_id
    assert [i for s in seqs for i in s] == [*tok(text * 10, add_special_tokens=False)["input_ids"], tok.eos_token_id]


def test_teacher_smoke_trains_and_saves(smoke_teacher: Path) -> None:
    info = json.loads((smoke_teacher / llm_teacher.INFO).read_text())
    assert info["last_loss"] < info["first_loss"]
    assert math.isfinite(info["held_out_perplexity"]) and 1 < info["held_out_perplexity"] < info["vocab_size"]
    assert 0 < info["held_out_accuracy"] < 1
    model = models.load_teacher(smoke_teacher)
    tok = load_tokenizer(smoke_teacher)  # the tokenizer is saved next to the model
    assert model.config.vocab_size == len(tok) == info["vocab_size"]


def test_teacher_topk_is_a_distribution(smoke_teacher: Path) -> None:
    model = models.load_teacher(smoke_teacher)
    tok = load_tokenizer(smoke_teacher)
    batch = Collator(int(tok.pad_token_id))(encode_files(tok, ["import os\nprint(os.getcwd())\n" * 3], seq_len=24))
    targets = InProcessTeacher(model, k=8)(batch)
    b, t = batch["input_ids"].shape
    assert targets.values.shape == targets.indices.shape == (b, t, 8)
    assert targets.values.dtype == torch.float16 and targets.indices.dtype == torch.int32
    assert targets.kind == "logprobs" and targets.tail is not None
    mass = targets.values.float().exp().sum(-1) + targets.tail.float()
    assert torch.allclose(mass, torch.ones_like(mass), atol=1e-2)
    assert bool((targets.values <= 0).all()) and bool((targets.tail >= 0).all())

    student = models.build("student-smoke", len(tok), max_len=64, pad_token_id=int(tok.pad_token_id))
    loss = kd_loss(TokenKDLoss(alpha=0.5), student(**{k: batch[k] for k in ("input_ids", "attention_mask")}).logits,
                   targets, batch)
    assert torch.isfinite(loss) and float(loss.detach()) > 0
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in student.parameters())


def test_bytes_per_token() -> None:
    assert bytes_per_token(4096, 16) == {"full_fp32": 16384, "topk_fp16_int32": 16 * 6 + 2}


def test_student_smoke_kd_and_baseline(smoke_teacher: Path, cache: Path) -> None:
    out = cache / "student.json"
    assert llm_student.main(["--smoke", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    runs = {r["kd"]: r for r in result["runs"]}
    assert set(runs) == {False, True} and runs[False]["seed"] == runs[True]["seed"]
    for r in runs.values():
        assert math.isfinite(r["first_loss"]) and math.isfinite(r["last_loss"])
        assert r["last_loss"] < r["first_loss"]
        assert math.isfinite(r["perplexity"]) and 0 <= r["accuracy"] <= 1
    assert result["bytes_per_token"]["topk_fp16_int32"] < result["bytes_per_token"]["full_fp32"]


def test_hf_trainer_smoke(smoke_teacher: Path, cache: Path) -> None:
    import accelerate  # noqa: F401 - the Trainer needs it; it is in the llm and dev extras

    from examples.llm import hf_trainer

    out = cache / "hf.json"
    assert hf_trainer.main(["--smoke", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert math.isfinite(result["first_loss"]) and result["last_loss"] < result["first_loss"]
