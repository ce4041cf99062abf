"""KServe v2 HTTP/REST on the teacher server, against NVIDIA's tritonclient.http and plain requests."""

from __future__ import annotations

import asyncio
import json
import re
import ssl
import threading
import time
import urllib.request
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
import torch
import tritonclient.grpc as tg
import tritonclient.http as th
import tritonclient.http.aio as tha
from google.protobuf import json_format
from tritonclient.utils import InferenceServerException

from examples.refteacher import build as build_ref
from protos.kserve import model_config_pb2, service_pb2
from teacher_server import (
    BatchingConfig,
    InferError,
    InvalidRequestError,
    ModelExecutionError,
    ModelNotFoundError,
    OverloadedError,
    ServerConfig,
    SpecError,
    TeacherServer,
    UnavailableError,
)
from teacher_server.cli import build_parser, config_from_args
from teacher_server.http_codec import decode_infer, http_status
from teacher_server.model_description import as_json
from tests.certs import make_certs
from tests.models import Affine, TwoHeads
from tests.servers import ServerThread, teacher_process

REF = "examples.refteacher:build"


def _run(coro: Coroutine[Any, Any, Any], timeout: float = 60.0) -> Any:
    return asyncio.run(asyncio.wait_for(coro, timeout))


@pytest.fixture(scope="module")
def ref_model() -> torch.nn.Module:
    return build_ref()


@pytest.fixture(scope="module")
def ref_server() -> Iterator[ServerThread]:
    cfg = ServerConfig(model=REF, name="ref_teacher", device="cpu", metrics_port=0, http_port=0,
                       batching=BatchingConfig(max_batch_size=64, max_queue_delay_us=2000))
    with ServerThread(cfg) as s:
        yield s


def _http_url(s: ServerThread) -> str:
    assert s.server is not None and s.server.http_port
    return f"127.0.0.1:{s.server.http_port}"


@pytest.fixture()
def client(ref_server: ServerThread) -> Iterator[th.InferenceServerClient]:
    c = th.InferenceServerClient(_http_url(ref_server), network_timeout=60.0)
    yield c
    c.close()


def _input(x: np.ndarray, name: str = "INPUT", dtype: str = "FP32", binary: bool = True) -> th.InferInput:
    i = th.InferInput(name, list(x.shape), dtype)
    i.set_data_from_numpy(x, binary_data=binary)
    return i


def _images(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, 3, 32, 32), dtype=np.float32)


def _expected(model: torch.nn.Module, x: np.ndarray) -> np.ndarray:
    with torch.inference_mode():
        out: np.ndarray = model(torch.from_numpy(x)).numpy()
        return out


