"""`distill gateway`: vLLM's scoring subset on loopback, answered through the whole mesh.

    distill gateway --registry etcd://10.0.0.5:2379 --service llm-teacher --port 8000
    # then, in the trainer: teacher_model_server_url="http://127.0.0.1:8000" (TRL)
    distill gateway --teacher math=etcd://10.0.0.5:2379/math-svc --teacher code=10.0.0.7:9898 --port 8000
    # then: teacher_server_urls={"math": "http://127.0.0.1:8000/teachers/math", "code": ".../teachers/code"}

LLM trainers (TRL's `VLLMClient.get_sequence_logprobs` and async distillation worker, verl's
teacher replicas) call one vLLM URL per teacher and retry it when it fails. The gateway is that URL,
beside the trainer, and behind it is the pool: teachers from the registry (or a fixed list), each
prompt sent in binary KServe v2 with the reduction done on the teacher (`distill.gateway_scoring`),
routed, hedged and failed over by the reader, and the gateway's demand published for the
autoscaler. Several teachers (`--teacher NAME=SPEC`, `distill.gateway_teachers`) each get their own
reader, so one teacher's failure or overload never fails another's requests. It serves

    GET  /health            200 once every teacher is usable, 503 (OpenAI error body naming those not) before
    GET  /v1/models         every served name (`data[i].id`), `max_model_len` when given
    POST /v1/completions    token-id prompts, `max_tokens: 1`, `prompt_logprobs: k`, `temperature`,
                            `model` (which teacher; may be left out with one): vLLM's answer, written by
                            `protos.vllm` as the teacher's is, `system_fingerprint` the teacher's fingerprint
    /teachers/NAME/...      the same three for teacher NAME alone: one base URL per teacher

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
from distill.gateway_teachers import TEACHER_FORM, TeacherSpec
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
from teacher_server.api import run_async

__all__ = ["Gateway", "GatewayConfig", "TeacherSpec", "run_gateway"]

log = logging.getLogger("distill.gateway")

OFFLOAD_BYTES = 256 << 10
"""Bodies this large are parsed on a worker thread; answers of this many entries rendered there."""
OFFLOAD_ENTRIES = 4096

_PATHS = ("/health", "/v1/models", "/v1/completions")
TEACHERS_PREFIX = "/teachers/"
"""Teacher NAME's own base URL is /teachers/NAME: the three paths of `_PATHS` beneath it."""


@dataclass(frozen=True)
class GatewayConfig:
    """Where the gateway listens and where its teachers are: several named ones (`named_teachers`,
    `--teacher NAME=SPEC`), or one (exactly one of `teachers` and `registry` + `service`), served
    as `served_model_name` (default: `model`, else the service, else "teacher"). A request's
    `model` names the teacher. `model` is the teachers' model (default: what each registered).
    `max_logprobs` bounds `prompt_logprobs` and is the top-k asked of the teachers;
    `max_model_len` is only reported. `registry_options` apply to every registry."""

    port: int = 8000
    host: str = "127.0.0.1"
    teachers: str | None = None
    registry: str | None = None
    service: str | None = None
    named_teachers: tuple[TeacherSpec, ...] = ()
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
        if self.named_teachers:
            if self.teachers is not None or self.registry is not None or self.service is not None:
                raise ValueError(f"--teacher {TEACHER_FORM} names each teacher and where it is; drop --teachers, "
                                 "--registry and --service (or use them alone for one teacher)")
            if self.served_model_name is not None:
                raise ValueError("--served-model-name is for one teacher; with --teacher, NAME is each teacher's "
                                 "served name")
            names = [t.name for t in self.named_teachers]
            if twice := sorted({n for n in names if names.count(n) > 1}):
                raise ValueError(f"--teacher names must differ; given more than once: {', '.join(twice)}")
        elif (self.teachers is None) == (self.registry is None):
            raise ValueError(f"pass --teacher {TEACHER_FORM} (once per teacher), or for one teacher exactly one of "
                             "--teachers HOST:PORT[,HOST:PORT] and --registry etcd://HOST:PORT (with --service NAME)")
        elif self.registry is not None and not self.service:
            raise ValueError("--registry needs --service NAME: the service the teachers register under")
        elif self.teachers is not None and self.service is not None:
            raise ValueError("--service applies only with --registry; drop it when using --teachers")
        if not 1 <= self.max_logprobs <= 1024:
            raise ValueError(f"--max-logprobs must be in 1..1024 (the top-k asked of the teachers), got "
                             f"{self.max_logprobs}")

    @property
    def name(self) -> str:
        """The served name of the one teacher of --teachers / --registry (the first of several)."""
        if self.named_teachers:
            return self.named_teachers[0].name
        return self.served_model_name or self.model or self.service or "teacher"

    def specs(self) -> tuple[TeacherSpec, ...]:
        """Every teacher served, in the order given: the one of --teachers / --registry is named `name`."""
        if self.named_teachers:
            return self.named_teachers
        return (TeacherSpec(self.name, teachers=self.teachers, registry=self.registry, service=self.service),)

    def scoring(self, spec: TeacherSpec | None = None) -> ScoringSettings:
        """The reader settings of teacher `spec` (default: the first)."""
        spec = spec or self.specs()[0]
        return ScoringSettings(
            teachers=spec.teachers, registry=spec.registry, service=spec.service,
            registry_options=dict(self.registry_options), model=self.model, input_name=self.input_name,
            output_name=self.output_name, max_logprobs=self.max_logprobs, timeout=self.timeout,
            no_teacher_timeout=self.no_teacher_timeout, student_id=self.student_id)


