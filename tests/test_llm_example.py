"""The LLM example (examples/llm) in smoke mode: corpus, tokenizer, teacher, student, Trainer loop.

Real runs, small: the tokenizer is trained on a few standard-library files, the smoke teacher and
student are tiny Llama models trained for a few dozen steps, all into a temporary cache. The
student runs once per teacher source: through a real teacher server and DistillReader (mesh), from
a store recorded through the same server and then read with no teacher (store), and in process. The assertions
are on what the runs produced (round trips, losses that fall, finite KD losses, the same KD result
from every source).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from distill.cache import TeacherOutputStore
from distill.losses import TokenKDLoss
from examples.common import CACHE_ENV
from examples.llm import mesh, models
from examples.llm import train_student as llm_student
from examples.llm import train_teacher as llm_teacher
from examples.llm.data import (
    IGNORE_INDEX,
    Batches,
    Collator,
    IndexBatches,
    TrainBatches,
    encode_files,
    is_held_out,
    load_corpus,
)
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


def test_collator_pads_to_a_fixed_width() -> None:
    batch = Collator(pad_id=0, pad_to=4)([[1, 2], [3]])
    assert batch["input_ids"].tolist() == [[1, 2, 0, 0], [3, 0, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 0, 0], [1, 0, 0, 0]]
    with pytest.raises(ValueError, match="does not fit pad_to=1"):
        Collator(pad_id=0, pad_to=1)([[1, 2]])


def test_train_batches_are_the_seeds_passes_with_their_indices() -> None:
    seqs = [[i, i + 1] for i in range(10)]
    # 7 steps of 4 over 10 sequences: two passes of 3 batches, and one batch of a third pass.
    loader = TrainBatches(seqs, Collator(0), batch_size=4, seed=3, steps=7)
    got = list(loader)
    assert len(got) == len(loader) == 7
    passes = Batches(seqs, Collator(0), batch_size=4, seed=3)
    want = [b["input_ids"].tolist() for _ in range(3) for b in passes][:7]
    assert [b["input_ids"].tolist() for b in got] == want  # the order the loop had before
    assert [b["index"].tolist() for b in got] == loader.plan()
    for b in got:
        assert b["input_ids"].tolist() == [seqs[i] for i in b["index"].tolist()]
    again = IndexBatches(seqs, Collator(0), [9, 0, 4], batch_size=2)
    assert [b["index"].tolist() for b in again] == [[9, 0], [4]] and len(again) == 2


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


@pytest.fixture(scope="module")
def student_runs(smoke_teacher: Path, cache: Path) -> dict[str, dict[str, Any]]:
    """The smoke student run once per teacher source: {source: results JSON}. One teacher server
    (the one ``main`` would start: the student's defaults, one smoke batch of 8 per request) serves
    the mesh run and records the store, passed as ``--teachers``."""
    defaults = llm_student.build_parser().parse_args([])
    results = {}
    with mesh.serve_teacher(smoke_teacher, k=defaults.k, temperature=defaults.temperature, max_batch_size=8,
                            threads=1) as teachers:
        for source in llm_student.SOURCES:
            out = cache / f"student-{source}.json"
            assert llm_student.main(["--smoke", "--teacher-source", source, "--teachers", teachers,
                                     "--out", str(out)]) == 0
            results[source] = json.loads(out.read_text())
    return results


@pytest.mark.parametrize("source", llm_student.SOURCES)
def test_student_smoke_kd_and_baseline(student_runs: dict[str, dict[str, Any]], source: str) -> None:
    result = student_runs[source]
    assert result["teacher_source"] == source
    runs = {r["kd"]: r for r in result["runs"]}
    assert set(runs) == {False, True} and runs[False]["seed"] == runs[True]["seed"]
    for r in runs.values():
        assert math.isfinite(r["first_loss"]) and math.isfinite(r["last_loss"])
        assert r["last_loss"] < r["first_loss"]
        assert math.isfinite(r["perplexity"]) and 0 <= r["accuracy"] <= 1
    assert result["bytes_per_token"]["topk_fp16_int32"] < result["bytes_per_token"]["full_fp32"]


def _kd(result: dict[str, Any]) -> dict[str, Any]:
    return next(r for r in result["runs"] if r["kd"])


def test_mesh_store_and_in_process_teach_the_same(student_runs: dict[str, dict[str, Any]]) -> None:
    mesh, store, inprocess = (student_runs[s] for s in ("mesh", "store", "inprocess"))
    # The store holds the mesh's float16 targets, so the KD runs agree (to rounding of the teacher's
    # forward pass on other batch compositions); the in-process teacher computes the same numbers.
    for key in ("perplexity", "accuracy", "first_loss", "last_loss"):
        assert _kd(store)[key] == pytest.approx(_kd(mesh)[key], rel=1e-4), key
        assert _kd(inprocess)[key] == pytest.approx(_kd(mesh)[key], rel=1e-3), key
    # The no-KD arm never sees a teacher: bit-identical in every source (same seed, same batches).
    baselines = {json.dumps([{k: v for k, v in r.items() if k != "seconds"} for r in res["runs"] if not r["kd"]])
                 for res in student_runs.values()}
    assert len(baselines) == 1
    # KD changed the run: its training loss is another function (KL to the teacher), so it differs.
    assert _kd(mesh)["last_loss"] != next(r for r in mesh["runs"] if not r["kd"])["last_loss"]


def test_the_store_holds_what_the_students_saw(student_runs: dict[str, dict[str, Any]]) -> None:
    result = student_runs["store"]
    with TeacherOutputStore.open(result["store"], mode="r") as store:
        ns = store.namespace
        assert len(store) == result["steps"] * result["batch_size"]  # one pass: every sequence drawn once
    assert (ns.model_version, ns.top_k, ns.dtype, ns.values) == (result["teacher_version"], result["k"], "float16",
                                                                   "logprobs")
    # A temperature of 1 is no temperature: the namespace records None for it.
    assert ns.temperature == (None if result["temperature"] == 1.0 else result["temperature"])
    assert dict(ns.extra) == {"topk_tail": "true"}


def test_a_recorded_store_trains_with_no_teacher(student_runs: dict[str, dict[str, Any]], cache: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    capsys.readouterr()
    out = cache / "student-store-again.json"
    assert llm_student.main(["--smoke", "--teacher-source", "store", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "no teacher needed" in printed and "teacher server:" not in printed
    again = json.loads(out.read_text())
    assert _kd(again)["perplexity"] == _kd(student_runs["store"])["perplexity"]  # the same stored targets


def test_hf_trainer_smoke(smoke_teacher: Path, cache: Path) -> None:
    import accelerate  # noqa: F401 - the Trainer needs it; it is in the llm and dev extras

    from examples.llm import hf_trainer

    out = cache / "hf.json"
    assert hf_trainer.main(["--smoke", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert math.isfinite(result["first_loss"]) and result["last_loss"] < result["first_loss"]
