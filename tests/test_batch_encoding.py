"""A batch's outputs encoded for the wire (`finishing.BatchOutputs.encoded`): a small whole-batch
output is laid out once and each request's answer views its rows; an output cut per request (a
padded batch's per-position output cut back to each length), a large one shared by several
requests, or one that is a view of more memory is copied request by request, so that an answer
waiting on a slow client holds its own rows only. Every answer equals its rows' own encoding."""

from __future__ import annotations

import pytest
import torch

from examples.refteacher import IO as REF_IO
from protos.kserve import encode_tensor
from teacher_server import finishing
from teacher_server.finishing import BatchOutputs
from teacher_server.instance import ModelInstance
from teacher_server.model import load_model
from teacher_server.transforms import OutputTransform
from teacher_server.validation import pad_plan
from teacher_server.work import Work
from tests import seq_models

LOGITS = REF_IO.outputs[0]  # FP32 [100], not per position
SEQ_IO = seq_models.CausalConvLM.io_spec
SEQ_LOGITS = SEQ_IO.outputs[0]  # FP32 [-1, VOCAB], per position


def _image_work(rows: int) -> Work:
    return Work([torch.zeros(rows, 3, 32, 32)], rows, [OutputTransform("LOGITS")], ((3, 32, 32),))


def _seq_work(length: int) -> Work:
    tokens = torch.ones(1, length, dtype=torch.int64)
    return Work([tokens, torch.ones_like(tokens)], 1, [OutputTransform("LOGITS")], (), length, pad_plan(SEQ_IO))


def _rows_of(works: list[Work]) -> list[tuple[int, int]]:
    spans, start = [], 0
    for w in works:
        spans.append((start, start + w.batch_size))
        start += w.batch_size
    return spans


def test_a_small_whole_batch_output_is_one_buffer_each_request_viewing_its_rows() -> None:
    works = [_image_work(n) for n in (8, 3, 8, 1)]
    out = torch.randn(20, 100)
    answers = BatchOutputs(works, whole=[("LOGITS", out, LOGITS)]).encoded()
    assert len(answers) == 4
    buffers = set()
    for (start, stop), [(name, dtype, shape, raw)] in zip(_rows_of(works), answers, strict=True):
        assert (name, dtype, shape) == ("LOGITS", "FP32", [stop - start, 100])
        assert bytes(raw) == encode_tensor(out[start:stop])[2]
        assert isinstance(raw, memoryview)
        buffers.add(id(raw.obj))
    assert len(buffers) == 1  # one layout of the batch, no copy a request


def test_outputs_cut_back_to_each_length_are_each_requests_own_copy() -> None:
    works = [_seq_work(5), _seq_work(3), _seq_work(5)]
    out = torch.randn(3, 5, seq_models.VOCAB)  # the padded batch: 5 positions
    pooled = torch.randn(3, seq_models.HIDDEN)
    answers = BatchOutputs(works, whole=[("LOGITS", out, SEQ_LOGITS), ("POOLED", pooled, SEQ_IO.outputs[1])]).encoded()
    for row, (w, [logits, pooled_answer]) in enumerate(zip(works, answers, strict=True)):
        assert logits[:3] == ("LOGITS", "FP32", [1, w.length, seq_models.VOCAB])
        assert isinstance(logits[3], bytes) and logits[3] == encode_tensor(out[row : row + 1, : w.length])[2]
        # The output every request takes whole rows of is still shared in the same batch.
        assert pooled_answer[2] == [1, seq_models.HIDDEN]
        assert bytes(pooled_answer[3]) == encode_tensor(pooled[row : row + 1])[2]


def test_a_large_output_of_several_requests_is_copied_a_request_and_of_one_request_viewed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(finishing, "SHARED_OUTPUT_MAX_BYTES", 1000)  # 2.5 rows of 100 floats
    works = [_image_work(2), _image_work(2)]
    out = torch.randn(4, 100)
    answers = BatchOutputs(works, whole=[("LOGITS", out, LOGITS)]).encoded()
    for (start, stop), [(_, _, _, raw)] in zip(_rows_of(works), answers, strict=True):
        assert isinstance(raw, bytes) and raw == encode_tensor(out[start:stop])[2]  # its own rows only
    # A batch of one request: its rows are the whole output, viewed whatever its size.
    [[(_, _, shape, raw)]] = BatchOutputs([_image_work(4)], whole=[("LOGITS", out, LOGITS)]).encoded()
    assert shape == [4, 100] and isinstance(raw, memoryview) and bytes(raw) == encode_tensor(out)[2]


def test_an_output_viewing_more_memory_than_its_own_is_copied(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(finishing, "SHARED_OUTPUT_MAX_BYTES", 1000)
    storage = torch.randn(50, 100)
    out = storage[:2]  # contiguous, but a view of 50 rows: an answer viewing it would hold them all
    [[(_, _, shape, raw)]] = BatchOutputs([_image_work(2)], whole=[("LOGITS", out, LOGITS)]).encoded()
    assert shape == [2, 100] and isinstance(raw, bytes) and raw == encode_tensor(out)[2]


def test_a_real_instance_answers_every_request_of_a_batch_with_its_own_rows() -> None:
    inst = ModelInstance(load_model("examples.refteacher:build", device="cpu"), 0, 64)
    try:
        works = [Work([torch.randn(n, 3, 32, 32, generator=torch.Generator().manual_seed(n))], n,
                      [OutputTransform("LOGITS")], ((3, 32, 32),)) for n in (8, 1, 5)]
        result = inst.run(works)
        with torch.inference_mode():
            expected = inst.model.module(torch.cat([w.inputs[0] for w in works]))  # type: ignore[operator]
        for (start, stop), [(_, _, shape, raw)] in zip(_rows_of(works), result.per_request, strict=True):
            got = torch.frombuffer(bytearray(raw), dtype=torch.float32).reshape(shape)
            assert shape == [stop - start, 100] and torch.allclose(got, expected[start:stop], atol=1e-5)
    finally:
        inst.close()
