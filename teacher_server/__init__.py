"""The serving side of the mesh: PyTorch teachers behind the Triton / KServe v2 gRPC protocol.

`TeacherServer` owns one model from load to drain; `ServerConfig` is its whole configuration;
`ModelIO` / `TensorSpec` declare a model's tensors. The CLI is `teacher-server`.
"""

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
