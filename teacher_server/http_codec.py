"""The HTTP edge's translations: KServe v2 REST JSON (with Triton's binary tensor data extension)
<-> the protocol-neutral request and result.

A request body is a JSON object, optionally followed by raw tensor bytes; the
`Inference-Header-Content-Length` header says where the JSON ends. An input carrying the
`binary_data_size` parameter takes its bytes, in input order, from that tail (viewed, not copied);
an input carrying `data` (flat or nested JSON numbers) is converted by numpy in one call. Either way
the lifecycle receives one raw buffer per input, so binary and JSON inputs can be mixed.

Outputs go back binary (after the JSON, sized by `binary_data_size`) when the request asks for it,
per output with `binary_data` or for all with the request parameter `binary_data_output`, which is
what `tritonclient.http` sends by default; otherwise as JSON `data`.

`decode_infer` never raises: whatever does not decode becomes a `malformed` request, which the
lifecycle refuses as invalid and counts, as the gRPC edge does with bytes that do not parse.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from protos.kserve import DATATYPES, NONFINITE_ROWS_PARAMETER, shape_numel
from protos.outputs import TOPK_INDICES, TOPK_TAIL, TOPK_VALUES
from protos.text import decode_bytes, encode_bytes
from teacher_server.errors import (
    InferError,
    InvalidRequestError,
    ModelExecutionError,
    ModelNotFoundError,
    OverloadedError,
    UnavailableError,
)
from teacher_server.infer_request import InferRequest, InputTensor, RawBuffer, RequestedOutput
from teacher_server.outputs import EncodedOutput

HEADER_LENGTH = "Inference-Header-Content-Length"

_STATUS: dict[type[InferError], int] = {
    InvalidRequestError: 400,
    ModelNotFoundError: 404,
    OverloadedError: 429,
    UnavailableError: 503,
    ModelExecutionError: 500,
}

# Bounds on what one JSON header may make the event loop walk, in the spirit of the gRPC edge's
# field bound: tensors per request and parameters per tensor or request.
MAX_TENSORS = 1024
MAX_PARAMETERS = 64

_EMPTY = b""


def http_status(error: InferError) -> int:
    """The HTTP status for a refusal (500 for one this edge does not know)."""
    for cls, code in _STATUS.items():
        if isinstance(error, cls):
            return code
    return 500


def error_body(message: str) -> bytes:
    """KServe v2's error form: `{"error": "..."}`."""
    return json.dumps({"error": message}).encode()


class _Malformed(Exception):
    pass


@dataclass(slots=True)
class DecodedInfer:
    """A decoded request and how its outputs go back: binary or JSON, per requested output name."""

    request: InferRequest
    binary_default: bool = False
    binary: dict[str, bool] = field(default_factory=dict)

    def wants_binary(self, output_name: str) -> bool:
        """Whether an encoded output goes back as binary; the top-k tensors follow their output's choice."""
        choice = self.binary.get(output_name)
        if choice is None:
            for derived in (TOPK_VALUES, TOPK_INDICES, TOPK_TAIL):
                if output_name.endswith(derived.suffix):
                    choice = self.binary.get(output_name[: -len(derived.suffix)])
                    break
        return self.binary_default if choice is None else choice


def _parameters(raw: object, where: str, drop: str) -> tuple[dict[str, object], object]:
    """Plain parameters of a JSON object, and the value of the binary-extension key `drop` (which
    is the edge's business, not the lifecycle's), or None."""
    if raw is None:
        return {}, None
    if not isinstance(raw, dict):
        raise _Malformed(f"{where}: 'parameters' must be a JSON object")
    if len(raw) > MAX_PARAMETERS:
        raise _Malformed(f"{where} carries {len(raw)} parameters; at most {MAX_PARAMETERS}")
    out: dict[str, object] = {}
    for key, value in raw.items():
        if value is not None and not isinstance(value, str | int | float | bool):
            raise _Malformed(f"{where}: parameter {key!r} must be a string, number or boolean")
        out[key] = value
    return out, out.pop(drop, None)


def _field(obj: Mapping[str, Any], key: str, kind: type, where: str) -> Any:
    value = obj.get(key)
    if not isinstance(value, kind):
        raise _Malformed(f"{where}: {key!r} must be a {'string' if kind is str else 'list'}")
    return value


