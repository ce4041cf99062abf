"""The model the PyTriton tests' Triton serves: `benchmarks/pytriton_server.py` is the server
script (run from PyTriton's own virtualenv); its `weights()`, the closed-form W of
`LOGITS = INPUT @ W`, is re-exported here for the tests that compare with it."""

from __future__ import annotations

from benchmarks.pytriton_server import READY_KEY, weights

__all__ = ["READY_KEY", "weights"]
