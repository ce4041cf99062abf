"""A teacher client whose inference requests share one ModelStreamInfer stream (`transport="stream"`).

A message on an open stream costs gRPC's Python server about a third of what a call costs at a
small request's size (`benchmarks.grpc_floor`), so a reader that sends many small chunks to a
teacher-server spends the teacher's host less on each. Everything else is `TeacherClient`'s: the
channel, the probes, the metadata, the encoding, the answer's checks and the typed errors.

How a stream keeps a call's contract:
  * Every request goes out under an id of this client's own (the chunk's id and a counter), so an
    answer finds its waiter whatever order the teacher answers in, and a retry on the same teacher
    never takes a late answer meant for an earlier attempt.
  * The deadline is kept here: past it the waiter fails with DEADLINE_EXCEEDED, as a call would,
    and the answer, when it comes, is dropped. A stream message carries no deadline, so the teacher
    still computes it.
  * A refusal arrives as the answer's `error_message`, "CODE: details" from a teacher-server (its
    facts as the answer's `REFUSAL_METADATA` parameter), and is typed by that code as a call's
    status would be; a server whose messages carry no code (Triton's) gives UNKNOWN.
  * A stream that ends (the teacher gone, its connection reset) fails every request still waiting
    on it with its status; the next request opens a new stream.
  * Past `MAX_STREAM_IN_FLIGHT` requests waiting on the stream, a request goes as a call instead:
    a teacher-server reads at most 128 requests a stream ahead of its answers.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Mapping

import grpc
import torch

from distill.call_errors import TeacherCallError, TeacherGoneError, call_error, rpc_error
from distill.teacher_client import TeacherClient, decode_response, encode_request
from distill.types import ChunkRequest
from protos.kserve import REFUSAL_METADATA, service_pb2

_STREAM_INFER = "/inference.GRPCInferenceService/ModelStreamInfer"
MAX_STREAM_IN_FLIGHT = 96


def stream_error(message: str, answer: service_pb2.ModelInferResponse) -> TeacherCallError:
    """The typed error for a stream answer's `error_message`, by the code's name it starts with."""
    name, sep, details = message.partition(": ")
    code = grpc.StatusCode[name] if sep and name in grpc.StatusCode.__members__ else grpc.StatusCode.UNKNOWN
    facts = answer.parameters.get(REFUSAL_METADATA)
    metadata = ((REFUSAL_METADATA, facts.string_param),) if facts is not None else None
    return call_error(code, details if code != grpc.StatusCode.UNKNOWN else message, metadata)


class _Stream:
    """One open ModelStreamInfer call, the requests waiting on it by wire id, its writer and reader.

    Requests are written by one task of the stream's own, in the order they were queued: a request
    given up (deadline, a hedge's loser) never cancels a write, which would cancel the whole stream
    with every other request on it. The first of the two tasks to see the stream fail ends it:
    every request still waiting on it fails with that failure."""

    def __init__(self, call: grpc.aio.StreamStreamCall) -> None:
        self.call = call
        self.waiting: dict[str, asyncio.Future[service_pb2.ModelInferResponse]] = {}
        self.outbox: asyncio.Queue[bytes] = asyncio.Queue()
        self.ended = False
        self.writer = asyncio.create_task(self._write(), name="teacher-stream-writer")
        self.reader = asyncio.create_task(self._read(), name="teacher-stream-reader")

    def end(self, error: Exception) -> None:
        """The stream is over: fail what waits on it (once; later calls find nothing waiting)."""
        self.ended = True
        for waiter in self.waiting.values():
            if not waiter.done():
                waiter.set_exception(error)

    async def _write(self) -> None:
        try:
            while True:
                await self.call.write(await self.outbox.get())
        except asyncio.CancelledError:
            raise
        except grpc.aio.AioRpcError as e:
            self.end(rpc_error(e))
        except Exception as e:  # grpc's UsageError or InvalidStateError: the call ended under the write
            self.end(TeacherCallError(grpc.StatusCode.UNAVAILABLE, f"the stream to the teacher ended: {e!r}"))
        self.call.cancel()  # the reader then ends too

    async def _read(self) -> None:
        error: Exception
        try:
            while True:
                message = await self.call.read()
                if message is grpc.aio.EOF:
                    error = TeacherCallError(grpc.StatusCode.UNAVAILABLE, "the teacher ended the stream")
                    break
                answer = message.infer_response
                waiter = self.waiting.get(answer.id)
                if waiter is None or waiter.done():
                    continue  # its waiter gave up (deadline, cancel): dropped
                if message.error_message:
                    waiter.set_exception(stream_error(message.error_message, answer))
                else:
                    waiter.set_result(answer)
        except grpc.aio.AioRpcError as e:
            error = rpc_error(e)
        except Exception as e:  # grpc's UsageError once the channel closed, or an answer we cannot read
            error = TeacherGoneError(f"the stream to the teacher failed: {e}")
        except asyncio.CancelledError:
            error = TeacherGoneError("the stream to the teacher was closed: the teacher left")
            raise
        finally:
            self.end(error)
            self.writer.cancel()

    async def close(self) -> None:
        self.call.cancel()
        self.writer.cancel()
        self.reader.cancel()
        await asyncio.gather(self.writer, self.reader, return_exceptions=True)


class StreamingTeacherClient(TeacherClient):
    """`TeacherClient` whose `infer` sends on one ModelStreamInfer stream (module docstring)."""

    def __init__(self, endpoint: str, credentials: grpc.ChannelCredentials | None = None,
                 server_name: str | None = None, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(endpoint, credentials, server_name, headers)
        self._open = self._channel.stream_stream(
            _STREAM_INFER, request_serializer=None,
            response_deserializer=service_pb2.ModelStreamInferResponse.FromString)
        self._stream: _Stream | None = None
        self._ids = itertools.count()
        self._closed = False

    def _current(self) -> _Stream:
        if self._closed:
            raise TeacherGoneError(f"the client of {self.endpoint} was closed: the teacher left")
        if self._stream is None or self._stream.ended:
            self._stream = _Stream(self._open(metadata=self._metadata))
        return self._stream

    async def infer(self, request: ChunkRequest, timeout: float) -> dict[str, torch.Tensor]:
        """One chunk on the stream, with this client's deadline; the checked outputs."""
        stream = self._current()
        if len(stream.waiting) >= MAX_STREAM_IN_FLIGHT:
            return await super().infer(request, timeout)
        wire_id = f"{request.request_id}#{next(self._ids)}"
        waiter: asyncio.Future[service_pb2.ModelInferResponse] = asyncio.get_running_loop().create_future()
        stream.waiting[wire_id] = waiter
        stream.outbox.put_nowait(encode_request(request, wire_id))
        try:
            async with asyncio.timeout(timeout):
                answer = await waiter
        except TimeoutError:
            raise TeacherCallError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                   f"no answer on the stream within {timeout:g} s") from None
        finally:
            stream.waiting.pop(wire_id, None)
            if not waiter.done():
                waiter.cancel()
            elif not waiter.cancelled():
                waiter.exception()  # read: a failure set as this request gave up is not logged
        return decode_response(answer, request)

    async def close(self) -> None:
        self._closed = True
        stream, self._stream = self._stream, None
        if stream is not None:
            await stream.close()
        await super().close()
