"""The student and tritonclient against a real Triton: PyTriton's Triton core on CPU.

`tests/pytriton_env.py` builds PyTriton's own virtualenv once (cached; about 2 minutes the first
time on a 2-core machine) and starts `tests/pytriton_server.py` from it, serving
`LOGITS = INPUT @ W`. Inputs here are integer-valued and W holds small integers, so every sum is
exact in FP32 and outputs are compared bit for bit with numpy's `x @ W`.
"""

from __future__ import annotations

import argparse
import logging
import queue
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import tritonclient.grpc as tg
from tritonclient.utils import InferenceServerException

import distill
from distill.errors import TeacherAccessError
from tests.pytriton_env import PyTritonServer, pytriton_python_or_skip, pytriton_server
from tests.pytriton_server import weights

# The first test to ask for a server may build the venv (pip download and install) first.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

DIM, CLASSES, MAX_BATCH = 16, 10, 64
# Every endpoint group Triton can restrict but health (PyTriton's own start-up check calls it without
# the header): metadata, config and inference answer only with the access header.
LOCKED_ENDPOINTS = "metadata,inference,shared-memory,model-config,model-repository,statistics,trace,logging"
# Far longer than any test may run: an error that comes at all came from the refusal, not the timeout.
NEVER_S = 3600.0


@pytest.fixture(scope="session")
def pytriton_python() -> Path:
    return pytriton_python_or_skip()


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


@pytest.fixture(scope="session")
def locked_triton(pytriton_python: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PyTritonServer]:
    """A Triton that restricts metadata, config and inference too, to callers with the header."""
    with pytriton_server(model="linear", dim=DIM, classes=CLASSES, max_batch_size=MAX_BATCH, restrict=LOCKED_ENDPOINTS,
                         venv=pytriton_python, log_dir=tmp_path_factory.mktemp("pytriton-locked")) as server:
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


def train_through_reader(server: PyTritonServer, **reader_options: Any) -> list[int]:
    """A few KD steps through DistillReader(model=..., **reader_options); checks every teacher output
    against x @ W and returns the batch ids in the order the reader delivered them."""
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
                               outputs=["LOGITS"], timeout=30.0, no_teacher_timeout=60.0, **reader_options) as reader:
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


def first_error(server: PyTritonServer, within_s: float = 120.0, **reader_options: Any) -> BaseException:
    """What a reader for `server` raises when started and iterated once. The reader runs on a daemon
    thread and is waited for at most `within_s`, so a reader that hangs fails the test without
    holding up the session."""
    loader = [{"INPUT": torch.from_numpy(integer_inputs(4, 1))}]
    outcome: queue.Queue[BaseException | None] = queue.Queue()

    def run() -> None:
        try:
            with distill.DistillReader(loader, teachers=server.grpc_url, inputs=["INPUT"], outputs=["LOGITS"],
                                       timeout=10.0, **reader_options) as reader:
                for _ in reader:
                    pass
        except BaseException as e:  # handed to the test thread
            outcome.put(e)
        else:
            outcome.put(None)

    threading.Thread(target=run, name="reader-under-test", daemon=True).start()
    try:
        error = outcome.get(timeout=within_s)
    except queue.Empty:
        pytest.fail(f"the reader neither failed nor finished within {within_s:g} s")
    assert error is not None, "the reader trained although the server should have refused it"
    return error


def test_hardened_triton_without_model_fails_at_once_naming_the_fix(hardened_triton: PyTritonServer) -> None:
    """Issue #12: RepositoryIndex refused. The reader raises at once (not after no_teacher_timeout,
    whatever the fallback), quoting the server and naming model= / --distill_model and the header."""
    r = hardened_triton.restriction
    assert r is not None
    for fallback in ("error", "hard_labels"):
        error = first_error(hardened_triton, no_teacher_timeout=NEVER_S, fallback=fallback)
        assert isinstance(error, TeacherAccessError) and isinstance(error, distill.NoTeacherError), repr(error)
        message = str(error)
        assert hardened_triton.grpc_url in message
        assert "RepositoryIndex answered UNAVAILABLE: This protocol is restricted" in message
        assert r.grpc_header in message
        assert "model='NAME' (--distill_model NAME)" in message
        assert f"headers={{{r.grpc_header!r}: TOKEN}} (--distill_header {r.grpc_header}=TOKEN)" in message
        assert "Start teacher-server processes" not in message
    # With the header the index answers, but PyTriton's lists no model (it loads them through the
    # load API): the reader cannot pick one and says at once to name it.
    error = first_error(hardened_triton, no_teacher_timeout=NEVER_S, headers=r.grpc_metadata())
    assert isinstance(error, distill.TeacherMismatchError), repr(error)
    assert "serves no ready model" in str(error) and "model='NAME' (--distill_model NAME)" in str(error)
    assert r.value not in str(error)


