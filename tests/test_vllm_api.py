"""vLLM's scoring subset on the teacher's HTTP port (`teacher_server.vllm_routes`): a tiny random
Llama saved with save_pretrained (with and without a tokenizer), served in process, answered over
real HTTP on loopback and checked against the same model in process; and every refusal's status
and OpenAI-style body. TRL's own client code against a teacher process: tests/test_trl_client.py."""

from __future__ import annotations

import asyncio
import gzip
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
import torch
import tritonclient.grpc as tg

from teacher_server import ServerConfig
from tests.hf_models import CONTEXT, VOCAB, load_reference, reference_logprobs, save_llama
from tests.servers import ServerThread

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tiny-llama-tok")
    save_llama(directory, tokenizer=True)
    return directory


@pytest.fixture(scope="module")
def bare_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tiny-llama-bare")
    save_llama(directory)
    return directory


@pytest.fixture(scope="module")
def reference(llama_dir: Path) -> torch.nn.Module:
    return load_reference(llama_dir)


@pytest.fixture(scope="module")
def server(llama_dir: Path) -> Iterator[ServerThread]:
    with ServerThread(ServerConfig(model=f"hf:{llama_dir}", name="llama", device="cpu", http_port=0,
                                   max_message_mb=1)) as s:
        yield s


@pytest.fixture(scope="module")
def bare_server(bare_dir: Path) -> Iterator[ServerThread]:
    with ServerThread(ServerConfig(model=f"hf:{bare_dir}", name="bare", device="cpu", http_port=0)) as s:
        yield s


def _base(s: ServerThread) -> str:
    assert s.server is not None and s.server.http_port is not None
    return f"http://127.0.0.1:{s.server.http_port}"


def _call(method: str, url: str, body: Any = None, raw: bytes | None = None) -> tuple[int, Any]:
    async def go() -> tuple[int, Any]:
        timeout = aiohttp.ClientTimeout(total=60)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            data = raw if raw is not None else None if body is None else json.dumps(body).encode()
            async with session.request(method, url, data=data,
                                       headers={"Content-Type": "application/json"}) as resp:
                text = await resp.read()
                return resp.status, json.loads(text) if text else None
    return asyncio.run(asyncio.wait_for(go(), 90))


def _post(s: ServerThread, body: Any) -> tuple[int, Any]:
    return _call("POST", _base(s) + "/v1/completions", body)


def _check_position(entry: dict[str, Any], logp: torch.Tensor, token: int, k: int, names: bool) -> None:
    """One prompt_logprobs position against the reference distribution `logp` [V]."""
    top = torch.topk(logp, k)
    want_ids = {str(i) for i in top.indices.tolist()} | {str(token)}
    assert set(entry) == want_ids
    assert next(iter(entry)) == str(token)  # vLLM's order: the prompt's own token first, then the top-k
    assert [i for i in entry if i != str(token)] == [str(i) for i in top.indices.tolist() if i != token]
    for r, (i, v) in enumerate(zip(top.indices.tolist(), top.values.tolist(), strict=True), 1):
        if i != token:
            assert entry[str(i)]["rank"] == r
        assert entry[str(i)]["logprob"] == pytest.approx(v, abs=1e-4)
    own = entry[str(token)]
    assert own["logprob"] == pytest.approx(float(logp[token]), abs=1e-4)
    assert own["rank"] == int((logp > logp[token]).sum()) + 1
    assert (own["decoded_token"] is not None) == names


