"""Abuse of a real teacher-server process, each case with its bound (issue #13, teacher side).

Every test runs `python -m teacher_server` and measures what the abuse costs the server: RSS in
MB, error codes and their sizes, what the log says; each one fails on the code before the fix.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from torch import nn

from protos.kserve import serialize_infer_request, service_pb2
from teacher_server.grpc_service import STREAM_MAX_UNSENT_BYTES
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
            "--max-batch-size", "8", "--max-queue-delay-us", "0", "--metrics-port", "0"]
    with TeacherProcess(args, cwd=REPO, env={"PYTHONPATH": str(REPO)}, ready_timeout=90, stop_grace=10) as t:
        yield t


def _metric(server: TeacherProcess, family: str) -> float:
    """One unlabelled-by-reason family's value from the server's /metrics (sum over its series)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{server.ready['metrics_port']}/metrics", timeout=10) as r:
        text = r.read().decode()
    if family.endswith("}"):  # one series, labels and all
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(family + " "))
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(family + "{") or line.startswith(family + " "))


def _wait_metric(server: TeacherProcess, family: str, at_least: float, timeout: float = 60.0) -> float:
    """Poll /metrics (bounded) until `family` reaches `at_least`."""
    deadline = time.monotonic() + timeout
    value = _metric(server, family)
    while value < at_least and time.monotonic() < deadline:
        time.sleep(0.05)
        value = _metric(server, family)
    assert value >= at_least, f"{family} = {value} after {timeout} s, waited for {at_least}"
    return value


def _unary(channel: grpc.Channel) -> grpc.UnaryUnaryMultiCallable:
    return channel.unary_unary(INFER, request_serializer=None,
                               response_deserializer=service_pb2.ModelInferResponse.FromString)


NEVER_READ_REQUESTS = 600  # 150 MiB of answers: the unbounded server grew by about that much
CAP_ANSWERS = STREAM_MAX_UNSENT_BYTES // (WIDE * 4)  # 64 answers of 256 KiB fill one stream's budget


