"""teacher-server's `/v1/completions` against answers recorded from real vLLM 0.32 for the same
requests on the same tiny Llama (tests/data/vllm_completions.json, re-recorded by
`python -m tests.record_vllm_answers`).

The model is rebuilt here from its seed (`tests.hf_models.save_vllm_llama`) and served by a real
teacher-server on loopback; each recorded request is sent to it and its answer must be vLLM's:
the same status, the same keys in the same order at every level (a client that reads the first
entry of a position's `prompt_logprobs` map reads the prompt's own token on both), the same values,
floats within 1e-4. Values that legitimately differ are left out: the completion's `id` and
`created`, the `system_fingerprint` (vLLM's names its build, ours is null), the sampled token of a
body at temperature 1 (vLLM samples it, the teacher answers the greedy one), and a refusal's words
beyond vLLM's own (ours add the flag that lifts the limit).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from teacher_server import ServerConfig
from tests.hf_models import load_reference, reference_logprobs, save_vllm_llama
from tests.record_vllm_answers import FIXTURE, SERVED_NAME
from tests.servers import ServerThread

RECORDED = json.loads(FIXTURE.read_text())
CASES = RECORDED["cases"]
TOLERANCE = 1e-4
NOT_COMPARED = {("id",), ("created",), ("system_fingerprint",)}
SAMPLED = {"text", "token_ids"}  # a choice's generated token, sampled by vLLM at a temperature other than 0


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("vllm-llama")
    save_vllm_llama(directory)
    return directory


@pytest.fixture(scope="module")
def server(llama_dir: Path) -> Iterator[ServerThread]:
    config = ServerConfig(model=f"hf:{llama_dir}", name=SERVED_NAME, device="cpu", http_port=0,
                          max_logprobs=RECORDED["max_logprobs"])
    with ServerThread(config) as s:
        yield s


async def _send(url: str, body: Any) -> tuple[int, Any]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session, \
            session.post(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}) as resp:
        return resp.status, json.loads(await resp.read())


def _post(s: ServerThread, body: Any) -> tuple[int, Any]:
    assert s.server is not None and s.server.http_port is not None
    return asyncio.run(asyncio.wait_for(_send(f"http://127.0.0.1:{s.server.http_port}/v1/completions", body), 90))


def differences(ours: Any, vllm: Any, path: tuple[Any, ...] = (), skip: frozenset[str] = frozenset(),
                anywhere: frozenset[str] = frozenset()) -> list[str]:
    """Where `ours` is not `vllm`: keys (and their order) at every level, then values, floats
    within TOLERANCE; `skip`: a choice's keys whose values are not compared, `anywhere`: keys
    whose values are not compared at any level."""
    where = "/".join(map(str, path)) or "the body"
    if isinstance(vllm, dict):
        if not isinstance(ours, dict):
            return [f"{where}: {type(ours).__name__}, vLLM has an object"]
        if list(ours) != list(vllm):
            return [f"{where}: keys {list(ours)}, vLLM's {list(vllm)}"]
        found = []
        in_choice = len(path) == 2 and path[0] == "choices"
        for key in vllm:
            if (*path, key) in NOT_COMPARED or (in_choice and key in skip) or key in anywhere:
                continue
            found += differences(ours[key], vllm[key], (*path, key), skip, anywhere)
        return found
    if isinstance(vllm, list):
        if not isinstance(ours, list) or len(ours) != len(vllm):
            return [f"{where}: {ours!r:.200}, vLLM's {vllm!r:.200}"]
        return [d for i, (a, b) in enumerate(zip(ours, vllm, strict=True))
                for d in differences(a, b, (*path, i), skip, anywhere)]
    if isinstance(vllm, float) and isinstance(ours, float):
        return [] if abs(ours - vllm) <= TOLERANCE else [f"{where}: {ours}, vLLM's {vllm}"]
    if type(ours) is not type(vllm) or ours != vllm:
        return [f"{where}: {ours!r}, vLLM's {vllm!r}"]
    return []


def test_the_rebuilt_model_is_the_one_vllm_served(llama_dir: Path) -> None:
    """The seeded rebuild gives the logits vLLM scored: the first recorded body's log-probs, from
    the model in process (a rebuild that drifted would fail every case below for that reason)."""
    case = CASES[0]
    ids = case["request"]["prompt"]
    logp = reference_logprobs(load_reference(llama_dir), ids)
    for i, position in enumerate(case["response"]["choices"][0]["prompt_logprobs"][1:], 1):
        for token, entry in position.items():
            assert float(logp[i - 1, int(token)]) == pytest.approx(entry["logprob"], abs=TOLERANCE)


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_answers_are_vllms(server: ServerThread, case: dict[str, Any]) -> None:
    request, vllm = case["request"], case["response"]
    status, ours = _post(server, request)
    assert status == case["status"], ours
    skip = frozenset(SAMPLED if request.get("temperature", 1.0) != 0 else ())
    if status != 200:  # OpenAI's error form; the words: vLLM's, then ours on how to lift the limit
        message, want = ours["error"].pop("message"), dict(vllm["error"])
        vllm_words = want.pop("message").split(" (parameter=")[0]
        if vllm_words.startswith("Requested prompt logprobs"):
            assert vllm_words in message and "--max-logprobs" in message
        assert list(ours["error"]) == list(want) and ours["error"] == want
        return
    assert differences(ours, vllm, skip=skip) == []


def test_the_gateway_answers_as_vllm_does(server: ServerThread) -> None:
    """`distill gateway` in front of the same teacher writes the same answer for every token-id
    case: keys, order and values, less what needs a tokenizer it does not hold (decoded tokens, the
    generated token's text). A refusal of the limit names --max-logprobs; -1 is refused there (the
    gateway knows no vocabulary), as vLLM refuses it here (the vocabulary exceeds the limit)."""
    from distill.gateway import Gateway, GatewayConfig

    cases = [c for c in CASES if not isinstance(c["request"]["prompt"], str)]
    assert len(cases) >= 5

    async def replay() -> list[tuple[int, Any]]:
        config = GatewayConfig(port=0, teachers=server.url, model=SERVED_NAME, max_logprobs=RECORDED["max_logprobs"])
        async with Gateway(config) as gateway:
            url = f"http://127.0.0.1:{gateway.port}/v1/completions"
            return [await _send(url, c["request"]) for c in cases]

    answers = asyncio.run(asyncio.wait_for(replay(), 240))
    for case, (status, ours) in zip(cases, answers, strict=True):
        vllm = case["response"]
        assert status == case["status"], (case["name"], ours)
        if status != 200:
            assert ours["error"]["param"] == vllm["error"]["param"] and ours["error"]["code"] == status
            if "logprobs of" in vllm["error"]["message"]:
                assert "--max-logprobs" in ours["error"]["message"], ours
            continue
        skip = frozenset({"text"} | (SAMPLED if case["request"].get("temperature", 1.0) != 0 else set()))
        assert differences(ours, vllm, skip=skip, anywhere=frozenset({"decoded_token"})) == [], case["name"]


def test_the_comparison_sees_key_order_and_values() -> None:
    """The comparison itself: the prompt token listed last instead of first, or a log-prob off by
    more than the tolerance, is a difference."""
    vllm = {"choices": [{"prompt_logprobs": [None, {"9": {"logprob": -8.0}, "907": {"logprob": -2.0}}]}]}
    reordered = {"choices": [{"prompt_logprobs": [None, {"907": {"logprob": -2.0}, "9": {"logprob": -8.0}}]}]}
    assert differences(reordered, vllm) == ["choices/0/prompt_logprobs/1: keys ['907', '9'], vLLM's ['9', '907']"]
    off = {"choices": [{"prompt_logprobs": [None, {"9": {"logprob": -8.001}, "907": {"logprob": -2.0}}]}]}
    assert len(differences(off, vllm)) == 1
    assert differences(json.loads(json.dumps(vllm)), vllm) == []