def _error(status: int, message: str, param: str | None = None) -> web.Response:
    return web.Response(body=error_body(status, message[:4000], param), status=status,
                        content_type="application/json")


def _names(names: Sequence[str]) -> str:
    return ", ".join(f"`{n}`" for n in names)


class Gateway:
    """The aiohttp server and one scorer (one reader) per teacher; `start()` / `close()` or
    `async with`. A teacher's requests wait only on its own scorer."""

    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.scorers: dict[str, Scorer] = {spec.name: Scorer(config.scoring(spec)) for spec in config.specs()}
        self._where = {spec.name: spec.where for spec in config.specs()}
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
        app.router.add_get(TEACHERS_PREFIX + "{teacher}/health", self.health)
        app.router.add_get(TEACHERS_PREFIX + "{teacher}/v1/models", self.models)
        app.router.add_post(TEACHERS_PREFIX + "{teacher}/v1/completions", self.completions)
        app.router.add_route("*", "/{tail:.*}", self.not_served)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False, auto_decompress=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.config.host, self.config.port)
        await site.start()
        server = site._server
        sockets = getattr(server, "sockets", None) or []
        self.port = sockets[0].getsockname()[1] if sockets else self.config.port
        for scorer in self.scorers.values():
            await scorer.start()
        for name, where in self._where.items():
            log.info("gateway on http://%s:%s serving %r from %s", self.config.host, self.port, name, where)
        return self

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        await asyncio.gather(*(scorer.close() for scorer in self.scorers.values()))

    def _teacher(self, request: web.Request) -> str | None:
        """The teacher of a /teachers/NAME/... path (None at the root); APIError 404 for an unknown NAME."""
        name = request.match_info.get("teacher")
        if name is not None and name not in self.scorers:
            raise APIError(404, f"no teacher is named `{name}`: this gateway serves {_names(list(self.scorers))} "
                                f"(GET /v1/models), each beneath {TEACHERS_PREFIX}NAME", "model")
        return name

    # ---- handlers -------------------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        try:
            name = self._teacher(request)
        except APIError as e:
            return _error(e.status, e.message, e.param)
        names = [name] if name else list(self.scorers)
        ready = await asyncio.gather(*(self.scorers[n].ready() for n in names))
        waiting = [n for n, ok in zip(names, ready, strict=True) if not ok]
        if not waiting:
            return web.Response(status=200)
        if len(self.scorers) == 1:
            return _error(503, "no teacher is usable yet; the gateway answers once one is (start teacher-server "
                               "processes, or check the registry address and service)")
        where = "; ".join(f"`{n}`: {self._where[n]}" for n in waiting)
        return _error(503, f"no teacher is usable yet for {_names(waiting)} ({where}); requests to the other "
                           f"teachers are answered, and each teacher's own health is at {TEACHERS_PREFIX}NAME/health")

    async def models(self, request: web.Request) -> web.Response:
        try:
            name = self._teacher(request)
        except APIError as e:
            return _error(e.status, e.message, e.param)
        names = [name] if name else list(self.scorers)
        prints = await asyncio.gather(*(self.scorers[n].fingerprint() for n in names))
        bodies = [models_body(n, self.config.max_model_len, p) for n, p in zip(names, prints, strict=True)]
        body = {"object": "list", "data": [entry for b in bodies for entry in b["data"]]}
        return web.Response(body=json.dumps(body).encode(), content_type="application/json")

    async def not_served(self, request: web.Request) -> web.Response:
        path = request.path
        if path.startswith(TEACHERS_PREFIX) and path.count("/") >= 3:
            path = "/" + path[len(TEACHERS_PREFIX):].split("/", 1)[1]
        if path in _PATHS:
            method = "POST" if path == "/v1/completions" else "GET"
            return _error(405, f"{request.method} {request.path}: use {method}")
        return _error(404, f"{request.method} {request.path} is not served; this gateway serves vLLM's scoring "
                           "subset: GET /health, GET /v1/models, POST /v1/completions, and the same beneath "
                           f"{TEACHERS_PREFIX}NAME for each teacher")

    async def completions(self, request: web.Request) -> web.Response:
        try:
            body = await self._complete(request, self._teacher(request))
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

    def _choose(self, model: str | None, fixed: str | None) -> str:
        """The teacher a body's `model` names: at /teachers/NAME only NAME (or none); at the root one of
        them, and may be left out only with one teacher. 404 (vLLM's status) for another model."""
        if fixed is not None:
            if model is not None and model != fixed:
                raise APIError(404, f"The model `{model}` does not exist: {TEACHERS_PREFIX}{fixed} serves `{fixed}` "
                                    f"(the gateway serves {_names(list(self.scorers))}, each at "
                                    f"{TEACHERS_PREFIX}NAME)", "model")
            return fixed
        if model is None:
            if len(self.scorers) == 1:
                return next(iter(self.scorers))
            raise APIError(400, f"name the teacher in `model`: one of {_names(list(self.scorers))} (GET /v1/models)",
                           "model")
        if model not in self.scorers:
            served = "serves" if len(self.scorers) == 1 else "serves the teachers"
            raise APIError(404, f"The model `{model}` does not exist: this gateway {served} "
                                f"{_names(list(self.scorers))} (GET /v1/models)", "model")
        return model

    async def _complete(self, request: web.Request, fixed: str | None) -> bytes:
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
        name = self._choose(req.model, fixed)
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
        scorer = self.scorers[name]
        results = await scorer.score(prompts, req.temperature)
        fingerprint = await scorer.fingerprint()
        entries = sum(len(p) for p in prompts) * ((req.prompt_logprobs or 0) + 1)
        if entries > OFFLOAD_ENTRIES:
            return await asyncio.to_thread(self._render, name, fingerprint, req, prompts, results)
        return self._render(name, fingerprint, req, prompts, results)

    def _render(self, name: str, fingerprint: str, req: CompletionRequest, prompts: Sequence[Sequence[int]],
                results: Sequence[Any]) -> bytes:
        choices = [choice(i, ids, result, k=req.prompt_logprobs, decode=None, return_token_ids=req.return_token_ids)
                   for i, (ids, result) in enumerate(zip(prompts, results, strict=True))]
        return completion_body(name, choices, sum(len(p) for p in prompts), fingerprint=fingerprint)


async def serve_until_stopped(config: GatewayConfig) -> None:
    """Serve until SIGINT or SIGTERM, then close the server and the reader."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    async with Gateway(config) as gateway:
        print(json.dumps({"gateway": f"http://{config.host}:{gateway.port}", "port": gateway.port,
                          "model": config.name, "models": list(gateway.scorers)}), flush=True)
        await stop.wait()


def run_gateway(config: GatewayConfig) -> int:
    """Serve `config` until SIGINT/SIGTERM (the `distill gateway` command); returns the exit status.
    The HTTP server runs on uvloop, as teacher-server does: its per-request cost is the gateway's
    share of the CPU beside a teacher on the same host."""
    run_async(serve_until_stopped(config))
    return 0
