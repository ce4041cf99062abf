"""TRL's own client code, unchanged, against a real `teacher-server --model hf:DIR --http-port 0`
process: `trl.generation.vllm_client.VLLMClient.get_sequence_logprobs` (what TRL's
ServerDistillationTrainer and SDPO call) and the async distillation rollout worker's teacher
scoring (`_AsyncRolloutLoop._resolve_teacher_model_names` and `_score_with_teacher`, with its own
aiohttp calls, retries and `prompt_logprobs` parsing). The teacher's answers equal the in-process
model's `log_softmax(model(x) / T)`.

`VLLMClient.__init__` refuses to start unless the `vllm` package is importable, although nothing
the scoring path runs uses it; the test satisfies that one check (`is_vllm_available` in the
client's module answers True) and runs the client code as shipped.
"""

from __future__ import annotations

import asyncio
import math
import re
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.hf_models import load_reference, reference_logprobs, save_llama
from tests.servers import teacher_process

transformers = pytest.importorskip("transformers")
pytest.importorskip("trl")
vllm_client = pytest.importorskip("trl.generation.vllm_client")

SEQUENCES = [[5, 9, 30, 2, 77, 41, 8, 13], [12, 3, 40, 41, 42], [60, 61, 62, 63, 64, 65, 66, 67, 68, 1, 2]]
PROMPT_LENGTHS = [3, 1, 6]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tiny-llama-trl")
    save_llama(directory)
    return directory


@pytest.fixture(scope="module")
def reference(llama_dir: Path) -> torch.nn.Module:
    return load_reference(llama_dir)


@pytest.fixture(scope="module")
def teacher(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The real command line: teacher-server --model hf:DIR --http-port 0 (and a metrics port)."""
    args = ["--model", f"hf:{llama_dir}", "--name", "tiny-llama", "--device", "cpu", "--http-port", "0",
            "--metrics-port", "0", "--max-logprobs", "50"]
    with teacher_process(args, tmp_path_factory.mktemp("trl-teacher")) as (_, info):
        yield info


@pytest.fixture
def client(teacher: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setattr(vllm_client, "is_vllm_available", lambda *a, **k: True)
    return vllm_client.VLLMClient(base_url=f"http://127.0.0.1:{teacher['http_port']}", connection_timeout=30)


def _successes(teacher: dict[str, Any]) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{teacher['metrics_port']}/metrics", timeout=10) as r:
        text = r.read().decode()
    found = re.search(r"^nv_inference_request_success\{[^}]*\} (\S+)$", text, re.M)
    assert found, text[:500]
    return float(found.group(1))


@pytest.mark.parametrize("chunk_size", [0, 2])
def test_get_sequence_logprobs_equals_the_model(client: Any, teacher: dict[str, Any], reference: torch.nn.Module,
                                                chunk_size: int) -> None:
    """Top-k and actual-token log-probs of the completion region, as TRL's client formats them."""
    k, temperature = 4, 0.8
    assert client.model == "tiny-llama"  # from GET /v1/models
    before = _successes(teacher)
    result = client.get_sequence_logprobs(SEQUENCES, PROMPT_LENGTHS, top_logprobs=k, temperature=temperature,
                                          chunk_size=chunk_size, max_concurrent_requests=2)
    assert _successes(teacher) - before == len(SEQUENCES)  # one request per prompt, counted as any other
    for b, (seq, start) in enumerate(zip(SEQUENCES, PROMPT_LENGTHS, strict=True)):
        logp = reference_logprobs(reference, seq, temperature)
        assert len(result["logprobs"][b]) == len(seq) - start
        for j, p in enumerate(range(start, len(seq))):
            top = torch.topk(logp[p - 1], k)
            assert result["logprob_token_ids"][b][j] == top.indices.tolist()
            assert result["logprobs"][b][j] == pytest.approx(top.values.tolist(), abs=1e-4)
            assert result["actual_token_ids"][b][j] == [seq[p]]
            assert result["actual_logprobs"][b][j] == pytest.approx([float(logp[p - 1, seq[p]])], abs=1e-4)
            assert not math.isinf(result["actual_logprobs"][b][j][0])  # present at any rank, not -inf


def test_a_refusal_reaches_trls_client_as_its_error(client: Any) -> None:
    """TRL's default top_logprobs (100) over the teacher's --max-logprobs (50 here): the 400 says
    which flag lifts the limit, and to what."""
    with pytest.raises(Exception, match=r"Request failed: 400.*max allowed: 50; start the server with "
                                        r"--max-logprobs 100"):
        client.get_sequence_logprobs([[1, 2, 3]], [1])


def test_the_async_rollout_workers_teacher_scoring(teacher: dict[str, Any], reference: torch.nn.Module,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """TRL's AsyncDistillationTrainer worker: it resolves the teacher's model id from /v1/models and
    scores a completion with `prompt_logprobs`, parsing each position rank-sorted, the realized
    token kept at any rank. Its generation side needs a student vLLM server and is not run."""
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    from accelerate.state import PartialState
    from trl.experimental.async_distillation.async_rollout_worker import _AsyncRolloutLoop

    PartialState()  # what the worker's child process does first: TRL logs through accelerate
    url = f"http://127.0.0.1:{teacher['http_port']}"
    k, temperature = 3, 1.5
    worker = _AsyncRolloutLoop(
        model_name="student", dataset=[], processing_class=None, eos_token_ids=[1], rollout_buffer=None,
        model_version_value=None, heartbeat_value=None, failed_event=None, exception_info_queue=None,
        metrics_queue=None, teacher_server_urls={"default": url}, teacher_top_k=k, teacher_temperature=temperature,
        request_timeout=30)
    prompt, completion = SEQUENCES[0][:3], SEQUENCES[0][3:]

    async def score() -> tuple[list[list[int]], list[list[float]]]:
        import aiohttp

        async with aiohttp.ClientSession() as session:
            worker.session = session
            await worker._resolve_teacher_model_names()
            scored: tuple[list[list[int]], list[list[float]]] = await worker._score_with_teacher(
                prompt, completion, url, worker.teacher_model_names["default"])
            return scored

    try:
        ids, lps = worker._loop.run_until_complete(asyncio.wait_for(score(), 120))
    finally:
        worker._loop.close()
        PartialState._reset_state()
    assert worker.teacher_model_names == {"default": "tiny-llama"}
    logp = reference_logprobs(reference, SEQUENCES[0], temperature)
    assert len(ids) == len(completion)
    for j, p in enumerate(range(len(prompt), len(SEQUENCES[0]))):
        token = SEQUENCES[0][p]
        top = torch.topk(logp[p - 1], k)
        want = top.indices.tolist() + ([token] if token not in top.indices.tolist() else [])
        want_lp = top.values.tolist() + ([float(logp[p - 1, token])] if token not in top.indices.tolist() else [])
        assert ids[j] == want  # rank-sorted: the top-k, then the realized token with its true rank
        assert lps[j] == pytest.approx(want_lp, abs=1e-4)
