"""One gRPC channel to one teacher, speaking the raw KServe v2 protocol.

Requests go out as pre-serialized bytes (`protos.kserve.serialize_infer_request`: one copy of
the inputs), so the student pays no protobuf arena copies on its hot path. Every call carries a
deadline. The same client works against our teacher-server and a real Triton.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from protos import registry_pb2
from protos.kserve import service_pb2

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


@dataclass(frozen=True)
class ClientTLS:
    """TLS towards teachers: the CA that signed their certificates, and this student's own
    certificate and key when teachers require mutual TLS. `server_name` overrides the name checked
    against the teacher's certificate (when endpoints are IPs the certificate does not list)."""

    ca: str | None = None
    cert: str | None = None
    key: str | None = None
    server_name: str | None = None

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise ValueError("a client certificate for mutual TLS needs both tls_cert and tls_key")
        for label, path in (("tls_ca", self.ca), ("tls_cert", self.cert), ("tls_key", self.key)):
            if path is not None and not Path(path).is_file():
                raise ValueError(f"{label} {path} does not exist")

    def credentials(self) -> grpc.ChannelCredentials:
        def read(path: str | None) -> bytes | None:
            return Path(path).read_bytes() if path else None

        return grpc.ssl_channel_credentials(read(self.ca), read(self.key), read(self.cert))


@dataclass(frozen=True)
class TensorMeta:
    name: str
    datatype: str
    shape: tuple[int, ...]  # without the batch dimension

    def accepts(self, datatype: str, shape: tuple[int, ...]) -> bool:
        return datatype == self.datatype and len(shape) == len(self.shape) and all(
            want in (-1, got) for want, got in zip(self.shape, shape, strict=True)
        )


@dataclass(frozen=True)
class TeacherMetadata:
    """What a student must know to call a teacher: model, batch limit, tensors."""

    model_name: str
    model_version: str
    max_batch_size: int
    inputs: dict[str, TensorMeta]
    outputs: dict[str, TensorMeta]

    @classmethod
    def from_record(cls, rec: registry_pb2.TeacherRecord) -> TeacherMetadata | None:
        """From a registry record; None when the record lacks the model facts (static lists)."""
        if not rec.model_name or not rec.inputs:
            return None
        return cls(
            rec.model_name, rec.model_version, rec.max_batch_size,
            {t.name: TensorMeta(t.name, t.datatype, tuple(t.shape)) for t in rec.inputs},
            {t.name: TensorMeta(t.name, t.datatype, tuple(t.shape)) for t in rec.outputs},
        )


class TeacherClient:
    """Owns the channel to one teacher endpoint; close() releases it."""

    def __init__(self, endpoint: str, credentials: grpc.ChannelCredentials | None = None,
                 server_name: str | None = None) -> None:
        self.endpoint = endpoint
        if credentials is None:
            self._channel = grpc.aio.insecure_channel(endpoint, options=CHANNEL_OPTIONS)
        else:
            options = [*CHANNEL_OPTIONS, *([("grpc.ssl_target_name_override", server_name)] if server_name else [])]
            self._channel = grpc.aio.secure_channel(endpoint, credentials, options=options)
        self._infer = self._channel.unary_unary(
            _INFER, request_serializer=None, response_deserializer=service_pb2.ModelInferResponse.FromString
        )

    async def infer(self, wire: bytes, timeout: float) -> service_pb2.ModelInferResponse:
        """One ModelInfer with a pre-serialized request; raises grpc.aio.AioRpcError on failure."""
        response: service_pb2.ModelInferResponse = await self._infer(wire, timeout=timeout)
        return response

    async def ready(self, model: str, timeout: float) -> bool:
        """ModelReady: the cheap probe that tells a hung teacher from one that answers again."""
        response = await self._channel.unary_unary(
            _READY, request_serializer=service_pb2.ModelReadyRequest.SerializeToString,
            response_deserializer=service_pb2.ModelReadyResponse.FromString,
        )(service_pb2.ModelReadyRequest(name=model), timeout=timeout)
        return bool(response.ready)

    async def fetch_metadata(self, model: str | None, version: str, timeout: float) -> TeacherMetadata:
        """ModelMetadata + ModelConfig; the model's name comes from RepositoryIndex when not given."""
        if not model:
            index = await self._channel.unary_unary(
                _INDEX, request_serializer=service_pb2.RepositoryIndexRequest.SerializeToString,
                response_deserializer=service_pb2.RepositoryIndexResponse.FromString,
            )(service_pb2.RepositoryIndexRequest(ready=True), timeout=timeout)
            names = sorted({m.name for m in index.models if m.state in ("", "READY")})
            if len(names) != 1:
                raise ValueError(
                    f"teacher {self.endpoint} serves {names or 'no ready model'}; pass model=NAME to the reader "
                    "to say which one to use"
                )
            model = names[0]
        meta = await self._channel.unary_unary(
            _METADATA, request_serializer=service_pb2.ModelMetadataRequest.SerializeToString,
            response_deserializer=service_pb2.ModelMetadataResponse.FromString,
        )(service_pb2.ModelMetadataRequest(name=model, version=version), timeout=timeout)
        config = await self._channel.unary_unary(
            _CONFIG, request_serializer=service_pb2.ModelConfigRequest.SerializeToString,
            response_deserializer=service_pb2.ModelConfigResponse.FromString,
        )(service_pb2.ModelConfigRequest(name=model, version=version), timeout=timeout)
        max_batch = config.config.max_batch_size

        def tensors(ts: Any) -> dict[str, TensorMeta]:
            # Metadata shapes include the batch dimension (-1) when the model batches.
            return {t.name: TensorMeta(t.name, t.datatype, tuple(t.shape[1:] if max_batch > 0 else t.shape))
                    for t in ts}

        return TeacherMetadata(meta.name, version or (meta.versions[-1] if meta.versions else ""),
                               max_batch, tensors(meta.inputs), tensors(meta.outputs))

    async def close(self) -> None:
        await self._channel.close(grace=None)
