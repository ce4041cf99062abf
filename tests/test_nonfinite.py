"""Teacher outputs that hold inf or NaN never reach the training loop unannounced, with real servers.

A real teacher-server serves a real torch model that overflows on marked rows (`tests.bad_models`):
the teacher finds the rows on its device before any transform, counts them on /metrics and names
them in its answer (the response parameter `nonfinite_rows`, over gRPC and HTTP alike); the
student's `DistillReader` raises `NonFiniteOutputError` naming the batch and rows by default, or
with `nonfinite="mask"` delivers the batch with `VALID_ROWS` marking exactly those rows, which
`KDLoss` and `TokenKDLoss` leave out of the soft term (compared with the loss of the valid rows
alone). Top-k answers of an overflowed row are caught too (the check runs before top-k), and an
fp16 model's overflow as well.
"""

from __future__ import annotations

import re
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import tritonclient.grpc as tg
import tritonclient.http as th

from distill import DistillReader
from distill.cache.store import TeacherOutputStore
from distill.errors import BatchRejectedError, NonFiniteOutputError
from distill.losses import KDLoss, SparseTargets, TokenKDLoss
from distill.outputs import VALID_ROWS
from protos.kserve import NONFINITE_ROWS_PARAMETER
from teacher_server import BatchingConfig, ServerConfig
from tests import seq_models
from tests.bad_models import FP16_BIG, INF_MARK, MARK_TOKEN, NAN_MARK
from tests.faults.helpers import expected, make_batch
from tests.servers import ServerThread

pytestmark = pytest.mark.timeout(180)

NAME = "teacher"
K = 4


def _server(model: str, max_batch: int = 8) -> ServerThread:
    return ServerThread(ServerConfig(model=model, name=NAME, device="cpu", metrics_port=0, http_port=0,
                                     batching=BatchingConfig(max_batch_size=max_batch, max_queue_delay_us=20_000)))


def _nonfinite_counter(server: ServerThread) -> float:
    """The teacher's count of rows answered with inf or NaN, from its /metrics, for this model."""
    assert server.server is not None and server.server.metrics_port is not None
    url = f"http://127.0.0.1:{server.server.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    found = re.search(r'^teacher_nonfinite_output_rows_total\{model="teacher",version="[^"]*"\} (\S+)$', text, re.M)
    assert found is not None, text
    return float(found.group(1))


def _pass(reader: DistillReader, limit: int = 100) -> tuple[list[tuple[Any, Any]], dict[int, BaseException]]:
    """One pass: the delivered (batch, teacher) pairs, and the errors by the place they took."""
    it = iter(reader)
    got: list[tuple[Any, Any]] = []
    errors: dict[int, BaseException] = {}
    for _ in range(limit):  # bounded: each next() yields, raises for one batch, or ends the pass
        try:
            got.append(next(it))
        except StopIteration:
            return got, errors
        except BatchRejectedError as e:
            errors[len(got) + len(errors)] = e
    raise AssertionError("the pass did not end")


def _affine_data() -> list[dict[str, torch.Tensor]]:
    """Six batches of 12 rows; batch 3 overflows at row 2 (inf) and row 9 (NaN): two chunks of 8."""
    data = [make_batch(i, rows=12) for i in range(6)]
    data[3]["X"][2, 0] = INF_MARK
    data[3]["X"][9, 0] = NAN_MARK
    return data


# ---- a classifier teacher ------------------------------------------------------------------------

def test_by_default_the_batch_fails_naming_its_rows_and_the_teacher_counts_them() -> None:
    with _server("tests.bad_models:overflow") as s, DistillReader(
            _affine_data(), teachers=s.url, inputs=["X"], teacher_batch_size=8, no_teacher_timeout=10) as reader:
        got, errors = _pass(reader)
        counted = _nonfinite_counter(s)
        rejected = reader.stats().rejected_batches
        with DistillReader(_affine_data(), teachers=s.url, inputs=["X"], teacher_batch_size=8,
                           fallback="hard_labels", no_teacher_timeout=10) as hard:
            labels_only, hard_errors = _pass(hard)
            hard_rejected = hard.stats().rejected_batches
    # Under hard labels the batch comes without teacher outputs instead, counted as rejected.
    assert not hard_errors and [t is None for _, t in labels_only] == [i == 3 for i in range(6)]
    assert hard_rejected == 1
    assert list(errors) == [3], errors
    error = errors[3]
    assert isinstance(error, NonFiniteOutputError)
    assert (error.batch, error.rows) == (3, (2, 9)) and f"service {error.service!r}" in str(error)
    assert "rows [2, 9] of batch 3" in str(error) and "nonfinite='mask'" in str(error), str(error)
    assert [int(b["idx"][0]) for b, _ in got] == [0, 1, 2, 4, 5]
    for batch, teacher in got:
        assert VALID_ROWS not in teacher
        assert torch.allclose(teacher["Y"], expected(batch["X"]), atol=1e-5)
    assert rejected == 1
    assert counted == 2


