"""Sequence packing (`--pack-sequences`, teacher_server.packing): a teacher process serving the tiny
Llama as `hf:DIR` runs the rows of padded requests several to a row, and every row's answer equals
the same row run alone in process, at every position, with zeros at padding; the token metrics
count the packed rows. A batch with a row that has padding inside its length runs padded."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import tritonclient.grpc as tg

from teacher_server.packing import first_fit, pack
from teacher_server.work import Work
from tests.hf_models import load_reference, save_llama
from tests.servers import teacher_process
from tests.test_row_rebatching import _inputs, _padded_batch, _tokens_total

transformers = pytest.importorskip("transformers")

NAMES = ("INPUT_IDS", "ATTENTION_MASK")


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tiny-llama-packed")
    save_llama(directory)
    return directory


def test_rows_are_packed_first_fit_and_put_back_in_batch_order() -> None:
    assert first_fit([12, 5, 9, 1], 12) == [[0], [2, 3], [1]]
    ids = torch.arange(1, 49).view(4, 12)
    works = [Work([ids[r : r + 1, :n]], 1, [], length=n, useful=n) for r, n in enumerate((12, 5, 9, 1))]
    packed = pack(ids, works)
    assert packed is not None and packed.ids.shape == (3, 12)
    assert packed.ids[1, :10].tolist() == [*ids[2, :9].tolist(), ids[3, 0].item()]  # the tail: any token
    assert packed.positions[1].tolist() == [*range(9), 0, 0, 1]
    back = packed.unpacked(packed.ids.unsqueeze(-1)).squeeze(-1)
    for r, n in enumerate((12, 5, 9, 1)):
        assert torch.equal(back[r, :n], ids[r, :n])
    # Padding inside a row's length (fewer useful positions than its length): not packed.
    works[1] = Work([ids[1:2, :5]], 1, [], length=5, useful=4)
    assert pack(ids, works) is None
    # Nothing saved (every row as long as the longest): not packed.
    full = [Work([ids[r : r + 1]], 1, [], length=12, useful=12) for r in range(4)]
    assert pack(ids, full) is None


def test_packed_answers_equal_each_row_alone(llama_dir: Path, tmp_path: Path) -> None:
    reference = load_reference(llama_dir)
    lengths, width = [12, 5, 9, 1, 3, 7], 16
    ids, mask = _padded_batch(lengths, width, seed=3, vocab=97)
    holed = mask.copy()
    holed[0, 4] = 0  # a zero inside row 0's length: its batch cannot be packed
    args = ["--model", f"hf:{llama_dir}", "--name", "llama", "--device", "cpu", "--instances", "1",
            "--metrics-port", "0", "--max-queue-delay-us", "20000", "--pack-sequences"]
    params = {"logprobs": True, "top_k": 8, "topk_tail": True}
    with teacher_process(args, tmp_path) as (_, info), tg.InferenceServerClient(f"127.0.0.1:{info['port']}") as c:
        port = int(info["metrics_port"])
        _, computed0 = _tokens_total(port)
        full = c.infer("llama", _inputs(NAMES, ids, mask), client_timeout=60)
        _, computed1 = _tokens_total(port)
        topk = c.infer("llama", _inputs(NAMES, ids, mask), parameters=params, client_timeout=60)
        padded = c.infer("llama", _inputs(NAMES, ids, holed), client_timeout=60)
        _, computed2 = _tokens_total(port)
        # Each row alone: a batch of one sequence, never packed.
        alone = [c.infer("llama", _inputs(NAMES, ids[r : r + 1, :n], None), parameters=params, client_timeout=60)
                 for r, n in enumerate(lengths)]
    # One batch of the six rows, packed into rows of 12 (12 | 9+3 | 7+5 | 1): 4 x 12 positions,
    # where padded it computes 6 x 12.
    assert computed1 - computed0 == 4 * 12
    logits = full.as_numpy("LOGITS")
    assert logits is not None
    for r, n in enumerate(lengths):
        with torch.inference_mode():
            want = reference(input_ids=torch.from_numpy(ids[r : r + 1, :n])).logits[0]
        assert np.allclose(logits[r, :n], want.numpy(), atol=1e-5), f"row {r}"
        assert not logits[r, n:].any(), f"row {r}: padding must come back as zeros"
        for out, tol in (("LOGITS_TOPK_VALUES", 1e-5), ("LOGITS_TOPK_INDICES", 0), ("LOGITS_TOPK_TAIL", 1e-6)):
            got, one = topk.as_numpy(out), alone[r].as_numpy(out)
            assert got is not None and one is not None and got.shape[:2] == (len(lengths), width)
            assert np.allclose(got[r, :n], one[0], atol=tol), f"row {r} {out}"
            assert not got[r, n:].any(), f"row {r} {out}: padding must come back as zeros"
    # The request with a hole ran padded (row 0 cut to 12, with its zero inside): 6 x 12 positions,
    # and its other rows' answers are those of the packed run.
    assert computed2 - computed1 - 4 * 12 == 6 * 12  # the top-k request was packed too
    holed_logits = padded.as_numpy("LOGITS")
    assert holed_logits is not None
    for r in range(1, len(lengths)):
        assert np.allclose(holed_logits[r], logits[r], atol=1e-5), f"row {r}"