async def _request(method: str, url: str, **kwargs: Any) -> tuple[int, dict[str, str], bytes]:
    """One plain request with aiohttp's client, as curl would send it."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session, \
            session.request(method, url, **kwargs) as resp:
        return resp.status, dict(resp.headers), await resp.read()


def _call(method: str, url: str, **kwargs: Any) -> tuple[int, dict[str, str], bytes]:
    result: tuple[int, dict[str, str], bytes] = _run(_request(method, url, **kwargs))
    return result


# ---- protocol surface --------------------------------------------------------------------------
def test_health_metadata_config_and_stats(client: th.InferenceServerClient) -> None:
    assert client.is_server_live()
    assert client.is_server_ready()
    assert client.is_model_ready("ref_teacher")
    assert client.is_model_ready("ref_teacher", "1")
    assert not client.is_model_ready("other")
    assert not client.is_model_ready("ref_teacher", "7")
    server = client.get_server_metadata()
    assert server["name"] == "teacher-server" and "binary_tensor_data" in server["extensions"]
    meta = client.get_model_metadata("ref_teacher")
    assert meta["name"] == "ref_teacher" and meta["versions"] == ["1"]
    assert meta["inputs"] == [{"name": "INPUT", "datatype": "FP32", "shape": [-1, 3, 32, 32]}]
    assert meta["outputs"] == [{"name": "LOGITS", "datatype": "FP32", "shape": [-1, 100]}]
    assert client.get_model_metadata("ref_teacher", "1") == meta
    cfg = client.get_model_config("ref_teacher")
    assert cfg["max_batch_size"] == 64 and cfg["platform"] == "pytorch_libtorch"
    assert [{k: i[k] for k in ("name", "data_type", "dims")} for i in cfg["input"]] == [
        {"name": "INPUT", "data_type": "TYPE_FP32", "dims": [3, 32, 32]}]
    assert cfg["dynamic_batching"]["max_queue_delay_microseconds"] == 2000
    assert cfg["instance_group"][0]["kind"] == "KIND_CPU"
    stats = client.get_inference_statistics("ref_teacher")["model_stats"][0]
    assert stats["name"] == "ref_teacher" and "success" in stats["inference_stats"]
    index = client.get_model_repository_index()
    assert index == [{"name": "ref_teacher", "version": "1", "state": "READY"}]


def test_the_http_config_and_metadata_are_the_grpc_answers_in_json(ref_server: ServerThread) -> None:
    """One message answers both protocols: HTTP's JSON parses back into exactly the gRPC answer,
    with Triton's numbers for 64-bit integers (protobuf's mapping would write strings) and every
    field shown, empty lists included."""
    with th.InferenceServerClient(_http_url(ref_server), network_timeout=60.0) as h, \
            tg.InferenceServerClient(ref_server.url) as g:
        http_cfg = h.get_model_config("ref_teacher")
        grpc_cfg = g.get_model_config("ref_teacher").config
        http_meta, grpc_meta = h.get_model_metadata("ref_teacher"), g.get_model_metadata("ref_teacher")
    assert json_format.ParseDict(http_cfg, model_config_pb2.ModelConfig()) == grpc_cfg
    assert json_format.ParseDict(http_meta, service_pb2.ModelMetadataResponse()) == grpc_meta
    assert http_meta["inputs"][0]["shape"] == [-1, 3, 32, 32]
    assert http_cfg["output"][0]["dims"] == [100]
    assert http_cfg["dynamic_batching"]["max_queue_delay_microseconds"] == 2000
    assert http_cfg["dynamic_batching"]["default_queue_policy"]["max_queue_size"] == 512
    assert http_cfg["input"][0]["is_shape_tensor"] is False  # a field at its default, shown as Triton shows it


def test_tritons_json_form_has_numbers_at_every_depth() -> None:
    """64-bit integers in nested messages and in maps of messages come out as numbers; an empty
    repeated field is shown; the JSON parses back into the same message."""
    cfg = model_config_pb2.ModelConfig(name="m", max_batch_size=4)
    cfg.input.add(name="X", data_type=model_config_pb2.TYPE_FP32, dims=[])
    cfg.parameters["k"].string_value = "v"
    cfg.dynamic_batching.priority_queue_policy[2].default_timeout_microseconds = 7
    doc = as_json(cfg)
    assert doc["input"][0]["dims"] == []
    assert doc["parameters"] == {"k": {"string_value": "v"}}
    assert doc["dynamic_batching"]["priority_queue_policy"]["2"]["default_timeout_microseconds"] == 7
    assert doc["dynamic_batching"]["max_queue_delay_microseconds"] == 0
    assert json_format.ParseDict(doc, model_config_pb2.ModelConfig()) == cfg


def test_unknown_model_is_not_found(client: th.InferenceServerClient) -> None:
    for call in (lambda: client.get_model_metadata("nope"), lambda: client.get_model_config("nope"),
                 lambda: client.get_model_metadata("ref_teacher", "9"),
                 lambda: client.infer("nope", [_input(_images(1))])):
        with pytest.raises(InferenceServerException) as e:
            call()
        assert e.value.status() == "404", e.value
        assert "not served here" in e.value.message() or "no version" in e.value.message()


def test_unknown_model_is_worded_as_triton_words_it(client: th.InferenceServerClient) -> None:
    """tritonclient.http sees Triton's opening words for a model not served, then what is served."""
    for call in (lambda: client.infer("nope", [_input(_images(1))]), lambda: client.get_model_metadata("nope"),
                 lambda: client.get_model_config("nope")):
        with pytest.raises(InferenceServerException) as e:
            call()
        assert e.value.status() == "404", e.value
        assert e.value.message() == ("Request for unknown model: 'nope' is not served here; "
                                     "this server serves 'ref_teacher'"), e.value.message()
    with pytest.raises(InferenceServerException) as e:
        client.get_model_metadata("ref_teacher", "9")
    assert e.value.message().startswith("Request for unknown model: 'ref_teacher' has no version '9'")


