"""The teacher-output store with on-policy scoring outputs, through a loader-wrapping DistillReader.

A real `hf:DIR` teacher process scores padded sequences of mixed lengths with `token_logprobs` and
a `SCORE_IDS` input; the reader records `<OUT>_TOKEN_LOGPROBS` and `<OUT>_SCORED_LOGPROBS` into a
store. The teacher is then stopped and a reader with `cache_mode="read"` and no teachers replays
the same batches: its outputs equal the recorded ones bit for bit, and those equal
`log_softmax(model(x) / T)` of the same model in this process. A replay that does not state
`token_logprobs` is refused by the store's namespace rather than given other numbers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("pyarrow")
pytest.importorskip("transformers")

from distill import DistillReader
from distill.cache import NamespaceMismatchError, TeacherOutputStore
from tests.hf_models import VOCAB, load_reference, save_llama
from tests.servers import teacher_process

pytestmark = pytest.mark.timeout(240)

TEMPERATURE, M = 1.5, 3
INPUTS = {"INPUT_IDS": "input_ids", "ATTENTION_MASK": "attention_mask", "SCORE_IDS": "score_ids"}
NAMES = ("LOGITS_TOKEN_LOGPROBS", "LOGITS_SCORED_LOGPROBS")
LENGTHS = ((5, 9, 12), (16, 3), (7, 11))


def _batches() -> list[dict[str, torch.Tensor]]:
    """Right-padded batches; sample i's ids and score ids depend on i alone (its store key)."""
    out, key = [], 0
    for lengths in LENGTHS:
        width = max(lengths)
        ids = torch.zeros(len(lengths), width, dtype=torch.int64)
        mask = torch.zeros_like(ids)
        score = torch.zeros(len(lengths), width, M, dtype=torch.int32)
        for row, n in enumerate(lengths):
            g = torch.Generator().manual_seed(100 + key + row)
            ids[row, :n] = torch.randint(1, VOCAB, (n,), generator=g)
            mask[row, :n] = 1
            score[row, :n] = torch.randint(0, VOCAB, (n, M), generator=g, dtype=torch.int32)
        out.append({"input_ids": ids, "attention_mask": mask, "score_ids": score,
                    "index": torch.arange(key, key + len(lengths))})
        key += len(lengths)
    return out


def _pass(batches: list[dict[str, torch.Tensor]], **kw: Any) -> list[dict[str, torch.Tensor]]:
    with DistillReader(batches, inputs=INPUTS, outputs=["LOGITS"], temperature=TEMPERATURE, key="index",
                       timeout=30.0, no_teacher_timeout=5.0, **kw) as reader:
        got = list(reader)
    assert [b["index"].tolist() for b, _ in got] == [b["index"].tolist() for b in batches]
    return [{name: out[name] for name in NAMES} for _, out in got]


def test_token_and_scored_logprobs_are_recorded_then_replayed_with_no_teacher(tmp_path: Path) -> None:
    model_dir, store = tmp_path / "llama", tmp_path / "store"
    save_llama(model_dir)
    batches = _batches()
    args = ["--model", f"hf:{model_dir}", "--name", "llama", "--device", "cpu", "--instances", "1",
            "--max-batch-size", "4", "--max-queue-delay-us", "2000"]
    with teacher_process(args, tmp_path) as (_, info):
        recorded = _pass(batches, teachers=f"127.0.0.1:{info['port']}", token_logprobs=True, cache=str(store),
                         cache_mode="write")

    # What was recorded is the model's: log_softmax(model(x) / T) at the next tokens and at SCORE_IDS.
    reference = load_reference(model_dir)
    for batch, out in zip(batches, recorded, strict=True):
        for row in range(batch["input_ids"].shape[0]):
            n = int(batch["attention_mask"][row].sum())
            ids = batch["input_ids"][row, :n]
            with torch.inference_mode():
                lp = torch.log_softmax(reference(input_ids=ids[None]).logits[0].float() / TEMPERATURE, dim=-1)
            torch.testing.assert_close(out[NAMES[0]][row, :n - 1], lp[:-1].gather(-1, ids[1:, None]).squeeze(-1),
                                       atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(out[NAMES[1]][row, :n], lp.gather(-1, batch["score_ids"][row, :n].long()),
                                       atol=1e-4, rtol=1e-4)
    with TeacherOutputStore.open(store) as opened:
        assert len(opened) == sum(len(lengths) for lengths in LENGTHS)

    # The teacher is gone: the store alone answers, bit for bit what was recorded.
    replayed = _pass(batches, token_logprobs=True, cache=str(store), cache_mode="read")
    for want, got in zip(recorded, replayed, strict=True):
        for name in NAMES:
            assert torch.equal(got[name], want[name]), name

    # The store's namespace names token_logprobs: a replay that does not ask for it is refused.
    with pytest.raises(NamespaceMismatchError, match="extra"):
        _pass(batches, cache=str(store), cache_mode="read")
