"""The whole KServe v2 stub of the student side: one gRPC channel to one teacher, the request's
encoding, the call, and the answer's decoding and checks.

Requests go out as pre-serialized bytes (`protos.kserve.serialize_infer_request`: one copy of
the inputs), so the student pays no protobuf arena copies on its hot path. Every call carries a
deadline. The same client works against our teacher-server and a real Triton.

The engine sees only `ChunkRequest` in, tensors or a typed error out, so it can be driven by any
object with the same four methods (`InferenceClient`), an in-memory teacher included. The error's
type is the verdict the engine's retry policy reads:
  `RequestRejectedError`   the teacher refused this input (INVALID_ARGUMENT, or its model raised on
                           it): the request's fault until another teacher accepts it
  `TeacherOverloadedError` RESOURCE_EXHAUSTED, or a CANCELLED the student did not cause: back off
  `TeacherCallError`       any other status: the teacher (or the way to it) failed
  `TeacherGoneError`       the channel was closed under the call: the teacher left
  `MalformedAnswerError`   the answer does not fit the request or the teacher's declared outputs
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Protocol, Self

import grpc
import numpy as np
import torch

from distill.call_errors import (
    MalformedAnswerError,
    ModelChoiceError,
    RequestRejectedError,
    TeacherCallError,
    TeacherGoneError,
    TeacherOverloadedError,
    TeacherRefusedError,
    access_refused,
    call_error,
    rpc_error,
)
from distill.config import ClientTLS
from distill.outputs import VALID_ROWS, per_sample_shape, wanted_outputs
from distill.text_fields import text_rows
from distill.types import ChunkRequest, TeacherMetadata, TensorMeta
from protos.kserve import (
    BY_LENGTH_PARAMETER,
    DATATYPES,
    FINGERPRINT_PARAMETER,
    NONFINITE_ROWS_PARAMETER,
    RAW_INPUT_FIELD,
    Datatype,
    decode_tensor,
    length_delimited,
    service_pb2,
    shape_numel,
)

# The request and metadata types live in distill.types, the verdicts in distill.call_errors (below
# this client and the engine alike); they are re-exported here, where the client's users find them.
__all__ = [
    "CHANNEL_OPTIONS",
    "ChunkRequest",
    "ClientTLS",
    "InferenceClient",
    "MalformedAnswerError",
    "ModelChoiceError",
    "RequestRejectedError",
    "TeacherCallError",
    "TeacherClient",
    "TeacherGoneError",
    "TeacherMetadata",
    "TeacherOverloadedError",
    "TeacherRefusedError",
    "TensorMeta",
    "access_refused",
    "call_error",
    "decode_response",
    "encode_request",
]

log = logging.getLogger(__name__)

_INFER = "/inference.GRPCInferenceService/ModelInfer"
_METADATA = "/inference.GRPCInferenceService/ModelMetadata"
_CONFIG = "/inference.GRPCInferenceService/ModelConfig"
_INDEX = "/inference.GRPCInferenceService/RepositoryIndex"
_READY = "/inference.GRPCInferenceService/ModelReady"

CHANNEL_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.max_receive_message_length", 1 << 30),
    ("grpc.max_send_message_length", 1 << 30),
    # Ping idle connections so a teacher that vanished without a FIN is noticed without traffic.
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    # The router retries on another teacher; gRPC's own retries would only add latency.
    ("grpc.enable_retries", 0),
    # Reconnect quickly after a teacher restarts on the same address.
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2_000),
]


# Serialized headers (every field but the id and the raw inputs) by what makes them: a reader sends
# the same few shapes for its whole life. An entry keeps the parameter mapping it was made from,
# so the id in its key stays that mapping's.
_HEADERS: dict[tuple[Any, ...], tuple[Any, bytes]] = {}
_ID_FIELD = service_pb2.ModelInferRequest.ID_FIELD_NUMBER


def _header(req: ChunkRequest) -> bytes:
    signature = tuple((name, f.datatype, f.array.shape[1:]) for name, f in req.inputs.items())
    key = (req.model_name, req.model_version, req.outputs, id(req.parameters), signature, req.size)
    hit = _HEADERS.get(key)
    if hit is not None and hit[0] is req.parameters:
        return hit[1]
    header = service_pb2.ModelInferRequest(model_name=req.model_name, model_version=req.model_version)
    for name, datatype, sample_shape in signature:
        header.inputs.add(name=name, datatype=datatype, shape=[req.size, *sample_shape])
    for name in req.outputs:
        header.outputs.add(name=name)
    # The transforms this reader states, each by its wire name (ReaderOptions.request_parameters):
    # top_k always, 0 included, so a teacher started with a --top-k default still sends the full
    # tensors this reader expects; one left to the teacher's default is not in the mapping.
    params = header.parameters
    for key_, value in req.parameters.items():
        if isinstance(value, bool):
            params[key_].bool_param = value
        elif isinstance(value, int):
            params[key_].int64_param = value
        elif isinstance(value, float):
            params[key_].double_param = value
        else:
            params[key_].string_param = value
    data = header.SerializeToString()
    if len(_HEADERS) >= 256:
        _HEADERS.clear()
    _HEADERS[key] = (req.parameters, data)
    return data


def encode_request(req: ChunkRequest, wire_id: str | None = None) -> bytes:
    """A ModelInferRequest's wire bytes: the request's header (serialized by protobuf once per shape of
    request, then reused), its id (`wire_id`, else the request's), then each input's rows copied once
    (a bundle's pieces joined in that copy). Protobuf parsers take fields in any order, so the result
    is a valid ModelInferRequest for any server."""
    rid = req.request_id if wire_id is None else wire_id
    parts: list[Any] = [_header(req), *length_delimited(_ID_FIELD, [rid.encode()])]
    for name, f in req.inputs.items():
        if f.datatype == "BYTES":  # texts: serialised per row (distill.text_fields)
            parts += length_delimited(RAW_INPUT_FIELD, [text_rows(inputs[name], a, b) for inputs, a, b in req.parts])
        else:
            parts += length_delimited(RAW_INPUT_FIELD, [inputs[name].array[a:b] for inputs, a, b in req.parts])
    return b"".join(parts)


def _tensor(raw: bytes, dt: Datatype, shape: list[int], owned: bool) -> torch.Tensor:
    """A tensor over an answer's buffer (no copy), or with `owned` a copy of it, shaped by numpy: on
    the engine's thread a torch operation releases and retakes the GIL, a handoff to the training
    loop's thread every time."""
    if dt.torch_dtype is torch.bfloat16:  # numpy has no bfloat16: torch views the 16-bit words
        t = decode_tensor(raw, dt, shape)
        return t.clone() if owned else t
    arr = np.frombuffer(raw, dtype=dt.numpy_dtype).reshape(shape)
    return torch.from_numpy(arr.copy() if owned else arr)


# What an answer to a request must carry: the wanted output names with their per-sample shapes
# (None: unknown), by the request's outputs, declared outputs, parameters and scoring. The same few
# requests repeat for a reader's whole life; an entry keeps the declared and parameter mappings it
# was made from, so the ids in its key stay theirs.
_Expected = tuple[tuple[str, "tuple[int, ...] | None"], ...]
_EXPECTED: dict[tuple[Any, ...], tuple[Any, Any, _Expected]] = {}


def _expected(req: ChunkRequest) -> _Expected:
    scored = "SCORE_IDS" in req.inputs
    key = (req.outputs, id(req.declared), id(req.parameters), scored)
    hit = _EXPECTED.get(key)
    if hit is not None and hit[0] is req.declared and hit[1] is req.parameters:
        return hit[2]
    plan = tuple((name, per_sample_shape(name, req.declared, req.parameters))
                 for name in wanted_outputs(req.outputs, req.parameters, scored=scored))
    if len(_EXPECTED) >= 256:
        _EXPECTED.clear()
    _EXPECTED[key] = (req.declared, req.parameters, plan)
    return plan


def decode_response(resp: service_pb2.ModelInferResponse, req: ChunkRequest) -> dict[str, torch.Tensor]:
    """The wanted outputs as tensors over the answer's buffers (copies with `req.owned`);
    MalformedAnswerError when they do not fit the request (a teacher that does, and keeps serving,
    is broken for this reader)."""
    if len(resp.raw_output_contents) != len(resp.outputs):
        raise MalformedAnswerError(f"{len(resp.outputs)} outputs but {len(resp.raw_output_contents)} raw buffers")
    expected = _expected(req)
    wanted = {name for name, _ in expected}
    shapes: dict[str, list[int]] = {}
    raws: dict[str, tuple[bytes, Datatype]] = {}
    for spec, raw in zip(resp.outputs, resp.raw_output_contents, strict=True):
        dt = DATATYPES.get(spec.datatype)
        shape = list(spec.shape)
        if dt is None:
            raise MalformedAnswerError(f"output {spec.name!r} has unsupported datatype {spec.datatype!r}")
        if not shape or shape[0] != req.size:
            raise MalformedAnswerError(f"output {spec.name!r} has shape {shape} for a chunk of {req.size}")
        if len(raw) != shape_numel(shape) * dt.itemsize:
            raise MalformedAnswerError(f"output {spec.name!r}: {len(raw)} bytes for shape {shape} of {spec.datatype}")
        if spec.name in wanted:  # one not asked for (a tail sent by default) is dropped unread
            shapes[spec.name] = shape
            raws[spec.name] = (raw, dt)
    missing = [n for n, _ in expected if n not in shapes]
    if missing:
        raise MalformedAnswerError(f"the answer lacks outputs {missing} (got {sorted(o.name for o in resp.outputs)})")
    out: dict[str, torch.Tensor] = {}
    for name, want in expected:
        shape = shapes[name]
        got = shape[1:]
        if want is not None and (len(want) != len(got) or any(w not in (-1, g) for w, g in zip(want, got,
                                                                                                strict=True))):
            raise MalformedAnswerError(
                f"output {name!r} came as {got} per sample; the teacher's metadata declares {list(want)}")
        raw, dt = raws[name]
        out[name] = _tensor(raw, dt, shape, req.owned)
    if NONFINITE_ROWS_PARAMETER in resp.parameters:
        out[VALID_ROWS] = _valid_rows(resp.parameters[NONFINITE_ROWS_PARAMETER].string_param, req.size)
    return out


def _valid_rows(text: str, size: int) -> torch.Tensor:
    """The answer's per-row validity mask from the rows a teacher named as holding inf or NaN
    (`NONFINITE_ROWS_PARAMETER`); MalformedAnswerError for a list that does not fit the request."""
    try:
        rows = [int(r) for r in text.split(",")]
    except ValueError:
        raise MalformedAnswerError(f"response parameter {NONFINITE_ROWS_PARAMETER!r} is {text!r}, not row "
                                   "numbers") from None
    if not rows or any(not 0 <= r < size for r in rows):
        raise MalformedAnswerError(f"response parameter {NONFINITE_ROWS_PARAMETER!r} names rows {text!r} of a "
                                   f"request of {size}")
    valid = torch.ones(size, dtype=torch.bool)
    valid[rows] = False
    return valid


class InferenceClient(Protocol):
    """What the engine needs of a teacher; `TeacherClient` speaks it over gRPC."""

    endpoint: str

    async def infer(self, request: ChunkRequest, timeout: float) -> dict[str, torch.Tensor]:
        """The checked outputs of one chunk; with `request.owned`, tensors the reader may keep as they are."""

    async def ready(self, model: str, timeout: float) -> bool: ...

    async def fetch_metadata(self, model: str | None, version: str, timeout: float) -> TeacherMetadata: ...

    async def close(self) -> None: ...


class TeacherClient:
    """Owns the channel to one teacher endpoint; close(), or leaving `async with`, releases it. Every
    method raises `TeacherCallError` / `TeacherGoneError` rather than gRPC's own exceptions."""

    def __init__(self, endpoint: str, credentials: grpc.ChannelCredentials | None = None,
                 server_name: str | None = None, headers: Mapping[str, str] | None = None) -> None:
        self.endpoint = endpoint
        # Sent as call metadata on every call (access tokens: never logged). Keys must already be
        # valid lower-case gRPC metadata keys (`ReaderOptions` checks them).
        self._metadata: tuple[tuple[str, str], ...] | None = tuple(headers.items()) if headers else None
        if credentials is None:
            self._channel = grpc.aio.insecure_channel(endpoint, options=CHANNEL_OPTIONS)
        else:
            options = [*CHANNEL_OPTIONS, *([("grpc.ssl_target_name_override", server_name)] if server_name else [])]
            self._channel = grpc.aio.secure_channel(endpoint, credentials, options=options)
        self._infer = self._channel.unary_unary(
            _INFER, request_serializer=None, response_deserializer=service_pb2.ModelInferResponse.FromString
        )

    async def infer(self, request: ChunkRequest, timeout: float) -> dict[str, torch.Tensor]:
        """One ModelInfer of a chunk, pre-serialized, with a deadline; the checked outputs."""
        wire = encode_request(request)
        try:
            response: service_pb2.ModelInferResponse = await self._infer(wire, timeout=timeout,
                                                                          metadata=self._metadata)
        except grpc.aio.AioRpcError as e:
            raise rpc_error(e) from None
        except grpc.aio.UsageError:
            raise TeacherGoneError(f"the channel to {self.endpoint} was closed: the teacher left") from None
        except grpc.RpcError as e:
            raise MalformedAnswerError(str(e)) from None
        return decode_response(response, request)

    async def ready(self, model: str, timeout: float) -> bool:
        """ModelReady: the cheap probe that tells a hung teacher from one that answers again."""
        try:
            response = await self._unary(_READY, service_pb2.ModelReadyRequest(name=model),
                                         service_pb2.ModelReadyResponse, timeout)
        except grpc.aio.AioRpcError as e:
            raise TeacherCallError(e.code(), e.details() or "") from None
        except grpc.aio.UsageError:
            raise TeacherGoneError(f"the channel to {self.endpoint} was closed: the teacher left") from None
        return bool(response.ready)

    async def fetch_metadata(self, model: str | None, version: str, timeout: float) -> TeacherMetadata:
        """ModelMetadata + ModelConfig; the model's name comes from RepositoryIndex when not given.
        ModelChoiceError when the teacher serves several models (or none) and none was named;
        TeacherCallError UNAVAILABLE while its model is still loading (ask again later);
        TeacherRefusedError when the teacher refuses one of these calls to this client."""
        try:
            return await self._fetch_metadata(model, version, timeout)
        except grpc.aio.AioRpcError as e:
            raise TeacherCallError(e.code(), e.details() or "") from None
        except grpc.aio.UsageError:
            raise TeacherGoneError(f"the channel to {self.endpoint} was closed: the teacher left") from None

    async def _fetch_metadata(self, model: str | None, version: str, timeout: float) -> TeacherMetadata:
        if not model:
            model = await self._only_model(timeout)
        meta = await self._unary(_METADATA, service_pb2.ModelMetadataRequest(name=model, version=version),
                                 service_pb2.ModelMetadataResponse, timeout)
        config = await self._unary(_CONFIG, service_pb2.ModelConfigRequest(name=model, version=version),
                                   service_pb2.ModelConfigResponse, timeout)
        max_batch = config.config.max_batch_size

        def tensors(ts: Any) -> dict[str, TensorMeta]:
            # Metadata shapes include the batch dimension (-1) when the model batches.
            return {t.name: TensorMeta(t.name, t.datatype, tuple(t.shape[1:] if max_batch > 0 else t.shape))
                    for t in ts}

        by_length = config.config.parameters.get(BY_LENGTH_PARAMETER)
        fingerprint = config.config.parameters.get(FINGERPRINT_PARAMETER)
        return TeacherMetadata(meta.name, version or (meta.versions[-1] if meta.versions else ""),
                               max_batch, tensors(meta.inputs), tensors(meta.outputs),
                               by_length is not None and by_length.string_value.lower() == "true",
                               fingerprint.string_value if fingerprint is not None else "")

    async def _only_model(self, timeout: float) -> str:
        """The one ready model of the teacher's repository. None ready while one is loading is the
        teacher not ready yet (TeacherCallError UNAVAILABLE, like a teacher not listening yet): a
        teacher-server lists its model as LOADING, a Triton lists only ready models when asked for
        them, so its whole repository is asked then."""
        index = await self._unary(_INDEX, service_pb2.RepositoryIndexRequest(ready=True),
                                  service_pb2.RepositoryIndexResponse, timeout)
        names = sorted({m.name for m in index.models if m.state in ("", "READY")})
        if len(names) == 1:
            return names[0]
        if not names:
            listed = index.models
            if not any(m.state == "LOADING" for m in listed):
                listed = (await self._unary(_INDEX, service_pb2.RepositoryIndexRequest(ready=False),
                                            service_pb2.RepositoryIndexResponse, timeout)).models
            loading = sorted({m.name for m in listed if m.state == "LOADING"})
            if loading:
                raise TeacherCallError(grpc.StatusCode.UNAVAILABLE, f"model {loading[0]!r} is still loading")
        raise ModelChoiceError(self.endpoint, names)

    async def _unary(self, method: str, request: Any, response_type: Any, timeout: float) -> Any:
        """One control-plane call with this client's headers and a deadline; a refusal of access
        comes out as `TeacherRefusedError` naming the call, other failures as gRPC's own errors."""
        try:
            return await self._channel.unary_unary(
                method, request_serializer=type(request).SerializeToString,
                response_deserializer=response_type.FromString,
            )(request, timeout=timeout, metadata=self._metadata)
        except grpc.aio.AioRpcError as e:
            code, details = e.code(), e.details() or ""
            if access_refused(code, details):
                raise TeacherRefusedError(code, details, method.rsplit("/", 1)[-1]) from None
            raise

    async def close(self) -> None:
        await self._channel.close(grace=None)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
