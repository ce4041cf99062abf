"""KServe v2 HTTP/REST, the second front end of a `RequestLifecycle` (`--http-port`).

It runs on the server's own event loop beside gRPC and shares everything behind the edge: the
lifecycle, the batcher, the metrics. Each handler decodes (`http_codec`), awaits the lifecycle and
maps typed refusals to HTTP statuses (400 invalid, 404 unknown model, 429 queue full, 503 loading
or draining, 500 model failure), with KServe's `{"error": "..."}` body. Routes:

    GET  /v2/health/live, /v2/health/ready, /v2
    GET  /v2/models/{name}[/versions/{version}]            metadata
    GET  /v2/models/{name}[/versions/{version}]/ready|config|stats
    POST /v2/models/{name}[/versions/{version}]/infer      JSON tensors or Triton's binary extension
    POST /v2/repository/index

Bodies are bounded by --max-message-mb (413 beyond it), compressed ones inflated off the loop within
that bound (`http_body`). A JSON header large enough to hold the loop noticeably is decoded on a
worker thread, and so are large JSON outputs.
"""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
from collections.abc import Awaitable, Callable

from aiohttp import web
from google.protobuf.message import Message

from teacher_server.config import HTTPLimits
from teacher_server.errors import InferError
from teacher_server.http_body import BodyReader, BodyRefused
from teacher_server.http_codec import (
    HEADER_LENGTH,
    DecodedInfer,
    EncodedResponse,
    decode_infer,
    encode_response,
    error_body,
    http_status,
)
from teacher_server.http_conn import listen
from teacher_server.lifecycle import RequestLifecycle, ServedModel, ServingState
from teacher_server.model_description import as_json, config_message, metadata_message
from teacher_server.outputs import EncodedOutput
from teacher_server.spec import ModelIO
from teacher_server.vllm_routes import add_vllm_routes

log = logging.getLogger(__name__)

# JSON this large (bytes) is parsed or rendered on a worker thread, so the loop keeps serving.
OFFLOAD_BYTES = 256 << 10

_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _json(payload: object, status: int = 200) -> web.Response:
    return web.Response(body=json.dumps(payload).encode(), status=status, content_type="application/json")


def _error(status: int, message: str) -> web.Response:
    return web.Response(body=error_body(message), status=status, content_type="application/json")


@web.middleware
async def _json_errors(request: web.Request, handler: _Handler) -> web.StreamResponse:
    """aiohttp's own refusals (no such route, wrong method) in KServe's error form; a client that
    went away (mid-body or before its answer) is routine: one debug line, no traceback."""
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return _error(e.status, f"{request.method} {request.path}: {e.reason}")
    except ConnectionError as e:
        log.debug("HTTP client %s went away during %s %s: %s", request.remote, request.method, request.path, e)
        return _error(499, "client closed the connection")  # never delivered: aiohttp drops it quietly


