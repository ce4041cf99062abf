"""Is the engine ready, and what record describes it: the probes of the HTTP engines (vLLM, SGLang).

Why two checks: ``ready()`` is the full check a record is built from (health, then the served
model), run until the engine first answers it and again after every withdrawal; ``healthy()`` is
the cheap liveness check run about once a second while the record is up. Both raise
:class:`EngineNotReady` with what they saw; neither ever raises anything else for an engine that is
down, slow or answering nonsense. Every HTTP call has a deadline (``timeout``).

The record of an HTTP engine says what every vLLM or SGLang server can do: score token-id or text
prompts with the prompt's own log-probs and a top-k (``--max-top-k``, vLLM's ``--max-logprobs``)
plus its tail mass, never whole logits; the vocabulary is not known here (``LOGITS`` is
``[-1, -1]``); the engine batches internally, so the batch bound is generous and requests of any
length are kept in flight (``batches_by_length``).
"""

from __future__ import annotations

import abc
import asyncio
import json
from dataclasses import dataclass
from typing import Any

import aiohttp

from discovery.aio import describe
from protos import registry_pb2
from teacher_server.registrar.engine import EngineAddress
from teacher_server.registrar.errors import EngineNotReady

__all__ = ["ENGINE_MAX_BATCH", "HTTPProbe", "Probe", "ProbeOptions", "SGLangProbe", "VLLMProbe", "make_probe"]

ENGINE_MAX_BATCH = 256
"""The batch bound an HTTP engine's record declares: engines batch internally (continuous batching),
so this only caps how many rows a student packs into one request."""


@dataclass(frozen=True)
class ProbeOptions:
    """``model``: the served model to register (None: the only one the engine serves).
    ``max_top_k``: the engine's top-k limit (vLLM ``--max-logprobs``). ``device``: the record's
    device string. ``timeout``: the deadline of one HTTP or gRPC call, in seconds."""

    model: str | None = None
    max_top_k: int = 20
    device: str = "engine"
    timeout: float = 5.0


class Probe(abc.ABC):
    """One engine's readiness, liveness and metrics. Owns its HTTP session (and, for KServe, its
    gRPC channel); :meth:`close` releases them."""

    def __init__(self, address: EngineAddress, options: ProbeOptions) -> None:
        self.address = address
        self.options = options
        self._session: aiohttp.ClientSession | None = None

    @abc.abstractmethod
    async def ready(self) -> registry_pb2.TeacherRecord:
        """The engine's record (without instance_id and started_at) once it answers every readiness
        check; :class:`EngineNotReady` otherwise."""

    @abc.abstractmethod
    async def healthy(self) -> None:
        """Return when the engine answers its health check; :class:`EngineNotReady` otherwise."""

    async def metrics(self) -> str | None:
        """The text of the engine's Prometheus metrics; None when no metrics URL is known or the
        scrape failed (the load then keeps to what is known)."""
        url = self.address.metrics_url
        if url is None:
            return None
        try:
            status, body = await self._get(url)
        except EngineNotReady:
            return None
        return body.decode("utf-8", errors="replace") if status == 200 else None

    async def close(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    async def _get(self, url: str) -> tuple[int, bytes]:
        """GET ``url`` within the deadline: (status, body); EngineNotReady when it does not answer."""
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.options.timeout))
        try:
            async with self._session.get(url, allow_redirects=False) as resp:
                return resp.status, await resp.read()
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            raise EngineNotReady(f"GET {url}: no answer ({describe(e)})") from None

    async def _get_json(self, route: str) -> Any:
        """GET the engine's ``route`` and parse its JSON; EngineNotReady unless it answers 200 with JSON."""
        url = f"{self.address.base_url}{route}"
        status, body = await self._get(url)
        if status != 200:
            raise EngineNotReady(f"GET {url}: HTTP {status}")
        try:
            return json.loads(body)
        except ValueError:
            raise EngineNotReady(f"GET {url}: the answer is not JSON") from None


class HTTPProbe(Probe):
    """The checks vLLM and SGLang share: ``GET /health`` answers 200."""

    async def healthy(self) -> None:
        url = f"{self.address.base_url}/health"
        status, _ = await self._get(url)
        if status != 200:
            raise EngineNotReady(f"GET {url}: HTTP {status}")

    def record(self, model_name: str) -> registry_pb2.TeacherRecord:
        """The record of an HTTP engine serving ``model_name`` (see the module docstring)."""
        a = self.address
        rec = registry_pb2.TeacherRecord(
            endpoint=a.endpoint, protocol=a.kind, path=a.path, model_name=model_name,
            max_batch_size=ENGINE_MAX_BATCH, device=self.options.device, instances=1, tls=a.tls,
            batches_by_length=True,
            capabilities=registry_pb2.Capabilities(
                declared=True, max_top_k=self.options.max_top_k, token_logprobs=True, score_ids=False,
                text_prompts=True, chunked=False, full_outputs=False, tail=True),
        )
        rec.inputs.add(name="INPUT_IDS", datatype="INT64", shape=[-1])
        rec.inputs.add(name="ATTENTION_MASK", datatype="INT64", shape=[-1])
        rec.outputs.add(name="LOGITS", datatype="FP32", shape=[-1, -1])
        return rec

    def choose_model(self, served: list[str], where: str) -> str:
        """``--model`` when the engine serves it, else the only model it serves."""
        wanted = self.options.model
        if wanted is not None:
            if wanted not in served:
                raise EngineNotReady(f"{where} lists {served or 'no model'}, not --model {wanted!r}; pass the name "
                                     "the engine serves (vLLM: --served-model-name, else the model path)")
            return wanted
        if len(served) != 1:
            raise EngineNotReady(f"{where} lists {served or 'no model'}; pass --model NAME to say which to register")
        return served[0]


class VLLMProbe(HTTPProbe):
    """vLLM's OpenAI-compatible server: ``/health``, then ``/v1/models`` lists the model."""

    async def ready(self) -> registry_pb2.TeacherRecord:
        await self.healthy()
        body = await self._get_json("/v1/models")
        data = body.get("data") if isinstance(body, dict) else None
        if not isinstance(data, list):
            raise EngineNotReady(f"GET {self.address.base_url}/v1/models: no 'data' list in the answer")
        cards = {str(m["id"]): m for m in data if isinstance(m, dict) and "id" in m}
        name = self.choose_model(list(cards), "/v1/models")
        record = self.record(name)
        record.fingerprint = str(cards[name].get("fingerprint") or "")  # teacher-server's card has one; vLLM's not
        return record


class SGLangProbe(HTTPProbe):
    """SGLang's native server: ``/health``, then ``/get_model_info`` names the model."""

    async def ready(self) -> registry_pb2.TeacherRecord:
        await self.healthy()
        body = await self._get_json("/get_model_info")
        path = body.get("model_path") if isinstance(body, dict) else None
        if not isinstance(path, str) or not path:
            raise EngineNotReady(f"GET {self.address.base_url}/get_model_info: no 'model_path' in the answer")
        # SGLang serves one model: --model only names it in the record (its --served-model-name).
        return self.record(self.options.model or path)


def make_probe(address: EngineAddress, options: ProbeOptions) -> Probe:
    """The probe of ``address.kind``."""
    if address.kind == "vllm":
        return VLLMProbe(address, options)
    if address.kind == "sglang":
        return SGLangProbe(address, options)
    from teacher_server.registrar.kserve_probe import KServeProbe

    return KServeProbe(address, options)
