"""Strategies for malformed ModelInferRequests, and the checks that a reply is one the protocol
allows, for the fuzz tests. The server under test serves ``tests.models:affine`` as ``affine``
(X: FP32[-1, 8] -> Y: FP32[-1, 4], max batch 8)."""

from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass, field

import grpc
import torch
from hypothesis import strategies as st

from protos.kserve import DATATYPES, WireFormatError, parse_infer_request, serialize_infer_request, service_pb2
from tests.models import Affine

MODEL = "affine"
MAX_BATCH = 8
MAX_MESSAGE = 1 << 20  # the fuzzed server's --max-message-mb 1
EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "1000"))

ALLOWED_ERRORS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.RESOURCE_EXHAUSTED}
AFFINE = Affine()

names = st.sampled_from(["X", "Y", "", "x", "X ", "\x00", "é", "X/../Y"]) | st.text(max_size=8)
datatypes = st.sampled_from([*DATATYPES, "FP8", "", "fp32", "BYTES", "STRING", "INT128"]) | st.text(max_size=6)
dims = st.sampled_from([-1, 0, 1, 2, 7, 8, 9, 2**31, 2**40, 2**63 - 1, -(2**63)]) | st.integers(-3, 16)
shapes = st.lists(dims, max_size=5)
param_names = st.sampled_from(["output_dtype", "top_k", "priority", "timeout", "classification",
                               "shared_memory_region", "binary_data", ""]) | st.text(max_size=10)
small_floats = st.floats(-100, 100, allow_nan=False, width=32)


@st.composite
def parameters(draw: st.DrawFn) -> dict[str, service_pb2.InferParameter]:
    """Random parameters of every InferParameter kind, sometimes the right name with the wrong type."""
    out: dict[str, service_pb2.InferParameter] = {}
    for name in draw(st.lists(param_names, max_size=3)):
        p = service_pb2.InferParameter()
        kind = draw(st.sampled_from(["bool", "int64", "string", "double", "uint64", "unset"]))
        if kind == "bool":
            p.bool_param = draw(st.booleans())
        elif kind == "int64":
            p.int64_param = draw(st.integers(-(2**63), 2**63 - 1) | st.integers(-2, 10))
        elif kind == "string":
            p.string_param = draw(st.sampled_from(["FP16", "BF16", "FP32", "fp16", "INT8", ""]) | st.text(max_size=6))
        elif kind == "double":
            p.double_param = draw(st.floats(allow_nan=True))
        elif kind == "uint64":
            p.uint64_param = draw(st.integers(0, 2**64 - 1))
        out[name] = p
    return out


def set_params(target: object, params: dict[str, service_pb2.InferParameter]) -> None:
    """Copy into a protobuf map of messages (which refuses plain assignment)."""
    for k, v in params.items():
        target[k].CopyFrom(v)  # type: ignore[index]


def _floats(draw: st.DrawFn, n: int) -> bytes:
    return struct.pack(f"<{n}f", *draw(st.lists(small_floats, min_size=n, max_size=n)))


@dataclass
class Case:
    """One generated request: its wire bytes and whether the generator left it valid."""

    data: bytes
    mutations: list[str] = field(default_factory=list)

    @property
    def valid(self) -> bool:
        return not self.mutations


MUTATIONS = ["model", "version", "input_name", "datatype", "shape", "raw_truncate", "raw_extend", "raw_garbage",
             "no_raw", "extra_raw", "typed_contents", "dup_input", "extra_input", "no_inputs", "request_params",
             "input_params", "outputs", "wire_truncate", "wire_flip", "wire_insert"]
VALID = ""  # the kind of an unmutated request
KINDS = [VALID, *MUTATIONS, "oversize"]  # what infer_cases(allow_oversize=True, kind=...) can be asked for
WHERE = ["top", "input", "output", "parameter", "contents"]  # where a field bomb goes


