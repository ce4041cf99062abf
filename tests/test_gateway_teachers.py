"""One `distill gateway` process in front of two teachers, `--teacher math=etcd://.../SERVICE` (a
real teacher-server registered in a real etcd) and `--teacher code=HOST:PORT` (a fixed list), each
a tiny Llama drawn with its own seed: `/v1/models` lists both, a request's `model` picks one, each
has its own base URL `/teachers/NAME` (/v1/models, /v1/completions, /health), and every answer
equals its own teacher's model in process (and not the other's). An unknown model is 404 in
OpenAI's error shape naming the served ones. TRL's async distillation rollout worker, unchanged,
with `teacher_server_urls={"math": GW/teachers/math, "code": GW/teachers/code}` and a per-row
`teacher_id`, scores each row with its own teacher. Last, the code teacher is SIGKILLed while
requests to math run: every math request is answered, and right; code's health turns 503.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import queue
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from discovery import open_registry
from discovery.local_etcd import LocalEtcd
from distill import cli as distill_cli
from distill.gateway_cli import config_from_args
from distill.gateway_teachers import TeacherSpec
from tests.etcd_fixtures import arun, unique_service
from tests.hf_models import load_reference, reference_logprobs, save_llama
from tests.servers import teacher_process
from tests.test_gateway import START_S, call, gateway_process, teacher_args, wait_for_status

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.timeout(300)  # the first test to use `mesh` starts etcd, two teachers and a gateway

SEEDS = {"math": 0, "code": 1}
PROMPTS = [[5, 9, 30, 2, 77, 41], [12, 3, 40, 41]]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    dirs = {}
    for name, seed in SEEDS.items():
        dirs[name] = tmp_path_factory.mktemp(f"tiny-llama-{name}")
        save_llama(dirs[name], tokenizer=True, seed=seed)
    return dirs


@pytest.fixture(scope="module")
def references(model_dirs: dict[str, Path]) -> dict[str, torch.nn.Module]:
    return {name: load_reference(directory) for name, directory in model_dirs.items()}


@pytest.fixture(scope="module")
def mesh(model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """math: a teacher registered under a service in etcd; code: a teacher on a fixed port; one gateway
    process serving both (the code teacher's process is SIGKILLed by the module's last test)."""
    service = unique_service("gw-math")
    with contextlib.ExitStack() as stack:
        etcd = stack.enter_context(LocalEtcd())
        _, math = stack.enter_context(teacher_process(
            teacher_args(model_dirs["math"], "--registry", etcd.address, "--service", service),
            tmp_path_factory.mktemp("math-teacher")))
        code_proc, code = stack.enter_context(teacher_process(teacher_args(model_dirs["code"]),
                                                              tmp_path_factory.mktemp("code-teacher")))
        _, base = stack.enter_context(gateway_process([
            "--teacher", f"math={etcd.address}/{service}", "--teacher", f"code=127.0.0.1:{code['port']}",
            "--timeout", "5", "--no-teacher-timeout", "5"]))
        wait_for_status(base + "/health", 200, START_S)
        yield {"base": base, "etcd": etcd, "service": service, "code_proc": code_proc,
               "http": {"math": f"http://127.0.0.1:{math['http_port']}", "code": f"http://127.0.0.1:{code['http_port']}"}}


_LOGPROBS: dict[tuple[int, tuple[int, ...], float], torch.Tensor] = {}


def logprobs(reference: torch.nn.Module, ids: list[int], temperature: float) -> torch.Tensor:
    """`reference_logprobs`, computed once per model, prompt and temperature."""
    key = (id(reference), tuple(ids), temperature)
    if key not in _LOGPROBS:
        _LOGPROBS[key] = reference_logprobs(reference, ids, temperature)
    return _LOGPROBS[key]


def assert_answers_like(answer: dict[str, Any], prompts: list[list[int]], reference: torch.nn.Module,
                        temperature: float, k: int) -> None:
    """Every prompt position's own-token and top-k log-probs equal `reference`'s at `temperature`."""
    for ids, c in zip(prompts, answer["choices"], strict=True):
        logp = logprobs(reference, ids, temperature)
        assert c["prompt_logprobs"][0] is None
        for position in range(1, len(ids)):
            entries = c["prompt_logprobs"][position]
            assert entries[str(ids[position])]["logprob"] == pytest.approx(
                float(logp[position - 1, ids[position]]), abs=1e-4)
            top = logp[position - 1].topk(k)
            for token, value in zip(top.indices.tolist(), top.values.tolist(), strict=True):
                assert entries[str(token)]["logprob"] == pytest.approx(value, abs=1e-4)


def test_the_teacher_flag_names_a_registry_service_or_a_list() -> None:
    parser = distill_cli.build_parser()
    config = config_from_args(parser.parse_args([
        "gateway", "--teacher", "math=etcd://10.0.0.5/math-svc", "--teacher", "code=10.0.0.7:9898,10.0.0.8:9898"]))
    assert config.specs() == (TeacherSpec("math", registry="etcd://10.0.0.5:2379", service="math-svc"),
                              TeacherSpec("code", teachers="10.0.0.7:9898,10.0.0.8:9898"))
    assert config.scoring(config.specs()[1]).teachers == "10.0.0.7:9898,10.0.0.8:9898"
    # the single-teacher flags stay one teacher, named by the model
    legacy = config_from_args(parser.parse_args(["gateway", "--teachers", "127.0.0.1:9001", "--model", "m"]))
    assert legacy.specs() == (TeacherSpec("m", teachers="127.0.0.1:9001"),)
    for argv, message in (
            (["--teacher", "a=h:1", "--teacher", "a=h:2"], "given more than once: a"),
            (["--teacher", "a=h:1", "--teachers", "h:2"], "drop --teachers"),
            (["--teacher", "a=h:1", "--served-model-name", "x"], "each teacher's served name")):
        with pytest.raises(ValueError, match=message):
            config_from_args(parser.parse_args(["gateway", *argv]))
    for bad, message in (("math", "expected NAME=etcd://"), ("m=etcd://h:1", "name the service"),
                         ("a/b=h:1", "URL path segment")):
        with pytest.raises(SystemExit):
            parser.parse_args(["gateway", "--teacher", bad])
        with pytest.raises(ValueError, match=message):
            from distill.gateway_teachers import teacher_spec
            teacher_spec(bad)


def test_each_model_and_each_base_url_answers_with_its_own_teacher(
        mesh: dict[str, Any], references: dict[str, torch.nn.Module]) -> None:
    base = mesh["base"]
    assert [m["id"] for m in call(base + "/v1/models")[1]["data"]] == ["math", "code"]
    # each teacher's fingerprint, from its own server (and math's registry record): the two models differ
    prints = {name: call(url + "/v1/models")[1]["data"][0]["fingerprint"] for name, url in mesh["http"].items()}
    assert [r.fingerprint for r in arun(_records(mesh["etcd"], mesh["service"]), 30)] == [prints["math"]]
    assert prints["math"] and prints["code"] and prints["math"] != prints["code"]
    for name, other in (("math", "code"), ("code", "math")):
        (card,) = call(f"{base}/teachers/{name}/v1/models")[1]["data"]
        assert (card["id"], card["fingerprint"]) == (name, prints[name])
        assert call(f"{base}/teachers/{name}/health")[0] == 200
        for url, body in ((base + "/v1/completions", {"model": name}),
                          (f"{base}/teachers/{name}/v1/completions", {"model": name}),
                          (f"{base}/teachers/{name}/v1/completions", {})):
            status, answer = call(url, {**body, "prompt": PROMPTS, "prompt_logprobs": 3, "temperature": 0.7})
            assert status == 200, answer
            assert (answer["model"], answer["system_fingerprint"]) == (name, prints[name])
            assert_answers_like(answer, PROMPTS, references[name], 0.7, 3)
            with pytest.raises(AssertionError):  # the two teachers differ: the other's values are not these
                assert_answers_like(answer, PROMPTS, references[other], 0.7, 3)


async def _records(etcd: LocalEtcd, service: str) -> list[Any]:
    async with open_registry(etcd.address) as reg:
        return [entry.record for entry in (await reg.teachers(service)).values()]


def test_an_unknown_model_or_teacher_is_404_naming_the_served_ones(mesh: dict[str, Any]) -> None:
    base = mesh["base"]
    status, answer = call(base + "/v1/completions", {"model": "physics", "prompt": [[1, 2]]})
    assert status == 404 and answer["error"]["type"] == "NotFoundError" and answer["error"]["param"] == "model"
    assert "`physics` does not exist" in answer["error"]["message"] and "`math`, `code`" in answer["error"]["message"]
    status, answer = call(base + "/teachers/math/v1/completions", {"model": "code", "prompt": [[1, 2]]})
    assert status == 404 and "/teachers/math serves `math`" in answer["error"]["message"], answer
    for url in ("/teachers/physics/v1/completions", "/teachers/physics/health", "/teachers/physics/v1/models"):
        status, answer = call(base + url, {"prompt": [[1, 2]]} if url.endswith("completions") else None)
        assert status == 404 and "no teacher is named `physics`" in answer["error"]["message"], (url, answer)
    status, answer = call(base + "/v1/completions", {"prompt": [[1, 2]]})  # two teachers: `model` says which
    assert status == 400 and answer["error"]["param"] == "model", answer
    assert call(base + "/teachers/math/v1/completions")[0] == 405  # GET where POST is served
    assert call(base + "/teachers/math/v2/models")[0] == 404


def test_trls_async_distillation_worker_scores_each_row_with_its_teacher(
        mesh: dict[str, Any], references: dict[str, torch.nn.Module], model_dirs: dict[str, Path],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """TRL's `_AsyncRolloutLoop` as shipped, given one URL per teacher, all on the gateway, and rows
    carrying `teacher_id`: `_generate_and_score_one` (the student's one-token turn is generated at
    the math URL, any vLLM-compatible URL serves it) routes each row to its teacher, and each row's
    top-k equals that teacher's model; `_score_with_teacher` over a longer completion too."""
    pytest.importorskip("trl")
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    from accelerate.state import PartialState
    from trl.experimental.async_distillation.async_rollout_worker import _AsyncRolloutLoop

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(model_dirs["math"]), local_files_only=True)
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    base, k, temperature = mesh["base"], 3, 1.3
    urls = {name: f"{base}/teachers/{name}" for name in SEEDS}
    rows = [{"prompt": [{"role": "user", "content": "w3 w4 w5"}], "teacher_id": "code"},
            {"prompt": [{"role": "user", "content": "w10 w11 w12 w13"}], "teacher_id": "math"},
            {"prompt": [{"role": "user", "content": "w20 w21"}], "teacher_id": "code"}]
    PartialState()  # what the worker's child process does first: TRL logs through accelerate
    worker = _AsyncRolloutLoop(
        model_name="math", dataset=rows, processing_class=tokenizer, eos_token_ids=[1], rollout_buffer=None,
        model_version_value=multiprocessing.Value("i", 0), heartbeat_value=None, failed_event=None,
        exception_info_queue=None, metrics_queue=queue.Queue(), vllm_server_url=urls["math"],
        teacher_server_urls=urls, teacher_top_k=k, teacher_temperature=temperature, max_tokens=1, request_timeout=60)
    completion = [40, 41, 42, 7, 8]

    async def run() -> tuple[list[Any], list[tuple[list[list[int]], list[list[float]]]]]:
        import aiohttp

        async with aiohttp.ClientSession() as session:
            worker.session = session
            await worker._resolve_teacher_model_names()
            samples = [await worker._generate_and_score_one(i, row) for i, row in enumerate(rows)]
            scored = []
            for row in rows:
                teacher_id, url = worker._resolve_teacher_server_url(row)
                prompt = tokenizer.apply_chat_template(row["prompt"], return_dict=False, add_generation_prompt=True)
                scored.append(await worker._score_with_teacher(prompt, completion, url,
                                                               worker.teacher_model_names[teacher_id]))
            return samples, scored

    try:
        samples, scored = worker._loop.run_until_complete(asyncio.wait_for(run(), 180))
    finally:
        worker._loop.close()
        PartialState._reset_state()
    assert worker.teacher_model_names == {"math": "math", "code": "code"}
    for row, sample, (ids, lps) in zip(rows, samples, scored, strict=True):
        assert sample.teacher_id == row["teacher_id"]
        sequence = sample.input_ids.tolist()
        positions = [p for p, m in enumerate(sample.completion_mask.tolist()) if m]
        assert len(positions) == 1  # max_tokens 1: one generated token, scored by the row's teacher
        prompt = sequence[:positions[0]]
        for name in SEEDS:
            logp = logprobs(references[name], sequence, temperature)
            top = logp[positions[0] - 1].topk(k)
            values = sample.teacher_topk_logprobs[positions[0], :k].tolist()
            same = (sample.teacher_topk_ids[positions[0], :k].tolist() == top.indices.tolist()
                    and values == pytest.approx(top.values.tolist(), abs=1e-4))
            assert same == (name == row["teacher_id"]), (name, row)
        logp = logprobs(references[row["teacher_id"]], prompt + completion, temperature)
        assert len(ids) == len(completion)
        for j, token in enumerate(completion):
            top = logp[len(prompt) + j - 1].topk(k)
            want = top.indices.tolist() + ([] if token in top.indices.tolist() else [token])
            assert ids[j] == want
            assert lps[j][:k] == pytest.approx(top.values.tolist(), abs=1e-4)


