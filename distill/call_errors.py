"""The verdicts a call to a teacher can end with, as exception types: the engine's retry policy
reads the type (`distill.teacher_client`'s docstring lists them), and the pool and dispatch judge
the teacher by it. A module of its own, beside the stub that raises them: what a call can end with
is one job, encoding and decoding the call another."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import grpc

from distill.errors import InputRefusal
from protos.kserve import REFUSAL_METADATA

__all__ = [
    "MalformedAnswerError",
    "ModelChoiceError",
    "RequestRejectedError",
    "TeacherCallError",
    "TeacherGoneError",
    "TeacherOverloadedError",
    "TeacherRefusedError",
    "access_refused",
    "call_error",
    "input_refusal",
    "rpc_error",
]


class TeacherCallError(Exception):
    """A call that the teacher (or the network on its way) refused or failed, with its gRPC status;
    the router judges the teacher by `code`."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


class RequestRejectedError(TeacherCallError):
    """The teacher refused this request's input (INVALID_ARGUMENT, or a model execution error): the
    input may be at fault rather than the teacher, so the engine retries it on one other teacher
    before it fails the batch, and ejects nobody for it. `refusal`: the facts of what it found
    wrong, when it sent them (rows counted within this request)."""

    def __init__(self, code: grpc.StatusCode, details: str, refusal: InputRefusal | None = None) -> None:
        super().__init__(code, details)
        self.refusal = refusal


class TeacherOverloadedError(TeacherCallError):
    """The teacher is overloaded (RESOURCE_EXHAUSTED, or a CANCELLED the student did not cause, which
    is how grpc.aio sheds requests over its pending limit): back off, never eject."""


# Model execution errors, by the message prefix of teacher-server and of Triton's backends. Other
# INTERNAL errors are the teacher's own failure.
_MODEL_ERROR_PREFIXES = ("model execution failed", "Failed to process the request")


def call_error(code: grpc.StatusCode, details: str, metadata: Any = None) -> TeacherCallError:
    """The typed error for a ModelInfer that ended with `code`: rejected, overloaded or failed;
    `metadata` is the call's trailing metadata (a refusal's facts, `protos.kserve.REFUSAL_METADATA`).

    A CANCELLED status that reaches here was not caused by this student: when the student cancels
    its own call, the awaiting task gets CancelledError and never sees a status."""
    if code == grpc.StatusCode.INVALID_ARGUMENT or (
            code == grpc.StatusCode.INTERNAL and details.startswith(_MODEL_ERROR_PREFIXES)):
        return RequestRejectedError(code, details, input_refusal(metadata) if metadata else None)
    if code in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.CANCELLED):
        return TeacherOverloadedError(code, details)
    return TeacherCallError(code, details)


def rpc_error(e: grpc.aio.AioRpcError) -> TeacherCallError:
    """`call_error` for a call or stream that gRPC ended with an error: its code, details and
    trailing metadata."""
    return call_error(e.code(), e.details() or "", e.trailing_metadata())


def input_refusal(metadata: Any) -> InputRefusal | None:
    """The facts a teacher sent with its refusal (`protos.kserve.REFUSAL_METADATA`), or None."""
    return next((InputRefusal.parse(value) for key, value in metadata if key == REFUSAL_METADATA), None)


class TeacherGoneError(Exception):
    """The client's channel was closed under a call: the teacher left the pool meanwhile."""


class MalformedAnswerError(ValueError):
    """The teacher answered, but not what was asked (missing outputs, wrong shapes or sizes)."""


class ModelChoiceError(ValueError):
    """No model was named and the teacher's repository does not settle which one to use: it lists
    several ready models, or none (and none loading). Waiting does not change that; naming the
    model does. The facts only: the caller says how its user names the model."""

    def __init__(self, endpoint: str, models: Sequence[str]) -> None:
        super().__init__(f"teacher {endpoint} serves {list(models) or 'no ready model'}, and no model was named")
        self.endpoint = endpoint
        self.models = tuple(models)


class TeacherRefusedError(TeacherCallError):
    """The teacher refused this student access to `rpc` (see `access_refused`); retrying with the same
    request and headers cannot succeed."""

    def __init__(self, code: grpc.StatusCode, details: str, rpc: str) -> None:
        super().__init__(code, details)
        self.rpc = rpc


def access_refused(code: grpc.StatusCode | str, details: str) -> bool:
    """Whether a call's status says the server refuses this client, rather than being down or busy:
    UNAUTHENTICATED, PERMISSION_DENIED, or Triton's restricted protocols, which answer UNAVAILABLE
    "This protocol is restricted, expecting header '...'". `code` may be the status's name, as in
    `str(TeacherCallError)` and the router's `last_error` ("CODE: details")."""
    name = code if isinstance(code, str) else code.name
    if name in ("UNAUTHENTICATED", "PERMISSION_DENIED"):
        return True
    return name == "UNAVAILABLE" and "restricted" in details.lower()