@st.composite
def infer_cases(draw: st.DrawFn, allow_oversize: bool = False, kind: str | None = None) -> Case:
    """A valid request to ``affine`` with 0-3 mutations drawn from MUTATIONS (plus oversize).

    Starting from a valid request keeps most cases one or two steps from valid, where validation
    bugs live; unmutated cases must succeed and their outputs are checked. ``kind``: VALID for no
    mutation, or a mutation every case has (with 0-2 others drawn), so that a test run per kind
    covers each one whatever hypothesis draws.
    """
    n = draw(st.integers(1, MAX_BATCH))
    req = service_pb2.ModelInferRequest(model_name=MODEL, model_version=draw(st.sampled_from(["", "1"])), id="case")
    req.inputs.add(name="X", datatype="FP32", shape=[n, 8])
    raws: list[bytes] = [_floats(draw, n * 8)]
    if draw(st.booleans()):  # valid output options
        req.parameters["output_dtype"].string_param = draw(st.sampled_from(["FP32", "FP16", "BF16"]))
    if draw(st.booleans()):
        req.parameters["top_k"].int64_param = draw(st.integers(0, 4))
    if draw(st.booleans()):
        req.outputs.add(name="Y")
    drawn = MUTATIONS + (["oversize"] if allow_oversize else [])
    if kind is None:
        mutations = draw(st.lists(st.sampled_from(drawn), max_size=3, unique=True))
    elif kind == VALID:
        mutations = []
    else:
        assert kind in drawn, f"no mutation kind {kind!r} here"
        mutations = [kind, *draw(st.lists(st.sampled_from([m for m in drawn if m != kind]), max_size=2, unique=True))]
    t = req.inputs[0]
    for m in [m for m in mutations if not m.startswith("wire_")]:
        if m == "model":
            req.model_name = draw(st.sampled_from(["", "nope", "Affine", "affine "]) | st.text(max_size=8))
        elif m == "version":
            req.model_version = draw(st.sampled_from(["2", "0", "01", " "]) | st.text(max_size=4))
        elif m == "input_name":
            t.name = draw(names)
        elif m == "datatype":
            t.datatype = draw(datatypes)
        elif m == "shape":
            t.ClearField("shape")
            t.shape.extend(draw(shapes))
        elif m == "raw_truncate" and raws:
            raws[0] = raws[0][: draw(st.integers(0, max(0, len(raws[0]) - 1)))]
        elif m == "raw_extend" and raws:
            raws[0] += draw(st.binary(min_size=1, max_size=64))
        elif m == "raw_garbage" and raws:
            raws[0] = draw(st.binary(max_size=512))
        elif m == "no_raw":
            raws = []
        elif m == "extra_raw":
            raws.append(draw(st.binary(max_size=64)))
        elif m == "typed_contents":
            raws = []
            count = draw(st.sampled_from([n * 8, 0, n * 8 - 1, n * 8 + 1]) | st.integers(0, 80))
            t.contents.fp32_contents.extend(draw(st.lists(small_floats, min_size=count, max_size=count)))
            if draw(st.booleans()):
                t.contents.int64_contents.extend(draw(st.lists(st.integers(-5, 5), max_size=8)))
        elif m == "dup_input":
            req.inputs.add().CopyFrom(t)
            if raws:
                raws.append(raws[0])
        elif m == "extra_input":
            extra = req.inputs.add(name=draw(names), datatype=draw(datatypes), shape=draw(shapes))
            set_params(extra.parameters, draw(parameters()))
            if raws:
                raws.append(draw(st.binary(max_size=128)))
        elif m == "no_inputs":
            req.ClearField("inputs")
            raws = []
        elif m == "request_params":
            set_params(req.parameters, draw(parameters()))
        elif m == "input_params":
            set_params(t.parameters, draw(parameters()))
        elif m == "outputs":
            for _ in range(draw(st.integers(1, 3))):
                o = req.outputs.add(name=draw(st.sampled_from(["Y", "Y", "Z", ""]) | names))
                set_params(o.parameters, draw(parameters()))
        elif m == "oversize":
            raws.append(b"\0" * (MAX_MESSAGE + draw(st.integers(1, 4096))))
    data = serialize_infer_request(req, raws)
    for m in [m for m in mutations if m.startswith("wire_")]:
        if m == "wire_truncate":
            data = data[: draw(st.integers(0, max(0, len(data) - 1)))]
        elif m == "wire_flip" and data:
            i = draw(st.integers(0, len(data) - 1))
            data = data[:i] + bytes([data[i] ^ draw(st.integers(1, 255))]) + data[i + 1 :]
        elif m == "wire_insert":
            i = draw(st.integers(0, len(data)))
            data = data[:i] + draw(st.binary(min_size=1, max_size=16)) + data[i:]
    return Case(data, mutations)


garbage_bytes = st.binary(max_size=2048).map(lambda b: Case(b, ["garbage"]))

# Tiny well-framed fields to repeat: unknown varint / fixed32 / fixed64 / empty string fields, an
# empty raw input, an empty input, output or parameter entry, a model name of one byte.
BOMB_UNITS = [b"\x78\x00", b"\x3a\x00", b"\x2a\x00", b"\x32\x00", b"\x22\x00", b"\x0a\x01m",
              b"\x7d\x00\x00\x00\x00", b"\x79" + b"\x00" * 8, b"\x7a\x00", b"\x08\x00"]


def _length_delimited(field_number: int, body: bytes) -> bytes:
    return bytes([(field_number << 3) | 2]) + _varint(len(body)) + body


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


