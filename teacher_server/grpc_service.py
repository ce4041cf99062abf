"""The Triton / KServe v2 `GRPCInferenceService`, as tritonclient and Triton's own tools expect it.

The gRPC front end of a `RequestLifecycle`: it decodes (`grpc_codec`), awaits the lifecycle, and
maps typed refusals to gRPC codes; it holds no request state of its own. Metadata and config
answers mirror what Triton reports for a PyTorch model with dynamic batching, so `tritonclient`,
`perf_analyzer` and our student treat this server and a real Triton the same way. Streaming
requests run concurrently and answer in completion order, matched by `id`; a failed stream
request answers with `error_message` ("CODE: details", its facts as the answer's
`REFUSAL_METADATA` parameter) and the stream goes on. A stream that does not read its
answers stops being read itself (bounded answers in flight and unsent bytes, per stream and in
all), and a client that cancels ends its stream quietly.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc

from protos.kserve import service_pb2, service_pb2_grpc
from teacher_server.errors import InferError
from teacher_server.grpc_codec import (
    deserialize_infer,
    encode_response,
    encode_stream_answer,
    encode_stream_error,
    error_details,
    error_metadata,
    grpc_status,
    response_parts,
)
from teacher_server.infer_request import InferRequest
from teacher_server.lifecycle import RequestLifecycle, ServingState
from teacher_server.model_description import config_message, metadata_message
from teacher_server.spec import ModelIO

log = logging.getLogger(__name__)

# Per stream: requests read and not yet answered on the wire, and bytes of answers computed and
# not yet taken by the transport. Past either, the stream stops reading requests.
STREAM_MAX_IN_FLIGHT = 128
STREAM_MAX_UNSENT_BYTES = 16 << 20
# All streams together: bytes of computed answers the transport has not taken yet.
MAX_UNSENT_BYTES = 128 << 20


class ByteBudget:
    """Bytes held for answers not yet sent, against a limit; `has_room` while under it.

    Charging never blocks (the answer already exists); a reader waits for room before taking the
    next request, so the overshoot is bounded by what is already running.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0
        self._room = asyncio.Event()
        self._room.set()

    @property
    def has_room(self) -> bool:
        return self.held < self.limit

    def charge(self, n: int) -> None:
        self.held += n
        if self.held >= self.limit:
            self._room.clear()

    def release(self, n: int) -> None:
        self.held -= n
        if self.held < self.limit:
            self._room.set()

    async def wait_room(self) -> None:
        await self._room.wait()