def test_token_ranks_over_kserve_are_the_true_ranks(server: ServerThread, reference: torch.nn.Module) -> None:
    """The registry's token_ranks transform on the binary path: rank of x[t+1] at position t,
    computed on the device, next to token_logprobs; 0 at the last position."""
    ids = np.array([[5, 9, 30, 2, 77, 41, 8]], dtype=np.int64)
    x = tg.InferInput("INPUT_IDS", list(ids.shape), "INT64")
    x.set_data_from_numpy(ids)
    with tg.InferenceServerClient(server.url) as c:
        result = c.infer("llama", [x], outputs=[tg.InferRequestedOutput("LOGITS")],
                         parameters={"token_ranks": True, "token_logprobs": True, "temperature": 2.0})
        # With top-k the ranks are counted within the k values where the token is among them (all
        # of them at k = the vocabulary, some at k = 40) and over the row elsewhere: the same ranks.
        with_top = [c.infer("llama", [x], parameters={"token_ranks": True, "top_k": k, "temperature": 2.0})
                    for k in (40, VOCAB)]
    logp = reference_logprobs(reference, ids[0].tolist(), 2.0)
    nxt = torch.from_numpy(ids[0, 1:])
    own = logp[:-1].gather(-1, nxt.unsqueeze(-1))
    want_ranks = (logp[:-1] > own).sum(-1) + 1
    ranks = result.as_numpy("LOGITS_TOKEN_RANKS")
    assert ranks.dtype == np.int32 and ranks.shape == (1, 7)
    assert ranks[0, :-1].tolist() == want_ranks.tolist() and ranks[0, -1] == 0
    for r in with_top:
        assert r.as_numpy("LOGITS_TOKEN_RANKS").tolist() == ranks.tolist()
    assert min(ranks[0, :-1]) <= 40 < max(ranks[0, :-1])  # k = 40 takes both ways
    assert max(ranks[0]) > 1  # a random model: some prompt tokens are not its top-1
    assert np.allclose(result.as_numpy("LOGITS_TOKEN_LOGPROBS")[0, :-1], own.squeeze(-1).numpy(), atol=1e-4)
    assert result.as_numpy("LOGITS") is None  # reduced on the device: the [T, V] logits are not sent


def test_health_and_models(server: ServerThread) -> None:
    status, body = _call("GET", _base(server) + "/health")
    assert (status, body) == (200, None)
    status, body = _call("GET", _base(server) + "/v1/models")
    assert status == 200
    assert body["object"] == "list" and body["data"][0]["id"] == "llama"
    assert body["data"][0]["max_model_len"] == CONTEXT


def test_prompt_logprobs_match_the_model(server: ServerThread, reference: torch.nn.Module) -> None:
    """Several token-id prompts of different lengths in one body: vLLM's shape, the top-k and each
    prompt token with its log-prob and true rank equal the in-process log_softmax(model(x) / T)."""
    prompts = [[5, 9, 30, 2, 77, 41, 8], [12, 3], [60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 1]]
    k, temperature = 3, 0.7
    status, body = _post(server, {"model": "llama", "prompt": prompts, "max_tokens": 1, "prompt_logprobs": k,
                                  "temperature": temperature, "return_token_ids": True})
    assert status == 200, body
    assert body["object"] == "text_completion" and body["model"] == "llama"
    assert body["usage"] == {"prompt_tokens": 20, "total_tokens": 23, "completion_tokens": 3,
                             "prompt_tokens_details": None, "completion_tokens_details": None}
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    for ids, c in zip(prompts, body["choices"], strict=True):
        logp = reference_logprobs(reference, ids, temperature)
        assert c["prompt_token_ids"] == ids
        assert c["token_ids"] == [int(logp[-1].argmax())]  # the one greedy token
        assert c["finish_reason"] == "length"
        pl = c["prompt_logprobs"]
        assert len(pl) == len(ids) and pl[0] is None
        for i in range(1, len(ids)):
            _check_position(pl[i], logp[i - 1], ids[i], k, names=True)


def test_temperature_zero_is_greedy_and_scores_unscaled(server: ServerThread, reference: torch.nn.Module) -> None:
    ids = [7, 8, 9, 10]
    status, body = _post(server, {"prompt": ids, "max_tokens": 1, "prompt_logprobs": 0, "temperature": 0})
    assert status == 200, body
    logp = reference_logprobs(reference, ids)
    pl = body["choices"][0]["prompt_logprobs"]
    for i in range(1, len(ids)):
        assert set(pl[i]) == {str(ids[i])}  # prompt_logprobs 0: only the prompt's own token
        assert pl[i][str(ids[i])]["logprob"] == pytest.approx(float(logp[i - 1, ids[i]]), abs=1e-4)
    tokenizer = transformers.AutoTokenizer.from_pretrained(server.config.model[3:], local_files_only=True)
    assert body["choices"][0]["text"] == tokenizer.decode([int(logp[-1].argmax())])


