"""The emulated W1 teacher, student step and loader: deterministic, correctly shaped, timed as declared."""

from __future__ import annotations

import time

import pytest
import torch

from examples import emulated
from teacher_server.model import load_model


def test_teacher_is_deterministic_and_shaped() -> None:
    x = torch.randn(8, 3, 32, 32)
    a, b = emulated.build(step_ms=0), emulated.build(step_ms=0)
    ya, yb = a(x), b(x)
    assert ya.shape == (8, 100) and ya.dtype == torch.float32
    assert torch.equal(ya, yb)  # same seed, same weights: an in-process copy can check a server
    assert not torch.equal(ya, emulated.build(step_ms=0, seed=1)(x))
    assert not torch.allclose(ya[0], ya[1])  # the logits depend on the input


def test_teacher_sleeps_per_started_batch_of_256(monkeypatch: pytest.MonkeyPatch) -> None:
    # What is checked is how long the model *asks* to wait (one step per started batch of 256),
    # and that it really waits at least that long; how much longer a loaded machine takes is not
    # the model's business (speed belongs to the benchmarks).
    asked: list[float] = []
    real_sleep = time.sleep

    def sleep(seconds: float) -> None:
        asked.append(seconds)
        real_sleep(seconds)

    monkeypatch.setattr(emulated.time, "sleep", sleep)
    m = emulated.build(step_ms=20)
    x = torch.zeros(257, 3, 32, 32)
    started = time.perf_counter()
    m(x[:256])
    one = time.perf_counter() - started
    started = time.perf_counter()
    m(x)
    two = time.perf_counter() - started
    m(x[:1])
    assert asked == [pytest.approx(0.02), pytest.approx(0.04), pytest.approx(0.02)]
    assert one >= 0.019 and two >= 0.039
    asked.clear()
    emulated.build(step_ms=0)(x)
    assert asked == []  # no emulated compute: no sleep at all


def test_build_reads_the_step_time_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(emulated.TEACHER_MS_ENV, "7.5")
    assert emulated.build().step_s == pytest.approx(0.0075)
    monkeypatch.delenv(emulated.TEACHER_MS_ENV)
    assert emulated.build().step_s == pytest.approx(emulated.DEFAULT_TEACHER_MS / 1000)


def test_teacher_server_accepts_its_io_spec(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(emulated.TEACHER_MS_ENV, "0")
    model = load_model("examples.emulated:build", device="cpu")
    assert [(s.name, s.datatype, s.shape) for s in model.io.inputs] == [("INPUT", "FP32", (3, 32, 32))]
    assert [(s.name, s.datatype, s.shape) for s in model.io.outputs] == [("LOGITS", "FP32", (100,))]


def test_loader_yields_w1_batches_and_rebuilds_distinct_inputs() -> None:
    plain = emulated.W1Loader(6, pool=2)
    batches = list(plain)
    assert len(batches) == len(plain) == 6 and [b["index"] for b in batches] == list(range(6))
    assert batches[0]["INPUT"].shape == (256, 3, 32, 32) and batches[0]["INPUT"].dtype == torch.float32
    assert batches[0]["label"].shape == (256,) and batches[0]["label"].dtype == torch.int64
    assert batches[0]["INPUT"] is batches[2]["INPUT"]  # reused: the loader costs nothing
    assert [b["index"] for b in plain] == list(range(6))  # re-iterable: one epoch per iter()

    distinct = emulated.W1Loader(6, pool=2, distinct=True)
    xs = [b["INPUT"] for b in distinct]
    assert not torch.equal(xs[0], xs[2])
    assert torch.equal(xs[4], distinct.inputs(4))


def test_student_step_sleeps_and_checks_logits() -> None:
    started = time.perf_counter()
    emulated.student_step(None, torch.zeros(4, 100), step_ms=10)
    assert time.perf_counter() - started >= 0.009
    with pytest.raises(ValueError, match="expected"):
        emulated.student_step(None, torch.zeros(4, 10), step_ms=0)
