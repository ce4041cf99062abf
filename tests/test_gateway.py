"""`distill gateway` as a real process in front of real `teacher-server --model hf:DIR` processes:
its flags; /health (503 with no teacher, 200 once one registers in a real etcd, 503 again once it
leaves), /v1/models, the refusals it answers itself in OpenAI's error form, and its demand in the
registry; TRL's own `VLLMClient.get_sequence_logprobs`, unchanged, through the gateway in front of
two teachers: the top-k and actual-token log-probs equal the in-process model's, and a teacher
SIGKILLed during a run of requests fails none of them; clients at six temperatures at once are all
answered, each at its own temperature; a prompt the teachers refuse gets a 400 in the request's
terms (which prompt, position, id, vocabulary)."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from benchmarks.gateway import stop_gateway
from discovery import open_registry
from discovery.local_etcd import LocalEtcd
from distill import cli as distill_cli
from distill.gateway_cli import config_from_args
from tests.etcd_fixtures import arun, unique_service
from tests.hf_models import load_reference, save_llama
from tests.servers import REPO, teacher_process

transformers = pytest.importorskip("transformers")

START_S = 60.0


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tiny-llama-gateway")
    save_llama(directory)
    return directory


@pytest.fixture(scope="module")
def etcd() -> Iterator[LocalEtcd]:
    with LocalEtcd() as server:
        yield server


def teacher_args(llama_dir: Path, *more: str) -> list[str]:
    return ["--model", f"hf:{llama_dir}", "--name", "tiny-llama", "--device", "cpu", "--http-port", "0", *more]


@contextlib.contextmanager
def gateway_process(args: Sequence[str]) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """`distill gateway --port 0 ARGS` as its own process; yields (process, base URL) once it listens
    (its first stdout line names the port). SIGTERM on exit, SIGKILL if it does not stop."""
    with tempfile.NamedTemporaryFile(prefix="gateway-", suffix=".log", delete=False) as log:
        log_path = log.name
    with open(log_path, "wb") as err:
        proc = subprocess.Popen([sys.executable, "-m", "distill.cli", "gateway", "--port", "0", *args], cwd=REPO,
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=err,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # bounded: the process prints it once listening, or exits
        if not line:
            proc.wait(10)
            raise AssertionError(f"the gateway exited ({proc.returncode}): {Path(log_path).read_text()[-3000:]}")
        info = json.loads(line)
        yield proc, f"http://127.0.0.1:{info['port']}"
    finally:
        stop_gateway(proc)
        os.unlink(log_path)


def call(url: str, body: Any = None, timeout: float = 60.0) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            text = resp.read()
            return resp.status, json.loads(text) if text else None
    except urllib.error.HTTPError as e:
        text = e.read()
        return e.code, json.loads(text) if text else None


def wait_for_status(url: str, status: int, timeout: float) -> float:
    """Poll GET `url` every 0.1 s until it answers `status`; the seconds it took."""
    start = time.monotonic()
    last: Any = None
    while time.monotonic() - start < timeout:
        try:
            last = call(url, timeout=5)[0]
        except OSError as e:
            last = e
        if last == status:
            return time.monotonic() - start
        time.sleep(0.1)
    raise AssertionError(f"{url} did not answer {status} within {timeout} s (last: {last})")


def wait_for_demand(etcd: LocalEtcd, service: str, suffix: str, timeout: float = 15.0) -> None:
    """Poll the registry until a student whose id ends with `suffix` publishes demand > 0."""
    async def poll() -> None:
        async with open_registry(etcd.address) as reg:
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                if any(d.student_id.endswith(suffix) and d.samples_per_s > 0 for d in await reg.demand(service)):
                    return
                await asyncio.sleep(0.1)
        raise AssertionError(f"no student *{suffix} published demand on {service} within {timeout} s")

    arun(poll(), timeout + 5)


def test_the_flags_the_manifest_and_the_readme_use() -> None:
    parser = distill_cli.build_parser()
    args = parser.parse_args(["gateway", "--registry", "etcd://10.0.0.5", "--service", "llm-teacher", "--port",
                              "8000"])
    config = config_from_args(args)
    assert (config.registry, config.service, config.port, config.host) == (
        "etcd://10.0.0.5:2379", "llm-teacher", 8000, "127.0.0.1")
    assert config.name == "llm-teacher"  # what /v1/models reports with neither --model nor --served-model-name
    args = parser.parse_args(["gateway", "--teachers", "127.0.0.1:9001,127.0.0.1:9002", "--model", "m"])
    config = config_from_args(args)
    assert (config.teachers, config.name, config.port) == ("127.0.0.1:9001,127.0.0.1:9002", "m", 8000)
    for argv, message in ((["gateway"], "exactly one of --teachers"),
                          (["gateway", "--registry", "etcd://h:1"], "needs --service"),
                          (["gateway", "--teachers", "h:1", "--service", "s"], "only with --registry")):
        with pytest.raises(ValueError, match=message):
            config_from_args(parser.parse_args(argv))


def test_the_python_api_answers_503_when_no_teacher_comes() -> None:
    """`distill.gateway.Gateway` in process, its teacher list pointing at a port where nothing
    listens: /health 503, and a completion waits --no-teacher-timeout and answers 503 naming them."""
    from discovery.local_etcd import free_port
    from distill.gateway import Gateway, GatewayConfig

    dead = f"127.0.0.1:{free_port()}"

    async def go() -> tuple[int, Any, int]:
        import aiohttp

        config = GatewayConfig(port=0, teachers=dead, model="m", no_teacher_timeout=1.0, timeout=1.0)
        async with Gateway(config) as gw, aiohttp.ClientSession() as session:
            base = f"http://127.0.0.1:{gw.port}"
            async with session.get(base + "/health") as resp:
                health = resp.status
            async with session.post(base + "/v1/completions", json={"prompt": [[1, 2, 3]], "model": "m"}) as resp:
                return resp.status, await resp.json(), health

    status, body, health = arun(go(), 60)
    assert health == 503
    assert status == 503 and dead in body["error"]["message"], body


def test_health_is_503_with_no_teacher_and_200_once_one_registers(etcd: LocalEtcd, llama_dir: Path,
                                                                  tmp_path: Path) -> None:
    service = unique_service("gw")
    with gateway_process(["--registry", etcd.address, "--service", service, "--served-model-name", "teacher-pool",
                          "--max-model-len", "64", "--max-body-mb", "0.01"]) as (_, base):
        status, body = call(base + "/health")
        assert status == 503 and body["error"]["code"] == 503 and "no teacher" in body["error"]["message"]
        assert call(base + "/v1/models")[1]["data"][0] | {"created": 0} == {
            "id": "teacher-pool", "object": "model", "created": 0, "owned_by": "distill-mesh", "root": "teacher-pool",
            "parent": None, "max_model_len": 64, "permission": []}
        # refusals the gateway answers itself, with no teacher needed
        for body, status, param in (
                ({"prompt": [[1, 2]], "max_tokens": 2}, 400, "max_tokens"),
                ({"prompt": [[1, 2]], "model": "other"}, 404, "model"),
                ({"prompt": "text"}, 400, "prompt"),
                ({"prompt": [list(range(65))]}, 400, "prompt"),
                ({"prompt": [[1, 2]], "prompt_logprob": 2}, 400, "prompt_logprob")):
            got, answer = call(base + "/v1/completions", body)
            assert (got, answer["error"]["param"]) == (status, param), answer
        assert call(base + "/v2/models/x/infer", {})[0] == 404
        status, answer = call(base + "/v1/completions", {"prompt": [[7] * 5000]})  # ~15 kB over 10 kB
        assert status == 413 and "limit" in answer["error"]["message"], answer
        zipped = urllib.request.Request(base + "/v1/completions", data=gzip.compress(b" " * (1 << 20)), headers={
            "Content-Type": "application/json", "Content-Encoding": "gzip"})  # 1 KB on the wire, 1 MiB inflated
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(zipped, timeout=60)
        assert refused.value.code == 415 and "uncompressed" in json.loads(refused.value.read())["error"]["message"]
        with teacher_process(teacher_args(llama_dir, "--registry", etcd.address, "--service", service),
                             tmp_path):
            wait_for_status(base + "/health", 200, START_S)
            status, answer = call(base + "/v1/completions", {"prompt": [[5, 9, 30, 2]], "prompt_logprobs": 2,
                                                             "model": "teacher-pool"})
            assert status == 200 and len(answer["choices"][0]["prompt_logprobs"]) == 4, answer
            wait_for_demand(etcd, service, "-gateway")  # what the autoscaler reads: one student, any temperature
        # the teacher drained and deregistered: no usable teacher, 503 again
        wait_for_status(base + "/health", 503, START_S)


# ---- scoring through the mesh: TRL's own client, unchanged, against the gateway ----------------------
SEQUENCES = [[5, 9, 30, 2, 77, 41, 8, 13], [12, 3, 40, 41, 42], [60, 61, 62, 63, 64, 65, 66, 67, 68, 1, 2]]
PROMPT_LENGTHS = [3, 1, 6]


@pytest.fixture(scope="module")
def reference(llama_dir: Path) -> Any:
    return load_reference(llama_dir)


@pytest.fixture(scope="module")
def two_teachers(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Any]]:
    """Two real teacher-server processes on the same tiny Llama (no registry: a fixed list)."""
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(teacher_process(teacher_args(llama_dir, "--metrics-port", "0"),
                                                   tmp_path_factory.mktemp("gw-teacher")))
               for _ in range(2)]


@pytest.fixture(scope="module")
def pool_gateway(two_teachers: list[Any]) -> Iterator[str]:
    """One `distill gateway` process over `two_teachers` (a fixed list) for the tests that only send
    it requests; its base URL once it answers /health with 200."""
    teachers = ",".join(f"127.0.0.1:{info['port']}" for _, info in two_teachers)
    with gateway_process(["--teachers", teachers, "--model", "tiny-llama"]) as (_, base):
        wait_for_status(base + "/health", 200, START_S)
        yield base


def vllm_client(base: str, monkeypatch: pytest.MonkeyPatch) -> Any:
    """TRL's VLLMClient as shipped; only its `vllm`-is-installed check is satisfied (see
    tests/test_trl_client.py: nothing the scoring path runs uses vLLM)."""
    pytest.importorskip("trl")
    module = pytest.importorskip("trl.generation.vllm_client")
    monkeypatch.setattr(module, "is_vllm_available", lambda *a, **k: True)
    return module.VLLMClient(base_url=base, connection_timeout=60)


def test_trls_get_sequence_logprobs_through_the_gateway_equals_the_model(
        pool_gateway: str, reference: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.hf_models import reference_logprobs

    client = vllm_client(pool_gateway, monkeypatch)
    assert client.model == "tiny-llama"
    k, temperature = 4, 0.8
    result = client.get_sequence_logprobs(SEQUENCES, PROMPT_LENGTHS, top_logprobs=k, temperature=temperature,
                                          chunk_size=1, max_concurrent_requests=3)
    for b, (seq, start) in enumerate(zip(SEQUENCES, PROMPT_LENGTHS, strict=True)):
        logp = reference_logprobs(reference, seq, temperature)
        assert len(result["logprobs"][b]) == len(seq) - start
        for j, p in enumerate(range(start, len(seq))):
            top = logp[p - 1].topk(k)
            assert result["logprob_token_ids"][b][j] == top.indices.tolist()
            assert result["logprobs"][b][j] == pytest.approx(top.values.tolist(), abs=1e-4)
            assert result["actual_token_ids"][b][j] == [seq[p]]
            assert result["actual_logprobs"][b][j] == pytest.approx([float(logp[p - 1, seq[p]])], abs=1e-4)


def test_a_teacher_sigkilled_behind_the_gateway_fails_no_request(
        llama_dir: Path, two_teachers: list[Any], reference: Any, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Two teachers (one of this test's own, one of the module's), requests in a loop from TRL's
    client; this test's teacher is SIGKILLed mid-run: every request is answered, and right."""
    from tests.hf_models import reference_logprobs

    with contextlib.ExitStack() as stack:
        procs = [stack.enter_context(teacher_process(teacher_args(llama_dir), tmp_path)), two_teachers[0]]
        teachers = ",".join(f"127.0.0.1:{info['port']}" for _, info in procs)
        _, base = stack.enter_context(gateway_process(["--teachers", teachers, "--timeout", "5"]))
        wait_for_status(base + "/health", 200, START_S)
        client = vllm_client(base, monkeypatch)
        want = [reference_logprobs(reference, seq, 1.0) for seq in SEQUENCES]
        deadline = time.monotonic() + 120
        killer = threading.Timer(0.01, procs[0][0].kill)  # SIGKILL while a request is in flight
        for i in range(12):
            assert time.monotonic() < deadline
            if i == 4:
                killer.start()
            result = client.get_sequence_logprobs(SEQUENCES, PROMPT_LENGTHS, top_logprobs=2, chunk_size=1,
                                                  max_concurrent_requests=3)
            for b, (seq, start) in enumerate(zip(SEQUENCES, PROMPT_LENGTHS, strict=True)):
                p = len(seq) - 1
                assert result["actual_logprobs"][b][-1] == pytest.approx([float(want[b][p - 1, seq[p]])], abs=1e-4)
                assert len(result["logprobs"][b]) == len(seq) - start
        killer.join(10)
        assert procs[0][0].wait(10) == -9  # it was killed, not drained


