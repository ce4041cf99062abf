"""The student and tritonclient against a real Triton: PyTriton's Triton core on CPU.

`tests/pytriton_env.py` builds PyTriton's own virtualenv once (cached; about 2 minutes the first
time on a 2-core machine) and starts `tests/pytriton_server.py` from it, serving
`LOGITS = INPUT @ W`. Inputs here are integer-valued and W holds small integers, so every sum is
exact in FP32 and outputs are compared bit for bit with numpy's `x @ W`.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import tritonclient.grpc as tg
from tritonclient.utils import InferenceServerException

import distill
from tests.pytriton_env import PyTritonServer, PyTritonUnavailable, check_platform, pytriton_server, pytriton_venv
from tests.pytriton_server import weights

# The first test to ask for a server may build the venv (pip download and install) first.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

DIM, CLASSES, MAX_BATCH = 16, 10, 64


@pytest.fixture(scope="session")
def pytriton_python() -> Path:
    try:
        check_platform()
    except PyTritonUnavailable as e:
        pytest.skip(str(e))
    return pytriton_venv()


@pytest.fixture(scope="session")
def open_triton(pytriton_python: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PyTritonServer]:
    """A Triton that serves every endpoint openly."""
    with pytriton_server(model="linear", dim=DIM, classes=CLASSES, max_batch_size=MAX_BATCH, restrict="none",
                         venv=pytriton_python, log_dir=tmp_path_factory.mktemp("pytriton-open")) as server:
        yield server


@pytest.fixture(scope="session")
def hardened_triton(pytriton_python: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PyTritonServer]:
    """A Triton with PyTriton's default restriction: model-repository, statistics, ... need a header."""
    with pytriton_server(model="linear", dim=DIM, classes=CLASSES, max_batch_size=MAX_BATCH, restrict="default",
                         venv=pytriton_python, log_dir=tmp_path_factory.mktemp("pytriton-hardened")) as server:
        yield server


def integer_inputs(rows: int, seed: int) -> np.ndarray:
    """Integer-valued FP32 rows in [-16, 16]: with W in [-8, 8] and DIM 16 every sum is exact in FP32."""
    return np.random.default_rng(seed).integers(-16, 17, size=(rows, DIM)).astype(np.float32)


