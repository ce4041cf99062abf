"""What one HTTP client can make the teacher do: compressed bodies are inflated off the event loop
within --max-message-mb (a gzip bomb gets 413 while gRPC clients keep being answered)."""

from __future__ import annotations

import asyncio
import gzip
import json
import threading
import time
import zlib
from collections.abc import Iterator
from typing import Any

import aiohttp
import numpy as np
import pytest
import torch
import tritonclient.grpc as tg

from teacher_server import ServerConfig, http_body
from teacher_server.http_body import MAX_INFLATE_RATIO, BodyRefused, inflate
from tests.models import Affine
from tests.servers import ServerThread

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    cfg = ServerConfig(model="tests.models:affine", name="affine", device="cpu", http_port=0, max_message_mb=64,
                       instances=1)
    with ServerThread(cfg) as s:
        yield s


def _url(s: ServerThread, path: str = "/v2/models/affine/infer") -> str:
    assert s.server is not None and s.server.http_port
    return f"http://127.0.0.1:{s.server.http_port}{path}"


def _post(url: str, body: bytes, headers: dict[str, str], timeout: float = 60.0) -> tuple[int, dict[str, Any]]:
    async def post() -> tuple[int, dict[str, Any]]:
        async with aiohttp.ClientSession(auto_decompress=False) as session, session.post(
                url, data=body, headers=headers, timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            return resp.status, json.loads(await resp.read())

    return asyncio.run(post())


def _infer_body(x: np.ndarray) -> bytes:
    return json.dumps({"inputs": [{"name": "X", "datatype": "FP32", "shape": list(x.shape),
                                   "data": x.ravel().tolist()}]}).encode()


def _compressible_block(size: int = 1 << 20) -> bytes:
    """Bytes that compress about 15x (mostly zeros, one random byte in 40): under the ratio bound,
    so only --max-message-mb stops their inflation, and slow enough to inflate to be watched."""
    rng = np.random.default_rng(0)
    block = np.zeros(size, np.uint8)
    at = rng.integers(0, size, size // 40)
    block[at] = rng.integers(1, 256, len(at), dtype=np.uint8)
    return block.tobytes()


def test_compressed_bodies_are_served() -> None:
    cfg = ServerConfig(model="tests.models:affine", name="affine", device="cpu", http_port=0, instances=1)
    x = np.arange(24, dtype=np.float32).reshape(3, 8) / 10
    want = Affine()(torch.from_numpy(x)).detach().numpy()
    raw_deflate = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    bodies = {
        "gzip": gzip.compress(_infer_body(x)),
        "deflate": zlib.compress(_infer_body(x)),
        "raw deflate": raw_deflate.compress(_infer_body(x)) + raw_deflate.flush(),
        "two gzip members": gzip.compress(_infer_body(x)[:10]) + gzip.compress(_infer_body(x)[10:]),
    }
    with ServerThread(cfg) as s:
        for what, body in bodies.items():
            encoding = "gzip" if "gzip" in what else "deflate"
            status, out = _post(_url(s), body, {"Content-Encoding": encoding})
            assert status == 200, (what, out)
            got = np.array(out["outputs"][0]["data"], np.float32).reshape(want.shape)
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        status, out = _post(_url(s), gzip.compress(_infer_body(x)), {"Content-Encoding": "br"})
        assert status == 415 and "gzip, deflate" in out["error"]
        status, out = _post(_url(s), gzip.compress(_infer_body(x))[:-12], {"Content-Encoding": "gzip"})
        assert status == 400 and "gzip" in out["error"]


def test_a_bomb_is_refused_by_its_ratio_after_a_fraction_of_the_limit() -> None:
    zeros = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    bomb = b"".join(zeros.compress(bytes(1 << 20)) for _ in range(256)) + zeros.flush()  # 256 MiB of zeros
    with pytest.raises(BodyRefused) as e:
        inflate(bomb, "gzip", limit=1 << 30)
    assert e.value.status == 413 and f"{MAX_INFLATE_RATIO} times" in e.value.message
    assert inflate(gzip.compress(bytes(1 << 20)), "gzip", limit=1 << 30) == bytes(1 << 20)  # under the floor


def test_a_gzip_bomb_gets_413_while_grpc_clients_are_answered(server: ServerThread,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A body of 5 MB on the wire that inflates to 80 MB (over --max-message-mb 64): the server
    inflates it on a worker thread, and gRPC answers arrive while it does; then 413. The window is
    the server's own: the inflation's start and end, recorded around the real function."""
    member = gzip.compress(_compressible_block())
    bomb = member * 80
    assert len(bomb) < 8 << 20
    window: list[float] = []
    real = http_body.inflate

    def timed(*args: Any, **kwargs: Any) -> bytes:
        window.append(time.monotonic())
        try:
            return real(*args, **kwargs)
        finally:
            window.append(time.monotonic())

    monkeypatch.setattr(http_body, "inflate", timed)
    answered: list[float] = []
    stop = threading.Event()
    x = np.ones((1, 8), np.float32)

    def grpc_client() -> None:
        with tg.InferenceServerClient(server.url) as c:
            inp = tg.InferInput("X", [1, 8], "FP32")
            inp.set_data_from_numpy(x)
            for _ in range(100_000):  # bounded; ends when the bomb is answered
                if stop.is_set():
                    return
                c.infer("affine", [inp], client_timeout=30.0)
                answered.append(time.monotonic())

    thread = threading.Thread(target=grpc_client, name="grpc-client")
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not answered and time.monotonic() < deadline:  # the gRPC client is under way first
            time.sleep(0.01)
        status, out = _post(_url(server), bomb, {"Content-Encoding": "gzip"})
    finally:
        stop.set()
        thread.join(60)
    assert status == 413 and "--max-message-mb" in out["error"] and "inflated" in out["error"], out
    assert len(window) == 2, "the body was inflated by the teacher's own bounded inflater"
    during = [t for t in answered if window[0] < t < window[1]]
    assert len(during) >= 3, (f"{len(during)} gRPC answers during {window[1] - window[0]:.2f} s of inflation "
                              f"({len(answered)} in all): the bomb held the event loop")