def test_with_the_mask_the_batch_comes_with_its_invalid_rows_marked_and_kd_loss_leaves_them_out() -> None:
    with _server("tests.bad_models:overflow") as s, DistillReader(
            _affine_data(), teachers=s.url, inputs=["X"], teacher_batch_size=8, nonfinite="mask",
            no_teacher_timeout=10) as reader:
        got, errors = _pass(reader)
    assert not errors and [int(b["idx"][0]) for b, _ in got] == list(range(6))
    for batch, teacher in got:
        if int(batch["idx"][0]) != 3:
            assert VALID_ROWS not in teacher
            continue
        valid = teacher[VALID_ROWS]
        assert valid.dtype == torch.bool and (~valid).nonzero().flatten().tolist() == [2, 9]
        y = teacher["Y"]
        assert not bool(torch.isfinite(y[2]).all()) and bool(torch.isnan(y[9]).all())
        assert torch.allclose(y[valid], expected(batch["X"][valid]), atol=1e-5)
        student = torch.randn(12, 4, generator=torch.Generator().manual_seed(0), requires_grad=True)
        labels = torch.arange(12) % 4
        for alpha in (0.0, 0.25):
            loss = KDLoss(temperature=2.0, alpha=alpha)
            got_loss = loss(student, y, labels, valid=valid)
            alone = (1 - alpha) * KDLoss(temperature=2.0, alpha=0.0)(student[valid], y[valid])
            if alpha:
                alone = alone + alpha * torch.nn.functional.cross_entropy(student, labels)
            assert torch.isfinite(got_loss) and torch.allclose(got_loss, alone), (alpha, got_loss, alone)
            got_loss.backward()
            assert student.grad is not None and bool(torch.isfinite(student.grad).all())
            student.grad = None
        assert KDLoss(alpha=0.0)(student, y, valid=torch.zeros(12, dtype=torch.bool)).item() == 0.0
        unmasked = KDLoss(alpha=0.0)(student, y)
        assert not bool(torch.isfinite(unmasked)), "without the mask the loss would be NaN"


def test_the_answer_names_the_rows_over_grpc_and_http_and_an_fp16_overflow_is_caught() -> None:
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(5))
    x[1] = FP16_BIG  # 8 x 20000 x 0.5 overflows fp16
    with _server("tests.bad_models:fp16_overflow") as s:
        assert s.server is not None and s.server.http_port is not None
        with tg.InferenceServerClient(s.url) as client:
            inp = tg.InferInput("X", [4, 8], "FP32")
            inp.set_data_from_numpy(x.numpy())
            result = client.infer(NAME, [inp], client_timeout=30)
            response = result.get_response()
            assert response.parameters[NONFINITE_ROWS_PARAMETER].string_param == "1"
            y = result.as_numpy("Y")
            assert np.isinf(y[1]).all() and np.isfinite(np.delete(y, 1, axis=0)).all()
            fine = tg.InferInput("X", [2, 8], "FP32")
            fine.set_data_from_numpy(x[[0, 2]].numpy())
            clean = client.infer(NAME, [fine], client_timeout=30).get_response()
            assert NONFINITE_ROWS_PARAMETER not in clean.parameters
        web = th.InferenceServerClient(f"127.0.0.1:{s.server.http_port}")
        try:
            hinp = th.InferInput("X", [4, 8], "FP32")
            hinp.set_data_from_numpy(x.numpy(), binary_data=True)
            answer = web.infer(NAME, [hinp], outputs=[th.InferRequestedOutput("Y", binary_data=True)], timeout=30)
            assert answer.get_response()["parameters"] == {NONFINITE_ROWS_PARAMETER: "1"}
        finally:
            web.close()
        with DistillReader([{"X": x, "idx": torch.zeros(4)}], teachers=s.url, inputs=["X"],
                           no_teacher_timeout=10) as reader:
            _, errors = _pass(reader)
        counted = _nonfinite_counter(s)
    assert list(errors) == [0] and isinstance(errors[0], NonFiniteOutputError) and errors[0].rows == (1,)
    assert counted == 3  # gRPC, HTTP and the reader's request: one row each


