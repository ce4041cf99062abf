"""Teacher server as a process: load, drain on SIGTERM with requests in flight, model files, CLI."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
import tritonclient.grpc as tg
import tritonclient.grpc.aio as tga
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.utils import InferenceServerException

from protos.kserve import service_pb2, service_pb2_grpc
from teacher_server import ModelIO, ServerConfig, TeacherServer
from tests.models import Affine, affine
from tests.servers import REPO, ServerThread, teacher_process


def _x(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, 8), dtype=np.float32)


def _input(x: np.ndarray) -> tg.InferInput:
    i = tg.InferInput("X", list(x.shape), "FP32")
    i.set_data_from_numpy(x)
    return i


def _expected(x: np.ndarray) -> np.ndarray:
    with torch.inference_mode():
        return affine()(torch.from_numpy(x)).numpy()


def scrape(metrics_port: int) -> dict[str, float]:
    """The server's /metrics by family name (the first sample of each family)."""
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return {fam.name: float(fam.samples[0].value) for fam in text_string_to_metric_families(text) if fam.samples}


def in_flight(metrics_port: int) -> float:
    """The server's in-flight request count, as its /metrics endpoint reports it."""
    return scrape(metrics_port)["teacher_in_flight_request_count"]


async def until(check: Callable[[], Awaitable[bool]], what: str, timeout: float = 30.0) -> None:
    """Poll `check` (bounded in count and time) until it is true; fail naming `what` otherwise."""
    deadline = time.monotonic() + timeout
    for _ in range(int(timeout / 0.02) + 1):
        if await check():
            return
        if time.monotonic() > deadline:
            break
        await asyncio.sleep(0.02)
    raise AssertionError(f"{what}: not true within {timeout} s")


def test_sigterm_drains_in_flight_requests_then_exits_zero(tmp_path: Path) -> None:
    args = ["--model", "tests.models:sleepy", "--name", "slow", "--device", "cpu", "--metrics-port", "0",
            "--max-batch-size", "2", "--max-queue-delay-us", "0", "--drain-grace", "20", "--instances", "1"]
    with teacher_process(args, tmp_path, env={"TEST_SLEEP_MS": "300"}) as (proc, info):
        url = info["endpoint"]

        async def go() -> tuple[list[object], object, int]:
            async with tga.InferenceServerClient(url) as c, grpc.aio.insecure_channel(url) as ch:
                xs = [_x(1, seed=i) for i in range(8)]
                in_flight_tasks = [asyncio.create_task(c.infer("slow", [_input(x)], client_timeout=30)) for x in xs]

                async def all_accepted() -> bool:  # in flight, or already answered
                    m = await asyncio.to_thread(scrape, info["metrics_port"])
                    return m["teacher_in_flight_request_count"] + m["nv_inference_request_success"] == 8

                await until(all_accepted, "all 8 requests accepted")
                proc.send_signal(signal.SIGTERM)
                health_stub = health_pb2_grpc.HealthStub(ch)

                async def not_serving() -> bool:
                    resp = await health_stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
                    return bool(resp.status == health_pb2.HealthCheckResponse.NOT_SERVING)

                await until(not_serving, "health NOT_SERVING after SIGTERM")
                health = await health_stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
                late: object
                try:
                    late = await c.infer("slow", [_input(_x(1))], client_timeout=10)
                except InferenceServerException as e:
                    late = e
                results = await asyncio.gather(*in_flight_tasks, return_exceptions=True)
                return [*zip(xs, results, strict=True)], late, health.status

        pairs, late, health_status = asyncio.run(asyncio.wait_for(go(), 60))
        for x, r in pairs:  # type: ignore[misc]
            assert not isinstance(r, BaseException), f"in-flight request failed during drain: {r}"
            assert np.allclose(r.as_numpy("Y"), _expected(x), atol=1e-5)
        assert health_status == health_pb2.HealthCheckResponse.NOT_SERVING
        assert isinstance(late, InferenceServerException) and late.status() == "StatusCode.UNAVAILABLE"
        assert "draining" in late.message()
        assert proc.wait(30) == 0


