"""KServe v2 / Triton inference protocol: messages, datatypes and the raw tensor codec.

Tensors travel as `raw_input_contents` / `raw_output_contents`: little-endian, C-order bytes of
exactly prod(shape) * itemsize. Decoding wraps the received bytes without copying; encoding
costs the one copy protobuf needs to own the bytes. Nothing is ever pickled.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from tritonclient.grpc import model_config_pb2, service_pb2, service_pb2_grpc

__all__ = [
    "BY_LENGTH_PARAMETER",
    "DATATYPES",
    "FINGERPRINT_PARAMETER",
    "NONFINITE_ROWS_PARAMETER",
    "REFUSAL_METADATA",
    "Datatype",
    "decode_tensor",
    "encode_tensor",
    "model_config_pb2",
    "service_pb2",
    "service_pb2_grpc",
    "shape_numel",
    "tensor_bytes",
]

BY_LENGTH_PARAMETER = "batches_by_length"
"""The ModelConfig parameter (string value "true") by which a teacher says it batches padded rows by
length (``TeacherRecord.batches_by_length`` in the registry says the same): it fills a batch from
rows of like length, so it needs many rows queued and a request waits longer than its forward pass;
a student's router then keeps its requests in flight instead of reading that queueing as overload."""

FINGERPRINT_PARAMETER = "distill_fingerprint"
"""The ModelConfig parameter (string value "fp-" and 16 hex digits) by which a teacher says which
model it computes with: a digest of its weights, config, tokenizer files and compute dtype
(``TeacherRecord.fingerprint`` in the registry says the same). Replicas of one service with
different fingerprints are different teachers; a student's reader uses one of them per run."""

NONFINITE_ROWS_PARAMETER = "nonfinite_rows"
"""The ModelInferResponse parameter (HTTP/REST: the response's `parameters`) by which teacher-server
says which rows of its answer hold a value that is not finite (inf, NaN): a string of the request's
row indices, comma-separated ("0,5"). Absent when every row is finite, so a client that does not
know it reads the same answers as before; a student's reader raises or masks those rows."""

REFUSAL_METADATA = "distill-refusal"
"""The trailing-metadata key by which teacher-server says, beside the status message a person reads,
what it found wrong in a refused request's input (INVALID_ARGUMENT), as JSON facts a student
program reads instead of the words: {"kind": "vocabulary" | "classes", "input": NAME, "value": ID,
"limit": N, "index": [row, position, ...]} for an id outside 0..N-1 (the model's vocabulary, or
the classes of the output it scores), {"kind": "context", "input": NAME, "value": LENGTH, "limit":
N, "index": []} for a sequence past the model's context. A server that sends none (Triton) leaves
its student the message alone."""

# Received protobuf bytes are immutable; tensors over them are only read (inference_mode), so
# torch's warning about non-writable buffers is noise on this path.
warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
warnings.filterwarnings("ignore", message="The given buffer is not writable")


@dataclass(frozen=True)
class Datatype:
    """One protocol datatype: its name on the wire, torch and numpy views, size, config enum."""

    name: str
    torch_dtype: torch.dtype
    numpy_dtype: np.dtype
    itemsize: int
    config_type: int  # model_config_pb2.DataType value, for ModelConfig
    contents_field: str | None  # typed InferTensorContents field, None when raw bytes only


def _dt(name: str, tdt: torch.dtype, ndt: str, cfg: str, field: str | None) -> Datatype:
    npd = np.dtype(ndt)
    return Datatype(name, tdt, npd, npd.itemsize, model_config_pb2.DataType.Value(cfg), field)


