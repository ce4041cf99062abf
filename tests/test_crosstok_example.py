"""The cross-tokenizer example (examples/crosstok): its --quick run end to end, and its parts.

``python -m examples.crosstok --quick`` runs once for the module in this process: two byte-level
BPEs of different sizes and a tiny teacher trained into a temporary cache, a real etcd and a real
``teacher-server`` process registered in it on loopback, and the four student arms, the KD ones
reading through ``DistillReader`` (texts for the cross-tokenizer arms, the on-policy one's own
samples as texts after its warm-up, ids for the reference). The assertions are on the JSON and the
table it wrote.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from examples.common import CACHE_ENV
from examples.crosstok import __main__ as crosstok_main
from examples.crosstok import arms
from examples.crosstok.corpus import TEXT, TextCollator, context, get_tokenizer, load_texts, plan, text_pieces
from examples.crosstok.onpolicy import OnPolicySettings, prompts_of
from examples.crosstok.train import bits_per_byte
from examples.llm.data import IGNORE_INDEX
from examples.llm.tokenizer import load_tokenizer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[dict[str, Any], str, Path]]:
    """The --quick run's JSON, its printed output, and the cache it trained into."""
    cache = tmp_path_factory.mktemp("crosstok-cache")
    out = cache / "results.json"
    printed = io.StringIO()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(CACHE_ENV, str(cache))
        with contextlib.redirect_stdout(printed):
            assert crosstok_main.main(["--quick", "--out", str(out)]) == 0
        yield json.loads(out.read_text()), printed.getvalue(), cache


def test_quick_run_measures_every_arm_below_the_uniform_bound(quick: tuple[dict[str, Any], str, Path]) -> None:
    result, _, _ = quick
    summary = result["summary"]
    assert set(summary) == set(arms.ARMS)
    seeds = result["settings"]["seeds"]
    assert seeds == [0, 1]
    steps = result["settings"]["steps"]
    assert sorted((r["arm"], r["seed"]) for r in result["runs"]) == sorted((a, s) for a in arms.ARMS for s in seeds)
    for run in result["runs"]:
        assert math.isfinite(run["bits_per_byte"]) and run["bits_per_byte"] > 0.0, run
        assert run["bytes"] == result["teacher"]["bytes"]  # every arm scores the same held-out text
        assert math.isfinite(run["first_loss"]) and math.isfinite(run["last_loss"]), run
        # Every step of a KD arm had the teacher's answer (no hard-label fallback), none of no_kd's.
        assert run["teacher_steps"] == (0 if run["arm"] == "no_kd" else steps), run
    for arm, m in summary.items():
        assert math.isfinite(m["mean"]) and m["std"] >= 0.0
        assert m["mean"] < m["uniform_bits_per_byte"], (arm, m)
    # The reference student has the teacher's tokenizer; the cross-tokenizer and no-KD students the smaller one,
    # and the same initial weights: the same size.
    by_arm = {r["arm"]: r for r in result["runs"]}
    assert by_arm["same_tokenizer_reference"]["vocab_size"] == result["teacher"]["settings"]["vocab_size"] == 512
    assert by_arm["no_kd"]["vocab_size"] == by_arm["crosstok_kd"]["vocab_size"] == 320
    assert by_arm["crosstok_onpolicy"]["vocab_size"] == 320
    assert by_arm["no_kd"]["parameters"] == by_arm["crosstok_kd"]["parameters"]
    assert by_arm["crosstok_onpolicy"]["parameters"] == by_arm["no_kd"]["parameters"]
    assert by_arm["no_kd"]["tokens"] == by_arm["crosstok_kd"]["tokens"] != by_arm["same_tokenizer_reference"]["tokens"]
    # Same initial weights, same batches: only the teacher's term can tell the two apart, on every seed.
    for seed in seeds:
        own = {r["arm"]: r["bits_per_byte"] for r in result["runs"] if r["seed"] == seed}
        assert own["crosstok_kd"] != own["no_kd"], own
    teacher = result["teacher"]
    assert teacher["bits_per_byte"] < teacher["uniform_bits_per_byte"]
    assert teacher["parameters"] > by_arm["no_kd"]["parameters"]


def test_quick_run_trains_the_on_policy_arm_on_teacher_scored_samples(
        quick: tuple[dict[str, Any], str, Path]) -> None:
    result, _, _ = quick
    settings = result["settings"]
    steps, batch_size = settings["steps"], settings["batch_size"]
    warm = OnPolicySettings(settings["warmup"], settings["prompt_tokens"], settings["new_tokens"]).warmup_steps(steps)
    assert 0 < warm < steps
    runs = {r["seed"]: r for r in result["runs"] if r["arm"] == "crosstok_onpolicy"}
    assert set(runs) == set(settings["seeds"])
    for seed, run in runs.items():
        own = run["onpolicy"]
        assert (own["warmup"], own["prompt_tokens"], own["new_tokens"]) == (0.75, 8, 16)
        assert own["onpolicy_steps"] == steps - warm
        # Every on-policy step had a prompt and the teacher scored its samples: none fell back to hard labels.
        assert own["scored_steps"] == own["onpolicy_steps"] and own["refused_steps"] == own["no_prompt_steps"] == 0
        assert 0 < own["scored_rows"] <= own["scored_steps"] * batch_size
        assert own["counted_chunks"] > 0
        assert math.isfinite(own["sample_kl_first"]) and math.isfinite(own["sample_kl_last"])
        # The samples' per-token reverse-KL estimate is an average of log q - log p: a student that samples from
        # itself is, in expectation, at least as likely as the teacher on its own text.
        assert own["sample_kl_first"] > 0.0, own
        # The warm-up is crosstok_kd's first steps exactly; the on-policy steps then move it elsewhere.
        kd = next(r for r in result["runs"] if r["arm"] == "crosstok_kd" and r["seed"] == seed)
        assert run["first_loss"] == pytest.approx(kd["first_loss"], rel=1e-5)
        assert run["bits_per_byte"] != kd["bits_per_byte"]


