"""benchmarks.packing's variants: every sequence computed exactly once per variant, within the
token budget, and the packed rows (positions restarting per sequence, no attention mask) giving
each sequence the logits it gets alone, with a real transformers Llama."""

from __future__ import annotations

import pytest
import torch

from benchmarks import packing

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
