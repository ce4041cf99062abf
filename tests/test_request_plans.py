"""Requests of a repeated kind are checked against a plan (`teacher_server.request_plans`): the
Work they become and the refusals they get are exactly `validation.validate`'s, and kinds whose
checks read values or parameters never get a plan.

Requests are real ModelInferRequest bytes decoded by the server's own gRPC deserializer.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from protos.kserve import serialize_infer_request, service_pb2
from teacher_server.errors import InvalidRequestError
from teacher_server.grpc_codec import deserialize_infer
from teacher_server.infer_request import InferRequest
from teacher_server.outputs import OutputDefaults
from teacher_server.request_plans import MAX_PLANS, RequestPlans
from teacher_server.spec import ModelIO, TensorSpec
from teacher_server.validation import validate
from teacher_server.work import Work

IO = ModelIO.parse(inputs=["A:FP32:3,4", "B:INT64:-1"], outputs=["OUT:FP32:5", "AUX:FP32:2"])
MAX_BATCH = 16
DEFAULTS = OutputDefaults()


def request(batch: int = 2, *, order: tuple[str, ...] = ("A", "B"), b_width: int = 6, outputs: tuple[str, ...] = (),
            top_k: int = 0, a_bytes: int | None = None, b_batch: int | None = None, seed: int = 0) -> InferRequest:
    """A decoded request of A [batch, 3, 4] FP32 and B [batch, b_width] INT64, inputs in `order`."""
    rng = np.random.default_rng(seed)
    arrays: dict[str, np.ndarray] = {"A": rng.standard_normal((batch, 3, 4), dtype=np.float32),
              "B": rng.integers(0, 100, (b_batch or batch, b_width), dtype=np.int64)}
    header = service_pb2.ModelInferRequest(model_name="m", id="r1")
    raws = []
    for name in order:
        x = arrays[name]
        header.inputs.add(name=name, datatype="FP32" if name == "A" else "INT64", shape=list(x.shape))
        raw = x.tobytes()
        raws.append(raw[:a_bytes] if name == "A" and a_bytes is not None else raw)
    for name in outputs:
        out = header.outputs.add(name=name)
        if top_k:
            out.parameters["top_k"].int64_param = top_k
    return deserialize_infer(serialize_infer_request(header, raws))


def assert_same(got: Work, want: Work) -> None:
    assert got.batch_size == want.batch_size
    assert got.outputs == want.outputs
    assert got.shape_key == want.shape_key
    assert got.length is None and not got.aux
    assert len(got.inputs) == len(want.inputs)
    for g, w in zip(got.inputs, want.inputs, strict=True):
        assert g.dtype == w.dtype and torch.equal(g, w)


def refusal(f: object, *args: object) -> str:
    with pytest.raises(InvalidRequestError) as e:
        f(*args)  # type: ignore[operator]
    return e.value.message


def test_a_repeated_kind_is_planned_and_decodes_as_validate_does() -> None:
    plans = RequestPlans(IO, MAX_BATCH, DEFAULTS)
    for seed, batch in enumerate((2, 2, 5, 16)):  # later requests of the kind take the plan, any batch size
        req = request(batch, seed=seed)
        assert_same(plans.validate(req), validate(req, IO, MAX_BATCH, DEFAULTS))
    assert plans.plans == 1


def test_inputs_sent_in_another_order_come_out_in_declared_order() -> None:
    plans = RequestPlans(IO, MAX_BATCH, DEFAULTS)
    for seed in range(3):
        req = request(3, order=("B", "A"), outputs=("AUX",), seed=seed)
        work = plans.validate(req)
        assert work.inputs[0].shape == (3, 3, 4) and work.inputs[1].dtype == torch.int64
        assert [w.name for w in work.outputs] == ["AUX"]
        assert_same(work, validate(req, IO, MAX_BATCH, DEFAULTS))
    assert plans.plans == 1


@pytest.mark.parametrize("bad", [
    {"a_bytes": 10},  # raw bytes that do not match the shape
    {"batch": MAX_BATCH + 1},  # over the model's max batch size
    {"b_batch": 3},  # inputs whose batch sizes differ
])
def test_a_planned_kind_is_refused_exactly_as_validate_refuses_it(bad: dict[str, int]) -> None:
    plans = RequestPlans(IO, MAX_BATCH, DEFAULTS)
    plans.validate(request(2))
    plans.validate(request(2, seed=1))
    assert plans.plans == 1
    req = request(**({"batch": 2} | bad))  # type: ignore[arg-type]
    assert refusal(plans.validate, req) == refusal(validate, req, IO, MAX_BATCH, DEFAULTS)


def test_kinds_with_parameters_or_other_widths_are_planned_apart_or_not_at_all() -> None:
    plans = RequestPlans(IO, MAX_BATCH, DEFAULTS)
    for _ in range(2):
        req = request(2, outputs=("OUT",), top_k=2)  # an output parameter: always the full path
        assert_same(plans.validate(req), validate(req, IO, MAX_BATCH, DEFAULTS))
        assert plans.validate(req).outputs[0]["top_k"] == 2
    assert plans.plans == 0
    for width in (6, 7, 6):  # B's client-sized dimension makes a kind of its own
        req = request(2, b_width=width)
        assert_same(plans.validate(req), validate(req, IO, MAX_BATCH, DEFAULTS))
    assert plans.plans == 2


def test_the_answer_size_is_checked_for_planned_kinds_too() -> None:
    # OUT and AUX: 28 bytes a row plus the framing margins, 914 bytes for 2 rows and 1,306 for 16.
    plans = RequestPlans(IO, MAX_BATCH, DEFAULTS, max_answer_bytes=1100)
    plans.validate(request(2))
    plans.validate(request(2))
    assert plans.plans == 1
    for _ in range(2):  # refused each time, not remembered as fitting
        assert "over the teacher's limit of 1,100 bytes" in refusal(plans.validate, request(16))
    assert plans.validate(request(2)).batch_size == 2


def test_padded_models_and_limited_ids_are_never_planned() -> None:
    padded = ModelIO.parse(inputs=["IDS:INT64:-1:pad=0"], outputs=["LOGITS:FP32:-1,8"])
    limited = ModelIO((TensorSpec("IDS", "INT64", (4,), max_value=10),), (TensorSpec("LOGITS", "FP32", (8,)),))
    for io, shape, high in ((padded, (2, 5), 8), (limited, (2, 4), 10)):
        plans = RequestPlans(io, MAX_BATCH, DEFAULTS)
        header = service_pb2.ModelInferRequest(model_name="m")
        header.inputs.add(name="IDS", datatype="INT64", shape=list(shape))
        ids = np.random.default_rng(0).integers(0, high, shape, dtype=np.int64)
        req = deserialize_infer(serialize_infer_request(header, [ids.tobytes()]))
        for _ in range(2):
            assert torch.equal(plans.validate(req).inputs[0], torch.from_numpy(ids))
        assert plans.plans == 0
    bad = ids.copy()
    bad[0, 0] = 10  # past the vocabulary: refused every time, as only the full path checks values
    header = service_pb2.ModelInferRequest(model_name="m")
    header.inputs.add(name="IDS", datatype="INT64", shape=list(bad.shape))
    req = deserialize_infer(serialize_infer_request(header, [bad.tobytes()]))
    assert "outside the vocabulary" in refusal(plans.validate, req)


def test_plans_are_bounded() -> None:
    plans = RequestPlans(IO, MAX_BATCH, DEFAULTS)
    for width in range(1, MAX_PLANS + 3):
        plans.validate(request(1, b_width=width))
        assert plans.plans <= MAX_PLANS
    assert 1 <= plans.plans <= MAX_PLANS
