"""`distill register` against real engines and a real etcd: teacher-server serving a tiny Hugging
Face Llama, standing in for vLLM where an engine must be killed and restarted (its HTTP port speaks
vLLM's /health, /v1/models and /v1/completions) and itself a KServe v2 engine; the SGLang-shaped
server of tests/sglang_server.py. The metrics parser also reads vLLM /metrics text recorded while
requests ran (tests/record_vllm_metrics.py). The registrar and the engines are separate processes,
stopped by signals as an operator would. A real vLLM's registration is in test_engine_clients.py,
beside the other tests that start one: one vLLM start for all of them."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TypeVar

import pytest
import tritonclient.grpc as tg
from google.protobuf import json_format

from discovery.local_etcd import LocalEtcd
from distill.cli import main as distill_main
from protos import registry_pb2
from teacher_server import launch
from teacher_server.registrar.engine import parse_engine
from teacher_server.registrar.errors import EngineNotReady, RegistrarUsageError
from teacher_server.registrar.kserve_probe import CAPABILITIES_PARAMETER
from teacher_server.registrar.load import LoadTracker, read_figures
from teacher_server.registrar.probes import ProbeOptions, make_probe
from tests.etcd_fixtures import arun, unique_service
from tests.hf_models import VLLM_CONTEXT, VLLM_VOCAB, save_llama, save_vllm_llama
from tests.registrar_runs import (
    HTTP_CAPABILITIES,
    entries,
    run_registrar,
    spawn,
    stop_proc,
    until,
)
from tests.sglang_server import sglang_server

# Engines load in processes of their own: minutes on a loaded 2-core machine.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

_T = TypeVar("_T")
REPO = Path(__file__).resolve().parent.parent
DATA = Path(__file__).parent / "data"


@pytest.fixture(scope="module")
def etcd() -> Iterator[LocalEtcd]:
    with LocalEtcd() as server:
        yield server


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("registrar-llama")
    save_llama(directory, tokenizer=True)
    return directory


@pytest.fixture(scope="module")
def vllm_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("registrar-vllm-llama")
    save_vllm_llama(directory)
    return directory


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _teacher_args(llama_dir: Path, *, port: str, http_port: str, metrics_port: str | None = None) -> list[str]:
    args = [sys.executable, "-m", "teacher_server", "--model", f"hf:{llama_dir}", "--name", "llama", "--device", "cpu",
            "--instances", "1", "--host", "127.0.0.1", "--port", port, "--http-port", http_port, "--drain-grace", "2"]
    return args + (["--metrics-port", metrics_port] if metrics_port is not None else [])


class MetricsServer:
    """A real HTTP server on loopback whose /metrics answers `text`, which the test sets: an
    engine's in-flight work, held where the test wants it."""

    def __init__(self, text: str) -> None:
        self.text = text
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = owner.text.encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                pass

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}/metrics"
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True, name="test-metrics")
        self._thread.start()

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(5)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with contextlib.suppress(ChildProcessError):
        done, _ = os.waitpid(pid, os.WNOHANG)  # a child of the test is reaped here; others raise
        return done == 0
    return True


