"""What one HTTP client can make the teacher do: compressed bodies are inflated off the event loop
within --max-message-mb (a gzip bomb gets 413 while gRPC clients keep being answered); a body that
trickles gets 408; connections beyond --http-max-connections get 503 while those held are served;
a client that goes away costs no traceback in the log. Real sockets on 127.0.0.1 throughout."""

from __future__ import annotations

import asyncio
import gzip
import json
import socket
import struct
import threading
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
import torch
import tritonclient.grpc as tg
import tritonclient.http as th

from teacher_server import ServerConfig, http_body
from teacher_server.http_body import MAX_INFLATE_RATIO, BodyRefused, inflate
from tests.models import Affine
from tests.servers import ServerThread, teacher_process

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
        with th.InferenceServerClient(_url(s, "")[len("http://"):]) as client:  # tritonclient compresses itself
            inp = th.InferInput("X", list(x.shape), "FP32")
            inp.set_data_from_numpy(x, binary_data=True)
            for algorithm in ("gzip", "deflate"):
                got = client.infer("affine", [inp], request_compression_algorithm=algorithm).as_numpy("Y")
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


# ---- slow and vanishing clients ------------------------------------------------------------------
def _connect(port: int, timeout: float = 10.0) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    sock.settimeout(timeout)
    return sock


def _read_response(sock: socket.socket, limit_s: float = 30.0) -> bytes:
    """Bytes until the peer closes or a whole response (headers and Content-Length) is in."""
    data = b""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        try:
            chunk = sock.recv(65536)
        except (ConnectionResetError, TimeoutError):
            break
        if not chunk:
            break
        data += chunk
        head, sep, body = data.partition(b"\r\n\r\n")
        length = [int(v) for k, _, v in (line.partition(b":") for line in head.split(b"\r\n"))
                  if k.strip().lower() == b"content-length"]
        if sep and length and len(body) >= length[0]:
            break
    return data


def _get(path: str) -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: teacher\r\nConnection: keep-alive\r\n\r\n".encode()


def test_a_trickling_body_gets_408_and_its_connection_closed() -> None:
    cfg = ServerConfig(model="tests.models:affine", name="affine", device="cpu", http_port=0, instances=1,
                       http_request_timeout_s=1.0)
    with ServerThread(cfg) as s:
        assert s.server is not None and s.server.http_port
        sock = _connect(s.server.http_port)
        sock.sendall(b"POST /v2/models/affine/infer HTTP/1.1\r\nHost: teacher\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100000\r\n\r\n{")
        answer = b""
        sock.settimeout(0.2)
        for _ in range(100):  # one byte every 0.2 s, at most 20 s: far past the 1 s bound
            try:
                answer += sock.recv(65536)
            except TimeoutError:
                pass
            if answer:
                break
            try:
                sock.sendall(b" ")
            except (BrokenPipeError, ConnectionResetError):
                break
        sock.settimeout(10.0)
        answer += _read_response(sock)
        sock.close()
        assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
        assert b"--http-request-timeout" in answer and b"Connection: close" in answer
        with _connect(s.server.http_port) as fresh:  # and the server serves on
            fresh.sendall(_get("/v2/health/ready"))
            assert _read_response(fresh).startswith(b"HTTP/1.1 200")


def test_trickled_headers_and_idle_connections_are_closed_after_the_idle_timeout() -> None:
    cfg = ServerConfig(model="tests.models:affine", name="affine", device="cpu", http_port=0, instances=1,
                       http_idle_timeout_s=1.0)
    with ServerThread(cfg) as s:
        assert s.server is not None and s.server.http_port
        idle, trickling = _connect(s.server.http_port), _connect(s.server.http_port)
        trickling.sendall(b"GET /v2/health/live HTTP/1.1\r\n")
        trickling.settimeout(0.2)
        closed = False
        started = time.monotonic()
        for _ in range(100):  # one header byte every 0.2 s, at most 20 s: far past the 1 s bound
            try:
                closed = trickling.recv(1024) == b""
            except TimeoutError:
                pass
            except ConnectionResetError:
                closed = True
            if closed:
                break
            try:
                trickling.sendall(b"X")
            except (BrokenPipeError, ConnectionResetError):
                closed = True
                break
        assert closed, f"a client trickling its headers was still held after {time.monotonic() - started:.1f} s"
        idle.settimeout(10.0)
        assert _read_response(idle) == b"", "an idle connection is closed, not answered"
        idle.close()
        trickling.close()


def test_a_connection_whose_head_arrived_is_not_cut_by_the_idle_timeout() -> None:
    """The first-request deadline ends with the head's blank line, even one split across reads: a
    body that follows later than --http-idle-timeout (within --http-request-timeout) is answered."""
    cfg = ServerConfig(model="tests.models:affine", name="affine", device="cpu", http_port=0, instances=1,
                       http_idle_timeout_s=1.0, http_request_timeout_s=20.0)
    body = _infer_body(np.ones((1, 8), dtype=np.float32))
    with ServerThread(cfg) as s:
        assert s.server is not None and s.server.http_port
        with _connect(s.server.http_port) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            head = (f"POST /v2/models/affine/infer HTTP/1.1\r\nHost: teacher\r\nContent-Type: application/json\r\n"
                    f"Content-Length: {len(body)}\r\n\r\n").encode()
            for piece in (head[:-3], head[-3:-1], head[-1:]):  # the blank line split over three reads
                sock.sendall(piece)
                time.sleep(0.1)
            time.sleep(1.6)  # past the 1 s idle timeout
            sock.sendall(body)
            answer = _read_response(sock)
        assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
        want = Affine()(torch.ones(1, 8)).detach().numpy().ravel().tolist()
        got = json.loads(answer.partition(b"\r\n\r\n")[2])["outputs"][0]["data"]
        assert np.allclose(got, want)