def infer(client: tg.InferenceServerClient, model: str, x: np.ndarray) -> np.ndarray:
    inp = tg.InferInput("INPUT", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    result = client.infer(model, [inp], outputs=[tg.InferRequestedOutput("LOGITS")], client_timeout=30.0)
    out = result.as_numpy("LOGITS")
    assert out is not None, "the response has no LOGITS"
    return out


def test_tritonclient_gets_exactly_x_at_w(open_triton: PyTritonServer) -> None:
    w = weights(DIM, CLASSES)
    with tg.InferenceServerClient(open_triton.grpc_url) as client:
        assert client.is_server_ready(client_timeout=10.0)
        assert client.is_model_ready(open_triton.model, client_timeout=10.0)
        config = client.get_model_config(open_triton.model, client_timeout=10.0).config
        assert config.max_batch_size == MAX_BATCH
        meta = client.get_model_metadata(open_triton.model, client_timeout=10.0)
        assert [(t.name, t.datatype, list(t.shape)) for t in meta.inputs] == [("INPUT", "FP32", [-1, DIM])]
        assert [(t.name, t.datatype, list(t.shape)) for t in meta.outputs] == [("LOGITS", "FP32", [-1, CLASSES])]
        for seed, rows in enumerate((1, 7, MAX_BATCH)):
            x = integer_inputs(rows, seed)
            out = infer(client, open_triton.model, x)
            assert out.dtype == np.float32 and out.shape == (rows, CLASSES)
            np.testing.assert_array_equal(out, x @ w)
        with pytest.raises(InferenceServerException, match="batch"):  # Triton's own limit check
            infer(client, open_triton.model, integer_inputs(MAX_BATCH + 1, 99))


def train_through_reader(server: PyTritonServer) -> list[int]:
    """A few KD steps through DistillReader(model=...); checks every teacher output against x @ W and
    returns the batch ids in the order the reader delivered them."""
    w = torch.from_numpy(weights(DIM, CLASSES))
    # Sizes around and over the teacher's max_batch_size: the reader splits the 150-row batch.
    sizes = (5, 32, MAX_BATCH, 150, 1, 17)
    loader = [
        {"INPUT": torch.from_numpy(integer_inputs(rows, 100 + i)), "label": torch.arange(rows) % CLASSES,
         "id": torch.full((rows,), i)}
        for i, rows in enumerate(sizes)
    ]
    torch.manual_seed(0)
    student = torch.nn.Linear(DIM, CLASSES)
    opt = torch.optim.SGD(student.parameters(), lr=1e-3)
    kd = distill.KDLoss(temperature=4.0, alpha=0.5)
    seen: list[int] = []
    with distill.DistillReader(loader, teachers=server.grpc_url, model=server.model, inputs=["INPUT"],
                               outputs=["LOGITS"], timeout=30.0, no_teacher_timeout=60.0) as reader:
        for batch, teacher in reader:
            assert len(seen) < len(sizes), "the reader delivered more batches than the loader has"
            logits = teacher["LOGITS"]
            assert logits.dtype == torch.float32 and logits.shape == (batch["INPUT"].shape[0], CLASSES)
            torch.testing.assert_close(logits, batch["INPUT"] @ w, rtol=0, atol=0)
            loss = kd(student(batch["INPUT"]), logits, batch["label"])
            assert torch.isfinite(loss)
            opt.zero_grad()
            loss.backward()
            opt.step()
            seen.append(int(batch["id"][0]))
    return seen


def test_reader_trains_against_real_triton(open_triton: PyTritonServer) -> None:
    assert train_through_reader(open_triton) == list(range(6))


def test_hardened_triton_restricts_the_repository_api(hardened_triton: PyTritonServer) -> None:
    """What PyTriton restricts by default, as a client sees it: the model-repository API answers
    UNAVAILABLE naming the header it wants; with the header it answers. Inference, metadata and
    config stay open."""
    r = hardened_triton.restriction
    assert r is not None and "model-repository" in r.endpoints
    assert r.grpc_header == "triton-grpc-protocol-triton-access-token"
    with tg.InferenceServerClient(hardened_triton.grpc_url) as client:
        with pytest.raises(InferenceServerException) as refused:
            client.get_model_repository_index(client_timeout=10.0)
        assert refused.value.status() == "StatusCode.UNAVAILABLE"
        assert "This protocol is restricted" in str(refused.value) and r.grpc_header in str(refused.value)
        # PyTriton loads models through the load API, not from files: even with the header the index is empty.
        index = client.get_model_repository_index(headers=r.grpc_metadata(), client_timeout=10.0, as_json=True)
        assert index.get("models", []) == []
        x = integer_inputs(3, 7)
        np.testing.assert_array_equal(infer(client, hardened_triton.model, x), x @ weights(DIM, CLASSES))


def test_reader_with_model_trains_against_hardened_triton(hardened_triton: PyTritonServer) -> None:
    """With model= the student needs only metadata, config and inference, which stay open."""
    assert train_through_reader(hardened_triton) == list(range(6))


def test_server_stops_cleanly_on_sigterm(pytriton_python: Path, tmp_path: Path) -> None:
    """The launcher's stop is a SIGTERM the server handles (exit 0, Triton stopped by PyTriton),
    not the SIGKILL it falls back to; its workspace is removed."""
    with pytriton_server(model="stopper", dim=DIM, classes=CLASSES, venv=pytriton_python, log_dir=tmp_path) as server:
        with tg.InferenceServerClient(server.grpc_url) as client:
            assert client.is_model_ready("stopper", client_timeout=10.0)
        assert server.workspace.is_dir()
    assert server.process.returncode == 0, server.log.read_text(errors="replace")[-3000:]
    assert not server.workspace.exists()
