"""vLLM's scoring subset on the teacher's HTTP port, beside KServe v2: the aiohttp handlers.

    GET  /health            200 while serving, 503 (OpenAI error body) while loading or draining
    GET  /v1/models         the served model (`data[0].id`, `max_model_len`)
    POST /v1/completions    token-id (or, with the teacher's tokenizer, text) prompts scored with
                            `prompt_logprobs`; one greedy token generated (`max_tokens: 1`)

Each prompt becomes its own request to the same `RequestLifecycle` the gRPC and KServe HTTP
front ends use (so the same validation, batcher, device-side transforms and metrics), all of a
body's prompts in flight at once; the first refusal answers the whole body and cancels the rest.
Refusals use OpenAI's error form (`protos.vllm.error_body`): 400 invalid, 404 unknown model or
path, 413 body too large, 429 queue full, 503 loading or draining, 500 model failure.

Text prompts need the teacher's tokenizer: an `hf:DIR` holding tokenizer files has one (loaded
once, on first use, off the event loop, from the directory only); otherwise text is refused with
a 400 that says to send token ids. Bodies are bounded like the KServe routes' (--max-message-mb),
prompts by the model's context and vocabulary, `prompt_logprobs` by `max_logprobs` (vLLM's
--max-logprobs; -1 asks for the whole vocabulary, as in vLLM).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from aiohttp import web

from protos.vllm import (
    MAX_PROMPT_LOGPROBS,
    APIError,
    CompletionRequest,
    check_prompt,
    choice,
    completion_body,
    error_body,
    models_body,
    outputs_not_finite,
    parse_completion,
    resolve_prompt_logprobs,
)
from teacher_server.errors import InferError, capped
from teacher_server.http_body import BodyReader, BodyRefused
from teacher_server.http_codec import http_status
from teacher_server.lifecycle import RequestLifecycle
from teacher_server.outputs import EncodedOutput
from teacher_server.spec import ModelIO
from teacher_server.transforms import scoreable, token_input
from teacher_server.vllm_protocol import infer_request, scored

log = logging.getLogger(__name__)

# Bodies (or answers: positions x entries) this large are parsed or rendered on a worker thread.
OFFLOAD_BYTES = 256 << 10
OFFLOAD_ENTRIES = 4096

_PATHS = ("/health", "/v1/models", "/v1/completions")


def _error(status: int, message: str, param: str | None = None) -> web.Response:
    return web.Response(body=error_body(status, capped(message), param), status=status,
                        content_type="application/json")


def _json(body: bytes) -> web.Response:
    return web.Response(body=body, content_type="application/json")


class VLLMRoutes:
    """The handlers for the one model a RequestLifecycle serves; `register(app)` adds them."""

    def __init__(self, lifecycle: RequestLifecycle, bodies: BodyReader,
                 max_logprobs: int = MAX_PROMPT_LOGPROBS) -> None:
        self._lifecycle = lifecycle
        self._bodies = bodies
        self._max_logprobs = max_logprobs
        self._tokenizer = lifecycle.text.tokenizer  # one tokenizer per server, shared with KServe text requests

    def register(self, app: web.Application) -> None:
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_route("*", "/v1/{tail:.*}", self.not_served)

    async def health(self, request: web.Request) -> web.Response:
        if self._lifecycle.accepting:
            return web.Response(status=200)
        return _error(503, f"the teacher is {self._lifecycle.state.value.lower()}; retry shortly or on another teacher")

    async def not_served(self, request: web.Request) -> web.Response:
        if request.path in _PATHS:
            method = "GET" if request.path != "/v1/completions" else "POST"
            return _error(405, f"{request.method} {request.path}: use {method}")
        return _error(404, f"{request.method} {request.path} is not served; this teacher serves vLLM's scoring "
                           "subset: GET /health, GET /v1/models, POST /v1/completions (and KServe v2 under /v2)")

    def _io(self) -> ModelIO:
        try:
            return self._lifecycle.io
        except InferError as e:
            raise APIError(http_status(e), e.message) from None

    async def models(self, request: web.Request) -> web.Response:
        try:
            io = self._io()
        except APIError as e:
            return _error(e.status, e.message)
        index = token_input(io)
        context = None if index is None else io.inputs[index].max_length
        model = self._lifecycle.model
        return _json(json.dumps(models_body(model.name, context, model.fingerprint)).encode())

    async def completions(self, request: web.Request) -> web.Response:
        try:
            return _json(await self._complete(request))
        except APIError as e:
            refused = _error(e.status, e.message, e.param)
            if e.status == 408:
                refused.force_close()  # the rest of the body is still on its way: close rather than read it
            return refused
        except (asyncio.CancelledError, web.HTTPException):
            raise
        except Exception as e:  # a bug here answers 500 in the form clients parse, and is logged
            log.exception("/v1/completions failed")
            return _error(500, f"the teacher failed to answer: {type(e).__name__}: {e}")

    async def _read(self, request: web.Request) -> bytes:
        """The body within the same bounds as the KServe routes (size, compression, arrival time)."""
        try:
            return await self._bodies.read(request)
        except BodyRefused as e:
            raise APIError(e.status, e.message) from None

    async def _complete(self, request: web.Request) -> bytes:
        body = await self._read(request)
        if len(body) > OFFLOAD_BYTES:
            req = await asyncio.to_thread(parse_completion, body, self._max_logprobs)
        else:
            req = parse_completion(body, self._max_logprobs)
        name = self._lifecycle.model.name
        if req.model is not None and req.model != name:
            raise APIError(404, f"The model `{req.model}` does not exist: this teacher serves `{name}` "
                                "(GET /v1/models)", "model")
        io = self._io()
        index = token_input(io)
        output = next((s for s in io.outputs if scoreable(s)), None)
        others = [s.name for i, s in enumerate(io.inputs) if i != index and s.name != io.attention_mask]
        if index is None or output is None or others:
            raise APIError(400, "/v1/completions scores causal LMs: a model with one padded token input and a "
                                "per-position output [T, V] (an hf: causal LM); use the KServe v2 routes for this one")
        tokenizer = await self._tokenizer.get()
        prompts = await self._token_ids(req, tokenizer)
        spec = io.inputs[index]
        for i, ids in enumerate(prompts):
            check_prompt(i, ids, spec.max_value, spec.max_length)
        req = replace(req, prompt_logprobs=resolve_prompt_logprobs(req.prompt_logprobs, spec.max_value,
                                                                   self._max_logprobs))
        top_k = max(req.prompt_logprobs or 0, 1)
        requests = [infer_request(name, ids, input_name=spec.name, datatype=spec.datatype, output_name=output.name,
                                  top_k=top_k, temperature=req.temperature)
                    for ids in prompts]
        results = await _all(self._lifecycle, requests)
        entries = sum(len(p) for p in prompts) * ((req.prompt_logprobs or 0) + 1)
        args = (req, prompts, results, output.name, tokenizer)
        if tokenizer is not None or entries > OFFLOAD_ENTRIES:
            return await asyncio.to_thread(self._render, *args)
        return self._render(*args)

    async def _token_ids(self, req: CompletionRequest, tokenizer: Any) -> list[Sequence[int]]:
        if not req.text:
            return [p for p in req.prompts if not isinstance(p, str)]
        if tokenizer is None:
            raise APIError(400, f"text prompts need the teacher's tokenizer, and {self._tokenizer.why_not}; send "
                                "token ids instead (prompt: [[id, ...], ...])", "prompt")
        texts = [p for p in req.prompts if isinstance(p, str)]
        ids = await asyncio.to_thread(self._tokenizer.encode, texts, req.add_special_tokens)
        for i, p in enumerate(ids):
            if not p:
                raise APIError(400, f"prompt {i} has no tokens once tokenized; send at least one", "prompt")
        return list(ids)

    def _render(self, req: CompletionRequest, prompts: list[Sequence[int]], results: list[list[EncodedOutput]],
                output: str, tokenizer: Any) -> bytes:
        decode = self._tokenizer.decode if tokenizer is not None else None
        choices = []
        for i, (ids, outs) in enumerate(zip(prompts, results, strict=True)):
            result = scored(outs, output)
            text = None if tokenizer is None else self._tokenizer.continuation(ids, int(result.top_ids[-1, 0]))
            choices.append(choice(i, ids, result, k=req.prompt_logprobs, decode=decode,
                                  return_token_ids=req.return_token_ids, text=text))
        return completion_body(self._lifecycle.model.name, choices, sum(len(p) for p in prompts),
                               self._lifecycle.model.fingerprint)


async def _all(lifecycle: RequestLifecycle, requests: list[Any]) -> list[list[EncodedOutput]]:
    """Every prompt's outputs, the requests in flight together, at most half the batcher's queue
    at a time (a body of more prompts than the queue holds is still answered, not refused as
    overload); the first refusal cancels the rest and answers for all (as does the caller going
    away)."""
    window = asyncio.Semaphore(max(1, lifecycle.model.batching.queue_bound(lifecycle.io.padded) // 2))

    async def one(request: Any) -> Any:
        async with window:
            return await lifecycle.infer(request)

    tasks = [asyncio.ensure_future(one(r)) for r in requests]
    try:
        done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    except asyncio.CancelledError:
        for t in tasks:
            t.cancel()
        raise
    for t in pending:
        t.cancel()
    if pending:
        await asyncio.gather(*pending, return_exceptions=True)
    for t in tasks:
        if t in done and not t.cancelled() and (e := t.exception()) is not None:
            for other in done:  # retrieve the others' exceptions so none is logged as never retrieved
                if not other.cancelled():
                    other.exception()
            if isinstance(e, InferError):
                raise APIError(http_status(e), e.message) from None
            raise e
    bad = [i for i, t in enumerate(tasks) if t.result().nonfinite_rows]
    if bad:  # never a log-probability of inf or NaN in a 200 answer
        raise outputs_not_finite(bad)
    return [t.result().outputs for t in tasks]


def add_vllm_routes(app: web.Application, lifecycle: RequestLifecycle, bodies: BodyReader,
                    max_logprobs: int = MAX_PROMPT_LOGPROBS) -> None:
    """Serve vLLM's scoring subset on `app` (the KServe v2 HTTP application) for `lifecycle`, at
    most `max_logprobs` (--max-logprobs) prompt_logprobs per position."""
    VLLMRoutes(lifecycle, bodies, max_logprobs).register(app)