def server_ssl_context(cert: str, key: str, client_ca: str | None) -> ssl.SSLContext:
    """The same TLS as the gRPC port: the PEM chain and key; client certificates required (signed
    by `client_ca`) exactly when it is given."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cert, key)
    if client_ca is not None:
        ctx.load_verify_locations(client_ca)
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


class HTTPService:
    """The REST handlers for the one model a RequestLifecycle serves; holds no request state."""

    def __init__(self, lifecycle: RequestLifecycle, bodies: BodyReader, max_logprobs: int = 20) -> None:
        self._lifecycle = lifecycle
        self._bodies = bodies
        self._max_logprobs = max_logprobs  # vLLM's --max-logprobs, for /v1/completions

    def application(self) -> web.Application:
        app = web.Application(middlewares=[_json_errors], client_max_size=self._bodies.max_body)
        app.router.add_get("/v2/health/live", self.live)
        app.router.add_get("/v2/health/ready", self.ready)
        app.router.add_get("/v2", self.server_metadata)
        app.router.add_post("/v2/repository/index", self.repository_index)
        for base in ("/v2/models/{name}", "/v2/models/{name}/versions/{version}"):
            app.router.add_get(base, self.model_metadata)
            app.router.add_get(f"{base}/ready", self.model_ready)
            app.router.add_get(f"{base}/config", self.model_config)
            app.router.add_get(f"{base}/stats", self.model_stats)
            app.router.add_post(f"{base}/infer", self.infer)
        add_vllm_routes(app, self._lifecycle, self._bodies, self._max_logprobs)  # /health, /v1/models, /v1/completions
        return app

    # ---- health and metadata -------------------------------------------------------------
    async def live(self, request: web.Request) -> web.Response:
        return _json({"live": True})

    async def ready(self, request: web.Request) -> web.Response:
        ready = self._lifecycle.accepting
        return _json({"ready": ready}, 200 if ready else 503)

    async def server_metadata(self, request: web.Request) -> web.Response:
        from teacher_server.version import __version__

        return _json({"name": "teacher-server", "version": __version__,
                      "extensions": ["binary_tensor_data", "model_configuration", "statistics"]})

    def _model(self, request: web.Request) -> web.Response | None:
        """None when the path names the served model; else its 404."""
        try:
            self._lifecycle.check_model(request.match_info["name"], request.match_info.get("version", ""))
        except InferError as e:
            return _error(http_status(e), e.message)
        return None

    async def model_ready(self, request: web.Request) -> web.Response:
        if (refused := self._model(request)) is not None:
            return refused
        ready = self._lifecycle.accepting
        return _json({"name": self._lifecycle.model.name, "ready": ready}, 200 if ready else 503)

    async def model_metadata(self, request: web.Request) -> web.Response:
        return self._describe(request, metadata_message)

    async def model_config(self, request: web.Request) -> web.Response:
        """Triton's JSON model configuration, the same facts as the gRPC ModelConfig answer."""
        return self._describe(request, config_message)

    def _describe(self, request: web.Request, build: Callable[[ServedModel, ModelIO], Message]) -> web.Response:
        """The model's description `build` makes, as JSON; the refusal instead for another model,
        or while the model's tensors are not known yet."""
        if (refused := self._model(request)) is not None:
            return refused
        try:
            io = self._lifecycle.io
        except InferError as e:
            return _error(http_status(e), e.message)
        return _json(as_json(build(self._lifecycle.model, io)))

    async def model_stats(self, request: web.Request) -> web.Response:
        if (refused := self._model(request)) is not None:
            return refused
        model = self._lifecycle.model
        m = self._lifecycle.metrics.snapshot()

        def stat(count: int, us: float) -> dict[str, int]:
            return {"count": count, "ns": int(us * 1000)}

        return _json({"model_stats": [{
            "name": model.name, "version": model.version, "last_inference": int(m.last_inference_ms),
            "inference_count": m.inference_count, "execution_count": m.exec_count,
            "inference_stats": {
                "success": stat(m.request_success, m.request_duration_us),
                "fail": stat(m.request_failure, 0.0),
                "queue": stat(m.request_success, m.queue_duration_us),
                "compute_input": stat(m.request_success, 0.0),  # inside compute_infer's time
                "compute_infer": stat(m.request_success, m.compute_infer_duration_us),
                "compute_output": stat(m.request_success, 0.0),
            },
        }]})

    async def repository_index(self, request: web.Request) -> web.Response:
        model = self._lifecycle.model
        state = {ServingState.SERVING: "READY", ServingState.DRAINING: "UNAVAILABLE",
                 ServingState.LOADING: "LOADING"}[self._lifecycle.state]
        return _json([{"name": model.name, "version": model.version, "state": state}])

    # ---- inference -----------------------------------------------------------------------
    async def infer(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await self._bodies.read(request)
        except BodyRefused as e:
            refused = _error(e.status, e.message)
            if e.status == 408:
                refused.force_close()  # the rest of the body is still on its way: close rather than read it
            return refused
        header_length = request.headers.get(HEADER_LENGTH)
        json_size = int(header_length) if header_length is not None and header_length.isdigit() else len(body)
        args = (body, header_length, request.match_info["name"], request.match_info.get("version", ""))
        if json_size > OFFLOAD_BYTES:
            decoded = await asyncio.to_thread(decode_infer, *args)
        else:
            decoded = decode_infer(*args)
        try:
            result = await self._lifecycle.infer(decoded.request)
        except InferError as e:
            return _error(http_status(e), e.message)
        encoded = await self._encode(decoded, result.outputs, result.nonfinite_rows)
        return await _send(request, encoded)

    async def _encode(self, decoded: DecodedInfer, outputs: list[EncodedOutput],
                      nonfinite_rows: tuple[int, ...] = ()) -> EncodedResponse:
        model = self._lifecycle.model
        as_json = sum(len(raw) for name, _, _, raw in outputs if not decoded.wants_binary(name))
        if as_json > OFFLOAD_BYTES // 8:  # about eight characters of JSON per byte of tensor
            return await asyncio.to_thread(encode_response, decoded, model.name, model.version, outputs,
                                           nonfinite_rows)
        return encode_response(decoded, model.name, model.version, outputs, nonfinite_rows)


async def _send(request: web.Request, encoded: EncodedResponse) -> web.StreamResponse:
    """Write the JSON header and each binary output as they are, without joining them into one copy."""
    if encoded.header_length is None:
        return web.Response(body=encoded.header, content_type="application/json")
    resp = web.StreamResponse(headers={HEADER_LENGTH: str(encoded.header_length)})
    resp.content_type = "application/octet-stream"
    resp.content_length = encoded.size
    await resp.prepare(request)
    await resp.write(encoded.header)
    for part in encoded.binary:
        await resp.write(part)
    await resp.write_eof()
    return resp


class HTTPFrontEnd:
    """The REST listener's lifetime: bound in `start`, closed in `stop` (after the drain, when every
    accepted request has been answered). `limits` bound what one client may hold (`HTTPLimits`)."""

    def __init__(self, lifecycle: RequestLifecycle, max_body_bytes: int, ssl_context: ssl.SSLContext | None = None,
                 shutdown_timeout_s: float = 1.0, limits: HTTPLimits | None = None) -> None:
        self._limits = limits or HTTPLimits()
        bodies = BodyReader(max_body_bytes, self._limits.http_request_timeout_s)
        self._app = HTTPService(lifecycle, bodies, self._limits.max_logprobs).application()
        self._ssl = ssl_context
        # Compressed bodies are inflated by BodyReader, off the loop and bounded, not by aiohttp's parser.
        self._runner = web.AppRunner(self._app, access_log=None, shutdown_timeout=shutdown_timeout_s,
                                     auto_decompress=False, keepalive_timeout=self._limits.http_idle_timeout_s)
        self._listener: asyncio.Server | None = None
        self.port = 0

    async def start(self, host: str, port: int) -> int:
        """Listen on host:port (0: a free one); the bound port. OSError naming the flag if it is taken."""
        await self._runner.setup()
        try:
            self._listener = await listen(self._runner, host, port, self._ssl, self._limits.http_max_connections,
                                          head_timeout_s=self._limits.http_idle_timeout_s)
        except OSError as e:
            await self._runner.cleanup()
            raise OSError(f"cannot bind HTTP {host}:{port} ({e.strerror}); is the port in use? "
                          "(--http-port 0 picks a free one)") from e
        self.port = int(self._listener.sockets[0].getsockname()[1])
        return self.port

    async def stop(self) -> None:
        """Stop listening, let handlers still writing finish (bounded), close connections."""
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        await self._runner.cleanup()