@pytest.mark.timeout(300)
def test_clients_at_six_temperatures_at_once_all_get_their_own_and_a_refused_prompt_is_named(
        pool_gateway: str, reference: Any) -> None:
    """Clients at 6 temperatures at once (60 requests, 12 in flight, the temperatures interleaved):
    every request is answered, each with the teacher's log-probs at its own temperature. A body whose
    prompt 1 holds an id past the vocabulary gets a 400 that names prompt 1, position 2, the id and
    the vocabulary's size, and nothing of the reader behind the gateway."""
    from tests.hf_models import VOCAB, reference_logprobs

    base = pool_gateway
    temperatures = [0.5, 0.7, 1.0, 1.3, 2.0, 3.0]
    prompts = [[5, 9, 30, 2, 77], [12, 3, 40, 41]]
    k = 2

    def ask(temperature: float) -> tuple[float, int, Any]:
        status, body = call(base + "/v1/completions", {"prompt": prompts, "max_tokens": 1, "prompt_logprobs": k,
                                                       "temperature": temperature}, timeout=120)
        return temperature, status, body

    with ThreadPoolExecutor(12) as pool:
        answers = list(pool.map(ask, temperatures * 10))
    status, refusal = call(base + "/v1/completions", {"prompt": [[1, 2], [1, 5, VOCAB]], "prompt_logprobs": 1})
    assert [(t, s, b) for t, s, b in answers if s != 200] == []
    want = {(t, i): reference_logprobs(reference, p, t) for t in temperatures for i, p in enumerate(prompts)}
    for temperature, _, body in answers:
        for i, (ids, c) in enumerate(zip(prompts, body["choices"], strict=True)):
            logp = want[temperature, i]
            for position in range(1, len(ids)):
                entries = c["prompt_logprobs"][position]
                token = ids[position]
                assert entries[str(token)]["logprob"] == pytest.approx(float(logp[position - 1, token]), abs=1e-4)
                top = logp[position - 1].topk(k)
                for token_id, value in zip(top.indices.tolist(), top.values.tolist(), strict=True):
                    assert entries[str(token_id)]["logprob"] == pytest.approx(value, abs=1e-4), (temperature, i)
    assert status == 400 and refusal["error"]["param"] == "prompt", refusal
    message = refusal["error"]["message"]
    for said in ("prompt 1:", f"token id {VOCAB}", "at position 2", f"vocabulary has {VOCAB} tokens"):
        assert said in message, message
    for unsaid in ("DistillReader", "BatchRejectedError", "fallback", "rows", "batch"):
        assert unsaid.lower() not in message.lower(), message