# ---- inference -----------------------------------------------------------------------------------
@pytest.mark.parametrize("binary_in", [True, False], ids=["binary-in", "json-in"])
@pytest.mark.parametrize("binary_out", [None, True, False], ids=["default-out", "binary-out", "json-out"])
def test_sync_infer_matches_in_process_model(client: th.InferenceServerClient, ref_model: torch.nn.Module,
                                             binary_in: bool, binary_out: bool | None) -> None:
    x = _images(5, seed=3)
    outputs = None if binary_out is None else [th.InferRequestedOutput("LOGITS", binary_data=binary_out)]
    r = client.infer("ref_teacher", [_input(x, binary=binary_in)], outputs=outputs, request_id="r-1")
    got = r.as_numpy("LOGITS")
    assert got.shape == (5, 100) and got.dtype == np.float32
    assert np.allclose(got, _expected(ref_model, x), atol=1e-5)
    response = r.get_response()
    assert response["id"] == "r-1" and response["model_name"] == "ref_teacher"
    sent_binary = "parameters" in response["outputs"][0]
    assert sent_binary == (binary_out is not False), "binary by default (tritonclient's binary_data_output)"


def test_aio_client_matches(ref_server: ServerThread, ref_model: torch.nn.Module) -> None:
    async def go() -> list[np.ndarray]:
        async with tha.InferenceServerClient(_http_url(ref_server)) as c:
            assert await c.is_server_ready() and await c.is_model_ready("ref_teacher")
            assert (await c.get_model_metadata("ref_teacher"))["name"] == "ref_teacher"
            results = await asyncio.gather(*[
                c.infer("ref_teacher", [_input(_images(n, seed=n), binary=n % 2 == 0)]) for n in range(1, 7)])
            return [r.as_numpy("LOGITS") for r in results]

    for n, got in enumerate(_run(go()), start=1):
        assert np.allclose(got, _expected(ref_model, _images(n, seed=n)), atol=1e-5)


def test_plain_json_request_and_response(ref_server: ServerThread, ref_model: torch.nn.Module) -> None:
    """What curl sends: a JSON body with nested data, no binary extension; JSON comes back."""
    x = _images(2, seed=5)
    body = {"id": "curl", "inputs": [{"name": "INPUT", "datatype": "FP32", "shape": [2, 3, 32, 32],
                                      "data": x.tolist()}]}
    url = f"http://{_http_url(ref_server)}/v2/models/ref_teacher/versions/1/infer"
    status, headers, raw = _call("POST", url, json=body)
    assert status == 200, raw
    assert headers["Content-Type"].startswith("application/json") and "Inference-Header-Content-Length" not in headers
    answer = json.loads(raw)
    assert answer["id"] == "curl" and answer["model_version"] == "1"
    [out] = answer["outputs"]
    assert out["name"] == "LOGITS" and out["datatype"] == "FP32" and out["shape"] == [2, 100]
    got = np.asarray(out["data"], np.float32).reshape(2, 100)
    assert np.allclose(got, _expected(ref_model, x), atol=1e-5)

    status, _, raw = _call("GET", f"http://{_http_url(ref_server)}/v2/health/ready")
    assert status == 200 and json.loads(raw) == {"ready": True}