# BF16 has no numpy dtype: its bytes are carried as int16 and viewed as torch.bfloat16.
DATATYPES: dict[str, Datatype] = {
    d.name: d
    for d in (
        _dt("BOOL", torch.bool, "bool", "TYPE_BOOL", "bool_contents"),
        _dt("UINT8", torch.uint8, "<u1", "TYPE_UINT8", "uint_contents"),
        _dt("INT8", torch.int8, "<i1", "TYPE_INT8", "int_contents"),
        _dt("INT16", torch.int16, "<i2", "TYPE_INT16", "int_contents"),
        _dt("INT32", torch.int32, "<i4", "TYPE_INT32", "int_contents"),
        _dt("INT64", torch.int64, "<i8", "TYPE_INT64", "int64_contents"),
        _dt("FP16", torch.float16, "<f2", "TYPE_FP16", None),
        _dt("BF16", torch.bfloat16, "<i2", "TYPE_BF16", None),
        _dt("FP32", torch.float32, "<f4", "TYPE_FP32", "fp32_contents"),
        _dt("FP64", torch.float64, "<f8", "TYPE_FP64", "fp64_contents"),
    )
}
_BY_TORCH: dict[torch.dtype, Datatype] = {d.torch_dtype: d for d in DATATYPES.values()}


def datatype(name: str) -> Datatype:
    """The Datatype for a wire name; ValueError listing the supported names otherwise."""
    try:
        return DATATYPES[name]
    except KeyError:
        raise ValueError(
            f"unsupported datatype {name!r}; supported: {', '.join(DATATYPES)}"
        ) from None


def datatype_of(dtype: torch.dtype) -> Datatype:
    try:
        return _BY_TORCH[dtype]
    except KeyError:
        raise ValueError(f"torch dtype {dtype} has no KServe v2 datatype") from None


def shape_numel(shape: Sequence[int]) -> int:
    return math.prod(shape) if shape else 1


def decode_tensor(buf: bytes | memoryview, dt: Datatype, shape: Sequence[int]) -> torch.Tensor:
    """A tensor viewing `buf` (no copy). The caller has checked len(buf) against the shape.

    Shaped by numpy before torch sees it: this runs once per request on the event loop, and a
    numpy reshape costs less than a torch one."""
    t = torch.from_numpy(np.frombuffer(buf, dtype=dt.numpy_dtype).reshape(tuple(shape)))
    if dt.torch_dtype is torch.bfloat16:
        t = t.view(torch.bfloat16)
    return t


def decode_values(values: Sequence[object], dt: Datatype, shape: Sequence[int]) -> torch.Tensor:
    """A tensor from typed values (KServe's typed `contents`, or JSON `data`), for clients that do
    not send raw bytes."""
    if dt.contents_field is None:
        raise ValueError(f"datatype {dt.name} can only be sent as raw_input_contents")
    arr = np.asarray(values, dtype=dt.numpy_dtype)
    if arr.size != shape_numel(shape):
        raise ValueError(f"{arr.size} values for shape {list(shape)} ({shape_numel(shape)} expected)")
    return torch.from_numpy(arr).reshape(tuple(shape))


def decode_contents(contents: service_pb2.InferTensorContents, dt: Datatype,
                    shape: Sequence[int]) -> torch.Tensor:
    """A tensor from a protobuf InferTensorContents, reading the field of datatype `dt`."""
    values = getattr(contents, dt.contents_field) if dt.contents_field is not None else ()
    return decode_values(values, dt, shape)


def encode_tensor(t: torch.Tensor) -> tuple[str, list[int], bytes]:
    """(datatype name, shape, raw bytes) of a CPU tensor; one copy, into the bytes object."""
    name, raw = tensor_bytes(t)
    return name, list(t.shape), raw.tobytes()


def tensor_bytes(t: torch.Tensor) -> tuple[str, memoryview]:
    """(datatype name, flat byte view) of a CPU tensor's data in row-major order: no copy of a
    contiguous tensor (one of any other), and the view keeps the tensor's memory alive."""
    dt = datatype_of(t.dtype)
    src = t.contiguous()
    if dt.torch_dtype is torch.bfloat16:
        src = src.view(torch.int16)
    return dt.name, src.numpy().data.cast("B")


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def length_delimited(field_number: int, buffers: Sequence[object]) -> list[object]:
    """One length-delimited protobuf field (bytes, string, sub-message) whose value is `buffers`
    one after another, as parts for a single ``b"".join``: the tag, the length, then the buffers
    themselves (anything exposing the buffer protocol), so the join is their only copy."""
    views = [memoryview(b).cast("B") for b in buffers]  # type: ignore[arg-type]
    return [_varint((field_number << 3) | 2), _varint(sum(v.nbytes for v in views)), *views]


