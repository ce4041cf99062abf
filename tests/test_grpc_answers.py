"""The gRPC edge's answers as wire bytes (`teacher_server.grpc_codec.response_parts`): every field a
ModelInferResponse built by protobuf would carry, the outputs framed as `raw_output_contents`, and
the same answer inside a ModelStreamInferResponse, as tritonclient's own messages parse them."""

from __future__ import annotations

import numpy as np
import pytest
from tritonclient.grpc import service_pb2

from protos.kserve import NONFINITE_ROWS_PARAMETER
from teacher_server.grpc_codec import encode_response, encode_stream_answer, response_parts
from teacher_server.infer_request import InferRequest

LOGITS = np.arange(24, dtype=np.float32).reshape(4, 6)
IDS = np.array([[1], [2], [3], [40_000]], dtype=np.int32)
OUTPUTS = [("LOGITS", "FP32", [4, 6], LOGITS.tobytes()), ("IDS", "INT32", [4, 1], IDS.tobytes()),
           ("EMPTY", "FP32", [0, 6], b"")]


def _expected(nonfinite: str = "") -> service_pb2.ModelInferResponse:
    resp = service_pb2.ModelInferResponse(model_name="m", model_version="3", id="req-7")
    if nonfinite:
        resp.parameters[NONFINITE_ROWS_PARAMETER].string_param = nonfinite
    for name, dtype, shape, raw in OUTPUTS:
        resp.outputs.add(name=name, datatype=dtype, shape=shape)
        resp.raw_output_contents.append(raw)
    return resp


@pytest.mark.parametrize(("rows", "named"), [((), ""), ((0, 3), "0,3")])
def test_an_answer_parses_as_the_message_protobuf_would_build(rows: tuple[int, ...], named: str) -> None:
    parts = response_parts(InferRequest(model_name="m", id="req-7"), "m", "3", OUTPUTS, rows)
    answer = service_pb2.ModelInferResponse.FromString(encode_response(parts))
    assert answer == _expected(named)
    assert np.array_equal(np.frombuffer(answer.raw_output_contents[0], np.float32).reshape(4, 6), LOGITS)
    assert np.array_equal(np.frombuffer(answer.raw_output_contents[1], np.int32).reshape(4, 1), IDS)


def test_a_stream_answer_carries_the_same_answer_and_no_error() -> None:
    parts = response_parts(InferRequest(model_name="m", id="req-7"), "m", "3", OUTPUTS, (2,))
    answer = service_pb2.ModelStreamInferResponse.FromString(encode_stream_answer(parts))
    assert answer.error_message == ""
    assert answer.infer_response == _expected("2")


def test_the_outputs_are_framed_not_copied_into_a_message() -> None:
    # The parts hold each output's own buffer (viewed), so the join is its only copy.
    big = np.ones((256, 1000), dtype=np.float32).tobytes()
    parts = response_parts(InferRequest(model_name="m"), "m", "", [("LOGITS", "FP32", [256, 1000], big)])
    views = [p for p in parts if isinstance(p, memoryview)]
    assert len(views) == 1 and views[0].obj is big
