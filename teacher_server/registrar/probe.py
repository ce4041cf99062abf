"""What every engine's probe answers: readiness (and the record), liveness, metrics.

Why two checks: ``ready()`` is the full check a record is built from (run until the engine first
answers it and again after every withdrawal); ``healthy()`` is the cheap liveness check run about
once a second while the record is up. Both raise :class:`EngineNotReady` with what they saw; neither
ever raises anything else for an engine that is down, slow or answering nonsense. Every HTTP call
has a deadline (``ProbeOptions.timeout``). The engines' own probes: :mod:`.probes` (vLLM, SGLang),
:mod:`.kserve_probe` (Triton, teacher-server).
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

__all__ = ["Probe", "ProbeOptions"]


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
