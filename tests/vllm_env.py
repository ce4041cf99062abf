"""The vLLM helpers of the tests: they live in `benchmarks/vllm_env.py`, which the benchmarks
share (a benchmark never imports tests/), and are re-exported here. The suite builds the cached
vLLM venv when it is missing (minutes, once per machine); it never skips.

`vllm_server` here is the benchmarks' server started the cheap way (`EAGER_ARGS`, `EAGER_ENV`):
eager PyTorch instead of `torch.compile` (whose graphs are compiled again for every new model
directory, and each test module saves its model in a fresh one), and the model's worker inside the
engine-core process instead of a third process that imports vLLM once more. The tests check what
vLLM answers and how it behaves as a server, which neither changes; the benchmarks measure vLLM as
deployed, so they keep its defaults (`benchmarks.vllm_env.vllm_server`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from benchmarks.vllm_env import (
    MAX_LOGPROBS,
    PYTHON_ENV,
    REQUIREMENTS,
    VLLM_VERSION,
    VllmError,
    VllmServer,
    venv_path,
    vllm_python,
    vllm_venv,
)
from benchmarks.vllm_env import vllm_server as deployed_vllm_server

__all__ = [
    "EAGER_ARGS",
    "EAGER_ENV",
    "MAX_LOGPROBS",
    "PYTHON_ENV",
    "REQUIREMENTS",
    "VLLM_VERSION",
    "VllmError",
    "VllmServer",
    "venv_path",
    "vllm_python",
    "vllm_server",
    "vllm_venv",
]

EAGER_ARGS: tuple[str, ...] = ("--enforce-eager", "--distributed-executor-backend", "uni")
"""No torch.compile and no CUDA-graph capture; the worker runs in the engine-core process. vLLM's
CPU platform accepts the `uni` executor only with `EAGER_ENV`."""
EAGER_ENV: Mapping[str, str] = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
"""Lets the engine core run its worker itself (the API server still runs the engine core in a
process of its own)."""


@contextlib.contextmanager
def vllm_server(model_dir: str | os.PathLike[str], *, extra_args: Sequence[str] = (),
                env: Mapping[str, str] | None = None, **options: Any) -> Iterator[VllmServer]:
    """`benchmarks.vllm_env.vllm_server` with `EAGER_ARGS` and `EAGER_ENV` (what the caller passes
    comes after them, so it wins); the other keyword arguments are passed on unchanged."""
    with deployed_vllm_server(model_dir, extra_args=(*EAGER_ARGS, *extra_args), env={**EAGER_ENV, **(env or {})},
                              **options) as server:
        yield server