def test_top_k_and_output_dtype_parameters(ref_server: ServerThread, ref_model: torch.nn.Module) -> None:
    x = _images(3, seed=9)
    want = torch.topk(torch.from_numpy(_expected(ref_model, x)), 4, dim=-1)
    url = f"http://{_http_url(ref_server)}/v2/models/ref_teacher/infer"
    body = {"inputs": [{"name": "INPUT", "datatype": "FP32", "shape": [3, 3, 32, 32], "data": x.ravel().tolist()}],
            "outputs": [{"name": "LOGITS", "parameters": {"top_k": 4, "output_dtype": "FP16"}}]}
    status, _, raw = _call("POST", url, json=body)
    assert status == 200, raw
    values, indices = json.loads(raw)["outputs"]
    assert values["name"] == "LOGITS_TOPK_VALUES" and values["datatype"] == "FP16"
    assert indices["name"] == "LOGITS_TOPK_INDICES" and indices["datatype"] == "INT32"
    assert np.array_equal(np.asarray(indices["data"]).reshape(3, 4), want.indices.numpy())
    assert np.allclose(np.asarray(values["data"]).reshape(3, 4), want.values.numpy(), atol=1e-2)

    body["outputs"] = [{"name": "LOGITS", "parameters": {"output_dtype": "BF16"}}]
    status, _, raw = _call("POST", url, json=body)
    assert status == 200, raw
    [bf16] = json.loads(raw)["outputs"]
    assert bf16["datatype"] == "BF16" and bf16["shape"] == [3, 100]
    full = _expected(ref_model, x)
    assert np.allclose(np.asarray(bf16["data"]).reshape(3, 100), full, rtol=1e-2, atol=1e-2)

    # Both top-k tensors follow the binary choice of the output they come from.
    r = th.InferenceServerClient(_http_url(ref_server))
    try:
        out = th.InferRequestedOutput("LOGITS", binary_data=True)
        result = r.infer("ref_teacher", [_input(x)], outputs=[out], parameters={"top_k": 4})
    finally:
        r.close()
    assert np.array_equal(result.as_numpy("LOGITS_TOPK_INDICES"), want.indices.numpy())
    assert all("parameters" in o for o in result.get_response()["outputs"])


def test_mixed_binary_and_json_inputs() -> None:
    """One input as binary bytes after the JSON header, the other as JSON data."""
    a = np.random.default_rng(0).standard_normal((5, 4), dtype=np.float32)
    b = np.arange(20, dtype=np.int64).reshape(5, 4)
    want = TwoHeads()(torch.from_numpy(a), torch.from_numpy(b))
    cfg = ServerConfig(model="tests.models:two_heads", name="two", device="cpu", http_port=0)
    with ServerThread(cfg) as s, th.InferenceServerClient(_http_url(s)) as c:
        r = c.infer("two", [_input(a, "A"), _input(b, "B", "INT64", binary=False)],
                    outputs=[th.InferRequestedOutput("SUM", binary_data=True),
                             th.InferRequestedOutput("ARGMAX", binary_data=False)])
        assert np.allclose(r.as_numpy("SUM"), want["SUM"].numpy())
        assert np.array_equal(r.as_numpy("ARGMAX"), want["ARGMAX"].numpy())

        # A binary tail longer than the inputs claim is refused, not silently ignored.
        header = json.dumps({"inputs": [
            {"name": "A", "datatype": "FP32", "shape": [5, 4], "parameters": {"binary_data_size": a.nbytes}},
            {"name": "B", "datatype": "INT64", "shape": [5, 4], "data": b.tolist()}]}).encode()
        url = f"http://{_http_url(s)}/v2/models/two/infer"
        status, _, raw = _call("POST", url, data=header + a.tobytes() + b"junk",
                               headers={"Inference-Header-Content-Length": str(len(header))})
        assert status == 400 and "belong to no input" in json.loads(raw)["error"]