def test_text_prompts_use_the_teachers_tokenizer(server: ServerThread, reference: torch.nn.Module) -> None:
    status, body = _post(server, {"prompt": ["w5 w9 w30", "w12 w3"], "max_tokens": 1, "prompt_logprobs": 2,
                                  "add_special_tokens": False, "return_token_ids": True})
    assert status == 200, body
    first = body["choices"][0]
    assert first["prompt_token_ids"] == [5, 9, 30]
    assert first["prompt_logprobs"][1]["9"]["decoded_token"] == "w9"
    logp = reference_logprobs(reference, [5, 9, 30])
    _check_position(first["prompt_logprobs"][2], logp[1], 30, 2, names=True)


def test_without_a_tokenizer_text_is_refused_and_tokens_are_not_decoded(bare_server: ServerThread) -> None:
    status, body = _post(bare_server, {"prompt": "hello there", "max_tokens": 1})
    assert status == 400
    assert body["error"]["type"] == "BadRequestError" and body["error"]["code"] == 400
    assert "send token ids" in body["error"]["message"] and "no tokenizer files" in body["error"]["message"]
    status, body = _post(bare_server, {"prompt": [[4, 5, 6]], "max_tokens": 1, "prompt_logprobs": 1})
    assert status == 200
    assert body["choices"][0]["text"] == ""
    assert all(e["decoded_token"] is None for e in body["choices"][0]["prompt_logprobs"][1].values())


@pytest.mark.parametrize(("body", "status", "param", "words"), [
    ({"prompt": [1, 2], "max_tokens": 16}, 400, "max_tokens", "generates exactly one greedy token"),
    ({"prompt": [1, 2], "max_tokens": 0}, 400, "max_tokens", "send max_tokens: 1"),
    ({"prompt": [1, 2], "max_tokens": 1, "prompt_logprobs": 21}, 400, "prompt_logprobs",
     "Requested prompt logprobs of 21, which is greater than max allowed: 20; start the server with --max-logprobs 21"),
    ({"prompt": [1, 2], "max_tokens": 1, "prompt_logprobs": -1}, 400, "prompt_logprobs",
     "the whole vocabulary, 97 tokens: Requested prompt logprobs of 97, which is greater than max allowed: 20; "
     "start the server with --max-logprobs 97"),
    ({"prompt": [1, 2], "max_tokens": 1, "prompt_logprobs": -2}, 400, "prompt_logprobs", "non-negative"),
    ({"prompt": [[1, 2], [3, 97]], "max_tokens": 1}, 400, "prompt", "prompt 1: token id 97 at position 1"),
    ({"prompt": [1, -1], "max_tokens": 1}, 400, "prompt", "outside the vocabulary (ids must be in 0..96)"),
    ({"prompt": list(range(1, 66)), "max_tokens": 1}, 400, "prompt", "maximum context length is 64 tokens"),
    ({"prompt": [1, 2], "model": "gpt-4"}, 404, "model", "The model `gpt-4` does not exist"),
    ({"prompt": [[1, 2], []]}, 400, "prompt", "prompt 1 is empty"),
    ({"prompt": [1.5, 2]}, 400, "prompt", "prompt mixes kinds"),
    ({"prompt": [1, 2], "temperature": -1}, 400, "temperature", "finite number >= 0"),
    ({"prompt": [1, 2], "stream": True}, 400, "stream", "not streamed"),
    ({"prompt": [1, 2], "n": 2}, 400, "n", "one completion per prompt"),
    ({"prompt": [1, 2], "prompt_logprob": 5}, 400, "prompt_logprob", "did you mean 'prompt_logprobs'"),
    ({"max_tokens": 1}, 400, "prompt", "missing field 'prompt'"),
])
def test_refusals_are_openai_errors(server: ServerThread, body: dict[str, Any], status: int, param: str,
                                    words: str) -> None:
    got, answer = _post(server, body)
    assert got == status, answer
    error = answer["error"]
    assert error["code"] == status and error["param"] == param
    assert error["type"] == {400: "BadRequestError", 404: "NotFoundError"}[status]
    assert words in error["message"]


