"""Engines as teachers: DistillReader calls vLLM and SGLang in their own protocols and gets the
tensors a KServe teacher-server returns for the same batch.

Three engines serve the same tiny Llama (`tests.hf_models.save_vllm_llama`): a real vLLM (one start
for the module, from the cached vLLM venv: tests/vllm_env.py), teacher-server's own
`/v1/completions` named as a vLLM engine, and the SGLang-shaped server (tests/sglang_server.py).
Every value is checked against the model run in process and against a KServe teacher-server's
answer over gRPC; refusals carry the engine's own words; a stopped engine fails over to the other
teacher of the same static list with every batch delivered once. `distill register` puts the
real vLLM in a real etcd, with its load, and withdraws it at SIGTERM.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import torch
from aiohttp import web

from discovery import open_registry
from discovery.base import TeacherRecord
from discovery.local_etcd import LocalEtcd
from discovery.static import parse_teachers
from distill import BatchRejectedError, DistillReader
from distill.call_errors import (
    RequestRejectedError,
    TeacherCallError,
    TeacherGoneError,
    TeacherOverloadedError,
)
from distill.checks import teacher_list
from distill.engines import SglangClient, VllmClient, engine_client
from distill.engines.rows import ENGINE_OUTPUTS
from distill.types import ChunkRequest, FieldArray
from teacher_server import ServerConfig
from teacher_server.registrar.load import read_figures
from tests.etcd_fixtures import unique_service
from tests.hf_models import VLLM_CONTEXT, VLLM_VOCAB, load_reference, reference_logprobs, save_vllm_llama
from tests.registrar_runs import HTTP_CAPABILITIES, entries, run_registrar, stop_proc, until
from tests.servers import ServerThread, teacher_process
from tests.sglang_server import SglangServer, sglang_server
from tests.vllm_env import VllmServer, vllm_server

# The real vLLM's fixture builds the cached vLLM venv on a machine that lacks it (pip, minutes) and
# starts vLLM (about two minutes on CPU): the first test that uses it pays both.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]

K = 5
TOLERANCE = 1e-4
READER = {"inputs": ["INPUT_IDS", "ATTENTION_MASK"], "outputs": ["LOGITS"], "top_k": K, "logprobs": True,
          "token_logprobs": True, "topk_tail": True, "timeout": 120.0}
ENGINES = ("vllm", "teacher-server-as-vllm", "sglang")


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("engine-llama")
    save_vllm_llama(directory)
    return directory


@pytest.fixture(scope="module")
def reference(llama_dir: Path) -> torch.nn.Module:
    return load_reference(llama_dir)


@pytest.fixture(scope="module")
def kserve(llama_dir: Path) -> Iterator[ServerThread]:
    """teacher-server: KServe v2 over gRPC, and its /v1/completions on the HTTP port."""
    config = ServerConfig(model=f"hf:{llama_dir}", name="llama", device="cpu", http_port=0, max_logprobs=20)
    with ServerThread(config) as s:
        yield s


@pytest.fixture(scope="module")
def sglang(llama_dir: Path) -> Iterator[SglangServer]:
    with sglang_server(llama_dir, context=VLLM_CONTEXT, vocab=VLLM_VOCAB) as s:
        yield s


@pytest.fixture(scope="module")
def vllm(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    with vllm_server(llama_dir, served_model_name="llama", log_dir=tmp_path_factory.mktemp("vllm-log")) as s:
        yield s


def teachers(engine: str, request: pytest.FixtureRequest) -> str:
    """The static list naming `engine` (its server started by its fixture)."""
    if engine == "vllm":
        return f"vllm://{request.getfixturevalue('vllm').address}"
    if engine == "sglang":
        return f"sglang://{request.getfixturevalue('sglang').address}"
    server = request.getfixturevalue("kserve").server
    return f"vllm://127.0.0.1:{server.http_port}"


def batches() -> list[dict[str, np.ndarray]]:
    """Padded token batches: full rows, right padding, left padding, a one-token row, and a row
    that is all padding (which no engine sees; zeros in the answer)."""
    rng = np.random.default_rng(7)
    out = []
    for b in range(3):
        ids = rng.integers(3, VLLM_VOCAB, size=(5, 11)).astype(np.int64)
        mask = np.ones_like(ids)
        mask[1, 7:] = 0
        mask[2, :4] = 0
        mask[3, 1:] = 0
        if b == 1:
            mask[4] = 0
        ids[mask == 0] = 0
        out.append({"INPUT_IDS": ids, "ATTENTION_MASK": mask})
    return out


def expected(model: torch.nn.Module, batch: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """What a teacher-server returns, computed here: per row's marked span, position t holds the
    top-k of log_softmax at t, the tail mass outside them and log p(token t + 1) (0 at the span's
    last position); zeros on padding."""
    ids, mask = batch["INPUT_IDS"], batch["ATTENTION_MASK"]
    rows, width = ids.shape
    out = {"LOGITS_TOPK_VALUES": torch.zeros(rows, width, K), "LOGITS_TOPK_INDICES": torch.zeros(rows, width, K,
                                                                                                  dtype=torch.int32),
           "LOGITS_TOPK_TAIL": torch.zeros(rows, width), "LOGITS_TOKEN_LOGPROBS": torch.zeros(rows, width)}
    for r in range(rows):
        marked = np.flatnonzero(mask[r])
        if not len(marked):
            continue
        a, b = int(marked[0]), int(marked[-1]) + 1
        prompt = ids[r, a:b].tolist()
        logp = reference_logprobs(model, prompt)
        values, indices = torch.topk(logp, K, dim=-1)
        out["LOGITS_TOPK_VALUES"][r, a:b] = values
        out["LOGITS_TOPK_INDICES"][r, a:b] = indices.to(torch.int32)
        out["LOGITS_TOPK_TAIL"][r, a:b] = (1.0 - values.exp().sum(-1)).clamp(min=0.0)
        nxt = torch.tensor(prompt[1:])
        out["LOGITS_TOKEN_LOGPROBS"][r, a:b - 1] = logp[:-1].gather(-1, nxt.unsqueeze(-1)).squeeze(-1)
    return out


def read(teacher_list: str, data: list[dict[str, np.ndarray]], **options: Any) -> list[dict[str, torch.Tensor]]:
    with DistillReader(data, **{"teachers": teacher_list, **READER, **options}) as reader:
        return [outputs for _, outputs in reader]


@pytest.fixture(scope="module")
def kserve_answers(kserve: ServerThread) -> list[dict[str, torch.Tensor]]:
    return read(kserve.url, batches())


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert set(got) == set(want), what
    for name, value in want.items():
        assert got[name].shape == value.shape and got[name].dtype == value.dtype, (what, name)
        if value.dtype == torch.int32:
            assert torch.equal(got[name], value), (what, name)
        else:
            assert torch.allclose(got[name], value, atol=TOLERANCE, rtol=0), (
                what, name, float((got[name] - value).abs().max()))


@pytest.mark.parametrize("engine", ENGINES)
def test_an_engine_answers_what_the_model_and_a_kserve_teacher_answer(
        engine: str, request: pytest.FixtureRequest, reference: torch.nn.Module,
        kserve_answers: list[dict[str, torch.Tensor]]) -> None:
    data = batches()
    answers = read(teachers(engine, request), data)
    assert len(answers) == len(data)
    for i, (got, batch, kserve_got) in enumerate(zip(answers, data, kserve_answers, strict=True)):
        assert_same(got, expected(reference, batch), f"{engine} batch {i} vs the model")
        assert_same(got, kserve_got, f"{engine} batch {i} vs the KServe teacher")


@pytest.mark.parametrize("engine", ["vllm", "teacher-server-as-vllm"])
def test_a_batch_of_one_sequence_is_scored_as_the_model_scores_it(
        engine: str, request: pytest.FixtureRequest, reference: torch.nn.Module) -> None:
    """One prompt goes to vLLM as a flat list of ids (a list of lists otherwise): the answer is
    read the same way."""
    data = [{name: value[r:r + 1] for name, value in batches()[0].items()} for r in (0, 1, 3)]
    answers = read(teachers(engine, request), data)
    assert len(answers) == len(data)
    for i, (got, batch) in enumerate(zip(answers, data, strict=True)):
        assert_same(got, expected(reference, batch), f"{engine} one-row batch {i} vs the model")


@pytest.mark.parametrize("engine", ["vllm", "teacher-server-as-vllm"])
def test_vllm_reports_the_ranks_a_kserve_teacher_reports(
        engine: str, request: pytest.FixtureRequest, kserve: ServerThread) -> None:
    data = batches()[:1]
    want = read(kserve.url, data, token_ranks=True)[0]["LOGITS_TOKEN_RANKS"]
    got = read(teachers(engine, request), data, token_ranks=True)[0]["LOGITS_TOKEN_RANKS"]
    assert torch.equal(got, want)
    assert int(got.max()) > K  # some prompt token lies outside the top-k: its rank comes from the engine


@pytest.mark.parametrize("engine", ENGINES)
def test_a_400_from_the_engine_rejects_the_batch_with_its_message(engine: str, request: pytest.FixtureRequest) -> None:
    data = batches()[:2]
    data[1]["INPUT_IDS"][0, 2] = VLLM_VOCAB + 4000  # outside the vocabulary: every engine answers 400
    with DistillReader(data, teachers=teachers(engine, request), **READER) as reader:
        it = iter(reader)
        _, first = next(it)
        assert first["LOGITS_TOPK_VALUES"].shape == (5, 11, K)
        with pytest.raises(BatchRejectedError) as caught:
            next(it)
    assert str(VLLM_VOCAB + 4000) in str(caught.value)


def test_what_an_engine_cannot_compute_is_refused_naming_it(sglang: SglangServer) -> None:
    data = batches()[:1]
    listed = f"sglang://{sglang.address}"
    served = sglang.requests
    refused: list[tuple[dict[str, Any], str]] = [
        ({"token_ranks": True}, "token_ranks"),
        ({"top_k": 0, "topk_tail": None, "token_logprobs": None}, "dense"),
        ({"temperature": 2.0}, "temperature 2.0"),
        ({"logprobs": None}, "raw logits"),
    ]
    for options, missing in refused:
        with DistillReader(data, teachers=listed, **{**READER, **options}) as reader, \
                pytest.raises(BatchRejectedError) as caught:
            next(iter(reader))
        assert missing in str(caught.value), options
    assert sglang.requests == served  # refused before any call


def test_a_stopped_engine_fails_over_to_the_next_teacher_of_the_list(
        llama_dir: Path, kserve: ServerThread, reference: torch.nn.Module) -> None:
    data = batches() * 4
    with sglang_server(llama_dir, context=VLLM_CONTEXT, vocab=VLLM_VOCAB) as engine, \
            DistillReader(data, teachers=f"sglang://{engine.address},{kserve.url}", prefetch=2, **READER) as reader:
        got = []
        for i, (batch, outputs) in enumerate(reader):
            got.append((batch, outputs))
            if i == 1:
                deadline = time.monotonic() + 30
                while engine.requests == 0 and time.monotonic() < deadline:
                    time.sleep(0.05)
                assert engine.requests > 0  # the engine served part of the stream before it stopped
                engine.stop()
        served = engine.requests
    assert len(got) == len(data)
    assert served < len(data)  # the rest went to the KServe teacher
    for (batch, outputs), sent in zip(got, data, strict=True):
        assert np.array_equal(batch["INPUT_IDS"], sent["INPUT_IDS"])  # in order, each once
        assert_same(outputs, expected(reference, sent), "after failover")


async def _status_app(status: int, body: str) -> tuple[web.AppRunner, int]:
    async def answer(request: web.Request) -> web.Response:
        return web.Response(status=status, text=body, content_type="application/json")

    app = web.Application()
    app.router.add_post("/generate", answer)
    app.router.add_post("/v1/completions", answer)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, int(site._server.sockets[0].getsockname()[1])  # type: ignore[union-attr]


def _chunk() -> ChunkRequest:
    ids = np.array([[5, 6, 7]], dtype=np.int64)
    return ChunkRequest("m", "", "r1", {"INPUT_IDS": FieldArray(ids, "INT64")}, 0, 1, ("LOGITS",),
                        dict(ENGINE_OUTPUTS), {"top_k": 2, "logprobs": True})


@pytest.mark.parametrize(("status", "verdict", "code"), [
    (400, RequestRejectedError, grpc.StatusCode.INVALID_ARGUMENT),
    (422, RequestRejectedError, grpc.StatusCode.INVALID_ARGUMENT),
    (429, TeacherOverloadedError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (503, TeacherOverloadedError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (500, TeacherCallError, grpc.StatusCode.INTERNAL),
])
@pytest.mark.parametrize("protocol", ["vllm", "sglang"])
def test_http_statuses_are_the_verdicts_the_grpc_client_gives(
        status: int, verdict: type[Exception], code: grpc.StatusCode, protocol: str) -> None:
    async def main() -> None:
        runner, port = await _status_app(status, json.dumps({"error": {"message": "the engine says no"}}))
        client = engine_client(protocol, f"127.0.0.1:{port}")
        try:
            with pytest.raises(verdict) as caught:
                await client.infer(_chunk(), 10.0)
            assert type(caught.value) is verdict and caught.value.code == code  # type: ignore[attr-defined]
            assert "the engine says no" in str(caught.value)
        finally:
            await client.close()
            await runner.cleanup()

    asyncio.run(asyncio.wait_for(main(), 60))


def test_a_refused_connection_is_unavailable_and_metadata_comes_from_the_engine(sglang: SglangServer,
                                                                                  kserve: ServerThread) -> None:
    async def main() -> None:
        runner, port = await _status_app(200, "{}")
        await runner.cleanup()  # nothing listens there any more
        gone = engine_client("vllm", f"127.0.0.1:{port}")
        with pytest.raises(TeacherCallError) as caught:
            await gone.infer(_chunk(), 10.0)
        assert caught.value.code == grpc.StatusCode.UNAVAILABLE
        await gone.close()
        assert kserve.server is not None
        for client in (SglangClient(sglang.address, _http(sglang.address)),
                       VllmClient("x", _http(f"127.0.0.1:{kserve.server.http_port}"))):
            meta = await client.fetch_metadata(None, "", 10.0)
            assert meta.outputs["LOGITS"].shape == (-1, -1) and meta.batches_by_length and meta.max_batch_size == 256
            assert meta.model_name in (str(sglang.model_dir), "llama")
            assert await client.ready(meta.model_name, 10.0)
            await client.close()

    asyncio.run(asyncio.wait_for(main(), 60))


def test_static_lists_name_engines_item_by_item() -> None:
    listed = "vllm://127.0.0.1:8000,127.0.0.1:9898,sglang://h:30000/teachers/math/,kserve://h:9899,vllm://127.0.0.1:8000"
    assert teacher_list(listed) == "vllm://127.0.0.1:8000,127.0.0.1:9898,sglang://h:30000/teachers/math,h:9899"
    records = [t.record() for t in parse_teachers("static://" + listed)]
    assert [(r.protocol, r.endpoint, r.path) for r in records] == [
        ("vllm", "127.0.0.1:8000", ""), ("", "127.0.0.1:9898", ""), ("sglang", "h:30000", "/teachers/math"),
        ("", "h:9899", "")]
    for bad, said in (("triton://h:1", "unknown teacher scheme"), ("vllm://h", "has no port"),
                      ("kserve://h:1/x", "no path prefix"), ("etcd://h:2379", "--distill_registry")):
        with pytest.raises(ValueError, match=said):
            teacher_list(bad)


def _http(address: str) -> Any:
    from distill.engines.http import EngineHTTP

    return EngineHTTP(f"http://{address}")


def test_engine_sessions_close(sglang: SglangServer) -> None:
    async def main() -> None:
        client = engine_client("sglang", sglang.address)
        assert await client.ready("", 10.0)
        await client.close()
        with pytest.raises(TeacherGoneError, match="closed"):
            await client.ready("", 10.0)

    asyncio.run(asyncio.wait_for(main(), 60))


def test_registered_engine_records_are_called_in_their_protocols(
        sglang: SglangServer, kserve: ServerThread, reference: torch.nn.Module) -> None:
    """Records in a real etcd naming `protocol` sglang and vllm (with an HTTP `path` of ""): the
    reader calls each in its protocol, and both answer every batch alike."""
    assert kserve.server is not None
    service = unique_service("engines")
    records = [TeacherRecord(instance_id="sglang-0", endpoint=sglang.address, protocol="sglang"),
               TeacherRecord(instance_id="vllm-0", endpoint=f"127.0.0.1:{kserve.server.http_port}", protocol="vllm")]
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True, name="registrations")
    thread.start()
    with LocalEtcd() as etcd:
        registry = open_registry(etcd.address)
        registrations = [registry.register(service, r, ttl=10) for r in records]
        try:
            for r in registrations:
                asyncio.run_coroutine_threadsafe(r.__aenter__(), loop).result(30)
            before = sglang.requests
            data = batches() * 2
            answers = read("", data, teachers=None, registry=etcd.address, service=service)
            assert sglang.requests > before  # the SGLang record was called over HTTP, not gRPC
            for got, sent in zip(answers, data, strict=True):
                assert_same(got, expected(reference, sent), "registered engines")
        finally:
            for r in registrations:
                asyncio.run_coroutine_threadsafe(r.__aexit__(None, None, None), loop).result(30)
            asyncio.run_coroutine_threadsafe(registry.close(), loop).result(30)
            loop.call_soon_threadsafe(loop.stop)
            thread.join(10)
            loop.close()


def test_a_mixed_pool_of_a_real_vllm_and_a_teacher_server_loses_nothing_to_a_sigkill(
        vllm: VllmServer, llama_dir: Path, reference: torch.nn.Module, tmp_path: Path) -> None:
    """One service in a real etcd: a real vLLM put there by `distill register`, and a teacher-server
    process registered by itself. Both serve the stream until the teacher-server is SIGKILLed mid-run;
    every batch still arrives once, in order, equal to the model, the rest answered by vLLM."""
    service = unique_service("mixed")
    data = batches() * 8
    with LocalEtcd() as etcd:
        log = tmp_path / "registrar.log"
        with log.open("wb") as out:
            registrar = subprocess.Popen(
                [sys.executable, "-m", "distill.cli", "register", "--engine", "vllm", "--url",
                 f"http://{vllm.address}", "--model", "llama", "--registry", etcd.address, "--service", service,
                 "--probe-interval", "0.2", "--ttl", "3"], stdout=out, stderr=subprocess.STDOUT,
                cwd=Path(__file__).resolve().parent.parent)
        try:
            args = ["--model", f"hf:{llama_dir}", "--name", "llama", "--device", "cpu", "--registry", etcd.address,
                    "--service", service, "--ttl", "3"]
            with teacher_process(args, tmp_path, timeout=300) as (teacher, _), DistillReader(
                    data, registry=etcd.address, service=service, prefetch=2, **READER) as reader:
                deadline = time.monotonic() + 60
                while reader.stats().teachers_in_use < 2:  # both members, before the stream starts
                    assert time.monotonic() < deadline, (reader.stats().teachers, log.read_text()[-2000:])
                    time.sleep(0.1)
                got = []
                for i, (batch, outputs) in enumerate(reader):
                    got.append((batch, outputs))
                    if i == 3:
                        teacher.kill()  # SIGKILL: no drain, no deregistration
        finally:
            registrar.terminate()
            registrar.wait(30)
    assert len(got) == len(data)
    for (batch, outputs), sent in zip(got, data, strict=True):
        assert np.array_equal(batch["INPUT_IDS"], sent["INPUT_IDS"])  # in order, each once
        assert_same(outputs, expected(reference, sent), "mixed pool after a SIGKILL")


def test_a_real_vllm_is_registered_with_its_load_then_withdrawn_at_sigterm(vllm: VllmServer, tmp_path: Path) -> None:
    """`distill register` beside a real vLLM: the record its probes build, the load read from vLLM's
    own /metrics, and a SIGTERM that withdraws the record once those metrics say nothing is in flight."""
    service = unique_service("reg-real-vllm")
    reg_log = tmp_path / "registrar.log"
    with LocalEtcd() as etcd:
        registrar = run_registrar(["--engine", "vllm", "--url", vllm.url, "--model", "llama", "--registry",
                                   etcd.address, "--service", service, "--instance-id", "r-real"], reg_log)
        try:
            entry = until(lambda: entries(etcd, service).get("r-real"), 60, "the real vLLM's record", reg_log)
            rec = entry.record
            assert (rec.endpoint, rec.protocol, rec.path, rec.model_name) == (vllm.address, "vllm", "", "llama")
            assert rec.capabilities == HTTP_CAPABILITIES
            loaded = until(lambda: entries(etcd, service)["r-real"].load, 30, "a published load", reg_log)
            assert loaded.in_flight == 0 and loaded.queue_depth == 0 and not loaded.draining

            with urllib.request.urlopen(vllm.url + "/metrics", timeout=30) as resp:
                figures = read_figures("vllm", resp.read().decode())
            assert (figures.running, figures.waiting) == (0.0, 0.0)
            assert figures.usage is not None and figures.finished is not None

            registrar.send_signal(signal.SIGTERM)
            assert registrar.wait(60) == 0
            assert entries(etcd, service) == {}
            assert "drained: nothing in flight" in reg_log.read_text(), "the real metrics said nothing was in flight"
        finally:
            stop_proc(registrar)
