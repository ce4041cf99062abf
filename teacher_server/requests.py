"""Turning a ModelInferRequest into work for the batcher, or a precise refusal.

Every check happens before a request is queued, so a bad request costs its sender a clear
INVALID_ARGUMENT and costs everyone else nothing. Input bytes are wrapped, not copied.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import grpc
import torch

from protos.kserve import (
    DATATYPES,
    WireFormatError,
    decode_contents,
    decode_tensor,
    parse_infer_request,
    service_pb2,
    shape_numel,
)
from teacher_server.instance import Work
from teacher_server.model import FLOAT_OUTPUT_DTYPES, EncodedOutput, OutputRequest
from teacher_server.spec import ModelIO

REQUEST_PARAMETERS = ("output_dtype", "top_k", "priority", "timeout")
OUTPUT_PARAMETERS = ("output_dtype", "top_k")


class InferError(Exception):
    """A refused request: the gRPC status and a message that tells the caller what to change."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def invalid(message: str) -> InferError:
    return InferError(grpc.StatusCode.INVALID_ARGUMENT, message)


@dataclass(frozen=True)
class OutputDefaults:
    """Server-wide defaults for outputs; requests override them with parameters."""

    datatype: str | None = None  # FP32/FP16/BF16 for floating outputs; None keeps the model's
    top_k: int = 0


def _param(p: service_pb2.InferParameter) -> object:
    which = p.WhichOneof("parameter_choice")
    return None if which is None else getattr(p, which)


def _output_options(params: object, where: str, base: OutputRequest, allowed: tuple[str, ...]) -> OutputRequest:
    dtype, top_k = base.datatype, base.top_k
    for key, p in params.items():  # type: ignore[attr-defined]
        value = _param(p)
        if key == "output_dtype":
            if not isinstance(value, str) or value.upper() not in FLOAT_OUTPUT_DTYPES:
                raise invalid(f"{where}: output_dtype must be one of {', '.join(FLOAT_OUTPUT_DTYPES)}, got {value!r}")
            dtype = value.upper()
        elif key == "top_k":
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise invalid(f"{where}: top_k must be a non-negative integer (int64_param), got {value!r}")
            top_k = value
        elif key == "classification":
            raise invalid(f"{where}: 'classification' outputs are not served; ask for top_k instead")
        elif key not in allowed:
            raise invalid(f"{where}: unknown parameter {key!r}; accepted: {', '.join(allowed)}")
    return OutputRequest(base.name, dtype, top_k)


@dataclass(frozen=True)
class InferWire:
    """A received ModelInferRequest: its header, and zero-copy views of its raw inputs (or why it is
    not a valid message at all)."""

    header: service_pb2.ModelInferRequest
    raws: Sequence[bytes | memoryview]
    error: str = ""


def deserialize_infer(data: bytes) -> InferWire:
    """gRPC request deserializer for ModelInfer / ModelStreamInfer; never raises, so malformed bytes
    become INVALID_ARGUMENT from the handler instead of an opaque INTERNAL from gRPC."""
    try:
        header, raws = parse_infer_request(data)
    except WireFormatError as e:
        return InferWire(service_pb2.ModelInferRequest(), [], f"malformed ModelInferRequest: {e}")
    return InferWire(header, raws)


