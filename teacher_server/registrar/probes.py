"""The probes of the HTTP engines (vLLM, SGLang), and the probe of each ``--engine``.

Readiness is health, then the served model (:mod:`.probe` states the contract). The record of an
HTTP engine says what every vLLM or SGLang server can do: score token-id or text prompts with the
prompt's own log-probs and a top-k (``--max-top-k``, vLLM's ``--max-logprobs``) plus its tail
mass, never whole logits; the vocabulary is not known here (``LOGITS`` is ``[-1, -1]``); the
engine batches internally, so the batch bound is generous and requests of any length are kept in
flight (``batches_by_length``).
"""

from __future__ import annotations

from protos import registry_pb2
from teacher_server.registrar.engine import EngineAddress
from teacher_server.registrar.errors import EngineNotReady
from teacher_server.registrar.kserve_probe import KServeProbe
from teacher_server.registrar.probe import Probe, ProbeOptions

__all__ = ["ENGINE_MAX_BATCH", "HTTPProbe", "Probe", "ProbeOptions", "SGLangProbe", "VLLMProbe", "make_probe"]

ENGINE_MAX_BATCH = 256
"""The batch bound an HTTP engine's record declares: engines batch internally (continuous batching),
so this only caps how many rows a student packs into one request."""


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
    return KServeProbe(address, options)