def test_vllm_engine_is_registered_only_while_it_answers(etcd: LocalEtcd, llama_dir: Path, tmp_path: Path) -> None:
    service = unique_service("reg-vllm")
    port, http_port, metrics_port = (str(_free_port()) for _ in range(3))
    reg_log, engine_log = tmp_path / "registrar.log", tmp_path / "engine.log"
    registrar = run_registrar(["--engine", "vllm", "--url", f"http://127.0.0.1:{http_port}", "--metrics-url",
                               f"http://127.0.0.1:{metrics_port}/metrics", "--registry", etcd.address, "--service",
                               service, "--instance-id", "r-vllm"], reg_log)
    engine: subprocess.Popen[bytes] | None = None
    try:
        until(lambda: "waiting for the vllm engine" in reg_log.read_text(), 60, "the registrar probes", reg_log)
        assert entries(etcd, service) == {}, "no record before the engine answers"

        engine = spawn(_teacher_args(llama_dir, port=port, http_port=http_port, metrics_port=metrics_port),
                       engine_log)
        entry = until(lambda: entries(etcd, service).get("r-vllm"), 120, "the record once ready", reg_log, engine_log)
        rec = entry.record
        assert (rec.endpoint, rec.protocol, rec.path, rec.model_name) == (f"127.0.0.1:{http_port}", "vllm", "", "llama")
        assert rec.capabilities == HTTP_CAPABILITIES
        assert [(t.name, t.datatype, list(t.shape)) for t in rec.inputs] == [("INPUT_IDS", "INT64", [-1]),
                                                                             ("ATTENTION_MASK", "INT64", [-1])]
        assert [(t.name, t.datatype, list(t.shape)) for t in rec.outputs] == [("LOGITS", "FP32", [-1, -1])]
        assert (rec.max_batch_size, rec.batches_by_length, rec.device, rec.tls) == (256, True, "engine", False)

        loaded = until(lambda: entries(etcd, service)["r-vllm"].load, 30, "a published load", reg_log)
        assert loaded.instance_id == "r-vllm" and not loaded.draining and loaded.in_flight == 0
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as resp:
            figures = read_figures("kserve", resp.read().decode())
        assert figures.in_flight == 0 and figures.waiting == 0 and figures.finished is not None

        engine.kill()
        engine.wait(10)
        until(lambda: entries(etcd, service) == {}, 30, "the record withdrawn after SIGKILL", reg_log)
        assert registrar.poll() is None, "the registrar waits for the engine to come back"

        engine = spawn(_teacher_args(llama_dir, port=port, http_port=http_port, metrics_port=metrics_port),
                       engine_log)
        back = until(lambda: entries(etcd, service).get("r-vllm"), 120, "the record after a restart", reg_log,
                     engine_log)
        assert back.record.endpoint == f"127.0.0.1:{http_port}" and back.record.protocol == "vllm"
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/v1/models", timeout=10) as resp:
            card = json.loads(resp.read())["data"][0]
        assert back.record.fingerprint and back.record.fingerprint == card["fingerprint"]

        registrar.send_signal(signal.SIGTERM)
        assert registrar.wait(60) == 0, launch.log_tail(reg_log, 40)
        assert entries(etcd, service) == {}
    finally:
        stop_proc(registrar)
        if engine is not None:
            stop_proc(engine)


def test_sglang_probe_record_health_and_metrics(vllm_llama_dir: Path) -> None:
    async def probe_while(server_url: str, stop: Callable[[], None]) -> registry_pb2.TeacherRecord:
        probe = make_probe(parse_engine("sglang", server_url + "/"), ProbeOptions(max_top_k=5, timeout=10))
        try:
            record = await probe.ready()
            await probe.healthy()
            text = await probe.metrics()
            assert text is not None
            figures = read_figures("sglang", text)
            assert (figures.running, figures.waiting) == (0.0, 0.0)
            await asyncio.to_thread(stop)
            with pytest.raises(EngineNotReady, match="no answer"):
                await probe.healthy()
            assert await probe.metrics() is None
            return record
        finally:
            await probe.close()

    with sglang_server(vllm_llama_dir, context=VLLM_CONTEXT, vocab=VLLM_VOCAB) as server:
        rec = arun(probe_while(f"http://{server.address}", server.stop), timeout=60)
    assert (rec.endpoint, rec.protocol, rec.path, rec.model_name) == (server.address, "sglang", "", str(vllm_llama_dir))
    assert rec.capabilities == registry_pb2.Capabilities(
        declared=True, max_top_k=5, token_logprobs=True, text_prompts=True, tail=True)