class InferenceService(service_pb2_grpc.GRPCInferenceServiceServicer):
    """Answers the inference protocol for the one model a RequestLifecycle serves."""

    def __init__(self, lifecycle: RequestLifecycle, max_unsent_bytes: int = MAX_UNSENT_BYTES) -> None:
        self._lifecycle = lifecycle
        self._unsent = ByteBudget(max_unsent_bytes)

    @property
    def unsent_bytes(self) -> int:
        """Bytes of stream answers computed and not yet taken by the transport, all streams."""
        return self._unsent.held

    # ---- health and metadata -------------------------------------------------------------
    async def ServerLive(self, request: Any, context: Any) -> service_pb2.ServerLiveResponse:
        return service_pb2.ServerLiveResponse(live=True)

    async def ServerReady(self, request: Any, context: Any) -> service_pb2.ServerReadyResponse:
        return service_pb2.ServerReadyResponse(ready=self._lifecycle.accepting)

    async def ModelReady(self, request: Any, context: Any) -> service_pb2.ModelReadyResponse:
        model = self._lifecycle.model
        known = request.name == model.name and request.version in ("", model.version)
        return service_pb2.ModelReadyResponse(ready=known and self._lifecycle.accepting)

    async def ServerMetadata(self, request: Any, context: Any) -> service_pb2.ServerMetadataResponse:
        from teacher_server.version import __version__

        return service_pb2.ServerMetadataResponse(
            name="teacher-server", version=__version__, extensions=["model_configuration", "statistics"]
        )

    async def ModelMetadata(self, request: Any, context: Any) -> service_pb2.ModelMetadataResponse:
        await self._require_model(request.name, request.version, context)
        return metadata_message(self._lifecycle.model, await self._io(context))

    async def ModelConfig(self, request: Any, context: Any) -> service_pb2.ModelConfigResponse:
        await self._require_model(request.name, request.version, context)
        return service_pb2.ModelConfigResponse(config=config_message(self._lifecycle.model, await self._io(context)))

    async def ModelStatistics(self, request: Any, context: Any) -> service_pb2.ModelStatisticsResponse:
        if request.name:
            await self._require_model(request.name, request.version, context)
        model = self._lifecycle.model
        m = self._lifecycle.metrics.snapshot()
        stats = service_pb2.ModelStatistics(
            name=model.name, version=model.version, last_inference=int(m.last_inference_ms),
            inference_count=m.inference_count, execution_count=m.exec_count,
        )
        st = stats.inference_stats
        st.success.count = m.request_success
        st.success.ns = int(m.request_duration_us * 1000)
        st.fail.count = m.request_failure
        st.queue.count = m.request_success
        st.queue.ns = int(m.queue_duration_us * 1000)
        st.compute_infer.count = m.request_success
        st.compute_infer.ns = int(m.compute_infer_duration_us * 1000)
        # The forward pass's time covers moving inputs in and outputs out, so their own durations
        # are 0; their counts must still equal compute_infer's (perf_analyzer refuses them otherwise).
        st.compute_input.count = m.request_success
        st.compute_output.count = m.request_success
        return service_pb2.ModelStatisticsResponse(model_stats=[stats])

    async def RepositoryIndex(self, request: Any, context: Any) -> service_pb2.RepositoryIndexResponse:
        model = self._lifecycle.model
        state = {ServingState.SERVING: "READY", ServingState.DRAINING: "UNAVAILABLE",
                 ServingState.LOADING: "LOADING"}[self._lifecycle.state]
        return service_pb2.RepositoryIndexResponse(
            models=[{"name": model.name, "version": model.version, "state": state}]
        )

    async def _require_model(self, name: str, version: str, context: Any) -> None:
        try:
            self._lifecycle.check_model(name, version)
        except InferError as e:
            await context.abort(grpc_status(e), error_details(e))

    async def _io(self, context: Any) -> ModelIO:
        try:
            return self._lifecycle.io
        except InferError as e:  # UnavailableError while the model loads
            await context.abort(grpc_status(e), error_details(e))
            raise  # unreachable: abort raises

    # ---- inference -----------------------------------------------------------------------
    async def _infer(self, request: InferRequest) -> tuple[list[object], int]:
        """The response to one request as wire parts (`response_parts`), and the bytes of output
        it carries."""
        result = await self._lifecycle.infer(request)
        model = self._lifecycle.model
        size = sum(len(raw) for *_, raw in result.outputs)
        return response_parts(request, model.name, model.version, result.outputs, result.nonfinite_rows), size

    async def ModelInfer(self, request: InferRequest, context: Any) -> bytes:
        try:
            return encode_response((await self._infer(request))[0])
        except InferError as e:
            await context.abort(grpc_status(e), error_details(e), trailing_metadata=error_metadata(e))
            raise  # unreachable: abort raises

    async def ModelStreamInfer(self, request_iterator: AsyncIterator[InferRequest], context: Any) -> None:
        """Bidirectional stream: requests run concurrently, answers go out as they complete.

        Backpressure: a request holds one of the stream's `STREAM_MAX_IN_FLIGHT` slots from the
        moment it is read until its answer has been handed to the transport, not merely queued,
        and the stream stops reading while its unsent answers hold `STREAM_MAX_UNSENT_BYTES` or
        all streams together hold the service's `max_unsent_bytes`. A client that sends and never
        reads therefore stalls its own stream (HTTP/2 flow control then stops its sender) instead
        of growing the server.
        """
        out: asyncio.Queue[tuple[bytes, int] | None] = asyncio.Queue()
        slots = asyncio.Semaphore(STREAM_MAX_IN_FLIGHT)
        mine = ByteBudget(STREAM_MAX_UNSENT_BYTES)
        shared = self._unsent
        tasks: set[asyncio.Task[None]] = set()

        async def one(req: InferRequest) -> None:
            try:
                parts, size = await self._infer(req)
                mine.charge(size)
                shared.charge(size)
                out.put_nowait((encode_stream_answer(parts), size))
            except InferError as e:
                out.put_nowait((encode_stream_error(req, e), 0))
            except BaseException:
                slots.release()  # no answer will be sent for this request
                raise

        async def read_requests() -> None:
            try:
                it = aiter(request_iterator)
                while True:
                    await slots.acquire()
                    if not (mine.has_room and shared.has_room):
                        await _room(mine, shared)
                    try:
                        req = await anext(it)
                    except StopAsyncIteration:
                        break
                    t = asyncio.create_task(one(req))
                    tasks.add(t)
                    t.add_done_callback(tasks.discard)
                await asyncio.gather(*list(tasks), return_exceptions=True)
            except grpc.RpcError:
                pass  # the client went away; the handler's finally cleans up
            finally:
                out.put_nowait(None)

        reader = asyncio.create_task(read_requests())
        held = 0
        try:
            while (item := await out.get()) is not None:
                answer, held = item
                if not await _write(context, answer):  # returns once the transport took it
                    return
                mine.release(held)
                shared.release(held)
                held = 0
                slots.release()
        finally:
            reader.cancel()
            for t in list(tasks):
                t.cancel()
            try:
                await asyncio.gather(reader, *tasks, return_exceptions=True)
            finally:
                # Answers computed and never sent: give their bytes back to the shared budget, also
                # when grpc cancels this handler again during the wait above (a cancelled stream
                # would otherwise keep its share of the budget for the server's life). A cancelled
                # task charges nothing, so none is charged after this.
                unsent = held
                while not out.empty():
                    rest = out.get_nowait()
                    if rest is not None:
                        unsent += rest[1]
                shared.release(unsent)