def test_stream_that_never_reads_is_bounded_and_others_are_served(wide_server: TeacherProcess) -> None:
    """A client sends 600 requests with 256 KiB answers on one stream and reads none: the server
    stops reading that stream once its unsent answers fill the stream's budget (its own count of
    answers stops, at least the 64 that fill 16 MiB and far below the 600 offered), so its RSS grows
    by a bounded amount (not ~150 MB), and a normal client is served meanwhile."""
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
            # The bound was reached, by the server's own count: it answered enough requests to fill
            # the stream's unsent budget, then stopped reading although the client offered more.
            # Plateau: the count unchanged over a second (a stream still being read answers dozens a
            # second here), polled a bounded number of times.
            answered = _wait_metric(wide_server, "nv_inference_request_success", CAP_ANSWERS)
            for _ in range(30):
                time.sleep(1.0)
                previous, answered = answered, _metric(wide_server, "nv_inference_request_success")
                if answered == previous:
                    break
            assert answered == previous, f"the server still answers the unread stream: {previous:.0f} -> {answered:.0f}"
            assert count == NEVER_READ_REQUESTS and answered < NEVER_READ_REQUESTS / 2, (
                f"the server answered {answered:.0f} of the {count} requests offered: the stream was not stopped")
            # A normal client is served while the bad stream is stalled.
            slowest = 0.0
            for i in range(5):
                t0 = time.monotonic()
                resp = _unary(good)(_request(f"good{i}"), timeout=10)
                slowest = max(slowest, time.monotonic() - t0)
                y = torch.frombuffer(bytearray(resp.raw_output_contents[0]), dtype=torch.float32)
                assert torch.equal(y, torch.arange(8, dtype=torch.float32).repeat(WIDE // 8))
            peak = max(peak, _rss_mb(pid))
        finally:
            done.set()
            responses.cancel()
    growth = peak - base
    print(f"never-reading stream: {count} requests sent by the client, {answered:.0f} answered (the stream's "
          f"budget holds {CAP_ANSWERS}, the rest the transport took), RSS {base:.0f} -> {peak:.0f} MB "
          f"(+{growth:.0f} MB; {NEVER_READ_REQUESTS} answers are {NEVER_READ_REQUESTS / 4:.0f} MiB); "
          f"a normal client meanwhile: slowest of 5 calls {slowest * 1000:.0f} ms")
    assert growth < 64, f"RSS grew by {growth:.0f} MB for a stream that never reads"


def test_client_cancelling_streams_logs_no_error(wide_server: TeacherProcess) -> None:
    """Clients that cancel a stream mid-flight (answers running, unsent, unread) are routine: the
    server logs no ERROR and no traceback, and serves on."""
    with grpc.insecure_channel(wide_server.endpoint) as ch:
        call = ch.stream_stream(STREAM, request_serializer=None,
                                response_deserializer=service_pb2.ModelStreamInferResponse.FromString)
        answered = _metric(wide_server, "nv_inference_request_success")
        for round_ in range(9):
            stop = threading.Event()

            def requests(r: int = round_, stop: threading.Event = stop) -> Iterator[bytes]:
                for i in range(20):
                    yield _request(f"c{r}-{i}", n=1 + r % 4)
                stop.wait(30)

            if round_ % 3 == 2:  # the client half-closes, then cancels while answers are being sent
                responses = call(iter([_request(f"h{round_}-{i}", n=4) for i in range(8)]), timeout=60)
            else:
                responses = call(requests(), timeout=60)
            if round_ % 3 == 1:  # after the first answer; else at once, while the answers are computed
                first = next(responses)
                assert not first.error_message, first.error_message
            elif round_ % 3 == 0:  # once every answer is computed and the server is blocked sending them
                _wait_metric(wide_server, "nv_inference_request_success", answered + 20)
            answered = _metric(wide_server, "nv_inference_request_success")
            responses.cancel()
            stop.set()
        resp = _unary(ch)(_request("after"), timeout=10)
        assert len(resp.raw_output_contents[0]) == WIDE * 4
    assert wide_server.stop() == 0
    log = wide_server.log_path.read_text()
    assert "ERROR" not in log and "Traceback" not in log, log[-3000:]


BURST = 2500  # concurrent unary calls; gRPC's default pending-call limit cancelled ~25% of 3,000


def test_overload_is_resource_exhausted_and_counted(tmp_path: Path) -> None:
    """A burst of 2,500 concurrent calls at a slow teacher with a 64-request queue: every call is
    answered OK or RESOURCE_EXHAUSTED (retry elsewhere), none CANCELLED, and each refusal is counted
    in nv_inference_request_failure{reason="REJECTED"}."""
    args = ["--model", "tests.models:sleepy_20", "--name", "affine", "--device", "cpu", "--instances", "1",
            "--max-batch-size", "8", "--max-queue-size", "64", "--metrics-port", "0"]
    with TeacherProcess(args, cwd=REPO, env={"PYTHONPATH": str(REPO)}, ready_timeout=90, stop_grace=10) as t:

        answers: set[bytes] = set()

        async def burst() -> dict[str, int]:
            codes: dict[str, int] = {}
            async with grpc.aio.insecure_channel(t.endpoint) as ch:
                call = ch.unary_unary(INFER, request_serializer=None, response_deserializer=None)
                data = _request(model="affine", n=1)

                async def one() -> None:
                    try:
                        answers.add(service_pb2.ModelInferResponse.FromString(
                            await call(data, timeout=120)).raw_output_contents[0])
                        code = "OK"
                    except grpc.aio.AioRpcError as e:
                        code = e.code().name
                    codes[code] = codes.get(code, 0) + 1

                await asyncio.gather(*[one() for _ in range(BURST)])
            return codes

        codes = asyncio.run(burst())
        with grpc.insecure_channel(t.endpoint) as ch:
            reference = _unary(ch)(_request(model="affine", n=1), timeout=30).raw_output_contents[0]
        rejected = _metric(t, 'nv_inference_request_failure{model="affine",version="1",reason="REJECTED"}')
        failures = _metric(t, "nv_inference_request_failure")
    print(f"burst of {BURST}: {codes}; REJECTED counted {rejected:.0f}, all failures {failures:.0f}")
    assert set(codes) <= {"OK", "RESOURCE_EXHAUSTED"}, codes
    # The scenario happened: the burst overflowed the 64-request queue (at least a queue's worth of
    # refusals seen by the clients and counted by the server; ~2,100 of 2,500 on an idle machine)
    # before anything is said about the calls that were served.
    assert codes.get("RESOURCE_EXHAUSTED", 0) >= 64, f"the burst did not overload the teacher: {codes}"
    assert rejected == failures == codes["RESOURCE_EXHAUSTED"], (codes, rejected, failures)
    assert codes.get("OK", 0) > 0, codes
    assert answers == {reference}, "an answered call carried the wrong outputs"


@pytest.fixture(scope="module")
def affine_server() -> Iterator[TeacherProcess]:
    args = ["--model", "tests.models:affine", "--name", "affine", "--device", "cpu", "--instances", "1",
            "--log-level", "DEBUG", "--http-port", "0"]
    with TeacherProcess(args, cwd=REPO, env={"PYTHONPATH": str(REPO)}, ready_timeout=90, stop_grace=10) as t:
        yield t


def _param(**kind: object) -> service_pb2.InferParameter:
    p = service_pb2.InferParameter()
    for field, value in kind.items():
        setattr(p, field, value)
    return p


def test_oversized_parameter_value_is_invalid_argument_with_a_short_message(affine_server: TeacherProcess) -> None:
    """A 10 KB output_dtype is refused INVALID_ARGUMENT (not RESOURCE_EXHAUSTED from an echo past
    gRPC's 8 KB metadata limit); the message quotes at most 64 characters of it."""
    bad = _request(model="affine", output_dtype=_param(string_param="F" * 10_000))
    with grpc.insecure_channel(affine_server.endpoint) as ch:
        with pytest.raises(grpc.RpcError) as e:
            _unary(ch)(bad, timeout=10)
        out = ch.unary_unary(INFER, request_serializer=None, response_deserializer=None)
        name_bomb = service_pb2.ModelInferRequest(model_name="m" * 20_000)
        with pytest.raises(grpc.RpcError) as e2:
            out(serialize_infer_request(name_bomb, []), timeout=10)
    details = e.value.details() or ""
    print(f"10 KB output_dtype: {e.value.code().name}, {len(details)}-character message")
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (e.value.code(), details[:200])
    assert "output_dtype must be one of" in details and len(details) < 300, details
    assert e2.value.code() == grpc.StatusCode.NOT_FOUND and len(e2.value.details() or "") < 300


def _with_tensor_parameters(where: str, n: int) -> bytes:
    req = service_pb2.ModelInferRequest(model_name="affine", id="p")
    tensor = req.inputs.add(name="X", datatype="FP32", shape=[1, 8])
    if where == "output":
        tensor = req.outputs.add(name="Y")
    for i in range(n):
        tensor.parameters[f"p{i}"].int64_param = i
    return serialize_infer_request(req, [torch.zeros(8).numpy().tobytes()])


@pytest.mark.parametrize("where", ["input", "output"])
def test_at_most_64_parameters_per_tensor(affine_server: TeacherProcess, where: str) -> None:
    """64 parameters on one tensor are served (unknown names are ignored, as Triton does); 65 are
    refused INVALID_ARGUMENT before any is converted, over gRPC and over HTTP alike."""
    name = "X" if where == "input" else "Y"
    with grpc.insecure_channel(affine_server.endpoint) as ch:
        ok = _unary(ch)(_with_tensor_parameters(where, 64), timeout=10)
        assert len(ok.raw_output_contents[0]) == 16
        with pytest.raises(grpc.RpcError) as e:
            _unary(ch)(_with_tensor_parameters(where, 65), timeout=10)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value
    assert f"{where} {name!r} carries 65 parameters; at most 64" in (e.value.details() or ""), e.value.details()

    def http(n: int) -> tuple[int, str]:
        tensor = {"name": name, "parameters": {f"p{i}": i for i in range(n)}}
        body = {"inputs": [{"name": "X", "datatype": "FP32", "shape": [1, 8], "data": [0.0] * 8}],
                "outputs": [{"name": "Y"}]}
        if where == "input":
            body["inputs"][0].update(tensor)  # type: ignore[index]
        else:
            body["outputs"] = [tensor]
        req = urllib.request.Request(
            f"http://127.0.0.1:{affine_server.ready['http_port']}/v2/models/affine/infer",
            data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as err:
            return err.code, err.read().decode()

    assert http(64)[0] == 200
    status, text = http(65)
    assert status == 400 and "carries 65 parameters; at most 64" in text, (status, text)


@pytest.mark.parametrize(("name", "value", "hint"), [
    ("priority", _param(string_param="high"), "priority must be a non-negative integer"),
    ("priority", _param(int64_param=-1), "priority must be a non-negative integer"),
    ("timeout", _param(int64_param=-5), "timeout must be a non-negative integer of microseconds"),
    ("timeout", _param(double_param=1.5), "timeout must be a non-negative integer of microseconds"),
])
def test_bad_priority_and_timeout_are_refused(affine_server: TeacherProcess, name: str,
                                              value: service_pb2.InferParameter, hint: str) -> None:
    with grpc.insecure_channel(affine_server.endpoint) as ch, pytest.raises(grpc.RpcError) as e:
        _unary(ch)(_request(model="affine", **{name: value}), timeout=10)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and hint in (e.value.details() or ""), e.value


def test_unknown_parameters_are_accepted_and_ignored(affine_server: TeacherProcess) -> None:
    """What Triton's clients send (sequence_id, binary_data_output, perf_analyzer's
    triton_enable_empty_final_response) is served as Triton does, not refused; valid priority and
    timeout are accepted; each ignored name is logged once at DEBUG."""
    params = {"sequence_id": _param(int64_param=7), "binary_data_output": _param(bool_param=True),
              "triton_enable_empty_final_response": _param(bool_param=True),
              "priority": _param(uint64_param=2), "timeout": _param(int64_param=1_000_000)}
    req = service_pb2.ModelInferRequest(model_name="affine", id="u")
    req.inputs.add(name="X", datatype="FP32", shape=[1, 8])
    for k, v in params.items():
        req.parameters[k].CopyFrom(v)
    req.outputs.add(name="Y").parameters["binary_data"].bool_param = True
    data = serialize_infer_request(req, [torch.zeros(8).numpy().tobytes()])
    with grpc.insecure_channel(affine_server.endpoint) as ch:
        for _ in range(3):
            resp = _unary(ch)(data, timeout=10)
            assert resp.outputs[0].name == "Y" and len(resp.raw_output_contents[0]) == 16
    log = affine_server.log_path.read_text()
    for name in ("sequence_id", "binary_data_output", "triton_enable_empty_final_response", "binary_data"):
        assert log.count(f"parameter '{name}'") == 1, (name, log[-2000:])
