"""`TeacherAccessError` on UNAUTHENTICATED and PERMISSION_DENIED, from a real gRPC server.

The server is an access gateway in front of a real teacher-server, as a deployment would put one:
a grpc server whose generic handler forwards every unary KServe call, bytes unchanged, to the
teacher, after checking the `authorization` header. No token: UNAUTHENTICATED on every call. A
read-only token: metadata, config and readiness pass, ModelInfer is PERMISSION_DENIED. A full token:
everything passes (so the refusals, not the gateway, are what the reader reacts to).

What must happen: the reader ends at once with TeacherAccessError quoting the server's code and
words and naming `headers=`, never waiting `no_teacher_timeout` (an hour here), whatever the
fallback; with the right token it trains on the teacher's exact outputs.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest
import torch

import distill
from distill.errors import TeacherAccessError
from teacher_server import ServerConfig
from tests.faults.helpers import expected, make_batch
from tests.servers import ServerThread

pytestmark = pytest.mark.timeout(120)

SERVICE_PREFIX = "/inference.GRPCInferenceService/"
FULL, READ_ONLY = "Bearer full-token", "Bearer read-only-token"
NEVER_S = 3600.0  # no_teacher_timeout: waiting for it would fail the test's own bound


class AccessGateway:
    """A real gRPC server on a free loopback port that forwards unary KServe calls to `upstream`
    once the caller's `authorization` header allows them."""

    def __init__(self, upstream: str) -> None:
        self._upstream = grpc.insecure_channel(upstream)
        self.seen: list[tuple[str, str]] = []  # (method, code) of each call, for the test's checks
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        self._server.add_generic_rpc_handlers([_Handler(self._upstream, self.seen)])
        self.port = self._server.add_insecure_port("127.0.0.1:0")

    @property
    def url(self) -> str:
        return f"127.0.0.1:{self.port}"

    def __enter__(self) -> AccessGateway:
        self._server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.stop(grace=None).wait(10)
        self._upstream.close()


class _Handler(grpc.GenericRpcHandler):
    def __init__(self, upstream: grpc.Channel, log: list[tuple[str, str]]) -> None:
        self._upstream = upstream
        self.log = log

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        method = details.method
        if not method.startswith(SERVICE_PREFIX) or method.endswith("StreamInfer"):
            return None  # UNIMPLEMENTED, as grpc answers an unknown method
        forward = self._upstream.unary_unary(method, request_serializer=None, response_deserializer=None)
        return grpc.unary_unary_rpc_method_handler(self._guarded(method, forward))

    def _guarded(self, method: str, forward: grpc.UnaryUnaryMultiCallable) -> Callable[[bytes, Any], bytes]:
        def handle(request: bytes, context: grpc.ServicerContext) -> bytes:
            token = dict(context.invocation_metadata()).get("authorization")
            if token not in (FULL, READ_ONLY):
                self.log.append((method, "UNAUTHENTICATED"))
                context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or unknown bearer token")
            if token == READ_ONLY and method.endswith("/ModelInfer"):
                self.log.append((method, "PERMISSION_DENIED"))
                context.abort(grpc.StatusCode.PERMISSION_DENIED, "this token may not run inference")
            self.log.append((method, "OK"))
            try:
                answer: bytes = forward(request, timeout=max(1.0, context.time_remaining() or 30.0))
            except grpc.RpcError as e:
                context.abort(e.code(), e.details() or "")
            return answer
        return handle


@pytest.fixture(scope="module")
def gateway() -> Iterator[AccessGateway]:
    with ServerThread(ServerConfig(model="tests.models:affine", name="affine", device="cpu")) as teacher, \
            AccessGateway(teacher.url) as gw:
        yield gw


def _run_reader(url: str, within_s: float = 60.0, **options: Any) -> tuple[BaseException | None, list[Any]]:
    """Start a reader on `url` and iterate one pass on a daemon thread, waited for at most
    `within_s`: what it raised (or None) and the outputs it delivered."""
    data = [make_batch(i, rows=4) for i in range(3)]
    outcome: queue.Queue[BaseException | None] = queue.Queue()
    delivered: list[Any] = []

    def run() -> None:
        try:
            with distill.DistillReader(data, teachers=url, inputs=["X"], outputs=["Y"], timeout=10.0,
                                       no_teacher_timeout=NEVER_S, **options) as reader:
                for batch, teacher in reader:
                    delivered.append((batch, teacher))
        except BaseException as e:  # handed to the test thread
            outcome.put(e)
        else:
            outcome.put(None)

    threading.Thread(target=run, name="reader-under-test", daemon=True).start()
    try:
        return outcome.get(timeout=within_s), delivered
    except queue.Empty:
        pytest.fail(f"the reader neither failed nor finished within {within_s:g} s (no_teacher_timeout {NEVER_S:g} s)")


def test_the_gateway_forwards_with_the_full_token(gateway: AccessGateway) -> None:
    """The control: with the full token the reader trains through the gateway on exact outputs."""
    error, delivered = _run_reader(gateway.url, headers={"authorization": FULL})
    assert error is None, repr(error)
    assert len(delivered) == 3
    for batch, teacher in delivered:
        assert torch.allclose(teacher["Y"], expected(batch["X"]), atol=1e-5)


@pytest.mark.parametrize("fallback", ["error", "hard_labels"])
def test_unauthenticated_is_a_teacher_access_error_at_once(gateway: AccessGateway, fallback: str) -> None:
    gateway.seen.clear()
    error, delivered = _run_reader(gateway.url, fallback=fallback)
    assert any(code == "UNAUTHENTICATED" for _, code in gateway.seen), gateway.seen  # the refusal happened
    assert all(code == "UNAUTHENTICATED" for _, code in gateway.seen), gateway.seen
    assert isinstance(error, TeacherAccessError), repr(error)
    message = str(error)
    assert gateway.url in message and "UNAUTHENTICATED: missing or unknown bearer token" in message, message
    assert "headers=" in message, message
    assert not delivered


@pytest.mark.parametrize("fallback", ["error", "hard_labels"])
def test_permission_denied_for_inference_is_a_teacher_access_error_at_once(
        gateway: AccessGateway, fallback: str) -> None:
    """The read-only token passes metadata and readiness, so the reader starts; its first chunk is
    refused PERMISSION_DENIED and the pass ends with TeacherAccessError, not a wait."""
    gateway.seen.clear()
    error, delivered = _run_reader(gateway.url, fallback=fallback, headers={"authorization": READ_ONLY})
    assert any(m.endswith("/ModelMetadata") and code == "OK" for m, code in gateway.seen), gateway.seen
    assert ("/inference.GRPCInferenceService/ModelInfer", "PERMISSION_DENIED") in gateway.seen, gateway.seen
    assert isinstance(error, TeacherAccessError), repr(error)
    message = str(error)
    assert "ModelInfer answered PERMISSION_DENIED: this token may not run inference" in message, message
    assert "check the headers this reader sends (authorization)" in message, message
    assert READ_ONLY not in message  # a token is never quoted
    assert not delivered
