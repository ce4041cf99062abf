"""The PyTriton helpers of the tests: they live in `benchmarks/pytriton_env.py`, which the
benchmarks share (a benchmark never imports tests/), and are re-exported here."""

from __future__ import annotations

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
    "pytriton_server",
    "pytriton_venv",
    "venv_path",
]