def test_malformed_large_and_unknown_paths(server: ServerThread) -> None:
    status, body = _call("POST", _base(server) + "/v1/completions", raw=b"{not json")
    assert status == 400 and "does not parse" in body["error"]["message"]
    big = json.dumps({"prompt": [[1] * 60] * 9000, "max_tokens": 1}).encode()  # > --max-message-mb 1
    status, body = _call("POST", _base(server) + "/v1/completions", raw=big)
    assert status == 413 and body["error"]["code"] == 413 and "--max-message-mb" in body["error"]["message"]
    status, body = _call("POST", _base(server) + "/v1/chat/completions", {"messages": []})
    assert status == 404 and "/v1/completions" in body["error"]["message"]
    status, body = _call("GET", _base(server) + "/v1/completions")
    assert status == 405 and body["error"]["type"] == "MethodNotAllowedError"
    assert _call("GET", _base(server) + "/v2/health/live")[0] == 200  # KServe v2 still beside it


def test_compressed_bodies_are_inflated_within_the_same_bounds(server: ServerThread) -> None:
    """The JSON endpoint reads bodies through the KServe routes' bounded reader: a gzip body is served,
    a gzip bomb (far under the limit on the wire, far over it inflated) is 413 in OpenAI's form."""
    body = {"model": "llama", "prompt": [[5, 9, 30, 2]], "max_tokens": 1, "prompt_logprobs": 2}
    plain = _post(server, body)
    assert plain[0] == 200, plain[1]

    async def post(raw: bytes) -> tuple[int, Any]:
        timeout = aiohttp.ClientTimeout(total=60)
        headers = {"Content-Type": "application/json", "Content-Encoding": "gzip"}
        async with aiohttp.ClientSession(timeout=timeout) as session, session.post(
                _base(server) + "/v1/completions", data=raw, headers=headers) as resp:
            return resp.status, json.loads(await resp.read())

    status, zipped = asyncio.run(asyncio.wait_for(post(gzip.compress(json.dumps(body).encode())), 90))
    assert status == 200 and zipped["choices"][0]["prompt_logprobs"] == plain[1]["choices"][0]["prompt_logprobs"]
    bomb = gzip.compress(b" " * (64 << 20))  # ~64 KB on the wire, 64 MiB inflated; the limit is 1 MiB
    assert len(bomb) < (1 << 20)
    status, refused = asyncio.run(asyncio.wait_for(post(bomb), 90))
    assert status == 413 and refused["error"]["code"] == 413 and "--max-message-mb" in refused["error"]["message"]


def test_a_draining_teacher_answers_503(bare_dir: Path) -> None:
    with ServerThread(ServerConfig(model=f"hf:{bare_dir}", name="bare", device="cpu", http_port=0)) as s:
        assert s.server is not None
        s.call(s.server.begin_drain())
        status, body = _call("GET", _base(s) + "/health")
        assert status == 503 and body["error"]["code"] == 503 and "draining" in body["error"]["message"]
        status, body = _post(s, {"prompt": [1, 2], "max_tokens": 1})
        assert status == 503 and body["error"]["type"] == "ServiceUnavailableError"
        assert "another teacher" in body["error"]["message"]