RAW_INPUT_FIELD = service_pb2.ModelInferRequest.RAW_INPUT_CONTENTS_FIELD_NUMBER


def serialize_infer_request(header: service_pb2.ModelInferRequest, raws: Sequence[object]) -> bytes:
    """Wire bytes of `header` plus `raws` as its raw_input_contents, copying each buffer once.

    Building the message through protobuf copies every input into its arena and again on
    serialization; here the small header is serialized by protobuf and each raw buffer (anything
    exposing the buffer protocol: a contiguous numpy array, memoryview, bytes) is appended as
    field 7 by one join. Protobuf parsers accept fields in any order, so the result is a valid
    ModelInferRequest for any server.
    """
    parts: list[object] = [header.SerializeToString()]
    for raw in raws:
        parts += length_delimited(RAW_INPUT_FIELD, [raw])
    return b"".join(parts)  # type: ignore[arg-type]


class WireFormatError(ValueError):
    """Bytes that are not a well-formed protobuf message."""


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf):
            raise WireFormatError("truncated varint")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7
        if shift >= 64:
            raise WireFormatError("varint longer than 64 bits")


# Bounds on the work one received message may cause on the event loop. A real request has a
# field per input, output, raw buffer and parameter (tens), and its non-raw part is names, shapes
# and parameters (kilobytes); within --max-message-mb a message of millions of tiny fields would
# otherwise hold the loop for seconds (walked here in Python) or tens of milliseconds per MiB
# (parsed by protobuf, which holds the GIL).
MAX_FIELDS = 1024
MAX_HEADER_BYTES = 1 << 20


def parse_infer_request(
    data: bytes, *, max_fields: int = MAX_FIELDS, max_header_bytes: int = MAX_HEADER_BYTES
) -> tuple[service_pb2.ModelInferRequest, list[memoryview]]:
    """Split a serialized ModelInferRequest into its header and zero-copy views of the raw inputs.

    The mirror of `serialize_infer_request`: protobuf parses only the small fields; each
    raw_input_contents (field 7) stays a view into the received bytes, so a multi-megabyte input
    is never copied on the way to the model (protobuf copies it on parse and again on every access).
    A message of more than `max_fields` top-level fields, or whose fields other than the raw
    inputs take more than `max_header_bytes`, is refused (WireFormatError) before any more work.
    """
    view = memoryview(data)
    header: list[memoryview] = []
    raws: list[memoryview] = []
    pos, end = 0, len(view)
    fields = header_bytes = 0
    while pos < end:
        fields += 1
        if fields > max_fields:
            raise WireFormatError(
                f"more than {max_fields} fields; a ModelInferRequest needs one per input, output, raw "
                "buffer and parameter")
        start = pos
        tag, pos = _read_varint(view, pos)
        field_number, wire_type = tag >> 3, tag & 7
        if field_number == 0:
            raise WireFormatError("field number 0")
        if wire_type == 0:
            _, pos = _read_varint(view, pos)
        elif wire_type == 1:
            pos += 8
        elif wire_type == 5:
            pos += 4
        elif wire_type == 2:
            length, body = _read_varint(view, pos)
            pos = body + length
            if pos > end:
                raise WireFormatError(f"field {field_number}: {length} bytes announced, {end - body} left")
            if field_number == 7:
                raws.append(view[body:pos])
                continue
        else:
            raise WireFormatError(f"field {field_number}: unsupported wire type {wire_type}")
        if pos > end:
            raise WireFormatError(f"field {field_number} runs past the end of the message")
        header_bytes += pos - start
        if header_bytes > max_header_bytes:
            raise WireFormatError(
                f"the fields other than raw_input_contents take more than {max_header_bytes} bytes; "
                "send tensors as raw_input_contents, not typed contents")
        header.append(view[start:pos])
    try:
        return service_pb2.ModelInferRequest.FromString(b"".join(header)), raws
    except Exception as e:  # protobuf's DecodeError, or a nested message out of shape
        raise WireFormatError(str(e)) from None