def test_locked_triton_with_model_and_headers_trains(locked_triton: PyTritonServer) -> None:
    """Metadata, config, readiness and inference all restricted: with model= and the header, the
    reader trains and gets x @ W exactly."""
    r = locked_triton.restriction
    assert r is not None and "inference" in r.endpoints and "metadata" in r.endpoints
    assert train_through_reader(locked_triton, headers=r.grpc_metadata()) == list(range(6))
    # The same from the flags, header names in any case.
    parser = distill.add_distill_args(argparse.ArgumentParser())
    args = parser.parse_args(["--distill_teachers", locked_triton.grpc_url, "--distill_model", locked_triton.model,
                              "--distill_header", f"{r.grpc_header.upper()}={r.value}"])
    x = integer_inputs(9, 5)
    with distill.DistillReader.from_args(args, [{"INPUT": torch.from_numpy(x)}], inputs=["INPUT"]) as reader:
        outputs = [teacher["LOGITS"] for _, teacher in reader]
    assert len(outputs) == 1
    torch.testing.assert_close(outputs[0], torch.from_numpy(x @ weights(DIM, CLASSES)), rtol=0, atol=0)


def test_locked_triton_without_the_header_fails_at_once(locked_triton: PyTritonServer,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    """model= given but no header (or a wrong one): ModelMetadata is refused; the error says which
    header to send, and neither it nor any log line shows a token this reader sent."""
    r = locked_triton.restriction
    assert r is not None
    error = first_error(locked_triton, model=locked_triton.model, no_teacher_timeout=NEVER_S)
    assert isinstance(error, TeacherAccessError), repr(error)
    message = str(error)
    assert "ModelMetadata answered UNAVAILABLE: This protocol is restricted" in message
    assert f"pass headers={{{r.grpc_header!r}: TOKEN}} (--distill_header {r.grpc_header}=TOKEN)" in message
    assert "--distill_model" not in message  # the model was named: that is not the problem here

    wrong = "not-the-token-" + r.value[:6]
    with caplog.at_level(logging.DEBUG):
        error = first_error(locked_triton, model=locked_triton.model, no_teacher_timeout=NEVER_S,
                            headers={r.grpc_header: wrong})
    assert isinstance(error, TeacherAccessError), repr(error)
    message = str(error)
    assert f"check the headers this reader sends ({r.grpc_header})" in message
    assert wrong not in message and r.value not in message
    assert "This protocol is restricted" in caplog.text  # the server's words reach the log
    assert wrong not in caplog.text


def test_triton_refusing_inference_fails_at_once(pytriton_python: Path, tmp_path: Path) -> None:
    """Only inference restricted: the reader starts (metadata is open), its first chunk is refused,
    and the epoch ends at once with the refusal, not after no_teacher_timeout, whatever the fallback."""
    with pytriton_server(model="linear", dim=DIM, classes=CLASSES, restrict="inference", venv=pytriton_python,
                         log_dir=tmp_path) as server:
        r = server.restriction
        assert r is not None and r.endpoints == ("inference",)
        for fallback in ("error", "hard_labels"):
            error = first_error(server, model=server.model, no_teacher_timeout=NEVER_S, fallback=fallback)
            assert isinstance(error, TeacherAccessError), repr(error)
            message = str(error)
            assert f"{server.grpc_url}: ModelInfer answered UNAVAILABLE: This protocol is restricted" in message
            assert f"pass headers={{{r.grpc_header!r}: TOKEN}}" in message


def test_server_stops_cleanly_on_sigterm(pytriton_python: Path, tmp_path: Path) -> None:
    """The launcher's stop is a SIGTERM the server handles (exit 0, Triton stopped by PyTriton),
    not the SIGKILL it falls back to; its workspace is removed."""
    with pytriton_server(model="stopper", dim=DIM, classes=CLASSES, venv=pytriton_python, log_dir=tmp_path) as server:
        with tg.InferenceServerClient(server.grpc_url) as client:
            assert client.is_model_ready("stopper", client_timeout=10.0)
        assert server.workspace.is_dir()
    assert server.process.returncode == 0, server.log.read_text(errors="replace")[-3000:]
    assert not server.workspace.exists()