def test_a_teacher_sigkilled_fails_none_of_the_others_requests(
        mesh: dict[str, Any], references: dict[str, torch.nn.Module]) -> None:
    """The module's last test: the code teacher is SIGKILLed while math requests run, and a code
    request waits on its own reader meanwhile. Every math request is answered, and right; code
    answers 503, its own /health turns 503, math's stays 200, and the root's names `code`."""
    base = mesh["base"]
    body = {"model": "math", "prompt": PROMPTS, "prompt_logprobs": 2, "temperature": 1.0}
    code_answers: list[tuple[int, Any]] = []
    killer = threading.Timer(0.01, mesh["code_proc"].kill)
    deadline = time.monotonic() + 120
    for i in range(10):
        assert time.monotonic() < deadline
        if i == 2:
            killer.start()
            killer.join(10)
            asker = threading.Thread(target=lambda: code_answers.append(call(
                base + "/teachers/code/v1/completions", {"prompt": PROMPTS}, timeout=60)))
            asker.start()
        status, answer = call(base + "/v1/completions", body)
        assert status == 200, answer
        assert_answers_like(answer, PROMPTS, references["math"], 1.0, 2)
    asker.join(60)
    assert mesh["code_proc"].wait(10) == -9  # killed, not drained
    assert [status for status, _ in code_answers] == [503], code_answers
    wait_for_status(base + "/teachers/code/health", 503, START_S)
    assert call(base + "/teachers/math/health")[0] == 200
    status, answer = call(base + "/health")
    assert status == 503 and "`code`" in answer["error"]["message"] and "`math`" not in answer["error"]["message"]
    status, answer = call(base + "/teachers/math/v1/completions", body)
    assert status == 200, answer