def test_prompts_are_the_prefixes_of_the_pieces_long_enough(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    tok = get_tokenizer(300, load_texts(quick=True), quick=True)
    batch = TextCollator(tok, 64)(["def f(x):\n    return x + 1\n", "a", "import os\nimport sys\n"])
    lengths = batch["attention_mask"].sum(dim=1).tolist()
    assert lengths[1] == 2  # the BOS and one token: too short for a prompt of 4
    prompts = prompts_of(batch, 4)
    assert prompts.shape == (2, 4)
    assert prompts.equal(batch["input_ids"][[0, 2], :4])
    assert (prompts[:, 0] == tok.eos_token_id).all()  # each starts at the BOS
    assert prompts_of(batch, max(lengths)).shape[0] == 0  # no piece longer than the prompt: no samples that step
    with pytest.raises(ValueError, match="warmup"):
        OnPolicySettings(warmup=1.0)
    with pytest.raises(ValueError, match="prompt_tokens"):
        OnPolicySettings(prompt_tokens=1)
    assert OnPolicySettings(warmup=0.5).warmup_steps(300) == 150


def test_quick_run_prints_the_table(quick: tuple[dict[str, Any], str, Path]) -> None:
    result, printed, _ = quick
    lines = printed.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("held-out bits per byte"))
    assert "seed 0" in lines[head] and "seed 1" in lines[head] and "mean ± std" in lines[head]
    rows = {line.split()[0]: line for line in lines[head + 1 : head + 2 + len(arms.ARMS)]}
    assert set(rows) == {"teacher", *arms.ARMS}
    for arm, m in result["summary"].items():
        assert f"{m['mean']:.4f} ± {m['std']:.4f}" in rows[arm]
    assert f"{result['teacher']['bits_per_byte']:.4f}" in rows["teacher"]


def test_the_teacher_directory_is_a_served_model_with_its_bos_adding_tokenizer(
        quick: tuple[dict[str, Any], str, Path]) -> None:
    _, _, cache = quick
    directory = cache / "crosstok" / "teacher-512-quick"
    assert (directory / "config.json").is_file() and (directory / "train_info.json").is_file()
    tok = load_tokenizer(directory)
    assert len(tok) == 512
    ids = tok("def f():\n    return 1")["input_ids"]
    assert ids[0] == tok.eos_token_id  # the BOS every text gets, so its first byte has a score
    assert tok.decode(ids[1:]) == "def f():\n    return 1"


def test_text_pieces_cut_at_lines_within_the_byte_limit() -> None:
    texts = ["one\ntwo\nthree\n", "é" * 7 + "\nx", "a\n" * 3]
    pieces = text_pieces(texts, 6)
    assert all(0 < len(p.encode()) <= 6 for p in pieces)
    assert "".join(pieces) == "".join(texts)
    assert pieces[:3] == ["one\n", "two\n", "three\n"]
    assert pieces[3:6] == ["ééé", "ééé", "é\nx"]  # a long line cut at characters, never inside one
    with pytest.raises(ValueError, match="max_bytes"):
        text_pieces(texts, 3)


def test_plan_repeats_the_seed_and_covers_every_piece_per_pass() -> None:
    a = plan(10, batch_size=4, steps=6, seed=3)
    assert a == plan(10, batch_size=4, steps=6, seed=3) and a != plan(10, batch_size=4, steps=6, seed=4)
    assert [len(b) for b in a] == [4, 4, 2, 4, 4, 2]
    assert sorted(i for b in a[:3] for i in b) == list(range(10))


class _Uniform(nn.Module):
    """A causal LM that gives every token the same probability."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab = vocab
        self.unused = nn.Parameter(torch.zeros(1))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> Any:
        return SimpleNamespace(logits=torch.zeros(*input_ids.shape, self.vocab))


def test_bits_per_byte_of_a_uniform_model_is_the_uniform_bound(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    corpus = load_texts(quick=True)
    tok = get_tokenizer(300, corpus, quick=True)
    pieces = text_pieces(list(corpus.texts("held_out"))[:2], 64)[:20]
    batch = TextCollator(tok, context(64))(pieces[:3])
    assert batch[TEXT] == pieces[:3]
    assert (batch["input_ids"][:, 0] == tok.eos_token_id).all()
    assert (batch["labels"] == IGNORE_INDEX).equal(batch["attention_mask"] == 0)
    m = bits_per_byte(_Uniform(len(tok)), tok, pieces, max_len=context(64), batch_size=7)
    assert m.bytes == sum(len(p.encode()) for p in pieces)
    assert m.tokens == sum(len(tok(p, add_special_tokens=False)["input_ids"]) for p in pieces)
    assert m.bits_per_byte == pytest.approx(m.uniform_bits_per_byte, rel=1e-5)
    assert m.uniform_bits_per_byte == pytest.approx(m.tokens * math.log2(300) / m.bytes)