# ---- refusals ------------------------------------------------------------------------------------
BAD_BODIES: dict[str, tuple[object, str]] = {
    "bad shape": ({"inputs": [{"name": "INPUT", "datatype": "FP32", "shape": [1, 3, 32], "data": [0.0] * 96}]},
                  "shape"),
    "bad dtype": ({"inputs": [{"name": "INPUT", "datatype": "FP64", "shape": [1, 3, 32, 32],
                               "data": [0.0] * 3072}]}, "datatype 'FP64' received"),
    "unknown dtype": ({"inputs": [{"name": "INPUT", "datatype": "WAT", "shape": [1, 3, 32, 32],
                                   "data": [0.0] * 3072}]}, "datatype 'WAT' received"),
    "too few values": ({"inputs": [{"name": "INPUT", "datatype": "FP32", "shape": [1, 3, 32, 32],
                                    "data": [0.0] * 7}]}, "7 values"),
    "text for numbers": ({"inputs": [{"name": "INPUT", "datatype": "FP32", "shape": [1, 3, 32, 32],
                                      "data": ["x"] * 3072}]}, "must be FP32 numbers"),
    "no data": ({"inputs": [{"name": "INPUT", "datatype": "FP32", "shape": [1, 3, 32, 32]}]}, "neither 'data'"),
    "not an object": ([1, 2], "JSON object"),
    "unknown output": ({"inputs": [{"name": "INPUT", "datatype": "FP32", "shape": [1, 3, 32, 32],
                                    "data": [0.0] * 3072}], "outputs": [{"name": "NOPE"}]}, "unknown output"),
}


@pytest.mark.parametrize("case", list(BAD_BODIES))
def test_bad_request_is_400_with_error_body(ref_server: ServerThread, case: str) -> None:
    body, words = BAD_BODIES[case]
    url = f"http://{_http_url(ref_server)}/v2/models/ref_teacher/infer"
    status, headers, raw = _call("POST", url, json=body)
    assert status == 400, raw
    assert headers["Content-Type"].startswith("application/json")
    assert words in json.loads(raw)["error"]


def test_tritonclient_sees_400_for_a_bad_shape(client: th.InferenceServerClient) -> None:
    with pytest.raises(InferenceServerException) as e:
        client.infer("ref_teacher", [_input(_images(2)[:, :1].copy())])
    assert e.value.status() == "400" and "shape" in e.value.message()


def test_malformed_bodies_and_unknown_routes(ref_server: ServerThread) -> None:
    base = f"http://{_http_url(ref_server)}"
    status, _, raw = _call("POST", f"{base}/v2/models/ref_teacher/infer", data=b"{not json")
    assert status == 400 and "does not parse" in json.loads(raw)["error"]
    status, _, raw = _call("POST", f"{base}/v2/models/ref_teacher/infer", data=b"{}",
                           headers={"Inference-Header-Content-Length": "99"})
    assert status == 400 and "Inference-Header-Content-Length" in json.loads(raw)["error"]
    status, _, raw = _call("GET", f"{base}/v2/nothing/here")
    assert status == 404 and "error" in json.loads(raw)
    status, _, raw = _call("GET", f"{base}/v2/models/ref_teacher/infer")
    assert status == 405 and "error" in json.loads(raw)


def test_body_over_max_message_mb_is_413() -> None:
    cfg = ServerConfig(model="tests.models:affine", name="affine", device="cpu", max_message_mb=1, http_port=0,
                       batching=BatchingConfig(max_batch_size=1 << 20))
    with ServerThread(cfg) as s, th.InferenceServerClient(_http_url(s)) as c:
        big = np.zeros((40_000, 8), np.float32)  # 1.28 MB > 1 MiB
        with pytest.raises(InferenceServerException) as e:
            c.infer("affine", [_input(big, "X")])
        assert e.value.status() == "413" and "--max-message-mb" in e.value.message()

        async def chunked() -> tuple[int, bytes]:
            async def parts() -> Any:
                for _ in range(3):
                    yield b" " * (512 << 10)

            async with aiohttp.ClientSession() as session, session.post(
                    f"http://{_http_url(s)}/v2/models/affine/infer", data=parts()) as resp:
                return resp.status, await resp.read()

        status, raw = _run(chunked())
        assert status == 413 and "--max-message-mb" in json.loads(raw)["error"]
        small = np.ones((3, 8), np.float32)
        got = c.infer("affine", [_input(small, "X")]).as_numpy("Y")
        assert np.allclose(got, Affine()(torch.from_numpy(small)).detach().numpy(), atol=1e-6)


