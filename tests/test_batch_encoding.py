"""A batch's outputs encoded for the wire (`finishing.BatchOutputs.encoded`): a whole-batch output
that every request takes whole rows of is laid out once and each request's rows are copied out of
it as bytes of their own (an answer waiting on a slow client holds its own rows, never the
batch's); a batch of one request answers with a view of its output unless that output is a view
of more memory; an output cut per request (a padded batch's per-position output cut back to each
length) is encoded request by request. Every answer equals its rows' own encoding."""

from __future__ import annotations

import torch

from examples.refteacher import IO as REF_IO
from protos.kserve import encode_tensor
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


def test_each_request_of_a_batch_gets_its_own_rows_as_bytes_of_its_own() -> None:
    works = [_image_work(n) for n in (8, 3, 8, 1)]
    out = torch.randn(20, 100)
    answers = BatchOutputs(works, whole=[("LOGITS", out, LOGITS)]).encoded()
    assert len(answers) == 4
    for (start, stop), [(name, dtype, shape, raw)] in zip(_rows_of(works), answers, strict=True):
        assert (name, dtype, shape) == ("LOGITS", "FP32", [stop - start, 100])
        assert isinstance(raw, bytes) and raw == encode_tensor(out[start:stop])[2]  # holds nothing else


def test_a_non_contiguous_or_bf16_output_is_encoded_in_row_major_order() -> None:
    works = [_image_work(2), _image_work(3)]
    out = torch.randn(100, 5).t()  # [5, 100], not contiguous
    for t in (out, out.to(torch.bfloat16)):
        answers = BatchOutputs(works, whole=[("LOGITS", t, LOGITS)]).encoded()
        for (start, stop), [(_, dtype, shape, raw)] in zip(_rows_of(works), answers, strict=True):
            assert (dtype, shape) == (encode_tensor(t)[0], [stop - start, 100])
            assert raw == encode_tensor(t[start:stop])[2]


def test_a_batch_of_one_request_answers_with_a_view_unless_the_output_views_more_memory() -> None:
    out = torch.randn(4, 100)
    [[(_, _, shape, raw)]] = BatchOutputs([_image_work(4)], whole=[("LOGITS", out, LOGITS)]).encoded()
    assert shape == [4, 100] and isinstance(raw, memoryview) and bytes(raw) == encode_tensor(out)[2]
    storage = torch.randn(50, 100)
    part = storage[:2]  # contiguous, but a view of 50 rows: an answer viewing it would hold them all
    [[(_, _, shape, raw)]] = BatchOutputs([_image_work(2)], whole=[("LOGITS", part, LOGITS)]).encoded()
    assert shape == [2, 100] and isinstance(raw, bytes) and raw == encode_tensor(part)[2]


def test_outputs_cut_back_to_each_length_are_encoded_a_request() -> None:
    works = [_seq_work(5), _seq_work(3), _seq_work(5)]
    out = torch.randn(3, 5, seq_models.VOCAB)  # the padded batch: 5 positions
    pooled = torch.randn(3, seq_models.HIDDEN)
    answers = BatchOutputs(works, whole=[("LOGITS", out, SEQ_LOGITS), ("POOLED", pooled, SEQ_IO.outputs[1])]).encoded()
    for row, (w, [logits, pooled_answer]) in enumerate(zip(works, answers, strict=True)):
        assert logits[:3] == ("LOGITS", "FP32", [1, w.length, seq_models.VOCAB])
        assert logits[3] == encode_tensor(out[row : row + 1, : w.length])[2]
        assert pooled_answer[2] == [1, seq_models.HIDDEN]
        assert pooled_answer[3] == encode_tensor(pooled[row : row + 1])[2]


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
