"""Malformed ModelInfer / ModelStreamInfer requests against one live teacher server.

For every case: the reply is OK (and then the outputs are right) or one of INVALID_ARGUMENT /
NOT_FOUND / RESOURCE_EXHAUSTED (oversize only) with a message; never INTERNAL or UNKNOWN, never a
dead server; a valid request right after still succeeds.

Each test runs once per kind of case (each mutation of wire.KINDS, each place of a field bomb), so
every kind is covered whatever hypothesis draws: by default 10 cases of each kind (FUZZ_EXAMPLES,
default 1000, over 100) and 220 raw garbage messages; the nightly-style run, ten times as many:
``FUZZ_EXAMPLES=10000 .venv/bin/pytest tests/fuzz``.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator

import grpc
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protos.kserve import service_pb2
from teacher_server import BatchingConfig, ServerConfig
from tests.fuzz.wire import (
    AFFINE,
    ALLOWED_ERRORS,
    EXAMPLES,
    KINDS,
    MAX_MESSAGE,
    MODEL,
    WHERE,
    Case,
    check_outputs,
    field_bombs,
    garbage_bytes,
    infer_cases,
    parses,
    valid_request,
)
from tests.servers import ServerThread

pytestmark = pytest.mark.timeout(600)

PER_KIND = max(5, EXAMPLES // 100)
FUZZ = settings(max_examples=PER_KIND, deadline=None, derandomize=False,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
INFER = "/inference.GRPCInferenceService/ModelInfer"
STREAM = "/inference.GRPCInferenceService/ModelStreamInfer"


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    cfg = ServerConfig(model="tests.models:affine", name=MODEL, device="cpu", max_message_mb=1,
                       batching=BatchingConfig(max_batch_size=8, max_queue_delay_us=0))
    with ServerThread(cfg) as srv:
        yield srv


@pytest.fixture(scope="module")
def channel(server: ServerThread) -> Iterator[grpc.Channel]:
    # The client may send more than the server takes: oversize must be refused by the server.
    with grpc.insecure_channel(server.url, options=[("grpc.max_send_message_length", 4 * MAX_MESSAGE)]) as ch:
        yield ch


def _unary(channel: grpc.Channel) -> grpc.UnaryUnaryMultiCallable:
    return channel.unary_unary(INFER, request_serializer=None,
                               response_deserializer=service_pb2.ModelInferResponse.FromString)


def _probe(channel: grpc.Channel) -> None:
    """A valid request succeeds with the right outputs: the server is alive and serving."""
    data, x = valid_request()
    resp = _unary(channel)(data, timeout=10)
    y = torch.frombuffer(bytearray(resp.raw_output_contents[0]), dtype=torch.float32).reshape(2, 4)
    with torch.inference_mode():
        assert torch.allclose(y, AFFINE(x), atol=1e-5)


def _check_unary(channel: grpc.Channel, case: Case) -> None:
    try:
        resp = _unary(channel)(case.data, timeout=10)
    except grpc.RpcError as e:
        code, details = e.code(), e.details() or ""
        assert code in ALLOWED_ERRORS, f"{code} for mutations {case.mutations}: {details}"
        assert details.strip(), f"{code} without a message for mutations {case.mutations}"
        oversize = len(case.data) > MAX_MESSAGE
        assert (code == grpc.StatusCode.RESOURCE_EXHAUSTED) == oversize, (
            f"{code} for a {len(case.data)}-byte message (limit {MAX_MESSAGE}): {details}")
        assert not case.valid, f"a valid request was refused: {code} {details}"
    else:
        check_outputs(case.data, resp)
    _probe(channel)


@pytest.mark.parametrize("kind", KINDS)
@FUZZ
@given(data=st.data())
def test_model_infer_mutated_requests(channel: grpc.Channel, kind: str, data: st.DataObject) -> None:
    _check_unary(channel, data.draw(infer_cases(allow_oversize=True, kind=kind)))


@settings(FUZZ, max_examples=PER_KIND * len(KINDS))
@given(case=garbage_bytes)
def test_model_infer_raw_garbage_bytes(channel: grpc.Channel, case: Case) -> None:
    _check_unary(channel, case)


@pytest.mark.parametrize("where", WHERE)
@FUZZ
@given(data=st.data())
def test_model_infer_field_bombs(channel: grpc.Channel, where: str, data: st.DataObject) -> None:
    _check_unary(channel, data.draw(field_bombs(allow_oversize=True, where=where)))


def _stream(channel: grpc.Channel, messages: list[bytes], timeout: float = 15.0) -> list[
        service_pb2.ModelStreamInferResponse]:
    """Send ``messages`` on one ModelStreamInfer call; collect one reply per message."""
    call = channel.stream_stream(STREAM, request_serializer=None,
                                 response_deserializer=service_pb2.ModelStreamInferResponse.FromString)
    done = threading.Event()
    replies: queue.Queue[service_pb2.ModelStreamInferResponse] = queue.Queue()

    def requests() -> Iterator[bytes]:
        yield from messages
        done.wait(timeout)  # half-close only after every reply: the stream must stay open meanwhile

    responses = call(requests(), timeout=timeout)
    try:
        for r in responses:
            replies.put(r)
            if replies.qsize() == len(messages):
                break
    finally:
        done.set()
        responses.cancel()
    return list(replies.queue)


ANY_CASE = infer_cases() | garbage_bytes | field_bombs()


@pytest.mark.parametrize("kind", [*KINDS[:-1], "garbage", "bomb"])  # oversize ends a stream: tested below
@FUZZ
@given(data=st.data())
def test_model_stream_infer_mutated_requests(channel: grpc.Channel, kind: str, data: st.DataObject) -> None:
    """Fuzzed requests and a valid one on one stream: every request gets one answer, errors come
    as error_message with an allowed code, and the stream (and the valid request) go on. The first
    request is of ``kind``, 0-2 more of any kind follow."""
    first = {"garbage": garbage_bytes, "bomb": field_bombs()}.get(kind, infer_cases(kind=kind))
    cases = [data.draw(first), *data.draw(st.lists(ANY_CASE, max_size=2))]
    probe, _ = valid_request(3, rid="probe-0123456789")
    replies = _stream(channel, [c.data for c in cases] + [probe])
    assert len(replies) == len(cases) + 1, f"{len(replies)} replies for {len(cases) + 1} requests"
    by_id: dict[str, list[Case]] = {}
    for c in cases:
        header = parses(c.data)
        by_id.setdefault(header.id if header is not None else "", []).append(c)
    probes = [r for r in replies if r.infer_response.id == "probe-0123456789"]
    assert len(probes) == 1 and not probes[0].error_message, probes
    check_outputs(probe, probes[0].infer_response)
    for r in replies:
        if r is probes[0]:
            continue
        mine = by_id.get(r.infer_response.id, [])
        if r.error_message:
            code = r.error_message.split(":", 1)[0]
            assert code in {c.name for c in ALLOWED_ERRORS} - {"RESOURCE_EXHAUSTED"}, r.error_message
            assert not (len(mine) == 1 and mine[0].valid), f"a valid request was refused: {r.error_message}"
        elif len(mine) == 1:
            check_outputs(mine[0].data, r.infer_response)
        else:  # an id shared by several of our requests: only the shape of the answer is checkable
            assert r.infer_response.outputs, r
    _probe(channel)


def test_oversized_stream_message_is_resource_exhausted_and_server_serves_on(channel: grpc.Channel) -> None:
    """Oversize on a stream ends that stream with RESOURCE_EXHAUSTED; other calls are unaffected."""
    with pytest.raises(grpc.RpcError) as e:
        _stream(channel, [b"\x00" * (MAX_MESSAGE + 10)])
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.value
    _probe(channel)


NEVER_READ = settings(FUZZ, max_examples=max(5, EXAMPLES // 50))


@NEVER_READ
@given(cases=st.lists(ANY_CASE, min_size=1, max_size=30),
       streams=st.integers(1, 3))
def test_streams_that_never_read(server: ServerThread, channel: grpc.Channel, cases: list[Case], streams: int) -> None:
    """Streams that send fuzzed requests (and valid ones) and never read an answer: other clients
    are served meanwhile, and once the streams are cancelled the server holds nothing for them (no
    request in flight, no unsent answer bytes)."""
    valid, _ = valid_request(8, rid="never-read")
    messages = [c.data for c in cases] + [valid] * 8
    stop = threading.Event()

    def requests() -> Iterator[bytes]:
        yield from messages
        stop.wait(30)

    call = channel.stream_stream(STREAM, request_serializer=None, response_deserializer=None)
    calls = [call(requests(), timeout=30) for _ in range(streams)]
    try:
        _probe(channel)
    finally:
        stop.set()
        for c in calls:
            c.cancel()
    srv = server.server
    assert srv is not None and srv.grpc_service is not None
    deadline = time.monotonic() + 20
    while (srv.in_flight or srv.grpc_service.unsent_bytes) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert srv.in_flight == 0, f"{srv.in_flight} requests still in flight after the streams were cancelled"
    assert srv.grpc_service.unsent_bytes == 0, f"{srv.grpc_service.unsent_bytes} unsent bytes still held"
    _probe(channel)