async def _write(context: Any, message: Any) -> bool:
    """Send one stream answer; False when the client is gone (cancelled, deadline, reset).

    Written here rather than yielded from a generator: a yielded answer that meets a cancelled call
    fails inside grpc, which logs an ERROR with a traceback for what is a routine client cancel.
    """
    if context.cancelled() or context.done():
        return False
    try:
        await context.write(message)
    except Exception as e:  # grpc raises its internal ExecuteBatchError / UsageError here
        log.debug("stream answer not sent, the client went away: %s", e)
        return False
    return True


async def _room(*budgets: ByteBudget) -> None:
    """Wait until every budget has room (each wait is woken by a release)."""
    while True:
        full = next((b for b in budgets if not b.has_room), None)
        if full is None:
            return
        await full.wait_room()


def _unimplemented(name: str) -> Any:
    async def handler(self: InferenceService, request: Any, context: Any) -> Any:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, f"{name} is not supported by teacher-server")

    handler.__name__ = name
    return handler


def add_inference_service(servicer: InferenceService, server: grpc.aio.Server) -> None:
    """Register the service from its descriptor, as the generated helper would, except that the two
    inference methods receive a protocol-neutral `InferRequest` over zero-copy views of the raw
    inputs instead of a parsed ModelInferRequest, whose accessors copy every raw buffer, and answer
    with wire bytes whose outputs were copied once, not a message that copies them twice."""
    service = service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    handlers = {}
    for method in service.methods:
        request_type = getattr(service_pb2, method.input_type.name)
        response_type = getattr(service_pb2, method.output_type.name)
        inference = method.name in ("ModelInfer", "ModelStreamInfer")
        deserialize = deserialize_infer if inference else request_type.FromString
        # The inference methods answer with wire bytes already (`grpc_codec.response_parts`).
        serialize = None if inference else response_type.SerializeToString
        factory = (grpc.stream_stream_rpc_method_handler if method.client_streaming and method.server_streaming
                   else grpc.unary_unary_rpc_method_handler)
        handlers[method.name] = factory(getattr(servicer, method.name), request_deserializer=deserialize,
                                        response_serializer=serialize)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))


for _name in (
    "RepositoryModelLoad", "RepositoryModelUnload", "SystemSharedMemoryStatus", "SystemSharedMemoryRegister",
    "SystemSharedMemoryUnregister", "CudaSharedMemoryStatus", "CudaSharedMemoryRegister",
    "CudaSharedMemoryUnregister", "TraceSetting", "LogSettings",
):
    setattr(InferenceService, _name, _unimplemented(_name))
