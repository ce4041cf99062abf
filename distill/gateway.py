"""`distill gateway`: vLLM's scoring subset on loopback, answered through the whole mesh.

    distill gateway --registry etcd://10.0.0.5:2379 --service llm-teacher --port 8000
    # then, in the trainer: teacher_model_server_url="http://127.0.0.1:8000" (TRL)

LLM trainers (TRL's `VLLMClient.get_sequence_logprobs` and async distillation worker, verl's
teacher replicas) call one vLLM URL and retry it when it fails. The gateway is that URL, beside
the trainer, and behind it is the pool: teachers from the registry (or a fixed list), each prompt
sent in binary KServe v2 with the reduction done on the teacher (`distill.gateway_scoring`),
routed, hedged and failed over by the reader, and the gateway's demand published for the
autoscaler. It serves

    GET  /health            200 once a teacher is usable, 503 (OpenAI error body) before
    GET  /v1/models         the served name (`data[0].id`), `max_model_len` when given
    POST /v1/completions    token-id prompts, `max_tokens: 1`, `prompt_logprobs: k`, `temperature`,
                            `model`: vLLM's answer, written by `protos.vllm` as the teacher's is

and refuses in OpenAI's error form (`protos.vllm.error_body`): 400 for a body `protos.vllm`
refuses or a prompt the teachers refuse, 404 for another model or path, 413 for a body over
`max_body_mb`, 503 with no usable teacher. Text prompts need a tokenizer, which the gateway does
not hold: send token ids. It listens on 127.0.0.1 by default: it is the trainer's own process.

Python: `async with Gateway(GatewayConfig(registry=..., service=..., port=8000)) as gw: ...`, or
`run_gateway(config)` to serve until SIGINT/SIGTERM.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from distill.gateway_scoring import Scorer, ScoringSettings
from protos.vllm import (
    MAX_PROMPT_LOGPROBS,
    APIError,
    CompletionRequest,
    choice,
    completion_body,
    error_body,
    models_body,
    parse_completion,
    resolve_prompt_logprobs,
)

__all__ = ["Gateway", "GatewayConfig", "run_gateway"]

log = logging.getLogger("distill.gateway")

OFFLOAD_BYTES = 256 << 10
"""Bodies this large are parsed on a worker thread; answers of this many entries rendered there."""
OFFLOAD_ENTRIES = 4096

_PATHS = ("/health", "/v1/models", "/v1/completions")


@dataclass(frozen=True)
class GatewayConfig:
    """Where the gateway listens and where its teachers are (exactly one of `teachers` and
    `registry` + `service`). `served_model_name` is what `/v1/models` names and `model` must
    match (default: `model`, else the service, else "teacher"); `model` is the teachers' model
    (default: what each registered). `max_logprobs` bounds `prompt_logprobs` and is the top-k
    asked of the teachers; `max_model_len` is only reported."""

    port: int = 8000
    host: str = "127.0.0.1"
    teachers: str | None = None
    registry: str | None = None
    service: str | None = None
    registry_options: dict[str, Any] = field(default_factory=dict)
    model: str | None = None
    served_model_name: str | None = None
    input_name: str = "INPUT_IDS"
    output_name: str = "LOGITS"
    max_logprobs: int = MAX_PROMPT_LOGPROBS
    max_model_len: int | None = None
    max_body_mb: float = 64.0
    timeout: float = 30.0
    no_teacher_timeout: float = 30.0
    student_id: str = ""

    def __post_init__(self) -> None:
        if (self.teachers is None) == (self.registry is None):
            raise ValueError("pass exactly one of --teachers HOST:PORT[,HOST:PORT] and --registry etcd://HOST:PORT "
                             "(with --service NAME)")
        if self.registry is not None and not self.service:
            raise ValueError("--registry needs --service NAME: the service the teachers register under")
        if self.teachers is not None and self.service is not None:
            raise ValueError("--service applies only with --registry; drop it when using --teachers")
        if not 1 <= self.max_logprobs <= 1024:
            raise ValueError(f"--max-logprobs must be in 1..1024 (the top-k asked of the teachers), got "
                             f"{self.max_logprobs}")

    @property
    def name(self) -> str:
        return self.served_model_name or self.model or self.service or "teacher"

    def scoring(self) -> ScoringSettings:
        return ScoringSettings(
            teachers=self.teachers, registry=self.registry, service=self.service,
            registry_options=dict(self.registry_options), model=self.model, input_name=self.input_name,
            output_name=self.output_name, max_logprobs=self.max_logprobs, timeout=self.timeout,
            no_teacher_timeout=self.no_teacher_timeout, student_id=self.student_id)


def _error(status: int, message: str, param: str | None = None) -> web.Response:
    return web.Response(body=error_body(status, message[:4000], param), status=status,
                        content_type="application/json")


class Gateway:
    """The aiohttp server and the scorer behind it; `start()` / `close()` or `async with`."""

    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.scorer = Scorer(config.scoring())
        self._runner: web.AppRunner | None = None
        self.port: int | None = None  # the bound port (config.port 0: a free one)

    async def __aenter__(self) -> Gateway:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def start(self) -> Gateway:
        app = web.Application(client_max_size=int(self.config.max_body_mb * (1 << 20)))
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_route("*", "/{tail:.*}", self.not_served)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False, auto_decompress=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.config.host, self.config.port)
        await site.start()
        server = site._server
        sockets = getattr(server, "sockets", None) or []
        self.port = sockets[0].getsockname()[1] if sockets else self.config.port
        await self.scorer.start()
        where = f"{self.config.service} in {self.config.registry}" if self.config.registry else self.config.teachers
        log.info("gateway on http://%s:%s serving %r from %s", self.config.host, self.port, self.config.name, where)
        return self

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        await self.scorer.close()

    # ---- handlers -------------------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        if await self.scorer.ready():
            return web.Response(status=200)
        return _error(503, "no teacher is usable yet; the gateway answers once one is (start teacher-server "
                           "processes, or check the registry address and service)")

    async def models(self, request: web.Request) -> web.Response:
        body = models_body(self.config.name, self.config.max_model_len)
        return web.Response(body=json.dumps(body).encode(), content_type="application/json")

    async def not_served(self, request: web.Request) -> web.Response:
        if request.path in _PATHS:
            method = "POST" if request.path == "/v1/completions" else "GET"
            return _error(405, f"{request.method} {request.path}: use {method}")
        return _error(404, f"{request.method} {request.path} is not served; this gateway serves vLLM's scoring "
                           "subset: GET /health, GET /v1/models, POST /v1/completions")

    async def completions(self, request: web.Request) -> web.Response:
        try:
            body = await self._complete(request)
        except APIError as e:
            return _error(e.status, e.message, e.param)
        except web.HTTPRequestEntityTooLarge:
            return _error(413, f"the body exceeds the gateway's limit of {self.config.max_body_mb:g} MB; send fewer "
                               "prompts per request")
        except (asyncio.CancelledError, web.HTTPException):
            raise
        except Exception as e:  # a bug answers 500 in the form clients parse, and is logged
            log.exception("/v1/completions failed")
            return _error(500, f"the gateway failed to answer: {type(e).__name__}: {e}")
        return web.Response(body=body, content_type="application/json")

    async def _complete(self, request: web.Request) -> bytes:
        encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
        if encoding not in ("identity", ""):
            # The gateway serves its own trainer on loopback, where compression buys nothing; refusing it
            # keeps inflation (a small body that inflates to gigabytes) off this event loop entirely.
            raise APIError(415, f"Content-Encoding {encoding!r} is not accepted by the gateway; send the JSON body "
                                "uncompressed (it serves the trainer on loopback)")
        raw = await request.read()
        k_max = self.config.max_logprobs
        if len(raw) > OFFLOAD_BYTES:
            req = await asyncio.to_thread(parse_completion, raw, k_max)
        else:
            req = parse_completion(raw, k_max)
        if req.model is not None and req.model != self.config.name:
            raise APIError(404, f"The model `{req.model}` does not exist: this gateway serves `{self.config.name}` "
                                "(GET /v1/models)", "model")
        if req.text:
            raise APIError(400, "text prompts need a tokenizer, which the gateway does not hold; send token ids "
                                "(prompt: [[id, ...], ...])", "prompt")
        prompts = [p for p in req.prompts if not isinstance(p, str)]
        context = self.config.max_model_len
        for i, ids in enumerate(prompts):
            if min(ids) < 0:
                raise APIError(400, f"prompt {i}: token ids must be >= 0", "prompt")
            if context is not None and len(ids) > context:
                raise APIError(400, f"prompt {i} has {len(ids)} tokens; the maximum context length is {context} "
                                    "tokens (max_model_len): shorten it", "prompt")
        # -1 (the whole vocabulary) is refused: the gateway holds no model to know its vocabulary by,
        # and its teachers answer --max-logprobs per position
        resolve_prompt_logprobs(req.prompt_logprobs, None, k_max)
        results = await self.scorer.score(prompts, req.temperature)
        entries = sum(len(p) for p in prompts) * ((req.prompt_logprobs or 0) + 1)
        if entries > OFFLOAD_ENTRIES:
            return await asyncio.to_thread(self._render, req, prompts, results)
        return self._render(req, prompts, results)

    def _render(self, req: CompletionRequest, prompts: Sequence[Sequence[int]], results: Sequence[Any]) -> bytes:
        choices = [choice(i, ids, result, k=req.prompt_logprobs, decode=None, return_token_ids=req.return_token_ids)
                   for i, (ids, result) in enumerate(zip(prompts, results, strict=True))]
        return completion_body(self.config.name, choices, sum(len(p) for p in prompts))


async def serve_until_stopped(config: GatewayConfig) -> None:
    """Serve until SIGINT or SIGTERM, then close the server and the reader."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    async with Gateway(config) as gateway:
        print(json.dumps({"gateway": f"http://{config.host}:{gateway.port}", "port": gateway.port,
                          "model": config.name}), flush=True)
        await stop.wait()


def run_gateway(config: GatewayConfig) -> int:
    """Serve `config` until SIGINT/SIGTERM (the `distill gateway` command); returns the exit status."""
    asyncio.run(serve_until_stopped(config))
    return 0
