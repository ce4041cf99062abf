"""The errors the registrar raises on purpose.

Why typed: the command line maps them to exit statuses (2 for a usage mistake, 1 for an engine
that died or never became ready) and each message says what to do about it.
"""

from __future__ import annotations

__all__ = ["EngineExitedError", "EngineNotReady", "ReadyTimeoutError", "RegistrarError", "RegistrarUsageError"]


class RegistrarError(Exception):
    """Base class of the registrar's errors."""


class RegistrarUsageError(RegistrarError, ValueError):
    """A bad ``--engine``, ``--url`` or option value: fix the command line (exit 2)."""


class EngineNotReady(RegistrarError):
    """One probe found the engine not (yet) ready; ``reason`` says what it saw. Not fatal: the
    registrar keeps probing, and logs the reason once each time it changes."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class ReadyTimeoutError(RegistrarError):
    """The engine was not ready within ``--ready-timeout`` seconds."""


class EngineExitedError(RegistrarError):
    """The engine the registrar started (``-- COMMAND``) exited on its own."""
