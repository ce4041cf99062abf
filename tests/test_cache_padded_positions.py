"""The store keeps per-position outputs of sequence teachers as they were answered: at the width of
the batch that was sent, padded positions included, and gives them back cut or zero-padded to each
later batch's own padded width.

The teacher is a causal convolution whose mask is declared as a plain padded input, so the server
computes padded positions instead of cutting rows back to the mask (teacher_server.rows): at the
first padded positions after a sequence it answers values that depend on the sequence's last
tokens (not zeros), so a store that dropped, zeroed or shifted padded positions would fail here.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("pyarrow")

from distill import DistillReader
from distill.cache import TeacherOutputStore
from teacher_server import BatchingConfig, ServerConfig
from tests import seq_models
from tests.servers import ServerThread

LENGTHS = [3, 11, 5, 8, 2, 12, 7, 4, 9]
NAMES = ("LOGITS_TOPK_VALUES", "LOGITS_TOPK_INDICES")


@pytest.fixture(scope="module")
def seq_teacher() -> Iterator[ServerThread]:
    cfg = ServerConfig(model="tests.seq_models:causal_conv_lm_uncut", name="seq", device="cpu", instances=1,
                       batching=BatchingConfig(max_batch_size=64, max_queue_delay_us=2000))
    with ServerThread(cfg) as srv:
        yield srv


def _batches(order: list[int], rows: int) -> list[dict[str, torch.Tensor]]:
    """Samples `order` in batches of `rows`, each right-padded to its batch's longest sample."""
    out = []
    for start in range(0, len(order), rows):
        idx = order[start:start + rows]
        width = max(LENGTHS[i] for i in idx)
        tokens = torch.zeros((len(idx), width), dtype=torch.int64)
        mask = torch.zeros((len(idx), width), dtype=torch.int64)
        for r, i in enumerate(idx):
            g = torch.Generator().manual_seed(200 + i)
            tokens[r, :LENGTHS[i]] = torch.randint(1, seq_models.VOCAB, (LENGTHS[i],), generator=g)
            mask[r, :LENGTHS[i]] = 1
        out.append({"TOKENS": tokens, "MASK": mask, "index": torch.tensor(idx)})
    return out


def _pass(data: list[dict[str, torch.Tensor]], **kw: Any) -> list[dict[str, torch.Tensor]]:
    with DistillReader(data, inputs=["TOKENS", "MASK"], outputs=["LOGITS"], top_k=5, key="index",
                       no_teacher_timeout=5.0, **kw) as reader:
        got = [(batch, out) for batch, out in reader]
    assert [b["index"].tolist() for b, _ in got] == [b["index"].tolist() for b in data]
    return [out for _, out in got]


def test_padded_positions_are_stored_as_answered_and_come_back_cut_or_zero_padded(
        seq_teacher: ServerThread, tmp_path: Path) -> None:
    cache = tmp_path / "kd"
    recorded = _batches(list(range(len(LENGTHS))), rows=3)  # widths 11, 12, 9
    answered = _pass(recorded, teachers=seq_teacher.url, cache=str(cache), cache_mode="write")

    # As answered: each sample's row at its batch's width, every position, bit for bit.
    as_answered: dict[int, dict[str, torch.Tensor]] = {}
    padded_nonzero = 0
    with TeacherOutputStore.open(cache) as store:
        for batch, out in zip(recorded, answered, strict=True):
            width = batch["TOKENS"].shape[1]
            keys = batch["index"].tolist()
            found = store.lookup(keys)
            assert bool(found.hit.all()), keys
            for name in NAMES:
                rows = found.ragged(name).unbind()
                for r, key in enumerate(keys):
                    assert rows[r].shape == (width, 5), (name, key, list(rows[r].shape))
                    want = out[name][r]
                    assert torch.equal(rows[r].to(want.dtype), want), f"{name} of sample {key} not as answered"
                    as_answered.setdefault(key, {})[name] = rows[r].to(want.dtype).clone()
            padding = batch["MASK"] == 0
            padded_nonzero += int((out["LOGITS_TOPK_VALUES"][padding] != 0).any(-1).sum())
    assert padded_nonzero > 0, "the teacher answered only zeros at padding: the test could not tell"

    # Read back offline in batches of other widths: stored positions up to the new width, zeros past
    # the stored width (a sample of 3 tokens stored at 11 comes back at 4 with 1 answered pad).
    regrouped = _batches([4, 0, 7, 2, 6, 1, 8, 5, 3], rows=2)  # widths 3, 5, 11, 12, 8
    assert {b["TOKENS"].shape[1] for b in regrouped} - {11, 12, 9}, "some batch must have a new width"
    stored = _pass(regrouped, cache=str(cache), cache_mode="read")
    cut = grown = 0
    for batch, out in zip(regrouped, stored, strict=True):
        width = batch["TOKENS"].shape[1]
        for r, key in enumerate(batch["index"].tolist()):
            for name in NAMES:
                row = as_answered[key][name]
                want = torch.zeros((width, 5), dtype=row.dtype)
                n = min(width, row.shape[0])
                want[:n] = row[:n]
                assert torch.equal(out[name][r], want), f"{name} of sample {key} at width {width}"
            cut += int(width < as_answered[key][NAMES[0]].shape[0])
            grown += int(width > as_answered[key][NAMES[0]].shape[0])
    assert cut and grown, (cut, grown)
