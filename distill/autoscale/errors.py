"""Errors the autoscaler raises on purpose; each message says what to do next."""

from __future__ import annotations

from discovery.errors import ElectionError

__all__ = [
    "AutoscaleError",
    "BackendError",
    "BackendUnavailableError",
    "ElectionError",
    "PolicyConfigError",
]


class AutoscaleError(Exception):
    """Base class of the autoscaler's errors."""


class PolicyConfigError(AutoscaleError, ValueError):
    """A scaling bound or tuning value is out of range (min > max, a negative window, ...).

    A ``ValueError`` too, so that command-line parsing reports it like any other bad flag.
    """


class BackendError(AutoscaleError):
    """The backend cannot do its job at all: a bad command template, a Deployment that does not
    exist, missing permissions. Raised at start so that a misconfiguration fails loudly instead of
    leaving the pool at whatever size it had."""


class BackendUnavailableError(BackendError):
    """The backend could not be reached this time (Kubernetes API timeout, connection refused).

    Transient: the controller holds the current count and tries again next period.
    """
