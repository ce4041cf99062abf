"""The vLLM helpers of the tests: they live in `benchmarks/vllm_env.py`, which the benchmarks
share (a benchmark never imports tests/), and are re-exported here. The suite builds the cached
vLLM venv when it is missing (minutes, once per machine); it never skips."""

from __future__ import annotations

from benchmarks.vllm_env import (
    MAX_LOGPROBS,
    PYTHON_ENV,
    REQUIREMENTS,
    VLLM_VERSION,
    VllmError,
    VllmServer,
    venv_path,
    vllm_python,
    vllm_server,
    vllm_venv,
)

__all__ = [
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
