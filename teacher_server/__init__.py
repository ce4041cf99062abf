"""The serving side of the mesh: PyTorch teachers behind the Triton / KServe v2 gRPC protocol.

`TeacherServer` owns one model from load to drain; `ServerConfig` is its whole configuration;
`ModelIO` / `TensorSpec` declare a model's tensors. From Python, `serve(model, inputs=..., outputs=...)`
serves an nn.Module until SIGTERM and `await start(model, ...)` returns a running server (see
`teacher_server.api`). The CLI is `teacher-server`.

One request's data path, module by module: `grpc_codec` (bytes -> `infer_request.InferRequest`),
`lifecycle` (admission, accounting), `validation` (-> `work.Work`), `batcher` (queue),
`instance` (forward pass), `outputs` (transform and encode), `grpc_codec` again (response).
Refusals are the typed exceptions of `errors`, mapped to status codes by each front end
(`grpc_service`; `http_service` with `http_codec` for KServe v2 HTTP/REST on `--http-port`, its
bodies read within bounds by `http_body` and its connections capped by `http_conn`).
Configuration: each setting is declared once (`settings`), on `config.ServerConfig`'s fields and
in `options`; the CLI (`cli`) and `serve()` (`api`) are derived from those declarations.

The names below are imported on first use: `teacher_server.launch` (which the autoscaler's local
backend uses to start teachers) must not make every importer pay for torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from teacher_server.api import serve, start
    from teacher_server.batcher import BatchingConfig
    from teacher_server.errors import (
        InferError,
        InvalidRequestError,
        ModelExecutionError,
        ModelNotFoundError,
        OverloadedError,
        UnavailableError,
    )
    from teacher_server.infer_request import InferRequest, InputTensor, RequestedOutput
    from teacher_server.lifecycle import InferResult, RequestLifecycle
    from teacher_server.model import LoadedModel, ModelLoadError, load_model
    from teacher_server.server import ServerConfig, TeacherServer
    from teacher_server.spec import ModelIO, SpecError, TensorSpec

from teacher_server.version import __version__

__all__ = [
    "BatchingConfig",
    "InferError",
    "InferRequest",
    "InferResult",
    "InputTensor",
    "InvalidRequestError",
    "LoadedModel",
    "ModelExecutionError",
    "ModelIO",
    "ModelLoadError",
    "ModelNotFoundError",
    "OverloadedError",
    "RequestLifecycle",
    "RequestedOutput",
    "ServerConfig",
    "SpecError",
    "TeacherServer",
    "TensorSpec",
    "UnavailableError",
    "__version__",
    "load_model",
    "serve",
    "start",
]

_WHERE = {
    "BatchingConfig": "batcher",
    "InferError": "errors", "InvalidRequestError": "errors", "ModelExecutionError": "errors",
    "ModelNotFoundError": "errors", "OverloadedError": "errors", "UnavailableError": "errors",
    "InferRequest": "infer_request", "InputTensor": "infer_request", "RequestedOutput": "infer_request",
    "InferResult": "lifecycle", "RequestLifecycle": "lifecycle",
    "LoadedModel": "model", "ModelLoadError": "model", "load_model": "model",
    "ServerConfig": "config", "TeacherServer": "server",
    "ModelIO": "spec", "SpecError": "spec", "TensorSpec": "spec",
    "serve": "api", "start": "api",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'teacher_server' has no attribute {name!r}")
    return getattr(importlib.import_module(f"teacher_server.{module}"), name)
