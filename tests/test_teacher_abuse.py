"""Abuse of a real teacher-server process, each case with its bound (issue #13, teacher side).

Every test runs `python -m teacher_server` and measures what the abuse costs the server: RSS in
MB, error codes and their sizes, what the log says; each one fails on the code before the fix.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from torch import nn

from protos.kserve import serialize_infer_request, service_pb2
from teacher_server.launch import TeacherProcess
from teacher_server.spec import ModelIO
from tests.servers import REPO

pytestmark = pytest.mark.timeout(180)

INFER = "/inference.GRPCInferenceService/ModelInfer"
STREAM = "/inference.GRPCInferenceService/ModelStreamInfer"
WIDE = 65536  # FP32 answer of one sample: 256 KiB


class Wide(nn.Module):
    """X: FP32[-1, 8] -> Y: FP32[-1, 65536], every answer 256 KiB per sample."""

    io_spec = ModelIO.parse(["X:FP32:8"], [f"Y:FP32:{WIDE}"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.repeat(1, WIDE // 8)


def wide() -> Wide:
    return Wide()


def _request(rid: str = "r", model: str = "wide", n: int = 1, **params: service_pb2.InferParameter) -> bytes:
    req = service_pb2.ModelInferRequest(model_name=model, id=rid)
    req.inputs.add(name="X", datatype="FP32", shape=[n, 8])
    for k, v in params.items():
        req.parameters[k].CopyFrom(v)
    return serialize_infer_request(req, [torch.arange(n * 8, dtype=torch.float32).numpy().tobytes()])


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


@pytest.fixture
def wide_server() -> Iterator[TeacherProcess]:
    args = ["--model", "tests.test_teacher_abuse:wide", "--name", "wide", "--device", "cpu", "--instances", "1",
            "--max-batch-size", "8", "--max-queue-delay-us", "0"]
    with TeacherProcess(args, cwd=REPO, env={"PYTHONPATH": str(REPO)}, ready_timeout=90, stop_grace=10) as t:
        yield t


def _unary(channel: grpc.Channel) -> grpc.UnaryUnaryMultiCallable:
    return channel.unary_unary(INFER, request_serializer=None,
                               response_deserializer=service_pb2.ModelInferResponse.FromString)


NEVER_READ_REQUESTS = 600  # 150 MiB of answers: the unbounded server grew by about that much


def test_stream_that_never_reads_is_bounded_and_others_are_served(wide_server: TeacherProcess) -> None:
    """A client sends 600 requests with 256 KiB answers on one stream and reads none: the server
    stops reading that stream once its unsent answers fill the stream's budget, so its RSS grows by
    a bounded amount (not ~150 MB), and a normal client is served meanwhile."""
    pid = wide_server.pid
    base = _rss_mb(pid)
    done = threading.Event()
    count = 0

    def requests() -> Iterator[bytes]:
        nonlocal count
        for i in range(NEVER_READ_REQUESTS):
            count += 1
            yield _request(f"s{i}")
        done.wait(120)  # then keep the stream open, unread, until the test is done with it

    with grpc.insecure_channel(wide_server.endpoint) as bad, grpc.insecure_channel(wide_server.endpoint) as good:
        call = bad.stream_stream(STREAM, request_serializer=None, response_deserializer=None)
        responses = call(requests(), timeout=120)  # never iterated: nothing is read
        try:
            # Wait until the server stopped taking requests or took them all (bounded in time):
            # RSS stops moving once the stream is stalled.
            peak, still, deadline = base, 0, time.monotonic() + 60
            while still < 10 and time.monotonic() < deadline:
                time.sleep(0.2)
                rss = _rss_mb(pid)
                still = still + 1 if rss <= peak + 1 else 0
                peak = max(peak, rss)
            # A normal client is served while the bad stream is stalled.
            for i in range(5):
                resp = _unary(good)(_request(f"good{i}"), timeout=10)
                assert len(resp.raw_output_contents[0]) == WIDE * 4
            peak = max(peak, _rss_mb(pid))
        finally:
            done.set()
            responses.cancel()
    growth = peak - base
    print(f"never-reading stream: {count} requests sent by the client, RSS {base:.0f} -> {peak:.0f} MB "
          f"(+{growth:.0f} MB; {NEVER_READ_REQUESTS} answers are {NEVER_READ_REQUESTS / 4:.0f} MiB)")
    assert growth < 64, f"RSS grew by {growth:.0f} MB for a stream that never reads"