def test_a_full_queue_answers_429_and_a_module_model_has_no_tokenizer() -> None:
    """A `module:factory` causal model (tests.seq_models) with its one instance held busy and a
    queue of two: of six bodies sent at once, those the queue and the instance took are answered
    once the instance is released, the rest meet the full queue (429, OpenAI form); text needs an
    hf: tokenizer; /v1/models has no context to report."""
    from teacher_server import BatchingConfig
    from tests import seq_models

    cfg = ServerConfig(model="tests.seq_models:causal_conv_lm", name="seq", device="cpu", http_port=0, instances=1,
                       batching=BatchingConfig(max_batch_size=1, max_queue_size=2, max_queue_delay_us=0))
    with ServerThread(cfg) as s:
        status, body = _call("GET", _base(s) + "/v1/models")
        assert status == 200 and body["data"][0]["max_model_len"] is None
        status, body = _post(s, {"prompt": "some text", "max_tokens": 1})
        assert status == 400 and "is not an hf: directory" in body["error"]["message"]
        status, body = _post(s, {"prompt": [[1, 2, 3]], "max_tokens": 1, "prompt_logprobs": 2})
        assert status == 200 and len(body["choices"][0]["prompt_logprobs"]) == 3

        async def burst() -> tuple[tuple[int, Any], list[int]]:
            data = json.dumps({"prompt": [1, 2, 3], "max_tokens": 1, "prompt_logprobs": 2}).encode()
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
                async def post() -> tuple[int, Any]:
                    async with session.post(_base(s) + "/v1/completions", data=data) as resp:
                        return resp.status, await resp.json()

                tasks = [asyncio.ensure_future(post()) for _ in range(6)]
                try:
                    done, _ = await asyncio.wait(tasks, timeout=60, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    seq_models.GATE.set()
                first = next(iter(done)).result()
                return first, [status for status, _ in await asyncio.gather(*tasks)]

        seq_models.GATE.clear()
        try:
            (status, body), statuses = asyncio.run(asyncio.wait_for(burst(), 90))
        finally:
            seq_models.GATE.set()
        assert status == 429, body
        assert body["error"]["type"] == "RateLimitError" and body["error"]["code"] == 429
        assert "queue" in body["error"]["message"]
        assert set(statuses) == {200, 429} and statuses.count(200) >= 2  # at least the two the queue holds


def test_a_body_of_more_prompts_than_the_queue_holds_is_answered(bare_dir: Path) -> None:
    from teacher_server import BatchingConfig

    cfg = ServerConfig(model=f"hf:{bare_dir}", name="bare", device="cpu", http_port=0,
                       batching=BatchingConfig(max_batch_size=4, max_queue_size=4))
    with ServerThread(cfg) as s:
        prompts = [[i % 90 + 1, 2, 3][: i % 3 + 1] for i in range(40)]
        status, body = _post(s, {"prompt": prompts, "max_tokens": 1, "prompt_logprobs": 1})
        assert status == 200, body
        assert [len(c["prompt_logprobs"]) for c in body["choices"]] == [len(p) for p in prompts]


def test_minus_one_is_the_whole_vocabulary_within_max_logprobs(bare_dir: Path, reference: torch.nn.Module) -> None:
    """prompt_logprobs -1 is vLLM's whole vocabulary: answered by a teacher whose --max-logprobs
    allows it (-1 itself: the vocabulary), every token of it per position, the prompt's own first
    and the rest in rank order; a bare body carries vLLM's keys, those not asked for null, and the
    teacher's fingerprint as `system_fingerprint`."""
    with ServerThread(ServerConfig(model=f"hf:{bare_dir}", name="bare", device="cpu", http_port=0,
                                   max_logprobs=-1)) as s:
        ids = [5, 9, 30]
        status, body = _post(s, {"prompt": ids, "max_tokens": 1, "prompt_logprobs": -1})
        assert status == 200, body
        pl = body["choices"][0]["prompt_logprobs"]
        logp = reference_logprobs(reference, ids)
        for i in (1, 2):
            assert len(pl[i]) == VOCAB
            _check_position(pl[i], logp[i - 1], ids[i], VOCAB, names=False)
            assert pl[i][str(ids[i])]["rank"] == int((logp[i - 1] > logp[i - 1, ids[i]]).sum()) + 1
        status, body = _post(s, {"prompt": ids, "max_tokens": 1, "prompt_logprobs": VOCAB + 1})
        assert status == 400 and "max allowed: 97; start the server with --max-logprobs 98" in body["error"]["message"]
        status, body = _post(s, {"prompt": ids, "max_tokens": 1})
        assert status == 200
        assert list(body) == ["id", "object", "created", "model", "choices", "service_tier", "system_fingerprint",
                              "usage", "kv_transfer_params", "ec_transfer_params", "metrics"]
        assert body["system_fingerprint"] == s.server.record().fingerprint  # the teacher's, not null
        assert body["choices"][0]["prompt_logprobs"] is None and body["choices"][0]["token_ids"] is None