def test_drain_grace_running_out_answers_unavailable_and_exits(tmp_path: Path) -> None:
    """A forward pass far longer than --drain-grace: the process leaves within about the grace,
    not when the pass ends, and the request gets UNAVAILABLE (students re-route), not a hang."""
    args = ["--model", "tests.models:stuck", "--name", "slow", "--device", "cpu", "--metrics-port", "0",
            "--max-batch-size", "1", "--drain-grace", "1", "--instances", "1"]
    with teacher_process(args, tmp_path, env={"TEST_STUCK_S": "120"}) as (proc, info):

        async def go() -> object:
            async with tga.InferenceServerClient(info["endpoint"]) as c:
                running = asyncio.create_task(c.infer("slow", [_input(_x(1))], client_timeout=100))

                async def admitted() -> bool:
                    return await asyncio.to_thread(in_flight, info["metrics_port"]) == 1

                await until(admitted, "the request in flight")
                proc.send_signal(signal.SIGTERM)
                try:
                    return await running
                except InferenceServerException as e:
                    return e

        failure = asyncio.run(asyncio.wait_for(go(), 60))
        assert isinstance(failure, InferenceServerException), f"the 120 s request did not fail: {failure}"
        assert failure.status() == "StatusCode.UNAVAILABLE", failure
        assert "retry on another teacher" in (failure.message() or ""), failure
        # The pass would run for two minutes; the process must not wait for it.
        assert proc.wait(30) == 0


def test_sigint_on_idle_server_exits_zero_quickly(tmp_path: Path) -> None:
    with teacher_process(["--model", "tests.models:affine", "--name", "a", "--device", "cpu"], tmp_path) as (
        proc, info,
    ):
        with tg.InferenceServerClient(info["endpoint"]) as c:
            assert np.allclose(c.infer("a", [_input(_x(2))]).as_numpy("Y"), _expected(_x(2)), atol=1e-5)
        start = time.monotonic()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(20) == 0
        assert time.monotonic() - start < 15


def test_health_not_serving_and_infer_unavailable_while_loading(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TEST_LOAD_S", "2")

    async def go() -> tuple[int, grpc.StatusCode, int]:
        server = TeacherServer(ServerConfig(model="tests.models:slow_load", name="s", device="cpu"))
        starting = asyncio.create_task(server.start())
        for _ in range(200):  # the port is bound before the model loads
            if server.port:
                break
            await asyncio.sleep(0.01)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
            health = health_pb2_grpc.HealthStub(ch)
            loading = (await health.Check(health_pb2.HealthCheckRequest(), timeout=5)).status
            req = service_pb2.ModelInferRequest(model_name="s")
            try:
                await service_pb2_grpc.GRPCInferenceServiceStub(ch).ModelInfer(req, timeout=5)
                code = grpc.StatusCode.OK
            except grpc.aio.AioRpcError as e:
                code = e.code()
            await asyncio.wait_for(starting, 30)
            ready = (await health.Check(health_pb2.HealthCheckRequest(service="s"), timeout=5)).status
        await server.stop(1)
        return loading, code, ready

    loading, code, ready = asyncio.run(go())
    assert loading == health_pb2.HealthCheckResponse.NOT_SERVING
    assert code == grpc.StatusCode.UNAVAILABLE
    assert ready == health_pb2.HealthCheckResponse.SERVING


def test_torchscript_file_with_flag_declared_io(tmp_path: Path) -> None:
    path = tmp_path / "affine.ts"
    torch.jit.save(torch.jit.script(Affine()), str(path))
    args = ["--model", str(path), "--name", "ts", "--device", "cpu", "--input", "X:FP32:8", "--output", "Y:FP32:4"]
    with teacher_process(args, tmp_path) as (_proc, info), tg.InferenceServerClient(info["endpoint"]) as c:
        x = _x(5, seed=3)
        assert np.allclose(c.infer("ts", [_input(x)]).as_numpy("Y"), _expected(x), atol=1e-5)


def test_exported_program_with_config_file(tmp_path: Path) -> None:
    batch = torch.export.Dim("batch", min=1, max=4096)
    program = torch.export.export(Affine(), (torch.zeros(2, 8),), dynamic_shapes={"x": {0: batch}})
    path = tmp_path / "affine.pt2"
    torch.export.save(program, str(path))
    config = tmp_path / "model.json"
    config.write_text(json.dumps({
        "inputs": [{"name": "X", "datatype": "FP32", "shape": [8]}],
        "outputs": [{"name": "Y", "datatype": "FP32", "shape": [4]}],
        "max_batch_size": 32,
    }))
    cfg = ServerConfig(model=str(path), name="pt2", device="cpu", io=ModelIO.parse(["X:FP32:8"], ["Y:FP32:4"]))
    with ServerThread(cfg) as s, tg.InferenceServerClient(s.url) as c:
        x = _x(7, seed=4)
        assert np.allclose(c.infer("pt2", [_input(x)]).as_numpy("Y"), _expected(x), atol=1e-5)
    args = ["--model", str(path), "--name", "pt2", "--device", "cpu", "--model-config", str(config)]
    with teacher_process(args, tmp_path) as (_proc, info), tg.InferenceServerClient(info["endpoint"]) as c:
        assert c.get_model_config("pt2", as_json=True)["config"]["max_batch_size"] == 32
        x = _x(3, seed=5)
        assert np.allclose(c.infer("pt2", [_input(x)]).as_numpy("Y"), _expected(x), atol=1e-5)


def _cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "teacher_server", *args], cwd=REPO, capture_output=True, check=False,
                          text=True, timeout=timeout)


