"""Engines as teachers: vLLM and SGLang called in their own protocols, answered in the mesh's tensors.

`VllmClient` (vLLM's `/v1/completions` with `prompt_logprobs`) and `SglangClient` (SGLang's
`/generate` with `return_logprob`) implement `distill.teacher_client.InferenceClient`, so the
reader's routing, hedging, failover and exactly-once delivery treat them like any KServe teacher:
one HTTP request per chunk, decoded into exactly the tensors a teacher-server returns for the same
request, and the same verdict types for failures (`distill.engines.http`). The reader's connector
(`distill.connector.grpc_connector`) picks the client by the teacher's registry record
(`protocol`, `path`, `tls`; `engine_client`).
"""

from distill.engines.client import EngineClient
from distill.engines.connect import ENGINES, PROTOCOLS, engine_client
from distill.engines.sglang import SglangClient
from distill.engines.vllm import VllmClient

__all__ = ["ENGINES", "PROTOCOLS", "EngineClient", "SglangClient", "VllmClient", "engine_client"]