def parse_request(
    req: service_pb2.ModelInferRequest, raws: Sequence[bytes | memoryview], io: ModelIO, max_batch_size: int,
    defaults: OutputDefaults,
) -> Work:
    """Validate and decode one request; raise InferError naming the first problem found.

    `raws` are the raw_input_contents (views into the received message, see deserialize_infer).
    """
    if any(k.startswith("shared_memory") for t in req.inputs for k in t.parameters) or any(
        k.startswith("shared_memory") for t in req.outputs for k in t.parameters
    ):
        raise invalid("shared-memory tensors are not supported; send raw_input_contents")
    if raws and len(raws) != len(req.inputs):
        raise invalid(
            f"{len(raws)} raw_input_contents for {len(req.inputs)} inputs; "
            "send one raw buffer per input, in the same order"
        )
    seen: dict[str, torch.Tensor] = {}
    batch: int | None = None
    for i, t in enumerate(req.inputs):
        spec = io.input(t.name)
        if spec is None:
            raise invalid(f"unknown input {t.name!r}; the model's inputs are {[s.name for s in io.inputs]}")
        if t.name in seen:
            raise invalid(f"input {t.name!r} appears twice")
        if t.datatype != spec.datatype:
            raise invalid(f"input {t.name!r}: datatype {t.datatype!r} received, the model expects {spec.datatype!r}")
        shape = list(t.shape)
        expected = [-1, *spec.shape]
        if len(shape) != len(expected) or any(d < 0 for d in shape) or not spec.matches(shape[1:]):
            raise invalid(f"input {t.name!r}: shape {shape} received, the model expects {expected}")
        n = shape[0]
        if n < 1:
            raise invalid(f"input {t.name!r}: batch size must be at least 1, got {n}")
        if n > max_batch_size:
            raise invalid(f"input {t.name!r}: batch size {n} exceeds the model's max_batch_size {max_batch_size}")
        if batch is not None and n != batch:
            raise invalid(f"input {t.name!r}: batch size {n} differs from the other inputs' {batch}")
        batch = n
        dt = DATATYPES[spec.datatype]
        if raws:
            buf = raws[i]
            want = shape_numel(shape) * dt.itemsize
            if len(buf) != want:
                raise invalid(
                    f"input {t.name!r}: {len(buf)} bytes received, shape {shape} of {spec.datatype} needs {want}"
                )
            seen[t.name] = decode_tensor(buf, dt, shape)
        else:
            try:
                seen[t.name] = decode_contents(t.contents, dt, shape)
            except ValueError as e:
                raise invalid(f"input {t.name!r}: {e}") from None
    missing = [s.name for s in io.inputs if s.name not in seen]
    if missing:
        raise invalid(f"missing inputs {missing}; the model's inputs are {[s.name for s in io.inputs]}")
    assert batch is not None

    base = _output_options(req.parameters, "request", OutputRequest("", defaults.datatype, defaults.top_k),
                           REQUEST_PARAMETERS)
    if req.outputs:
        wanted = []
        names = set()
        for o in req.outputs:
            spec = io.output(o.name)
            if spec is None:
                raise invalid(f"unknown output {o.name!r}; the model's outputs are {[s.name for s in io.outputs]}")
            if o.name in names:
                raise invalid(f"output {o.name!r} requested twice")
            names.add(o.name)
            inherited = OutputRequest(o.name, base.datatype, base.top_k)
            wanted.append(_output_options(o.parameters, f"output {o.name!r}", inherited, OUTPUT_PARAMETERS))
    else:
        wanted = [OutputRequest(s.name, base.datatype, base.top_k) for s in io.outputs]
    for w in wanted:
        spec = io.output(w.name)
        assert spec is not None
        if w.top_k and not spec.shape:
            raise invalid(f"output {w.name!r} has no class dimension; top_k needs one")
        if w.top_k and spec.shape[-1] != -1 and w.top_k > spec.shape[-1]:
            raise invalid(f"output {w.name!r}: top_k {w.top_k} exceeds its last dimension {spec.shape[-1]}")
    return Work([seen[s.name] for s in io.inputs], batch, wanted)


def build_response(
    req: service_pb2.ModelInferRequest, model_name: str, version: str, outputs: list[EncodedOutput]
) -> service_pb2.ModelInferResponse:
    resp = service_pb2.ModelInferResponse(model_name=model_name, model_version=version, id=req.id)
    for name, dtype, shape, _ in outputs:
        resp.outputs.add(name=name, datatype=dtype, shape=shape)
    resp.raw_output_contents.extend(raw for *_, raw in outputs)
    return resp