def test_cli_help_lists_the_flags(capsys: pytest.CaptureFixture[str]) -> None:
    """The command's flags, parsed in this process (--help exits before anything serves)."""
    from teacher_server.cli import main

    with pytest.raises(SystemExit) as exited:
        main(["--help"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--model", "--name", "--host", "--port", "--device", "--max-batch-size", "--max-queue-delay-us",
                 "--max-queue-size", "--instances", "--output-dtype", "--metrics-port", "--log-level",
                 "--max-message-mb", "--registry", "--service"):
        assert flag in out, flag


@pytest.mark.parametrize("args,message", [
    (["--model", "tests.models:undeclared"], "declares no inputs"),
    (["--model", "tests.models:nonexistent"], "has no attribute 'nonexistent'"),
    (["--model", "no_such_module:build"], "cannot import 'no_such_module'"),
    (["--model", "/nonexistent/model.pt2"], "does not exist"),
    (["--model", "tests.models:affine", "--input", "X:FP33:8"], "datatype 'FP33' is not supported"),
    (["--model", "tests.models:affine", "--input", "X:FP32"], "expected NAME:DATATYPE:D1,D2"),
    (["--model", "tests.models:affine", "--registry", "etcd://127.0.0.1:2379"], "--registry needs --service"),
    (["--model", "tests.models:affine", "--instances", "-1"], "--instances must be >= 0"),
    (["--model", "tests.models:affine", "--registry", "etcd://127.0.0.1:2379", "--service", "s",
      "--registry-cert", "/etc/hostname"], "needs both the certificate and its key"),
    (["--model", "tests.models:affine", "--registry", "etcd://127.0.0.1:2379", "--service", "s",
      "--registry-ca-cert", "/nonexistent/ca.pem"], "CA certificate /nonexistent/ca.pem does not exist"),
    (["--model", "tests.models:affine", "--registry", "etcd://", "--service", "s"], "etcd://HOST:PORT"),
    (["--model", "tests.models:affine", "--max-batch-size", "0"], "max_batch_size must be >= 1"),
])
def test_cli_bad_arguments_fail_clearly(args: list[str], message: str, capsys: pytest.CaptureFixture[str],
                                        caplog: pytest.LogCaptureFixture) -> None:
    """Refused before anything serves, so the command's entry point runs in this process: its exit
    status, and the message it prints or logs (a process's log reaches its stderr:
    test_cli_port_in_use_fails)."""
    from teacher_server.cli import main

    code = main([*args, "--device", "cpu", "--port", "0"])
    said = capsys.readouterr().err + caplog.text
    assert code == 2, said
    assert message in said, said


def test_cli_port_in_use_fails(tmp_path: Path) -> None:
    with teacher_process(["--model", "tests.models:affine", "--device", "cpu"], tmp_path) as (_proc, info):
        out = _cli("--model", "tests.models:affine", "--device", "cpu", "--port", str(info["port"]))
        assert out.returncode == 1 and "cannot bind" in out.stderr, out.stderr
