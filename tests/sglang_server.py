"""An SGLang-shaped server for the tests: SGLang's native `/generate`, `/health`,
`/get_model_info` and `/metrics`, answered from a real torch model (tests/hf_models.py's tiny Llama).

SGLang itself needs a GPU (its kernels have no CPU build a test machine can install), so this
server follows SGLang's documented response bodies instead (its native API docs and
`GenerateReqInput` / `meta_info`): a request names `input_ids` (one token-id list, or a list of
them: a batch, answered with a list of results in order), `sampling_params` (`max_new_tokens`,
`temperature`), `return_logprob`, `logprob_start_len` and `top_logprobs_num`; each result is
`{"text", "output_ids", "meta_info"}` where `meta_info` holds `id`, `finish_reason`,
`prompt_tokens`, `completion_tokens`, `cached_tokens`, `e2e_latency` and, with `return_logprob`,
`input_token_logprobs` (`[logprob, token_id, null]` per prompt token from `logprob_start_len`, the
first prompt token's logprob null), `output_token_logprobs`, `input_top_logprobs` (per prompt token
a list of `top_logprobs_num` such triples, largest first; null for the first prompt token) and
`output_top_logprobs`. The text of each triple is null (SGLang's default
`return_text_in_logprobs: false`). Log-probs are the model's log-softmax (SGLang reports prompt
log-probs before sampling); the generated token is greedy at temperature 0, else sampled from a
seeded generator. A refusal is HTTP 400 with `{"error": {"message": ...}}`, as SGLang answers a
request it cannot serve.

`sglang_server(model_dir)` runs it on a free loopback port in a thread with its own event loop;
the model runs on a worker thread, never on the event loop. `stop()` closes it (a stopped engine,
for failover tests); `requests` counts the `/generate` calls answered.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from aiohttp import web

from tests.hf_models import load_reference


class BadRequest(ValueError):
    """What SGLang answers with 400 and its message."""


class SglangServer:
    """The server's state: the model, its counters, and the aiohttp runner once started."""

    def __init__(self, model_dir: Path, context: int, vocab: int) -> None:
        self.model_dir = model_dir
        self.model = load_reference(model_dir)
        self.context = context
        self.vocab = vocab
        self.requests = 0
        self.prompt_tokens = 0
        self.port = 0
        self._generator = torch.Generator().manual_seed(0)
        self._lock = threading.Lock()  # one forward at a time, as one GPU worker runs them
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="sglang-server")
        self._runner: web.AppRunner | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    # ---- the API ------------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/generate", self._generate)
        app.router.add_get("/health", self._health)
        app.router.add_get("/get_model_info", self._model_info)
        app.router.add_get("/metrics", self._metrics)
        return app

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def _model_info(self, request: web.Request) -> web.Response:
        return web.json_response({
            "model_path": str(self.model_dir), "tokenizer_path": str(self.model_dir), "is_generation": True,
            "preferred_sampling_params": None, "weight_version": "default", "has_image_understanding": False,
            "has_audio_understanding": False, "model_type": "llama", "architectures": ["LlamaForCausalLM"]})

    async def _metrics(self, request: web.Request) -> web.Response:
        name = str(self.model_dir)
        lines = [
            "# HELP sglang:num_running_reqs The number of running requests.",
            "# TYPE sglang:num_running_reqs gauge",
            f'sglang:num_running_reqs{{model_name="{name}"}} 0.0',
            "# HELP sglang:num_queue_reqs The number of requests in the waiting queue.",
            "# TYPE sglang:num_queue_reqs gauge",
            f'sglang:num_queue_reqs{{model_name="{name}"}} 0.0',
            "# HELP sglang:prompt_tokens_total Number of prefill tokens processed.",
            "# TYPE sglang:prompt_tokens_total counter",
            f'sglang:prompt_tokens_total{{model_name="{name}"}} {float(self.prompt_tokens)}',
        ]
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

    async def _generate(self, request: web.Request) -> web.Response:
        try:
            body = json.loads(await request.read())
            if not isinstance(body, dict):
                raise BadRequest("the request must be a JSON object")
            answer = await asyncio.to_thread(self.answer, body)
        except (BadRequest, json.JSONDecodeError) as e:
            return web.json_response({"error": {"message": str(e)}}, status=400)
        self.requests += 1
        return web.json_response(answer)

    # ---- the model ----------------------------------------------------------------------------
    def answer(self, body: dict[str, Any]) -> Any:
        ids = body.get("input_ids")
        if ids is None:
            raise BadRequest("this server takes input_ids (token ids); text prompts need a tokenizer")
        single = bool(ids) and all(isinstance(t, int) for t in ids)
        prompts = [ids] if single else ids
        if not isinstance(prompts, list) or not prompts or not all(isinstance(p, list) and p for p in prompts):
            raise BadRequest("input_ids must be a non-empty list of token ids, or a list of them")
        params = body.get("sampling_params") or {}
        temperature = float(params.get("temperature", 1.0))
        max_new = int(params.get("max_new_tokens", 128))
        if max_new != 1:
            raise BadRequest("this test server generates exactly one token: send max_new_tokens 1")
        want_logprob = bool(body.get("return_logprob", False))
        start = int(body.get("logprob_start_len", -1))
        k = int(body.get("top_logprobs_num", 0) or 0)
        if k < 0 or k > self.vocab:
            raise BadRequest(f"top_logprobs_num {k} must be in 0..{self.vocab}")
        results = []
        for i, prompt in enumerate(prompts):
            for t, token in enumerate(prompt):
                if not isinstance(token, int) or not 0 <= token < self.vocab:
                    raise BadRequest(f"input_ids[{i}][{t}] = {token!r} is out of the vocabulary (0..{self.vocab - 1})")
            if len(prompt) + 1 > self.context:
                raise BadRequest(f"The input ({len(prompt)} tokens) is longer than the model's context length "
                                 f"({self.context} tokens).")
            results.append(self._one(prompt, temperature, want_logprob, start, k))
        return results[0] if single else results

    def _one(self, prompt: list[int], temperature: float, want_logprob: bool, start: int, k: int) -> dict[str, Any]:
        began = time.monotonic()
        with self._lock, torch.inference_mode():
            logits = self.model(input_ids=torch.tensor([prompt])).logits[0].float()
            logp = torch.log_softmax(logits, dim=-1)
            if temperature == 0:
                out = int(logits[-1].argmax())
            else:
                probs = torch.softmax(logits[-1] / temperature, dim=-1)
                out = int(torch.multinomial(probs, 1, generator=self._generator))
        self.prompt_tokens += len(prompt)
        meta: dict[str, Any] = {
            "id": uuid.uuid4().hex, "finish_reason": {"type": "length", "length": 1}, "prompt_tokens": len(prompt),
            "completion_tokens": 1, "cached_tokens": 0}
        if want_logprob:
            first = max(start, 0) if start >= 0 else len(prompt)
            positions = range(first, len(prompt))
            meta["input_token_logprobs"] = [
                [None if j == 0 else float(logp[j - 1, prompt[j]]), prompt[j], None] for j in positions]
            meta["output_token_logprobs"] = [[float(logp[-1, out]), out, None]]
            if k > 0:
                values, indices = torch.topk(logp, k, dim=-1)
                rows = [[[float(v), int(x), None] for v, x in zip(vs, xs, strict=True)]
                        for vs, xs in zip(values.tolist(), indices.tolist(), strict=True)]
                meta["input_top_logprobs"] = [None if j == 0 else rows[j - 1] for j in positions]
                meta["output_top_logprobs"] = [rows[-1]]
            else:
                meta["input_top_logprobs"] = [None if j == 0 else [] for j in positions]
                meta["output_top_logprobs"] = [[]]
        meta["e2e_latency"] = time.monotonic() - began
        return {"text": f" w{out}", "output_ids": [out], "meta_info": meta}

    # ---- running it ---------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

        async def serve() -> int:
            self._runner = web.AppRunner(self.app())
            await self._runner.setup()
            site = web.TCPSite(self._runner, "127.0.0.1", 0)
            await site.start()
            server = site._server
            assert server is not None and server.sockets  # type: ignore[union-attr]
            return int(server.sockets[0].getsockname()[1])  # type: ignore[union-attr]

        self.port = asyncio.run_coroutine_threadsafe(serve(), self._loop).result(30)

    def stop(self) -> None:
        """Close the listener and every connection (idempotent): the engine is gone."""
        if self._runner is not None:
            runner, self._runner = self._runner, None
            asyncio.run_coroutine_threadsafe(runner.cleanup(), self._loop).result(30)

    def close(self) -> None:
        self.stop()
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
        if not self._loop.is_running():
            self._loop.close()


@contextlib.contextmanager
def sglang_server(model_dir: Path, *, context: int, vocab: int) -> Iterator[SglangServer]:
    """An SGLang-shaped server for the causal LM in `model_dir` (its context and vocabulary) until the block ends."""
    server = SglangServer(model_dir, context, vocab)
    server.start()
    try:
        yield server
    finally:
        server.close()