@st.composite
def field_bombs(draw: st.DrawFn, allow_oversize: bool = False, where: str | None = None) -> Case:
    """Byte-level protobuf field bombs: one tiny field repeated up to the message limit, at the top
    level or packed inside an input, an output, a parameter or typed contents (``where``, one of
    WHERE; drawn when None), sometimes after a valid request. Each must be answered (refused or
    served) without stalling the server."""
    unit = draw(st.sampled_from(BOMB_UNITS) | st.binary(min_size=1, max_size=6))
    limit = MAX_MESSAGE + (4096 if allow_oversize else -64)
    size = draw(st.sampled_from([limit, limit // 2, 4096]) | st.integers(1, limit))
    body = unit * max(1, size // len(unit))
    if where is None:
        where = draw(st.sampled_from(WHERE))
    if where == "input":
        body = _length_delimited(5, body)
    elif where == "output":
        body = _length_delimited(6, body)
    elif where == "parameter":
        body = _length_delimited(4, _length_delimited(2, body))
    elif where == "contents":
        body = _length_delimited(5, _length_delimited(5, body))
    if draw(st.booleans()):
        body = valid_request(rid="bomb")[0] + body
    return Case(body[: max(1, limit)], ["bomb", where])


def _decode(raw: bytes, datatype: str, shape: list[int]) -> torch.Tensor:
    dt = DATATYPES[datatype]
    assert len(raw) == math.prod(shape) * dt.itemsize, f"{datatype}{shape}: {len(raw)} bytes"
    t = torch.frombuffer(bytearray(raw), dtype=dt.torch_dtype if datatype != "BF16" else torch.int16)
    if datatype == "BF16":
        t = t.view(torch.bfloat16)
    return t.reshape(shape)


def check_outputs(sent: bytes, resp: service_pb2.ModelInferResponse) -> None:
    """The server said OK: the outputs must be the in-process model's on the inputs it accepted.

    The inputs are re-read from the bytes we sent, as the server parsed them, so this holds for
    mutated requests that happen to be valid as well.
    """
    header, raws = parse_infer_request(sent)
    idx = [i for i, t in enumerate(header.inputs) if t.name == "X"]
    assert len(idx) == 1 and len(header.inputs) == 1, f"OK for inputs {[t.name for t in header.inputs]}"
    t = header.inputs[0]
    shape = list(t.shape)
    assert t.datatype == "FP32" and len(shape) == 2 and shape[1] == 8 and 1 <= shape[0] <= MAX_BATCH, (
        f"OK for X {t.datatype}{shape}")
    x = _decode(bytes(raws[0]), "FP32", shape) if raws else torch.tensor(list(t.contents.fp32_contents)).reshape(shape)
    with torch.inference_mode():
        want = AFFINE(x)
    assert resp.outputs, "OK without outputs"
    assert len(resp.outputs) == len(resp.raw_output_contents)
    checkable = bool(torch.isfinite(x).all()) and float(x.abs().max()) < 1e4
    got = {o.name: _decode(bytes(r), o.datatype, list(o.shape)) for o, r in
           zip(resp.outputs, resp.raw_output_contents, strict=True)}
    assert set(got) <= {"Y", "Y_TOPK_VALUES", "Y_TOPK_INDICES"}, set(got)
    tol = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 2e-1}
    if "Y" in got:
        y = got["Y"]
        assert list(y.shape) == [shape[0], 4]
        if checkable:
            assert torch.allclose(y.float(), want, rtol=tol[y.dtype], atol=tol[y.dtype] * 10), (y, want)
    if "Y_TOPK_VALUES" in got:
        v, i = got["Y_TOPK_VALUES"], got["Y_TOPK_INDICES"]
        assert v.shape == i.shape and v.shape[0] == shape[0] and 1 <= v.shape[1] <= 4
        if checkable:
            picked = want.gather(1, i.long())
            assert torch.allclose(v.float(), picked, rtol=tol[v.dtype], atol=tol[v.dtype] * 10)
            kth = torch.topk(want, v.shape[1]).values[:, -1:]
            assert bool((picked >= kth - tol[v.dtype] * 10).all()), "top-k indices are not the largest"


def parses(data: bytes) -> service_pb2.ModelInferRequest | None:
    try:
        return parse_infer_request(data)[0]
    except WireFormatError:
        return None


def valid_request(n: int = 2, rid: str = "probe") -> tuple[bytes, torch.Tensor]:
    """A request that must succeed, and its input."""
    x = torch.arange(n * 8, dtype=torch.float32).reshape(n, 8) / 10
    req = service_pb2.ModelInferRequest(model_name=MODEL, id=rid)
    req.inputs.add(name="X", datatype="FP32", shape=[n, 8])
    return serialize_infer_request(req, [x.numpy().tobytes()]), x
