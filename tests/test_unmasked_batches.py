"""A right-padded batch of an hf: causal LM runs without its attention mask: every real position
attends only to earlier positions, all real, so the mask changes nothing the answer keeps, and
leaving it out spares transformers' reading of it on the host (two device synchronisations a
forward pass on a GPU, measured by benchmarks/host_bound.py) and lets attention use its causal
kernels. A batch holding a request with padding inside a row (a hole the row keeps) runs with the
mask, as does any model that does not declare itself causal."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from teacher_server.instance import ModelInstance, unmasked
from teacher_server.model import LoadedModel, load_model
from teacher_server.outputs import OutputTransform
from teacher_server.validation import pad_plan
from teacher_server.work import Work
from tests.hf_models import VOCAB, load_reference, save_llama


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tiny-llama")
    save_llama(directory)
    return directory


class Recorder:
    """Wraps the teacher's decoder call and keeps the attention mask each batch passed it."""

    def __init__(self, hidden: Callable[..., Any]) -> None:
        self.inner = hidden
        self.masks: list[torch.Tensor | None] = []

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> Any:
        self.masks.append(attention_mask)
        return self.inner(input_ids, attention_mask)


@pytest.fixture
def recorded(llama_dir: Path) -> Iterator[tuple[LoadedModel, Recorder]]:
    model = load_model(f"hf:{llama_dir}", device="cpu")
    recorder = Recorder(model.module.hidden)
    model.module.hidden = recorder  # before any instance takes the model's HeadSplit
    yield model, recorder


def _works(model: LoadedModel, rows: list[tuple[np.ndarray, np.ndarray]]) -> list[Work]:
    """One Work a row, its `useful` counted from its mask as the server's RowSplitter does."""
    want = [OutputTransform("LOGITS", None, 5, True, 1.0, True)]
    plan = pad_plan(model.io)
    works = []
    for ids, mask in rows:
        t_ids, t_mask = torch.from_numpy(ids[None]), torch.from_numpy(mask[None])
        works.append(Work([t_ids, t_mask], 1, want, (), ids.shape[0], plan, useful=int(mask.sum())))
    return works


def _run(model: LoadedModel, works: list[Work]) -> list[dict[str, np.ndarray]]:
    inst = ModelInstance(model, 0, max_batch_size=8)
    try:
        result = inst.run(works).per_request
    finally:
        inst.close()
    out = []
    for named in result:
        out.append({name: np.frombuffer(raw, np.int32 if name.endswith("INDICES") else np.float32)
                    .reshape(shape) for name, _, shape, raw in named})
    return out


def _reference_topk(llama_dir: Path, ids: np.ndarray, mask: np.ndarray) -> torch.return_types.topk:
    model = load_reference(llama_dir)
    with torch.inference_mode():
        logits = model(input_ids=torch.from_numpy(ids[None]), attention_mask=torch.from_numpy(mask[None])).logits
    return torch.topk(torch.log_softmax(logits[0], dim=-1), 5, dim=-1)


def test_a_right_padded_batch_runs_without_its_mask_and_answers_as_each_row_alone(
        llama_dir: Path, recorded: tuple[LoadedModel, Recorder]) -> None:
    model, recorder = recorded
    rng = np.random.default_rng(5)
    rows = [(rng.integers(1, VOCAB, size=n, dtype=np.int64), np.ones(n, dtype=np.int64)) for n in (4, 11, 7)]
    works = _works(model, rows)
    assert unmasked(works)
    answers = _run(model, works)
    assert recorder.masks == [None], "the right-padded batch still passed its mask"
    for (ids, mask), got in zip(rows, answers, strict=True):
        want = _reference_topk(llama_dir, ids, mask)
        assert np.allclose(got["LOGITS_TOPK_VALUES"][0], want.values.numpy(), atol=1e-5)
        assert np.array_equal(got["LOGITS_TOPK_INDICES"][0], want.indices.numpy())


def test_a_row_with_padding_inside_keeps_the_batchs_mask(
        llama_dir: Path, recorded: tuple[LoadedModel, Recorder]) -> None:
    model, recorder = recorded
    rng = np.random.default_rng(6)
    holed = np.ones(9, dtype=np.int64)
    holed[3:5] = 0  # a row keeps the padding between its first and last real positions
    rows = [(rng.integers(1, VOCAB, size=6, dtype=np.int64), np.ones(6, dtype=np.int64)),
            (rng.integers(1, VOCAB, size=9, dtype=np.int64), holed)]
    works = _works(model, rows)
    assert not unmasked(works)
    answers = _run(model, works)
    assert len(recorder.masks) == 1 and recorder.masks[0] is not None
    assert recorder.masks[0].tolist() == [[1, 1, 1, 1, 1, 1, 0, 0, 0], holed.tolist()]
    ids, mask = rows[1]
    want = _reference_topk(llama_dir, ids, mask)
    real = mask == 1
    assert np.allclose(answers[1]["LOGITS_TOPK_VALUES"][0][real], want.values.numpy()[real], atol=1e-5)
    # and the hole mattered: without the mask the positions after it would see two more tokens
    blind = _reference_topk(llama_dir, ids, np.ones_like(mask))
    assert not np.allclose(blind.values.numpy()[5:], want.values.numpy()[5:], atol=1e-3)


def test_a_work_whose_mask_was_not_counted_keeps_the_mask() -> None:
    ids = torch.ones((1, 5), dtype=torch.int64)
    counted = Work([ids, torch.ones_like(ids)], 1, [], (), 5, (), useful=5)
    uncounted = Work([ids, torch.ones_like(ids)], 1, [], (), 5, ())
    assert unmasked([counted]) and not unmasked([counted, uncounted])


def test_only_a_causal_lm_declares_its_mask_droppable(tmp_path: Path) -> None:
    import transformers

    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, num_labels=3)
    transformers.LlamaForSequenceClassification(config).eval().save_pretrained(str(tmp_path))
    classifier = load_model(f"hf:{tmp_path}", device="cpu")
    assert classifier.module.causal_mask_only is False
    inst = ModelInstance(classifier, 0, max_batch_size=2)
    try:
        assert inst._unmask is None
    finally:
        inst.close()