def test_full_queue_is_429() -> None:
    cfg = ServerConfig(model="tests.models:sleepy", name="slow", device="cpu", http_port=0,
                       batching=BatchingConfig(max_batch_size=1, max_queue_delay_us=0, max_queue_size=2))
    with ServerThread(cfg) as s:
        async def go() -> list[object]:
            async with tha.InferenceServerClient(_http_url(s), conn_limit=32) as c:
                x = np.ones((1, 8), np.float32)
                return await asyncio.gather(*[c.infer("slow", [_input(x, "X")]) for _ in range(12)],
                                            return_exceptions=True)

        results = _run(go())
    errors = [r for r in results if isinstance(r, BaseException)]
    assert errors, "12 concurrent requests on a 2-deep queue behind a 50 ms model must overflow"
    for e in errors:
        assert isinstance(e, InferenceServerException) and e.status() == "429", e
        assert "queue is full" in e.message()
    assert len(errors) < len(results), "the requests that fit are answered"


def test_refusals_map_to_the_same_statuses_as_grpc() -> None:
    assert http_status(InvalidRequestError("x")) == 400
    assert http_status(ModelNotFoundError("x")) == 404
    assert http_status(OverloadedError("x")) == 429
    assert http_status(UnavailableError("x")) == 503
    assert http_status(ModelExecutionError("x")) == 500
    assert http_status(InferError("x")) == 500


def test_model_failure_is_500_and_server_survives() -> None:
    cfg = ServerConfig(model="tests.models:broken", name="b", device="cpu", http_port=0)
    with ServerThread(cfg) as s, th.InferenceServerClient(_http_url(s)) as c:
        with pytest.raises(InferenceServerException) as e:
            c.infer("b", [_input(np.full((1, 8), 1e7, np.float32), "X")])
        assert e.value.status() == "500" and "boom" in e.value.message()
        assert c.infer("b", [_input(np.ones((1, 8), np.float32), "X")]).as_numpy("Y").shape == (1, 4)


# ---- drain ---------------------------------------------------------------------------------------
_GATE = threading.Event()


