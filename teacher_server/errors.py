"""Why a request was refused, in words any front end can map to its own status codes.

The request lifecycle raises these; each protocol edge turns them into its status (gRPC codes in
`grpc_service`, HTTP statuses for a REST front end) and nothing below the edge knows which
protocol carried the request. Every message tells the caller what to change.
"""

from __future__ import annotations

from collections.abc import Mapping


class InferError(Exception):
    """A refused request. Subclasses say why; `message` is what the caller reads, and `facts` what
    a program reads instead (an id out of range: which input, where, which id, which limit; sent by
    the gRPC edge as `protos.kserve.REFUSAL_METADATA`), when the refusal has such facts."""

    def __init__(self, message: str, facts: Mapping[str, object] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.facts = facts


class InvalidRequestError(InferError):
    """The request itself is wrong (tensor names, datatypes, shapes, sizes, parameters, bytes);
    sending it again unchanged fails again. gRPC: INVALID_ARGUMENT."""


# How Triton starts the message for a model it does not serve; clients written for Triton (its own
# client examples among them) match on it, so ours starts the same way and then says what is served.
UNKNOWN_MODEL = "Request for unknown model"


class ModelNotFoundError(InferError):
    """The request names a model or version this server does not serve. gRPC: NOT_FOUND."""

    @classmethod
    def unknown_model(cls, name: str, served: str) -> ModelNotFoundError:
        return cls(f"{UNKNOWN_MODEL}: {echo(name)} is not served here; this server serves {served!r}")

    @classmethod
    def unknown_version(cls, name: str, version: str, served: str) -> ModelNotFoundError:
        return cls(f"{UNKNOWN_MODEL}: {echo(name)} has no version {echo(version)}; served version is {served!r}")


class UnavailableError(InferError):
    """The server cannot take the request now (loading, draining, stopping); another teacher or a
    retry shortly will. gRPC: UNAVAILABLE."""


class OverloadedError(InferError):
    """The batcher's queue is full; retry on another teacher or later. gRPC: RESOURCE_EXHAUSTED."""


class ModelExecutionError(InferError):
    """The model raised while running the batch that held this request. gRPC: INTERNAL."""


# A refusal quotes what the caller sent so they can find it; a value of 10 KB quoted whole would
# push the status message past gRPC's 8 KB metadata limit and turn the refusal into another error.
MAX_ECHO_CHARS = 64
MAX_MESSAGE_CHARS = 1024


def echo(value: object, limit: int = MAX_ECHO_CHARS) -> str:
    """`repr(value)`, cut to `limit` characters with the full length noted, for error messages."""
    text = repr(value)
    if len(text) <= limit:
        return text
    size = f"{len(value)} characters" if isinstance(value, str | bytes) else f"{len(text)} characters shown"
    return f"{text[:limit]}... ({size})"


def capped(message: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """A message cut to `limit` characters: what every front end sends as a refusal's text."""
    return message if len(message) <= limit else f"{message[:limit]}... (message cut at {limit} characters)"
