"""Compressed gRPC messages: gRPC's own C core inflates them, off the Python event loop, and holds
the inflated size to --max-message-mb (grpc.max_receive_message_length) while it inflates. A small
gzip request is served; a gzip "bomb" (a few hundred KB on the wire, 80 MiB inflated, over a 64 MiB
limit) is refused RESOURCE_EXHAUSTED, and the same channel's next request is answered."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import numpy as np
import pytest
from tritonclient.grpc import service_pb2, service_pb2_grpc

from teacher_server import ServerConfig
from tests.servers import ServerThread

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    cfg = ServerConfig(model="tests.models:affine", name="affine", device="cpu", max_message_mb=64, instances=1)
    with ServerThread(cfg) as s:
        yield s


def _request(rows: int) -> service_pb2.ModelInferRequest:
    req = service_pb2.ModelInferRequest(model_name="affine")
    t = req.inputs.add(name="X", datatype="FP32")
    t.shape.extend([rows, 8])
    req.raw_input_contents.append(np.ones((rows, 8), np.float32).tobytes())
    return req


def test_a_gzip_request_is_served_and_a_gzip_bomb_is_refused(server: ServerThread) -> None:
    with grpc.insecure_channel(server.url, options=[("grpc.max_send_message_length", -1)]) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        small = stub.ModelInfer(_request(4), timeout=30, compression=grpc.Compression.Gzip)
        assert list(small.outputs[0].shape) == [4, 4]
        bomb = _request(80 * (1 << 20) // 32)  # 80 MiB of input bytes, all the same: it compresses ~1000x
        assert bomb.ByteSize() > 64 << 20
        with pytest.raises(grpc.RpcError) as refused:
            stub.ModelInfer(bomb, timeout=60, compression=grpc.Compression.Gzip)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused.value
        assert "larger than max" in (refused.value.details() or ""), refused.value.details()
        after = stub.ModelInfer(_request(2), timeout=30)  # the server, and this channel, serve on
        assert list(after.outputs[0].shape) == [2, 4]