class _Gated(Affine):
    """Affine whose non-zero batches wait for the test to open _GATE (the warm-up batch is zeros)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if bool(x.any()):
            _GATE.wait(60)
        return super().forward(x)


def gated() -> _Gated:
    return _Gated()


def test_drain_answers_503_and_finishes_in_flight() -> None:
    _GATE.clear()
    cfg = ServerConfig(model="tests.test_http:gated", name="g", device="cpu", http_port=0)
    with ServerThread(cfg) as s:
        assert s.server is not None
        server = s.server
        base = f"http://{_http_url(s)}"
        x = np.ones((2, 8), np.float32)
        body = {"inputs": [{"name": "X", "datatype": "FP32", "shape": [2, 8], "data": x.ravel().tolist()}]}

        async def go() -> None:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
                in_flight = asyncio.create_task(session.post(f"{base}/v2/models/g/infer", json=body))
                for _ in range(600):  # until the server holds it (bounded: 60 s)
                    if server.in_flight == 1:
                        break
                    await asyncio.sleep(0.1)
                assert server.in_flight == 1
                await asyncio.to_thread(s.call, server.begin_drain())
                async with session.get(f"{base}/v2/health/ready") as r:
                    assert r.status == 503
                async with session.get(f"{base}/v2/health/live") as r:
                    assert r.status == 200
                async with session.get(f"{base}/v2/models/g/ready") as r:
                    assert r.status == 503
                async with session.post(f"{base}/v2/models/g/infer", json=body) as r:
                    assert r.status == 503 and "draining" in (await r.json())["error"]
                _GATE.set()
                async with await in_flight as r:
                    assert r.status == 200
                    got = np.asarray((await r.json())["outputs"][0]["data"], np.float32).reshape(2, 4)
                assert np.allclose(got, Affine()(torch.from_numpy(x)).detach().numpy(), atol=1e-6)

        try:
            _run(go(), 90)
        finally:
            _GATE.set()
        assert s.call(server.drain(10.0))
    assert server.http_port is None, "the HTTP site is closed with the server"


# ---- the same requests in the same metrics ---------------------------------------------------------
def test_http_and_grpc_requests_share_the_metrics(ref_server: ServerThread, client: th.InferenceServerClient) -> None:
    assert ref_server.server is not None
    url = f"http://127.0.0.1:{ref_server.server.metrics_port}/metrics"

    def scrape() -> dict[str, float]:
        text = urllib.request.urlopen(url, timeout=10).read().decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("nv_inference_"):
                key, value = line.rsplit(" ", 1)
                out[key] = float(value)
        return out

    labels = '{model="ref_teacher",version="1"}'
    before = scrape()
    client.infer("ref_teacher", [_input(_images(3))])
    with tg.InferenceServerClient(ref_server.url) as g:
        i = tg.InferInput("INPUT", [4, 3, 32, 32], "FP32")
        i.set_data_from_numpy(_images(4))
        g.infer("ref_teacher", [i])
    with pytest.raises(InferenceServerException):
        client.infer("ref_teacher", [_input(_images(2)[:, :1].copy())])
    after = scrape()
    assert after[f"nv_inference_request_success{labels}"] - before[f"nv_inference_request_success{labels}"] == 2
    assert after[f"nv_inference_count{labels}"] - before[f"nv_inference_count{labels}"] == 7
    other = 'nv_inference_request_failure{model="ref_teacher",version="1",reason="OTHER"}'
    assert after[other] - before[other] == 1


# ---- configuration ---------------------------------------------------------------------------------
def test_http_port_flag() -> None:
    parser = build_parser()
    assert config_from_args(parser.parse_args(["--model", REF])).http_port is None, "off by default"
    assert config_from_args(parser.parse_args(["--model", REF, "--http-port", "8000"])).http_port == 8000
    with pytest.raises(SpecError, match="--http-port"):
        ServerConfig(model=REF, http_port=70000)


def test_http_port_in_use_is_a_clear_error() -> None:
    cfg = ServerConfig(model="tests.models:affine", name="a", device="cpu", http_port=0)
    with ServerThread(cfg) as s:
        assert s.server is not None
        taken = s.server.http_port
        clash = ServerThread(ServerConfig(model="tests.models:affine", name="a", device="cpu", http_port=taken))
        with pytest.raises(OSError, match="--http-port 0 picks a free one"):
            clash.__enter__()
        clash.__exit__(None, None, None)


def test_decoding_views_binary_inputs_without_copying() -> None:
    x = np.arange(16, dtype=np.float32)
    header = json.dumps({"inputs": [{"name": "X", "datatype": "FP32", "shape": [2, 8],
                                     "parameters": {"binary_data_size": x.nbytes}}]}).encode()
    body = header + x.tobytes()
    decoded = decode_infer(body, str(len(header)), "m")
    assert not decoded.request.malformed
    [raw] = decoded.request.raw_inputs
    assert isinstance(raw, memoryview) and raw.obj is body, "a view into the received body"
    assert np.array_equal(np.frombuffer(raw, np.float32), x)
    assert decoded.request.inputs[0].parameters == {}, "binary_data_size is the edge's, not the model's"


_LOAD_GATE = threading.Event()


def gated_load() -> Affine:
    """A model whose load waits for the test to open _LOAD_GATE, like a long checkpoint read."""
    _LOAD_GATE.wait(60)
    return Affine()


def test_loading_server_answers_503_until_ready() -> None:
    """The HTTP port answers at once; ready and infer are 503 until the model is loaded."""
    _LOAD_GATE.clear()
    cfg = ServerConfig(model="tests.test_http:gated_load", name="a", device="cpu", http_port=0)
    server = TeacherServer(cfg)
    thread = ServerThread(cfg)
    thread.server = server
    thread._thread.start()
    try:
        started = asyncio.run_coroutine_threadsafe(server.start(), thread._loop)
        for _ in range(3000):  # until the port is bound (bounded: 30 s)
            if server.http_port or started.done():
                break
            time.sleep(0.01)
        assert server.http_port, started.exception() if started.done() else "no HTTP port after 30 s"
        base = f"http://127.0.0.1:{server.http_port}"
        assert _call("GET", f"{base}/v2/health/live")[0] == 200
        assert _call("GET", f"{base}/v2/health/ready")[0] == 503
        status, _, raw = _call("GET", f"{base}/v2/models/a")
        assert status == 503 and "loading" in json.loads(raw)["error"]
        body = {"inputs": [{"name": "X", "datatype": "FP32", "shape": [1, 8], "data": [0.0] * 8}]}
        status, _, raw = _call("POST", f"{base}/v2/models/a/infer", json=body)
        assert status == 503 and "loading" in json.loads(raw)["error"]
        _LOAD_GATE.set()
        started.result(60)
        assert _call("GET", f"{base}/v2/health/ready")[0] == 200
        assert _call("POST", f"{base}/v2/models/a/infer", json=body)[0] == 200
    finally:
        _LOAD_GATE.set()
        thread.__exit__(None, None, None)


def test_compressed_request_bodies(client: th.InferenceServerClient, ref_model: torch.nn.Module) -> None:
    """tritonclient's request_compression_algorithm: the body arrives gzip or deflate encoded."""
    x = _images(2, seed=4)
    for algorithm in ("gzip", "deflate"):
        r = client.infer("ref_teacher", [_input(x)], request_compression_algorithm=algorithm,
                         response_compression_algorithm=algorithm)
        assert np.allclose(r.as_numpy("LOGITS"), _expected(ref_model, x), atol=1e-5), algorithm


