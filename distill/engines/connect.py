"""An engine's client by the protocol a teacher's registry record names (the reader's connector,
`distill.connector.grpc_connector`, calls it for every record that is not KServe).

"vllm" is a vLLM OpenAI server (`VllmClient`), "sglang" an SGLang server (`SglangClient`), both over
HTTP under the record's `path` prefix; "" and "kserve" are KServe v2 gRPC teachers (`TeacherClient`).
TLS follows the reader's settings (`ClientTLS`: https with its CA, client certificate and server
name) or, without them, the record's `tls` flag (https verified by the system's roots). The
reader's headers go with every call as HTTP headers.
"""

from __future__ import annotations

from collections.abc import Mapping

from distill.config import ClientTLS
from distill.engines.client import EngineClient
from distill.engines.http import EngineHTTP, ssl_context
from distill.engines.sglang import SglangClient
from distill.engines.vllm import VllmClient

__all__ = ["ENGINES", "PROTOCOLS", "engine_client"]

ENGINES: dict[str, type[EngineClient]] = {"vllm": VllmClient, "sglang": SglangClient}
"""The engine clients by the record's `protocol`."""
PROTOCOLS = ("", "kserve", *ENGINES)
"""Every protocol a record may name."""


def engine_client(protocol: str, endpoint: str, path: str = "", *, tls: ClientTLS | None = None,
                  registered_tls: bool = False, headers: Mapping[str, str] | None = None) -> EngineClient:
    """The client of engine `protocol` ("vllm", "sglang") at `endpoint` (host:port) under `path`."""
    cls = ENGINES.get(protocol)
    if cls is None:
        raise ValueError(f"unknown engine protocol {protocol!r}; known: {sorted(ENGINES)}")
    context = ssl_context(tls, registered_tls)
    prefix = "/" + path.strip("/") if path.strip("/") else ""
    base = f"{'https' if context is not None else 'http'}://{endpoint}{prefix}"
    server_name = tls.server_name if tls is not None else None
    return cls(endpoint, EngineHTTP(base, context, server_name, dict(headers or {})))
