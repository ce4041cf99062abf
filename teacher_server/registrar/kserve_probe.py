"""The probe of a KServe v2 gRPC engine (Triton, teacher-server): ready, and what its record says.

Readiness is the protocol's own: ServerReady, then ModelReady of the model (``--model``, else the
only one RepositoryIndex lists); the record's tensors, batch bound, by-length batching and
fingerprint come from ModelMetadata and ModelConfig, so a student sees what it would see by
asking the engine itself. Every RPC has a deadline (``ProbeOptions.timeout``).

Capabilities: a model whose ModelConfig carries a ``capabilities`` parameter (the JSON form of
``registry.Capabilities``; teacher-server always declares one, :mod:`teacher_server.capabilities`)
is described by it; any other KServe model is assumed to answer whole outputs (``full_outputs``)
and no top-k, which is what a plain Triton model does.
"""

from __future__ import annotations

from typing import Any

import grpc
from google.protobuf import json_format

from discovery.aio import describe
from protos import registry_pb2
from protos.kserve import BY_LENGTH_PARAMETER, FINGERPRINT_PARAMETER, service_pb2, service_pb2_grpc
from teacher_server.capabilities import CAPABILITIES_PARAMETER
from teacher_server.registrar.engine import EngineAddress
from teacher_server.registrar.errors import EngineNotReady
from teacher_server.registrar.probe import Probe, ProbeOptions

__all__ = ["CAPABILITIES_PARAMETER", "KServeProbe"]



class KServeProbe(Probe):
    """ServerReady / ModelReady for liveness; metadata and config for the record."""

    def __init__(self, address: EngineAddress, options: ProbeOptions) -> None:
        super().__init__(address, options)
        self._channel: grpc.aio.Channel | None = None
        self._stub: service_pb2_grpc.GRPCInferenceServiceStub | None = None
        self._model: str | None = None  # the model of the last record

    def _rpc(self) -> service_pb2_grpc.GRPCInferenceServiceStub:
        if self._stub is None:
            target = self.address.endpoint
            self._channel = (grpc.aio.secure_channel(target, grpc.ssl_channel_credentials()) if self.address.tls
                             else grpc.aio.insecure_channel(target))
            self._stub = service_pb2_grpc.GRPCInferenceServiceStub(self._channel)
        return self._stub

    async def _call(self, name: str, request: Any) -> Any:
        """One RPC within the deadline; EngineNotReady with its status when it fails."""
        try:
            return await getattr(self._rpc(), name)(request, timeout=self.options.timeout)
        except grpc.aio.AioRpcError as e:
            raise EngineNotReady(f"{name} at {self.address.endpoint}: {describe(e)}") from None

    async def _model_name(self) -> str:
        if self.options.model is not None:
            return self.options.model
        index = await self._call("RepositoryIndex", service_pb2.RepositoryIndexRequest())
        names = sorted({m.name for m in index.models})
        if len(names) != 1:
            raise EngineNotReady(f"RepositoryIndex at {self.address.endpoint} lists {names or 'no model'}; pass "
                                 "--model NAME to say which to register")
        return names[0]

    async def healthy(self) -> None:
        ready = await self._call("ServerReady", service_pb2.ServerReadyRequest())
        if not ready.ready:
            raise EngineNotReady(f"ServerReady at {self.address.endpoint}: not ready")
        model = self._model or self.options.model
        if model is not None:
            answer = await self._call("ModelReady", service_pb2.ModelReadyRequest(name=model))
            if not answer.ready:
                raise EngineNotReady(f"ModelReady({model!r}) at {self.address.endpoint}: not ready")

    async def ready(self) -> registry_pb2.TeacherRecord:
        self._model = None
        await self.healthy()
        name = await self._model_name()
        answer = await self._call("ModelReady", service_pb2.ModelReadyRequest(name=name))
        if not answer.ready:
            raise EngineNotReady(f"ModelReady({name!r}) at {self.address.endpoint}: not ready")
        meta = await self._call("ModelMetadata", service_pb2.ModelMetadataRequest(name=name))
        config = (await self._call("ModelConfig", service_pb2.ModelConfigRequest(name=name))).config
        record = self._record(name, meta, config)
        self._model = name
        return record

    def _record(self, name: str, meta: Any, config: Any) -> registry_pb2.TeacherRecord:
        batched = config.max_batch_size > 0
        rec = registry_pb2.TeacherRecord(
            endpoint=self.address.endpoint, protocol="kserve", path="", model_name=name,
            model_version=(meta.versions[-1] if meta.versions else ""),
            max_batch_size=config.max_batch_size, device=self.options.device,
            instances=max(1, sum(g.count for g in config.instance_group)), tls=self.address.tls,
            batches_by_length=config.parameters[BY_LENGTH_PARAMETER].string_value == "true",
            fingerprint=config.parameters[FINGERPRINT_PARAMETER].string_value,
        )
        for specs, out in ((meta.inputs, rec.inputs), (meta.outputs, rec.outputs)):
            for t in specs:
                shape = list(t.shape)[1:] if batched and t.shape else list(t.shape)  # the registry has no batch dim
                out.add(name=t.name, datatype=t.datatype, shape=shape)
        rec.capabilities.CopyFrom(self._capabilities(name, config))
        return rec

    def _capabilities(self, name: str, config: Any) -> registry_pb2.Capabilities:
        declared = config.parameters[CAPABILITIES_PARAMETER].string_value
        if declared:
            try:
                caps = json_format.Parse(declared, registry_pb2.Capabilities())
            except json_format.ParseError as e:
                raise EngineNotReady(f"ModelConfig({name!r}) parameter {CAPABILITIES_PARAMETER!r} is not the JSON "
                                     f"form of registry.Capabilities ({e}); fix the model's configuration") from None
            caps.declared = True
            return caps
        return registry_pb2.Capabilities(declared=True, max_top_k=0, full_outputs=True)

    async def close(self) -> None:
        channel, self._channel, self._stub = self._channel, None, None
        if channel is not None:
            await channel.close()
        await super().close()