def test_http_serves_the_same_tls_as_grpc(tmp_path: Path) -> None:
    """With --tls-cert/--tls-key (and --tls-client-ca) the REST port is HTTPS with the same rules:
    plaintext and clients without a certificate from the CA are refused."""
    certs = make_certs(tmp_path / "certs")
    cfg = ServerConfig(model="tests.models:affine", name="a", device="cpu", http_port=0,
                       tls_cert=str(certs.server_pem), tls_key=str(certs.server_key),
                       tls_client_ca=str(certs.ca_pem))
    body = {"inputs": [{"name": "X", "datatype": "FP32", "shape": [1, 8], "data": [1.0] * 8}]}

    def context(cert: Path | None, key: Path | None) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=str(certs.ca_pem))
        if cert is not None and key is not None:
            ctx.load_cert_chain(str(cert), str(key))
        return ctx

    with ServerThread(cfg) as s:
        assert s.server is not None
        https = f"https://127.0.0.1:{s.server.http_port}/v2/models/a/infer"
        status, _, raw = _call("POST", https, json=body, ssl=context(certs.client_pem, certs.client_key))
        assert status == 200, raw
        assert len(json.loads(raw)["outputs"][0]["data"]) == 4
        for cert, key in ((None, None), (certs.rogue_pem, certs.rogue_key)):
            with pytest.raises(aiohttp.ClientError):
                _call("POST", https, json=body, ssl=context(cert, key))
        with pytest.raises(aiohttp.ClientError):
            _call("POST", https.replace("https", "http"), json=body)


def test_teacher_process_serves_http_on_the_flag(tmp_path: Path) -> None:
    """The real CLI: --http-port 0 binds a free port (logged), beside gRPC, in one process."""
    args = ["--model", "tests.models:affine", "--name", "a", "--device", "cpu", "--instances", "1",
            "--http-port", "0"]
    with teacher_process(args, tmp_path) as (_, info):
        [log] = tmp_path.glob("teacher-*.log")
        found = re.search(r"KServe v2 HTTP/REST on 127\.0\.0\.1:(\d+)", log.read_text())
        assert found, log.read_text()
        x = np.ones((2, 8), np.float32)
        with th.InferenceServerClient(f"127.0.0.1:{found.group(1)}") as c:
            got = c.infer("a", [_input(x, "X")]).as_numpy("Y")
        with tg.InferenceServerClient(f"127.0.0.1:{info['port']}") as g:
            assert g.is_model_ready("a")
    assert np.allclose(got, Affine()(torch.from_numpy(x)).detach().numpy(), atol=1e-6)