def test_connections_over_the_cap_get_503_while_held_ones_are_served() -> None:
    cfg = ServerConfig(model="tests.models:affine", name="affine", device="cpu", http_port=0, instances=1,
                       http_max_connections=2)
    with ServerThread(cfg) as s:
        assert s.server is not None and s.server.http_port
        port = s.server.http_port
        held = [_connect(port), _connect(port)]
        for sock in held:  # answered on a kept-alive connection: each is held by the server now
            sock.sendall(_get("/v2/health/live"))
            assert _read_response(sock).startswith(b"HTTP/1.1 200")
        for _ in range(3):
            with _connect(port) as extra:
                answer = _read_response(extra)
            assert answer.startswith(b"HTTP/1.1 503"), answer[:200]
            assert b"Retry-After: 1" in answer and b"--http-max-connections (2)" in answer
        for sock in held:  # the connections held are served on
            sock.sendall(_get("/v2/health/ready"))
            assert _read_response(sock).startswith(b"HTTP/1.1 200")
        held.pop().close()
        deadline = time.monotonic() + 10
        answer = b""
        while time.monotonic() < deadline:  # the server notices the close; then a new client gets in
            with _connect(port) as fresh:
                fresh.sendall(_get("/v2/health/ready"))
                answer = _read_response(fresh)
            if answer.startswith(b"HTTP/1.1 200"):
                break
            time.sleep(0.05)
        assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
        held[0].close()


def test_connections_over_the_cap_get_503_on_the_clis_event_loop(tmp_path: Path) -> None:
    """The CLI's process runs on uvloop, whose transports are not asyncio's own classes: there too
    each connection over the cap reads its 503, and the log holds one warning for them all rather
    than a traceback (or any line) per refused connection."""
    args = ["--model", "tests.models:affine", "--name", "affine", "--device", "cpu", "--instances", "1",
            "--port", "0", "--http-port", "0", "--http-max-connections", "2"]
    with teacher_process(args, tmp_path) as (_proc, info):
        port = info["http_port"]
        held = [_connect(port), _connect(port)]
        for sock in held:  # answered on a kept-alive connection: each is held by the server now
            sock.sendall(_get("/v2/health/live"))
            assert _read_response(sock).startswith(b"HTTP/1.1 200")
        for _ in range(5):
            with _connect(port) as extra:
                extra.sendall(_get("/v2/health/ready"))
                answer = _read_response(extra)
            assert answer.startswith(b"HTTP/1.1 503"), answer[:200]
            assert b"Retry-After: 1" in answer and b"--http-max-connections (2)" in answer
            assert json.loads(answer.partition(b"\r\n\r\n")[2])["error"].startswith("the teacher holds")
        for sock in held:  # the connections held are served on
            sock.sendall(_get("/v2/health/ready"))
            assert _read_response(sock).startswith(b"HTTP/1.1 200")
            sock.close()
    text = "\n".join(p.read_text() for p in tmp_path.glob("teacher-*.log"))
    assert "serving affine" in text, text[-2000:]
    assert "Traceback" not in text and "ERROR" not in text and "AssertionError" not in text, text[-4000:]
    assert text.count("HTTP connection refused with 503") == 1, text[-4000:]


def _drop(sock: socket.socket) -> None:
    """Close with a reset (SO_LINGER 0), as a killed client does."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def test_clients_that_go_away_leave_no_traceback(tmp_path: Path) -> None:
    """Clients dropped mid-body and before their (slow) answer: the teacher-server process's own
    log holds no traceback and no ERROR line, and it serves on."""
    args = ["--model", "tests.models:sleepy", "--name", "slow", "--device", "cpu", "--instances", "1",
            "--port", "0", "--http-port", "0"]
    x = np.ones((2, 8), np.float32)
    with teacher_process(args, tmp_path, env={"TEST_SLEEP_MS": "300"}) as (_proc, info):
        port = info["http_port"]
        for _ in range(3):  # mid-body
            sock = _connect(port)
            sock.sendall(b"POST /v2/models/slow/infer HTTP/1.1\r\nHost: teacher\r\nContent-Length: 50000\r\n\r\n"
                         + b" " * 1000)
            time.sleep(0.1)
            _drop(sock)
        for _ in range(3):  # before the answer: the forward pass takes 300 ms
            sock = _connect(port)
            body = _infer_body(x)
            sock.sendall(b"POST /v2/models/slow/infer HTTP/1.1\r\nHost: teacher\r\n"
                         + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            time.sleep(0.05)
            _drop(sock)
        time.sleep(1.0)  # the abandoned requests finish and try to answer
        with _connect(port) as fresh:
            fresh.sendall(_get("/v2/health/ready"))
            assert _read_response(fresh).startswith(b"HTTP/1.1 200")
    text = "\n".join(p.read_text() for p in tmp_path.glob("teacher-*.log"))
    assert "serving slow" in text, text[-2000:]
    assert "Traceback" not in text and "ERROR" not in text and "Error handling request" not in text, text[-4000:]
