"""The serving side of the mesh: PyTorch teachers behind the Triton / KServe v2 gRPC protocol.

`TeacherServer` owns one model from load to drain; `ServerConfig` is its whole configuration;
`ModelIO` / `TensorSpec` declare a model's tensors. The CLI is `teacher-server`.

The names below are imported on first use: `teacher_server.launch` (which the autoscaler's local
backend uses to start teachers) must not make every importer pay for torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from teacher_server.batcher import BatchingConfig
    from teacher_server.model import LoadedModel, ModelLoadError, load_model
    from teacher_server.server import ServerConfig, TeacherServer
    from teacher_server.spec import ModelIO, SpecError, TensorSpec

__version__ = "0.1.0"

__all__ = [
    "BatchingConfig",
    "LoadedModel",
    "ModelIO",
    "ModelLoadError",
    "ServerConfig",
    "SpecError",
    "TeacherServer",
    "TensorSpec",
    "__version__",
    "load_model",
]

_WHERE = {
    "BatchingConfig": "batcher", "LoadedModel": "model", "ModelLoadError": "model", "load_model": "model",
    "ServerConfig": "server", "TeacherServer": "server", "ModelIO": "spec", "SpecError": "spec", "TensorSpec": "spec",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'teacher_server' has no attribute {name!r}")
    return getattr(importlib.import_module(f"teacher_server.{module}"), name)
