"""The PyTriton helpers of the tests: they live in `benchmarks/pytriton_env.py`, which the
benchmarks share (a benchmark never imports tests/), and are re-exported here."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.pytriton_env import (
    GRPC_HEADER_PREFIX,
    REQUIREMENTS,
    SERVER_SCRIPT,
    PyTritonError,
    PyTritonServer,
    PyTritonUnavailable,
    Restriction,
    cached_venv,
    check_platform,
    libpython_dir,
    pytriton_server,
    pytriton_venv,
    venv_path,
)

__all__ = [
    "GRPC_HEADER_PREFIX",
    "REQUIREMENTS",
    "SERVER_SCRIPT",
    "PyTritonError",
    "PyTritonServer",
    "PyTritonUnavailable",
    "Restriction",
    "cached_venv",
    "check_platform",
    "libpython_dir",
    "pytriton_python_or_skip",
    "pytriton_server",
    "pytriton_venv",
    "venv_path",
]


def pytriton_python_or_skip() -> Path:
    """PyTriton's virtualenv's interpreter, built once (about 2 minutes); the test is skipped only
    on a platform PyTriton does not support (its wheels are for Linux x86_64 and aarch64)."""
    try:
        check_platform()
    except PyTritonUnavailable as e:
        pytest.skip(str(e))
    return pytriton_venv()
