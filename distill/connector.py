"""How the reader opens a client for each teacher it meets: by the teacher's registry record and the
reader's transport, one of `TeacherClient` (a call a chunk), `StreamingTeacherClient` (one stream a
teacher) or an engine's own client (`distill.engines`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import grpc

from discovery.base import TeacherRecord
from distill.config import ClientTLS
from distill.engines.connect import engine_client
from distill.teacher_client import InferenceClient, TeacherClient
from distill.teacher_stream import StreamingTeacherClient


def grpc_connector(tls: ClientTLS | None, headers: Mapping[str, str] | None, transport: str = "call"
                   ) -> Callable[[str, TeacherRecord], InferenceClient]:
    """How the reader opens a client per teacher, by its registry record's `protocol`: KServe v2
    over gRPC ("" or "kserve"; `transport` "stream" sends its chunks on one ModelStreamInfer stream,
    `distill.teacher_stream`), or an engine in its own protocol ("vllm", "sglang":
    `distill.engines`, under the record's HTTP `path`). Plaintext, unless the reader was given TLS
    settings or the teacher registered as TLS (then the system's root certificates verify it).
    ValueError for a protocol this reader does not know."""
    configured = tls.credentials() if tls is not None else None
    server_name = tls.server_name if tls is not None else None
    kserve = StreamingTeacherClient if transport == "stream" else TeacherClient

    def connect(endpoint: str, record: TeacherRecord) -> InferenceClient:
        protocol = record.protocol.lower()
        if protocol not in ("", "kserve"):
            return engine_client(protocol, endpoint, record.path, tls=tls, registered_tls=record.tls,
                                 headers=headers)
        credentials = configured if configured is not None else (
            grpc.ssl_channel_credentials() if record.tls else None)
        return kserve(endpoint, credentials, server_name, headers)

    return connect