def test_sigterm_withdraws_first_then_waits_for_in_flight_work_then_stops_the_engine(
        etcd: LocalEtcd, llama_dir: Path, tmp_path: Path) -> None:
    service = unique_service("reg-drain")
    http_port = _free_port()
    ready = tmp_path / "ready.json"
    reg_log = tmp_path / "registrar.log"
    metrics = MetricsServer('# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{model_name="llama"} 2\n'
                            '# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{model_name="llama"} 1\n')
    command = [*_teacher_args(llama_dir, port="0", http_port="{port}"), "--ready-file", str(ready)]
    registrar = run_registrar(["--engine", "vllm", "--url", f"http://127.0.0.1:{http_port}", "--metrics-url",
                               metrics.url, "--registry", etcd.address, "--service", service, "--instance-id",
                               "r-drain", "--drain-timeout", "60", "--stop-grace", "10", "--", *command], reg_log)
    try:
        until(lambda: entries(etcd, service).get("r-drain"), 120, "the record of the engine child", reg_log)
        loaded = until(lambda: entries(etcd, service)["r-drain"].load, 30, "a published load", reg_log)
        assert (loaded.in_flight, loaded.queue_depth, loaded.busy_fraction) == (3, 1, 1.0)
        engine_pid = int(json.loads(ready.read_text())["pid"])

        registrar.send_signal(signal.SIGTERM)
        until(lambda: entries(etcd, service) == {}, 30, "the record withdrawn at SIGTERM", reg_log)
        until(lambda: "waiting up to 60 s" in reg_log.read_text(), 30, "the drain begins", reg_log)
        assert registrar.poll() is None, "the registrar waits while the engine has work in flight"
        assert _alive(engine_pid), "the engine serves its in-flight work after the record is gone"

        metrics.text = metrics.text.replace("} 2\n", "} 0\n").replace("} 1\n", "} 0\n")
        assert registrar.wait(60) == 0
        until(lambda: not _alive(engine_pid), 30, "the engine stopped after the drain", reg_log)
        assert "drained: nothing in flight" in reg_log.read_text()
    finally:
        stop_proc(registrar)
        metrics.close()


def test_kserve_engine_child_record_from_its_metadata_and_exit_when_it_dies(
        etcd: LocalEtcd, llama_dir: Path, tmp_path: Path) -> None:
    service = unique_service("reg-kserve")
    port = _free_port()
    ready = tmp_path / "ready.json"
    reg_log = tmp_path / "registrar.log"
    command = [*_teacher_args(llama_dir, port="{port}", http_port="0"), "--ready-file", str(ready)]
    registrar = run_registrar(["--engine", "kserve", "--url", f"grpc://127.0.0.1:{port}", "--registry", etcd.address,
                               "--service", service, "--instance-id", "r-kserve", "--", *command], reg_log)
    try:
        rec = until(lambda: entries(etcd, service).get("r-kserve"), 120, "the kserve record", reg_log).record
        client = tg.InferenceServerClient(f"127.0.0.1:{port}")
        meta = client.get_model_metadata("llama")
        config = client.get_model_config("llama").config
        client.close()
        assert (rec.endpoint, rec.protocol, rec.path, rec.model_name) == (f"127.0.0.1:{port}", "kserve", "", "llama")
        assert [(t.name, t.datatype, list(t.shape)) for t in rec.inputs] == [
            (t.name, t.datatype, list(t.shape)[1:]) for t in meta.inputs]
        assert [(t.name, t.datatype, list(t.shape)) for t in rec.outputs] == [
            (t.name, t.datatype, list(t.shape)[1:]) for t in meta.outputs]
        assert rec.max_batch_size == config.max_batch_size > 0
        # teacher-server declares its capabilities in its ModelConfig, and the registrar copies them.
        declared = config.parameters[CAPABILITIES_PARAMETER].string_value
        assert rec.capabilities == json_format.Parse(declared, registry_pb2.Capabilities())
        assert rec.capabilities.max_top_k > 0 and rec.capabilities.score_ids and rec.capabilities.declared

        os.kill(int(json.loads(ready.read_text())["pid"]), signal.SIGKILL)
        assert registrar.wait(30) == 1
        assert entries(etcd, service) == {}
        assert "the engine exited on its own" in reg_log.read_text()
    finally:
        stop_proc(registrar)


