"""A teacher's vocabulary pieces, fetched once from the teacher itself.

The matched-vocabulary divergence needs the teacher's pieces (`VocabMap`). A student without the
teacher's tokenizer at hand asks the teacher: input ``VOCAB_IDS`` (INT64 ``[N, 1]``) is answered with
``VOCAB_PIECES`` (BYTES ``[N, 1]``, each id's piece, empty for an id with none), a plain ModelInfer.
The ids ``0 .. V - 1`` are asked in pages; V is the last dimension of the teacher's scored output
(``LOGITS``) as its metadata declares it, unless given. One blocking call at start, every RPC under
the one overall deadline.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import grpc
import numpy as np

from distill.call_errors import ModelChoiceError, TeacherCallError
from distill.teacher_client import CHANNEL_OPTIONS
from protos.kserve import service_pb2, service_pb2_grpc
from protos.text import VOCAB_IDS, VOCAB_PIECES, decode_bytes

__all__ = ["fetch_vocab_pieces"]


def fetch_vocab_pieces(endpoint: str, model: str | None = None, *, vocab_size: int | None = None,
                       output: str = "LOGITS", page: int = 8192, timeout: float = 30.0,
                       credentials: grpc.ChannelCredentials | None = None,
                       metadata: Sequence[tuple[str, str]] = ()) -> list[bytes | None]:
    """The piece of every teacher id ``0 .. V - 1`` (None for an id with none), from the teacher at
    `endpoint` (``host:port``, gRPC).

    Args:
        model: the teacher's model name; its only ready model when None.
        vocab_size: V; by default the last dimension of `output` in the model's metadata.
        page: ids per request (keep an answer under the teacher's message limit).
        timeout: seconds for the whole fetch; every call gets what is left of it.
        credentials: TLS channel credentials, None for plain text.
        metadata: gRPC headers sent with every call (e.g. an authorization token).

    Raises TeacherCallError with the gRPC status (DEADLINE_EXCEEDED when `timeout` ran out,
    INVALID_ARGUMENT when the teacher serves no text requests or V is past its vocabulary),
    ModelChoiceError when no model is named and the teacher does not serve exactly one, and
    ValueError when V is neither given nor declared.
    """
    if page < 1:
        raise ValueError(f"page must be >= 1 ids per request, got {page!r}")
    deadline = time.monotonic() + timeout
    channel = (grpc.secure_channel(endpoint, credentials, options=CHANNEL_OPTIONS) if credentials is not None
               else grpc.insecure_channel(endpoint, options=CHANNEL_OPTIONS))
    try:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)

        def call(method: Any, request: Any) -> Any:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TeacherCallError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                       f"fetching the vocabulary of {endpoint} took over {timeout} s")
            try:
                return method(request, timeout=left, metadata=tuple(metadata))
            except grpc.RpcError as e:
                raise TeacherCallError(e.code(), e.details() or "") from None

        if model is None:
            index = call(stub.RepositoryIndex, service_pb2.RepositoryIndexRequest(ready=True))
            names = sorted({m.name for m in index.models if m.state in ("", "READY")})
            if len(names) != 1:
                raise ModelChoiceError(endpoint, names)
            model = names[0]
        if vocab_size is None:
            vocab_size = _declared_size(call(stub.ModelMetadata, service_pb2.ModelMetadataRequest(name=model)),
                                        output, endpoint)
        pieces: list[bytes | None] = []
        for start in range(0, vocab_size, page):
            ids = np.arange(start, min(start + page, vocab_size), dtype="<i8")
            request = service_pb2.ModelInferRequest(model_name=model)
            request.inputs.add(name=VOCAB_IDS, datatype="INT64", shape=[ids.size, 1])
            request.outputs.add(name=VOCAB_PIECES)
            request.raw_input_contents.append(ids.tobytes())
            answer = call(stub.ModelInfer, request)
            if len(answer.raw_output_contents) != 1:
                raise TeacherCallError(grpc.StatusCode.INTERNAL, f"{endpoint} answered {VOCAB_IDS} with "
                                       f"{len(answer.raw_output_contents)} raw outputs, not {VOCAB_PIECES} alone")
            pieces.extend(p or None for p in decode_bytes(answer.raw_output_contents[0], int(ids.size)))
        return pieces
    finally:
        channel.close()


def _declared_size(meta: Any, output: str, endpoint: str) -> int:
    for t in meta.outputs:
        if t.name == output:
            size = int(t.shape[-1]) if len(t.shape) else -1
            if size > 0:
                return size
            break
    raise ValueError(f"teacher {endpoint} declares no fixed last dimension for output {output!r}; "
                     "pass vocab_size (the teacher's vocabulary size)")
