"""benchmarks.packing's variants: every sequence computed exactly once per variant, within the
token budget, and the packed rows (positions restarting per sequence, no attention mask) giving
each sequence the logits it gets alone, with a real transformers Llama."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from benchmarks import common, packing

pytest.importorskip("transformers")

S = packing.Settings(sequences=20, min_len=2, row=32, budget=128, hidden=32, layers=2, heads=4, vocab=97)


def test_each_variant_computes_every_sequence_once_within_the_budget() -> None:
    seqs = packing.draw(S)
    for make in (packing.sorted_batches, packing.bucket_batches, packing.server_batches):
        batches = make(seqs, S.budget)
        assert sorted(i for _, where in batches for i, _, _ in where) == list(range(len(seqs)))
        for inputs, where in batches:
            ids = inputs["input_ids"]
            assert ids.numel() <= S.budget or len(where) == 1
            for i, r, at in where:
                assert at == 0 and torch.equal(ids[r, : len(seqs[i])], seqs[i])
    packed = packing.packed_batches(seqs, S.budget, S.row)
    assert sorted(i for _, where in packed for i, _, _ in where) == list(range(len(seqs)))
    for inputs, where in packed:  # each row: its sequences side by side, positions from 0 for each
        assert inputs["input_ids"].numel() <= S.budget and "attention_mask" not in inputs
        for i, r, at in where:
            n = len(seqs[i])
            assert at + n <= S.row and torch.equal(inputs["input_ids"][r, at : at + n], seqs[i])
            assert torch.equal(inputs["position_ids"][r, at : at + n], torch.arange(n))


def test_packed_rows_give_each_sequence_its_own_logits() -> None:
    model, attention = packing.make_model(S)
    assert attention == "sdpa"
    seqs = packing.draw(S)
    packed = packing.packed_batches(seqs, S.budget, S.row)
    assert any(len({r for _, r, _ in where}) < len(where) for _, where in packed)  # rows do hold several
    assert packing.max_diff(model, seqs, packed) < 1e-4
    # Without the reset positions the same rows are one long sequence: the check would catch it.
    inputs, where = next((b, w) for b, w in packed if len({r for _, r, _ in w}) < len(w))
    flat = {k: v for k, v in inputs.items() if k != "position_ids"}
    assert packing.max_diff(model, seqs, [(flat, where)]) > 1e-3


def test_the_benchmark_takes_a_device_and_a_compute_dtype(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--device` / `--compute-dtype` (cuda on a GPU; here the CPU in bf16): the model runs in that
    dtype, packing stays within bf16's rounding of each sequence alone, and the JSON says where it ran."""
    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path)
    assert packing.main(["--quick", "--compute-dtype", "BF16", "--out", "pk"]) == 0
    doc = json.loads((tmp_path / "pk.json").read_text())
    assert doc["machine"]["device"] == "cpu" and doc["machine"]["compute_dtype"] == "BF16"
    assert doc["settings"]["compute_dtype"] == "BF16"
    assert 0 < doc["max_abs_diff"]["packed"] < 5e-2
    assert all(v["tokens_per_s"] > 0 for v in doc["variants"].values())
    model, _ = packing.make_model(packing.Settings(hidden=32, layers=1, heads=4, vocab=97, compute_dtype="BF16"))
    assert next(model.parameters()).dtype == torch.bfloat16
    with pytest.raises(SystemExit):
        packing.parse_args(["--device", "gpu0"])