def test_bad_engine_or_url_exits_2_and_an_engine_never_ready_exits_1(etcd: LocalEtcd,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    base = ["register", "--registry", etcd.address, "--service", unique_service("reg-bad")]
    assert distill_main([*base, "--engine", "tgi", "--url", "http://127.0.0.1:1"]) == 2
    assert "use one of kserve, vllm, sglang" in capsys.readouterr().err
    assert distill_main([*base, "--engine", "vllm", "--url", "127.0.0.1:8000"]) == 2
    assert "not an HTTP URL; use http://HOST:PORT" in capsys.readouterr().err
    assert distill_main([*base, "--engine", "kserve", "--url", "http://127.0.0.1:8001"]) == 2
    assert "a KServe v2 engine is a gRPC address" in capsys.readouterr().err
    closed = _free_port()
    assert distill_main([*base, "--engine", "vllm", "--url", f"http://127.0.0.1:{closed}", "--ready-timeout",
                         "0.5", "--probe-timeout", "0.5"]) == 1
    assert "not ready within --ready-timeout 0.5 s" in capsys.readouterr().err


def test_engine_urls_give_the_record_address_path_and_metrics() -> None:
    a = parse_engine("vllm", "https://teachers.example:8443/math/")
    assert (a.endpoint, a.path, a.tls, a.base_url, a.metrics_url) == (
        "teachers.example:8443", "/math", True, "https://teachers.example:8443/math",
        "https://teachers.example:8443/math/metrics")
    b = parse_engine("sglang", "http://[::1]:30000", "http://[::1]:30001/metrics")
    assert (b.endpoint, b.path, b.tls, b.metrics_url) == ("[::1]:30000", "", False, "http://[::1]:30001/metrics")
    c = parse_engine("KServe", "10.0.0.5:8001")
    assert (c.kind, c.endpoint, c.tls, c.base_url, c.metrics_url) == ("kserve", "10.0.0.5:8001", False, None, None)
    assert parse_engine("kserve", "grpcs://h:8001").tls
    for kind, url in (("vllm", "http://h:1/?x=1"), ("vllm", "http://user@h:1"), ("kserve", "grpc://h"),
                      ("sglang", "")):
        with pytest.raises(RegistrarUsageError):
            parse_engine(kind, url)


def _recorded(name: str) -> str:
    return (DATA / name).read_text()


def test_load_from_real_vllm_metrics() -> None:
    busy = read_figures("vllm", _recorded("vllm_metrics_busy.txt"))
    idle = read_figures("vllm", _recorded("vllm_metrics_idle.txt"))
    for figures in (busy, idle):
        assert figures.usage is not None and 0.0 <= figures.usage <= 1.0
    assert busy.running is not None and busy.waiting is not None and busy.finished is not None
    assert idle.finished is not None
    assert (idle.running, idle.waiting) == (0.0, 0.0)
    assert busy.running + busy.waiting > 0
    assert idle.finished > busy.finished

    tracker = LoadTracker("vllm", "v-1")
    tracker.update(_recorded("vllm_metrics_busy.txt"), now=100.0)
    load = tracker.load()
    assert (load.in_flight, load.queue_depth) == (int(busy.running + busy.waiting), int(busy.waiting))
    assert load.busy_fraction == pytest.approx(busy.usage)
    tracker.update(_recorded("vllm_metrics_idle.txt"), now=102.0)
    assert tracker.load().samples_per_s == pytest.approx((idle.finished - busy.finished) / 2.0)
    assert tracker.load().in_flight == 0


def test_missing_or_broken_metrics_keep_what_is_known() -> None:
    tracker = LoadTracker("sglang", "s-1")
    tracker.update("# TYPE sglang:num_running_reqs gauge\nsglang:num_running_reqs 2\n", now=1.0)
    load = tracker.load()
    assert (load.in_flight, load.queue_depth, load.busy_fraction, load.samples_per_s) == (2, 0, 1.0, 0.0)
    tracker.update("this is { not prometheus", now=2.0)
    tracker.update(None, now=3.0)
    assert tracker.load().in_flight == 2 and tracker.failed_scrapes == 2
    nothing = LoadTracker("vllm", "v-2")
    nothing.update("# TYPE other gauge\nother 1\n", now=1.0)
    assert nothing.in_flight is None and nothing.load().in_flight == 0


def test_a_counter_that_goes_back_is_a_restart_not_a_negative_rate() -> None:
    def text(n: int) -> str:
        return f"# TYPE vllm:request_success counter\nvllm:request_success_total{{finished_reason=\"stop\"}} {n}\n"

    tracker = LoadTracker("vllm", "v-3")
    tracker.update(text(100), now=0.0)
    tracker.update(text(130), now=1.0)
    assert tracker.load().samples_per_s == pytest.approx(30.0)
    tracker.update(text(5), now=2.0)
    assert tracker.load().samples_per_s == 0.0

