"""What the vLLM and SGLang clients share: the `InferenceClient` methods around one engine call.

`infer` plans the chunk (`distill.engines.rows.plan`: prompts cut to their masks, refusals of what
an engine cannot compute), sends it as ONE HTTP request in the engine's own protocol (the
subclass's `_score`), and puts the decoded answer back at the request's padded width
(`assemble`). `ready` is the engine's health route. `fetch_metadata` serves a teacher that has no
registry record (a static list): the model's name from the engine, and the contract every engine
serves, INPUT_IDS / ATTENTION_MASK in and LOGITS [-1, -1] out (reduced outputs only), batching
rows by length (engines schedule sequences, not padded batches).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import grpc
import torch

from distill.call_errors import ModelChoiceError, TeacherCallError
from distill.engines.http import EngineHTTP
from distill.engines.rows import ENGINE_INPUTS, ENGINE_OUTPUTS, Plan, RowScores, assemble, plan
from distill.types import ChunkRequest, TeacherMetadata

__all__ = ["MAX_BATCH_SIZE", "EngineClient"]

MAX_BATCH_SIZE = 256
"""The rows a reader sends an engine in one request when no registry record says otherwise."""


class EngineClient:
    """One engine at `endpoint` (host:port) under HTTP path prefix `path`; subclasses speak its protocol."""

    engine: ClassVar[str] = "engine"
    health_route: ClassVar[str] = "/health"
    reports_ranks: ClassVar[bool] = False

    def __init__(self, endpoint: str, http: EngineHTTP) -> None:
        self.endpoint = endpoint
        self._http = http

    async def infer(self, request: ChunkRequest, timeout: float) -> dict[str, torch.Tensor]:
        """The chunk's outputs as a KServe teacher-server returns them, from one engine request."""
        pl = plan(request, self.engine, ranks=self.reports_ranks)
        scores = await self._score(pl, request.model_name, timeout)
        return assemble(pl, scores)

    async def _score(self, pl: Plan, model: str, timeout: float) -> Sequence[RowScores]:
        raise NotImplementedError

    async def ready(self, model: str, timeout: float) -> bool:
        return await self._http.healthy(self.health_route, timeout)

    async def fetch_metadata(self, model: str | None, version: str, timeout: float) -> TeacherMetadata:
        """The engine's model and the contract every engine serves (module docstring)."""
        served = await self._models(timeout)
        if model:
            if model not in served:
                raise TeacherCallError(grpc.StatusCode.NOT_FOUND, f"{self.engine} at {self.endpoint} serves "
                                                                  f"{served}, not model {model!r}; name one of those")
            name = model
        elif len(served) == 1:
            name = served[0]
        else:
            raise ModelChoiceError(self.endpoint, served)
        return TeacherMetadata(name, version, MAX_BATCH_SIZE, dict(ENGINE_INPUTS), dict(ENGINE_OUTPUTS),
                               batches_by_length=True)

    async def _models(self, timeout: float) -> list[str]:
        raise NotImplementedError

    async def close(self) -> None:
        await self._http.close()

