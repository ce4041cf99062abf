"""ModelStreamInfer's caps, each shown reached and holding on a real gRPC server: at most 128
requests read ahead of what a stream has sent, reading stopped while 16 MiB of one stream's answers
(or 128 MiB of all streams') wait unsent.

The clients here never read their answers, except the one that measures the read-ahead cap. The
paced clients send one request every 20 ms, so each answer is usually computed before the next
request is read and the byte caps, not the read-ahead cap, are what stops the stream. The server's own figures
(`InferenceService.unsent_bytes`, `TeacherServer.in_flight`) are read from the test's thread.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import grpc
import pytest
import torch
from torch import nn

from protos.kserve import serialize_infer_request, service_pb2
from teacher_server import BatchingConfig, ServerConfig
from teacher_server.grpc_service import MAX_UNSENT_BYTES, STREAM_MAX_IN_FLIGHT, STREAM_MAX_UNSENT_BYTES
from teacher_server.spec import ModelIO
from tests.servers import ServerThread

pytestmark = pytest.mark.timeout(180)

STREAM = "/inference.GRPCInferenceService/ModelStreamInfer"
WIDE = 65536
ANSWER = WIDE * 4  # bytes of one answer: 256 KiB
MIB = 1 << 20


class Wide(nn.Module):
    """X: FP32[-1, 8] -> Y: FP32[-1, 65536]: every answer is 256 KiB per sample."""

    io_spec = ModelIO.parse(["X:FP32:8"], [f"Y:FP32:{WIDE}"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.repeat(1, WIDE // 8)


def wide() -> Wide:
    return Wide()


class SlowSmall(nn.Module):
    """X: FP32[-1, 8] -> Y: FP32[-1, 8], 50 ms per batch: requests pile up in the server."""

    io_spec = ModelIO.parse(["X:FP32:8"], ["Y:FP32:8"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.05)
        return x + 1


def slow_small() -> SlowSmall:
    return SlowSmall()


def _server(model: str) -> ServerThread:
    return ServerThread(ServerConfig(model=model, name="m", device="cpu", instances=1,
                                     batching=BatchingConfig(max_batch_size=8, max_queue_delay_us=0,
                                                             max_queue_size=4096)))


def _request(rid: str) -> bytes:
    req = service_pb2.ModelInferRequest(model_name="m", id=rid)
    req.inputs.add(name="X", datatype="FP32", shape=[1, 8])
    return serialize_infer_request(req, [torch.arange(8, dtype=torch.float32).numpy().tobytes()])


class Streams:
    """Streams that send `n` requests each (every `pace_s` seconds) and then stay open, unread,
    until closed; `sent` counts what the clients offered."""

    def __init__(self, url: str, count: int, n: int, pace_s: float) -> None:
        self._done = threading.Event()
        self._channels = [grpc.insecure_channel(url) for _ in range(count)]
        self.sent = [0] * count
        self.calls = [ch.stream_stream(STREAM, request_serializer=None, response_deserializer=None)(
            self._requests(k, n, pace_s), timeout=120) for k, ch in enumerate(self._channels)]

    def _requests(self, k: int, n: int, pace_s: float) -> Iterator[bytes]:
        for i in range(n):
            if self._done.is_set():
                return
            self.sent[k] += 1
            yield _request(f"{k}-{i}")
            if pace_s:
                self._done.wait(pace_s)
        self._done.wait(120)

    def close(self) -> None:
        self._done.set()
        for call in self.calls:
            call.cancel()
        for ch in self._channels:
            ch.close()


def _plateau(read: Callable[[], float], at_least: float, still_s: float = 1.0, timeout: float = 60.0) -> float:
    """Poll `read` (bounded) until it reaches `at_least` and then holds for `still_s`; the value."""
    deadline = time.monotonic() + timeout
    value, since = read(), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.05)
        now = read()
        if now != value:
            value, since = now, time.monotonic()
        elif value >= at_least and time.monotonic() - since >= still_s:
            return value
    raise AssertionError(f"no plateau at or above {at_least} within {timeout} s: last {value}")


def test_a_stream_reads_at_most_128_requests_ahead_of_its_answers() -> None:
    """A client sends 400 requests at once at a model that takes 50 ms per batch of 8 and reads its
    answers: the server's in-flight count reaches 128 (the cap is what holds it) and never passes
    it, and every request is answered."""
    with _server("tests.test_stream_caps:slow_small") as s:
        assert s.server is not None
        server = s.server
        answered = 0
        peak = 0
        stop = threading.Event()

        def sample() -> None:
            nonlocal peak
            for _ in range(10_000):  # bounded: ends when the stream is done
                if stop.is_set():
                    return
                peak = max(peak, server.in_flight)
                time.sleep(0.005)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        with grpc.insecure_channel(s.url) as ch:
            call = ch.stream_stream(STREAM, request_serializer=None,
                                    response_deserializer=service_pb2.ModelStreamInferResponse.FromString)
            for resp in call(iter([_request(f"r{i}") for i in range(400)]), timeout=120):
                assert not resp.error_message, resp.error_message
                answered += 1
        stop.set()
        sampler.join(10)
    print(f"read-ahead cap: peak in flight {peak}, answered {answered}")
    assert answered == 400
    assert peak == STREAM_MAX_IN_FLIGHT, f"peak in flight {peak}, the cap is {STREAM_MAX_IN_FLIGHT}"


def test_a_paced_stream_that_never_reads_stops_at_its_16_mib() -> None:
    """Requests every 20 ms, answers of 256 KiB never read: the stream's unsent answers reach 16 MiB
    and stay there (a few answers over, below the 32 MiB its 128 read-ahead slots would hold), and
    the server stops taking requests while the client offers more."""
    with _server("tests.test_stream_caps:wide") as s:
        assert s.server is not None and s.server.grpc_service is not None
        service = s.server.grpc_service
        streams = Streams(s.url, count=1, n=300, pace_s=0.02)
        try:
            held = _plateau(lambda: service.unsent_bytes, STREAM_MAX_UNSENT_BYTES)
            offered = streams.sent[0]
        finally:
            streams.close()
    print(f"one paced stream: {held / MIB:.2f} MiB unsent at the plateau, {offered} requests offered")
    # Reached, and stopped by the byte cap: under the 32 MiB its 128 read-ahead slots alone would
    # let it hold (an answer or a few over 16 MiB on an idle machine; more read ahead on a busy one).
    assert STREAM_MAX_UNSENT_BYTES <= held < STREAM_MAX_IN_FLIGHT * ANSWER, held / MIB
    assert offered > held // ANSWER + 16, f"the client offered only {offered}: the cap was not what stopped it"


def test_paced_streams_that_never_read_stop_at_128_mib_in_all() -> None:
    """Twenty such streams (a request every 50 ms each) could hold 320 MiB by their own caps; all
    together stop reading at 128 MiB. They hold a little more than that: 131 MiB on an idle
    machine, 176-201 MiB seen on a busy one, whose server falls behind and reads requests before
    their answers exist to be charged. Cancelling them gives the shared budget back (else every
    later stream would stall)."""
    streams_n = 20
    assert streams_n * STREAM_MAX_UNSENT_BYTES > MAX_UNSENT_BYTES  # the shared cap binds first
    with _server("tests.test_stream_caps:wide") as s:
        assert s.server is not None and s.server.grpc_service is not None
        service = s.server.grpc_service
        streams = Streams(s.url, count=streams_n, n=200, pace_s=0.05)
        try:
            held = _plateau(lambda: service.unsent_bytes, MAX_UNSENT_BYTES)
            offered = sum(streams.sent)
        finally:
            streams.close()
        deadline = time.monotonic() + 30
        while service.unsent_bytes and time.monotonic() < deadline:  # bounded: the cancels are handled
            time.sleep(0.05)
        after = service.unsent_bytes
    print(f"{streams_n} paced streams: {held / MIB:.2f} MiB unsent at the plateau, {offered} requests offered, "
          f"{after / MIB:.2f} MiB once they were cancelled")
    assert after == 0, f"cancelled streams still hold {after / MIB:.2f} MiB of the shared budget"
    # Reached, and stopped by the shared cap: under the 320 MiB the per-stream caps alone allow.
    assert MAX_UNSENT_BYTES <= held < streams_n * STREAM_MAX_UNSENT_BYTES, held / MIB
    assert offered > held // ANSWER + 5 * streams_n, f"the clients offered only {offered}"


def test_a_stream_that_sends_everything_at_once_holds_at_most_128_answers() -> None:
    """The worst case the byte caps cannot stop: 600 requests arrive before the first answer is
    computed, so the stream reads its 128 and computes them all. Its unsent answers stay at or below
    128 answers (here 32 MiB), and no more requests are read while they wait."""
    with _server("tests.test_stream_caps:wide") as s:
        assert s.server is not None and s.server.grpc_service is not None
        service = s.server.grpc_service
        streams = Streams(s.url, count=1, n=600, pace_s=0.0)
        try:
            held = _plateau(lambda: service.unsent_bytes, STREAM_MAX_UNSENT_BYTES)
        finally:
            streams.close()
    print(f"one unpaced stream: {held / MIB:.2f} MiB unsent at the plateau")
    assert STREAM_MAX_UNSENT_BYTES <= held <= STREAM_MAX_IN_FLIGHT * ANSWER, held / MIB
