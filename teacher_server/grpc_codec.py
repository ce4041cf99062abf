"""The gRPC edge's translations: KServe v2 protobuf <-> the protocol-neutral request and result.

`deserialize_infer` is the request deserializer of ModelInfer / ModelStreamInfer: it splits the
received bytes into a small protobuf header and zero-copy views of the raw inputs
(`protos.kserve.parse_infer_request`) and hands the lifecycle an `InferRequest` over them.
`response_parts` encodes outputs back (sent as bytes, the outputs copied once), and `grpc_status`
maps a typed refusal to its gRPC code.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

import grpc

from protos.kserve import (
    DATATYPES,
    NONFINITE_ROWS_PARAMETER,
    REFUSAL_METADATA,
    WireFormatError,
    length_delimited,
    parse_infer_request,
    service_pb2,
)
from teacher_server.errors import (
    InferError,
    InvalidRequestError,
    ModelExecutionError,
    ModelNotFoundError,
    OverloadedError,
    UnavailableError,
    capped,
)
from teacher_server.infer_request import InferRequest, InputTensor, Parameters, RequestedOutput
from teacher_server.outputs import EncodedOutput

_STATUS: dict[type[InferError], grpc.StatusCode] = {
    InvalidRequestError: grpc.StatusCode.INVALID_ARGUMENT,
    ModelNotFoundError: grpc.StatusCode.NOT_FOUND,
    UnavailableError: grpc.StatusCode.UNAVAILABLE,
    OverloadedError: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ModelExecutionError: grpc.StatusCode.INTERNAL,
}


def grpc_status(error: InferError) -> grpc.StatusCode:
    """The gRPC code for a refusal (INTERNAL for one this edge does not know)."""
    for cls, code in _STATUS.items():
        if isinstance(error, cls):
            return code
    return grpc.StatusCode.INTERNAL


def error_details(error: InferError) -> str:
    """A refusal's message as gRPC status details: bounded, so it always fits the 8 KB metadata
    limit and the caller sees the refusal's own code."""
    return capped(error.message)


def error_metadata(error: InferError) -> tuple[tuple[str, str], ...]:
    """A refusal's facts as trailing metadata (`protos.kserve.REFUSAL_METADATA`, JSON), or none."""
    if not error.facts:
        return ()
    return ((REFUSAL_METADATA, json.dumps(error.facts, separators=(",", ":"))),)


# Parameters read per input or output: a map inside one field is not bounded by the field count
# of `parse_infer_request`, and converting each entry costs Python time on the event loop.
MAX_TENSOR_PARAMETERS = 64


_NONE: Parameters = MappingProxyType({})  # shared, read-only: most tensors carry no parameters


class _TooManyParametersError(Exception):
    pass


def _parameters(params: Mapping[str, Any], where: str = "") -> Parameters:
    """A protobuf map<string, InferParameter> as plain values (None for a parameter set empty)."""
    if where and len(params) > MAX_TENSOR_PARAMETERS:
        raise _TooManyParametersError(f"{where} carries {len(params)} parameters; at most {MAX_TENSOR_PARAMETERS}")
    out: dict[str, object] = {}
    for key, p in params.items():
        which = p.WhichOneof("parameter_choice")
        out[key] = None if which is None else getattr(p, which)
    return out


def _input(t: service_pb2.ModelInferRequest.InferInputTensor) -> InputTensor:
    values: Sequence[Any] = ()
    if t.HasField("contents"):
        dt = DATATYPES.get(t.datatype)
        if dt is not None and dt.contents_field is not None:
            values = getattr(t.contents, dt.contents_field)
        elif t.datatype == "BYTES":  # text requests (`protos.text`)
            values = t.contents.bytes_contents
    params = _parameters(t.parameters, f"input {t.name!r}") if t.parameters else _NONE
    return InputTensor(t.name, t.datatype, t.shape, values, params)


def to_infer_request(header: service_pb2.ModelInferRequest, raws: list[memoryview]) -> InferRequest:
    """The neutral request over a parsed header and the raw input views (no tensor bytes copied)."""
    return InferRequest(
        model_name=header.model_name, model_version=header.model_version, id=header.id,
        inputs=[_input(t) for t in header.inputs],
        outputs=[RequestedOutput(o.name, _parameters(o.parameters, f"output {o.name!r}") if o.parameters else _NONE)
                 for o in header.outputs],
        parameters=_parameters(header.parameters) if header.parameters else _NONE,
        raw_inputs=raws,
    )


def deserialize_infer(data: bytes) -> InferRequest:
    """gRPC request deserializer for ModelInfer / ModelStreamInfer; never raises, so malformed bytes
    become INVALID_ARGUMENT from the handler instead of an opaque INTERNAL from gRPC."""
    try:
        header, raws = parse_infer_request(data)
    except WireFormatError as e:
        return InferRequest(model_name="", malformed=f"malformed ModelInferRequest: {e}")
    try:
        return to_infer_request(header, raws)
    except _TooManyParametersError as e:
        return InferRequest(model_name=header.model_name, model_version=header.model_version, id=header.id,
                            malformed=f"malformed ModelInferRequest: {e}")


_RAW_OUTPUT_FIELD = service_pb2.ModelInferResponse.RAW_OUTPUT_CONTENTS_FIELD_NUMBER
_STREAM_ANSWER_FIELD = service_pb2.ModelStreamInferResponse.INFER_RESPONSE_FIELD_NUMBER


def response_parts(request: InferRequest, model_name: str, version: str, outputs: list[EncodedOutput],
                   nonfinite_rows: Sequence[int] = ()) -> list[object]:
    """A ModelInferResponse's wire bytes as parts for one join: every field but the raw outputs
    serialized by protobuf, then each output's bytes framed as a `raw_output_contents` field
    (protobuf takes fields in any order), so the outputs are copied once, by the join, and never
    into a message. Rows whose outputs are not finite are named in `NONFINITE_ROWS_PARAMETER`."""
    header = service_pb2.ModelInferResponse(model_name=model_name, model_version=version, id=request.id)
    if nonfinite_rows:
        header.parameters[NONFINITE_ROWS_PARAMETER].string_param = ",".join(map(str, nonfinite_rows))
    for name, dtype, shape, _ in outputs:
        header.outputs.add(name=name, datatype=dtype, shape=shape)
    parts: list[object] = [header.SerializeToString()]
    for *_, raw in outputs:
        parts += length_delimited(_RAW_OUTPUT_FIELD, [raw])
    return parts


def encode_response(parts: list[object]) -> bytes:
    """ModelInfer's answer from `response_parts`."""
    return b"".join(parts)  # type: ignore[arg-type]


def encode_stream_error(request: InferRequest, error: InferError) -> bytes:
    """ModelStreamInfer's answer to a refused request: `error_message` is the gRPC code's name, ": "
    and the refusal's message (a stream has no status a request), and the refusal's facts, when it
    has them, ride as the answer's `REFUSAL_METADATA` parameter (JSON), where a call carries them
    as trailing metadata."""
    answer = service_pb2.ModelInferResponse(id=request.id, model_name=request.model_name,
                                            model_version=request.model_version)
    for key, value in error_metadata(error):
        answer.parameters[key].string_param = value
    return service_pb2.ModelStreamInferResponse(error_message=f"{grpc_status(error).name}: {error_details(error)}",
                                                infer_response=answer).SerializeToString()


def encode_stream_answer(parts: list[object]) -> bytes:
    """ModelStreamInfer's answer (`infer_response` set) from `response_parts`, in the same one join."""
    return b"".join(length_delimited(_STREAM_ANSWER_FIELD, parts))  # type: ignore[arg-type]