def _shape(raw: object, where: str) -> list[int]:
    if not isinstance(raw, list) or not all(isinstance(d, int) and not isinstance(d, bool) for d in raw):
        raise _Malformed(f"{where}: 'shape' must be a list of integers")
    return raw


def _json_data(data: object, datatype: str, shape: list[int], where: str) -> RawBuffer:
    """Raw bytes of JSON `data` (flat or nested), converted by numpy in one call."""
    if datatype == "BYTES":  # strings (text requests: `protos.text`), serialised as the binary form is
        try:
            items = np.asarray(data, dtype=object).reshape(-1)
        except ValueError:
            items = np.asarray([None], dtype=object)
        if not all(isinstance(v, str) for v in items.tolist()):
            raise _Malformed(f"{where}: BYTES 'data' must be strings, flat or nested as the shape")
        if all(d >= 0 for d in shape) and items.size != shape_numel(shape):
            raise _Malformed(f"{where}: {items.size} strings in 'data' for shape {shape} "
                             f"({shape_numel(shape)} expected)")
        return encode_bytes([v.encode("utf-8", "surrogatepass") for v in items.tolist()])
    dt = DATATYPES.get(datatype)
    if dt is None:
        return _EMPTY  # validation names the datatype the model expects
    if dt.name == "BF16":
        raise _Malformed(f"{where}: BF16 has no JSON form; send it as binary data (binary_data_size)")
    try:
        arr = np.asarray(data, dtype=dt.numpy_dtype)
    except (ValueError, TypeError, OverflowError):
        raise _Malformed(f"{where}: 'data' must be {datatype} numbers, flat or nested as the shape") from None
    if all(d >= 0 for d in shape) and arr.size != shape_numel(shape):
        raise _Malformed(f"{where}: {arr.size} values in 'data' for shape {shape} ({shape_numel(shape)} expected)")
    return np.ascontiguousarray(arr).reshape(-1).data.cast("B")


def _decode(body: bytes, header_length: str | None, model_name: str, version: str) -> DecodedInfer:
    if header_length is None:
        split = len(body)
    else:
        try:
            split = int(header_length)
        except ValueError:
            raise _Malformed(f"{HEADER_LENGTH} must be an integer, got {header_length!r}") from None
        if not 0 < split <= len(body):
            raise _Malformed(f"{HEADER_LENGTH} {split} does not fit a body of {len(body)} bytes")
    try:
        header = json.loads(body if split == len(body) else body[:split])
    except (ValueError, RecursionError) as e:
        raise _Malformed(f"the request's JSON does not parse: {e}") from None
    if not isinstance(header, dict):
        raise _Malformed("the request must be a JSON object with 'inputs'")
    request_id = header.get("id", "")
    if not isinstance(request_id, str):
        raise _Malformed("'id' must be a string")
    params, binary_output = _parameters(header.get("parameters"), "request", "binary_data_output")
    raw_inputs = _field(header, "inputs", list, "request")
    raw_outputs = header.get("outputs", [])
    if not isinstance(raw_outputs, list):
        raise _Malformed("request: 'outputs' must be a list")
    if len(raw_inputs) > MAX_TENSORS or len(raw_outputs) > MAX_TENSORS:
        raise _Malformed(f"a request names at most {MAX_TENSORS} inputs and {MAX_TENSORS} outputs")

    tail = memoryview(body)[split:]
    offset = 0
    inputs: list[InputTensor] = []
    raws: list[RawBuffer] = []
    for i, t in enumerate(raw_inputs):
        if not isinstance(t, dict):
            raise _Malformed(f"input {i} must be a JSON object")
        name = _field(t, "name", str, f"input {i}")
        where = f"input {name!r}"
        datatype = _field(t, "datatype", str, where)
        shape = _shape(t.get("shape"), where)
        tparams, size = _parameters(t.get("parameters"), where, "binary_data_size")
        if size is not None:
            if isinstance(size, bool) or not isinstance(size, int) or size < 0:
                raise _Malformed(f"{where}: binary_data_size must be a non-negative integer, got {size!r}")
            if offset + size > len(tail):
                raise _Malformed(f"{where}: binary_data_size {size} runs past the {len(tail)} bytes after "
                                 f"the JSON header ({HEADER_LENGTH} {split})")
            raws.append(tail[offset:offset + size])
            offset += size
        elif "data" in t:
            raws.append(_json_data(t["data"], datatype, shape, where))
        elif any(k.startswith("shared_memory") for k in tparams):
            raws.append(_EMPTY)  # validation refuses shared memory with its own message
        else:
            raise _Malformed(f"{where} has neither 'data' nor a binary_data_size parameter")
        inputs.append(InputTensor(name, datatype, shape, (), tparams))
    if offset != len(tail):
        raise _Malformed(f"{len(tail) - offset} bytes after the JSON header belong to no input's binary_data_size")

    outputs: list[RequestedOutput] = []
    binary: dict[str, bool] = {}
    for i, o in enumerate(raw_outputs):
        if not isinstance(o, dict):
            raise _Malformed(f"output {i} must be a JSON object")
        name = _field(o, "name", str, f"output {i}")
        oparams, wants = _parameters(o.get("parameters"), f"output {name!r}", "binary_data")
        if wants is not None:
            binary[name] = bool(wants)
        outputs.append(RequestedOutput(name, oparams))
    request = InferRequest(model_name=model_name, model_version=version, id=request_id, inputs=inputs,
                           outputs=outputs, parameters=params, raw_inputs=raws)
    return DecodedInfer(request, bool(binary_output), binary)


