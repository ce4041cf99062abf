"""The Triton / KServe v2 `GRPCInferenceService`, as tritonclient and Triton's own tools expect it.

Metadata and config answers mirror what Triton reports for a PyTorch model with dynamic
batching, so `tritonclient`, `perf_analyzer` and our student treat this server and a real
Triton the same way. Streaming requests run concurrently and answer in completion order,
matched by `id`; a failed stream request answers with `error_message` and the stream goes on.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import grpc

from protos.kserve import DATATYPES, model_config_pb2, service_pb2, service_pb2_grpc
from teacher_server.batcher import BatcherClosedError, QueueFullError
from teacher_server.requests import InferError, InferWire, build_response, deserialize_infer, parse_request

if TYPE_CHECKING:
    from teacher_server.server import TeacherServer

_STREAM_MAX_IN_FLIGHT = 1024


class InferenceService(service_pb2_grpc.GRPCInferenceServiceServicer):
    """Answers the inference protocol for the one model a TeacherServer serves."""

    def __init__(self, server: TeacherServer) -> None:
        self._server = server

    # ---- health and metadata -------------------------------------------------------------
    async def ServerLive(self, request: Any, context: Any) -> service_pb2.ServerLiveResponse:
        return service_pb2.ServerLiveResponse(live=True)

    async def ServerReady(self, request: Any, context: Any) -> service_pb2.ServerReadyResponse:
        return service_pb2.ServerReadyResponse(ready=self._server.accepting)

    async def ModelReady(self, request: Any, context: Any) -> service_pb2.ModelReadyResponse:
        known = request.name == self._server.model_name and request.version in ("", self._server.model_version)
        return service_pb2.ModelReadyResponse(ready=known and self._server.accepting)

    async def ServerMetadata(self, request: Any, context: Any) -> service_pb2.ServerMetadataResponse:
        from teacher_server import __version__

        return service_pb2.ServerMetadataResponse(
            name="teacher-server", version=__version__, extensions=["model_configuration", "statistics"]
        )

    async def ModelMetadata(self, request: Any, context: Any) -> service_pb2.ModelMetadataResponse:
        await self._require_model(request.name, request.version, context)
        io = self._server.io
        resp = service_pb2.ModelMetadataResponse(
            name=self._server.model_name, versions=[self._server.model_version], platform="pytorch_libtorch"
        )
        for s in io.inputs:
            resp.inputs.add(name=s.name, datatype=s.datatype, shape=[-1, *s.shape])
        for s in io.outputs:
            resp.outputs.add(name=s.name, datatype=s.datatype, shape=[-1, *s.shape])
        return resp

    async def ModelConfig(self, request: Any, context: Any) -> service_pb2.ModelConfigResponse:
        await self._require_model(request.name, request.version, context)
        srv = self._server
        cfg = model_config_pb2.ModelConfig(
            name=srv.model_name, platform="pytorch_libtorch", backend="pytorch",
            max_batch_size=srv.config.batching.max_batch_size,
        )
        for s in srv.io.inputs:
            cfg.input.add(name=s.name, data_type=DATATYPES[s.datatype].config_type, dims=list(s.shape))
        for s in srv.io.outputs:
            cfg.output.add(name=s.name, data_type=DATATYPES[s.datatype].config_type, dims=list(s.shape))
        if srv.config.batching.enabled:
            cfg.dynamic_batching.max_queue_delay_microseconds = srv.config.batching.max_queue_delay_us
            cfg.dynamic_batching.default_queue_policy.max_queue_size = srv.config.batching.max_queue_size
        gpu = srv.device.type == "cuda"
        group = cfg.instance_group.add(
            name=f"{srv.model_name}_0", count=srv.config.instances,
            kind=model_config_pb2.ModelInstanceGroup.KIND_GPU if gpu else model_config_pb2.ModelInstanceGroup.KIND_CPU,
        )
        if gpu:
            group.gpus.append(srv.device.index or 0)
        return service_pb2.ModelConfigResponse(config=cfg)

    async def ModelStatistics(self, request: Any, context: Any) -> service_pb2.ModelStatisticsResponse:
        if request.name:
            await self._require_model(request.name, request.version, context)
        m = self._server.metrics
        stats = service_pb2.ModelStatistics(
            name=self._server.model_name, version=self._server.model_version,
            last_inference=int(self._server.last_inference_ms), inference_count=m.inference_count,
            execution_count=m.exec_count,
        )
        st = stats.inference_stats
        st.success.count = m.request_success
        st.success.ns = int(m.request_duration_us * 1000)
        st.fail.count = sum(m.request_failure.values())
        st.queue.count = m.request_success
        st.queue.ns = int(m.queue_duration_us * 1000)
        st.compute_infer.count = m.request_success
        st.compute_infer.ns = int(m.compute_infer_duration_us * 1000)
        return service_pb2.ModelStatisticsResponse(model_stats=[stats])

    async def RepositoryIndex(self, request: Any, context: Any) -> service_pb2.RepositoryIndexResponse:
        state = "READY" if self._server.accepting else ("UNAVAILABLE" if self._server.draining else "LOADING")
        return service_pb2.RepositoryIndexResponse(
            models=[{"name": self._server.model_name, "version": self._server.model_version, "state": state}]
        )

    async def _require_model(self, name: str, version: str, context: Any) -> None:
        try:
            self._server.check_model(name, version)
        except InferError as e:
            await context.abort(e.code, e.message)

    # ---- inference -----------------------------------------------------------------------
    async def _infer(self, wire: InferWire) -> service_pb2.ModelInferResponse:
        srv = self._server
        m = srv.metrics
        request = wire.header
        start = time.perf_counter_ns()
        srv.begin_request()
        try:
            if wire.error:
                raise InferError(grpc.StatusCode.INVALID_ARGUMENT, wire.error)
            srv.check_model(request.model_name, request.model_version)
            if not srv.accepting:
                raise InferError(grpc.StatusCode.UNAVAILABLE, srv.unavailable_reason())
            work = parse_request(request, wire.raws, srv.io, srv.config.batching.max_batch_size,
                                 srv.output_defaults)
            try:
                outputs, timing = await srv.batcher.submit(work)
            except QueueFullError as e:
                m.request_failure["REJECTED"] += 1
                raise InferError(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e)) from None
            except BatcherClosedError as e:
                m.request_failure["OTHER"] += 1
                raise InferError(grpc.StatusCode.UNAVAILABLE, f"{e}; retry on another teacher") from None
            except asyncio.CancelledError:
                m.request_failure["CANCELED"] += 1
                raise
            except Exception as e:
                m.request_failure["BACKEND"] += 1
                raise InferError(grpc.StatusCode.INTERNAL, f"model execution failed: {e}") from e
            response = build_response(request, srv.model_name, srv.model_version, outputs)
        except InferError as e:
            if e.code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAVAILABLE):
                m.request_failure["OTHER"] += 1
            raise
        finally:
            srv.end_request()
        m.request_success += 1
        m.inference_count += work.batch_size
        m.request_duration_us += (time.perf_counter_ns() - start) / 1000
        m.queue_duration_us += timing.queue_ns / 1000
        m.compute_infer_duration_us += timing.compute_ns / 1000
        srv.last_inference_ms = time.time() * 1000
        return response

    async def ModelInfer(self, request: Any, context: Any) -> service_pb2.ModelInferResponse:
        try:
            return await self._infer(request)
        except InferError as e:
            await context.abort(e.code, e.message)
            raise  # unreachable: abort raises

    async def ModelStreamInfer(
        self, request_iterator: AsyncIterator[InferWire], context: Any
    ) -> AsyncIterator[service_pb2.ModelStreamInferResponse]:
        """Bidirectional stream: requests run concurrently, answers go out as they complete."""
        out: asyncio.Queue[service_pb2.ModelStreamInferResponse | None] = asyncio.Queue()
        slots = asyncio.Semaphore(_STREAM_MAX_IN_FLIGHT)
        tasks: set[asyncio.Task[None]] = set()

        async def one(wire: InferWire) -> None:
            req = wire.header
            try:
                resp = await self._infer(wire)
                await out.put(service_pb2.ModelStreamInferResponse(infer_response=resp))
            except InferError as e:
                await out.put(service_pb2.ModelStreamInferResponse(
                    error_message=f"{e.code.name}: {e.message}",
                    infer_response=service_pb2.ModelInferResponse(
                        id=req.id, model_name=req.model_name, model_version=req.model_version
                    ),
                ))
            finally:
                slots.release()

        async def read_requests() -> None:
            try:
                async for req in request_iterator:
                    await slots.acquire()
                    t = asyncio.create_task(one(req))
                    tasks.add(t)
                    t.add_done_callback(tasks.discard)
                await asyncio.gather(*list(tasks), return_exceptions=True)
            finally:
                await out.put(None)

        reader = asyncio.create_task(read_requests())
        try:
            while (item := await out.get()) is not None:
                yield item
        finally:
            reader.cancel()
            for t in list(tasks):
                t.cancel()
            await asyncio.gather(reader, *tasks, return_exceptions=True)


def _unimplemented(name: str) -> Any:
    async def handler(self: InferenceService, request: Any, context: Any) -> Any:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, f"{name} is not supported by teacher-server")

    handler.__name__ = name
    return handler


def add_inference_service(servicer: InferenceService, server: grpc.aio.Server) -> None:
    """Register the service from its descriptor, as the generated helper would, except that the two
    inference methods receive `InferWire` (header + zero-copy raw input views) instead of a parsed
    ModelInferRequest, whose accessors copy every raw buffer."""
    service = service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    handlers = {}
    for method in service.methods:
        request_type = getattr(service_pb2, method.input_type.name)
        response_type = getattr(service_pb2, method.output_type.name)
        inference = method.name in ("ModelInfer", "ModelStreamInfer")
        deserialize = deserialize_infer if inference else request_type.FromString
        factory = (grpc.stream_stream_rpc_method_handler if method.client_streaming and method.server_streaming
                   else grpc.unary_unary_rpc_method_handler)
        handlers[method.name] = factory(getattr(servicer, method.name), request_deserializer=deserialize,
                                        response_serializer=response_type.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))


for _name in (
    "RepositoryModelLoad", "RepositoryModelUnload", "SystemSharedMemoryStatus", "SystemSharedMemoryRegister",
    "SystemSharedMemoryUnregister", "CudaSharedMemoryStatus", "CudaSharedMemoryRegister",
    "CudaSharedMemoryUnregister", "TraceSetting", "LogSettings",
):
    setattr(InferenceService, _name, _unimplemented(_name))