def test_the_store_never_records_a_row_answered_with_inf_or_nan(tmp_path: Path) -> None:
    data = _affine_data()
    for i, b in enumerate(data):
        b["index"] = torch.arange(i * 12, (i + 1) * 12)
    with _server("tests.bad_models:overflow") as s, DistillReader(
            data, teachers=s.url, inputs=["X"], outputs=["Y"], teacher_batch_size=8, nonfinite="mask",
            cache=str(tmp_path / "kd"), cache_mode="read_write", key="index", no_teacher_timeout=10) as reader:
        got, errors = _pass(reader)
    assert not errors and len(got) == 6  # closing the reader wrote what it queued for the store
    with TeacherOutputStore.open(tmp_path / "kd") as store:
        assert len(store) == 6 * 12 - 2
        stored = store.contains(np.arange(36, 48))
        assert stored.tolist() == [i not in (2, 9) for i in range(12)], "batch 3's rows 2 and 9 were stored"
        y = store.lookup(np.arange(36, 48)[stored], ["Y"]).outputs["Y"]
        assert isinstance(y, torch.Tensor) and bool(torch.isfinite(y).all())


# ---- a language model served as top-k ------------------------------------------------------------

def _sequences() -> Iterator[dict[str, torch.Tensor]]:
    """Two batches of right-padded sequences of lengths in one length bucket (the teacher batches
    their rows together, padding the shorter ones with positions its model makes NaN); batch 1's
    row 2 holds MARK_TOKEN, where the model divides by zero."""
    g = torch.Generator().manual_seed(11)
    for b, lengths in enumerate([(12, 9, 16, 10), (11, 16, 9, 13, 10)]):
        ids = torch.zeros(len(lengths), max(lengths), dtype=torch.int64)
        mask = torch.zeros_like(ids)
        for r, n in enumerate(lengths):
            row = torch.randint(1, seq_models.VOCAB, (n,), generator=g)
            row[row == MARK_TOKEN] = MARK_TOKEN + 1
            ids[r, :n], mask[r, :n] = row, 1
        if b == 1:
            ids[2, 4] = MARK_TOKEN
        yield {"input_ids": ids, "attention_mask": mask, "idx": torch.full((len(lengths),), b)}


class Sequences:
    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        return _sequences()


def _lm_reader(url: str, **kw: Any) -> DistillReader:
    return DistillReader(Sequences(), teachers=url, inputs={"TOKENS": "input_ids", "MASK": "attention_mask"},
                         outputs=["LOGITS"], top_k=K, logprobs=True, topk_tail=True, no_teacher_timeout=10, **kw)


def test_top_k_answers_of_an_overflowed_row_are_caught_and_token_kd_loss_leaves_the_row_out() -> None:
    first = len(seq_models.BATCHES)
    with _server("tests.bad_models:overflow_lm", max_batch=16) as s:
        with _lm_reader(s.url) as reader:
            got, errors = _pass(reader)
        assert [int(b["idx"][0]) for b, _ in got] == [0] and list(errors) == [1], errors
        error = errors[1]
        assert isinstance(error, NonFiniteOutputError) and (error.batch, error.rows) == (1, (2,)), error
        with _lm_reader(s.url, nonfinite="mask") as reader:
            got, errors = _pass(reader)
        counted = _nonfinite_counter(s)
    # Rows of different lengths shared padded batches: the NaN the model computes past a shorter
    # row's end is not held against that row.
    assert any(shape[0] > 1 for shape in seq_models.BATCHES[first:]), seq_models.BATCHES[first:]
    assert not errors and [int(b["idx"][0]) for b, _ in got] == [0, 1]
    assert counted == 2
    (_, clean), (batch, teacher) = got
    assert VALID_ROWS not in clean
    valid = teacher[VALID_ROWS]
    assert valid.tolist() == [True, True, False, True, True]
    targets = SparseTargets.from_outputs(teacher, "LOGITS", kind="logprobs")
    assert not bool(torch.isfinite(targets.values[2]).all())
    mask = batch["attention_mask"]
    real = mask.bool()
    assert bool(torch.isfinite(targets.values[valid][real[valid]]).all())
    b, t = mask.shape
    student = torch.randn(b, t, seq_models.VOCAB, generator=torch.Generator().manual_seed(1), requires_grad=True)
    loss = TokenKDLoss(temperature=1.0)
    got_loss = loss(student, targets, attention_mask=mask, valid=valid)
    alone = loss(student[valid], SparseTargets(targets.values[valid], targets.indices[valid], targets.tail[valid]
                                               if targets.tail is not None else None, "logprobs"),
                 attention_mask=mask[valid])
    assert torch.isfinite(got_loss) and torch.allclose(got_loss, alone), (got_loss, alone)
    got_loss.backward()
    assert student.grad is not None and bool(torch.isfinite(student.grad).all())
    nothing = loss(student, targets, attention_mask=mask, valid=torch.zeros(b, dtype=torch.bool))
    assert nothing.item() == 0.0