def decode_infer(body: bytes, header_length: str | None, model_name: str, version: str = "") -> DecodedInfer:
    """The neutral request in an HTTP infer body; `header_length` is the Inference-Header-Content-Length
    header (None when the body is all JSON). Never raises: see the module docstring."""
    try:
        return _decode(body, header_length, model_name, version)
    except _Malformed as e:
        return DecodedInfer(InferRequest(model_name=model_name, model_version=version, malformed=str(e)))


def _json_values(dtype: str, raw: bytes | memoryview, shape: Sequence[int]) -> list[Any]:
    if dtype == "BYTES":  # strings; bytes that are not UTF-8 as lone surrogates (binary_data keeps them)
        return [b.decode("utf-8", "surrogateescape") for b in decode_bytes(raw, shape_numel(shape))]
    dt = DATATYPES[dtype]
    arr = np.frombuffer(raw, dtype=dt.numpy_dtype)
    if dt.name == "BF16":
        return torch.from_numpy(arr.copy()).view(torch.bfloat16).float().tolist()
    values: list[Any] = arr.tolist()
    return values


@dataclass(frozen=True)
class EncodedResponse:
    """An infer response: the JSON header, then the binary outputs in order. `header_length` is
    for Inference-Header-Content-Length, None when the JSON is the whole body."""

    header: bytes
    binary: Sequence[bytes | memoryview]
    header_length: int | None

    @property
    def size(self) -> int:
        return len(self.header) + sum(len(b) for b in self.binary)


def encode_response(decoded: DecodedInfer, model_name: str, version: str,
                    outputs: list[EncodedOutput], nonfinite_rows: Sequence[int] = ()) -> EncodedResponse:
    """The response to `decoded`: each output binary or as JSON `data`, as its request asked; rows
    whose outputs are not finite named in its `parameters` (`NONFINITE_ROWS_PARAMETER`), as gRPC's
    response does."""
    out: list[dict[str, Any]] = []
    binary: list[bytes | memoryview] = []
    for name, dtype, shape, raw in outputs:
        entry: dict[str, Any] = {"name": name, "datatype": dtype, "shape": shape}
        if decoded.wants_binary(name):
            entry["parameters"] = {"binary_data_size": len(raw)}
            binary.append(raw)
        else:
            entry["data"] = _json_values(dtype, raw, shape)
        out.append(entry)
    body: dict[str, Any] = {"model_name": model_name, "model_version": version, "outputs": out}
    if decoded.request.id:
        body["id"] = decoded.request.id
    if nonfinite_rows:
        body["parameters"] = {NONFINITE_ROWS_PARAMETER: ",".join(map(str, nonfinite_rows))}
    header = json.dumps(body, separators=(",", ":")).encode()
    return EncodedResponse(header, binary, len(header) if binary else None)
