"""Outputs go back asynchronously (teacher_server.finishing): an instance's thread launches a batch
and takes the next one while its finishing stage cuts and encodes the previous one. Checked on a
CPU model with a real instance and batcher: the finishing of a batch is held (its encoding waits
on an event) to see what runs meanwhile, how many batches an instance holds, and what a failure
or a close while finishing does to the requests."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest
import torch

from teacher_server import finishing
from teacher_server.api import server_config
from teacher_server.batcher import BatcherClosedError, BatchingConfig, DynamicBatcher
from teacher_server.cli import build_parser, flag_values
from teacher_server.instance import ModelInstance
from teacher_server.model import load_model
from teacher_server.outputs import EncodedOutput
from teacher_server.spec import SpecError
from teacher_server.work import Work
from tests import seq_models
from tests.test_staging import _work

MODEL = "tests.seq_models:causal_conv_lm"


class HeldEncoder:
    """Stands in for `BatchOutputs.encoded` (`install`): each call (a batch) says it started, waits
    for `release` (bounded), and the call numbered `fail_call` (from 1) raises instead of encoding."""

    def __init__(self, fail_call: int = 0) -> None:
        self.release = threading.Event()
        self.started = threading.Semaphore(0)
        self.calls = 0
        self.fail_call = fail_call
        self._real = finishing.BatchOutputs.encoded

    def __call__(self, outputs: finishing.BatchOutputs) -> list[list[EncodedOutput]]:
        self.calls += 1
        self.started.release()
        assert self.release.wait(60), "the test never released the finishing stage"
        if self.calls == self.fail_call:
            raise RuntimeError("encoding this batch broke")
        return self._real(outputs)

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        def encoded(outputs: finishing.BatchOutputs) -> list[list[EncodedOutput]]:
            return self(outputs)  # a function, so that the class binds it as a method

        monkeypatch.setattr(finishing.BatchOutputs, "encoded", encoded)


@pytest.fixture(autouse=True)
def _open_gate() -> Iterator[None]:
    seq_models.GATE.set()
    seq_models.BATCHES.clear()
    yield
    seq_models.GATE.set()


@pytest.fixture
def held(monkeypatch: pytest.MonkeyPatch) -> Iterator[HeldEncoder]:
    enc = HeldEncoder()
    enc.install(monkeypatch)
    yield enc
    enc.release.set()


def _run(coro: Awaitable[Any], timeout: float = 60.0) -> Any:
    async def bounded() -> Any:
        return await asyncio.wait_for(coro, timeout)
    return asyncio.run(bounded())


def _wait(what: str, cond: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.002)


async def _until(what: str, cond: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.002)


def _instance() -> ModelInstance:
    inst = ModelInstance(load_model(MODEL, device="cpu"), 0, 64)
    seq_models.BATCHES.clear()  # the load's warm-up forward
    return inst


def _logits(outs: list[EncodedOutput]) -> torch.Tensor:
    [(name, dtype, shape, raw)] = outs
    assert (name, dtype) == ("LOGITS", "FP32")
    return torch.frombuffer(bytearray(raw), dtype=torch.float32).reshape(shape)


def _reference(w: Work) -> torch.Tensor:
    with torch.inference_mode():
        out: torch.Tensor = seq_models.causal_conv_lm()(w.inputs[0], w.inputs[1])["LOGITS"]
    return out


def test_the_instance_runs_the_next_batch_while_the_last_one_is_finished(held: HeldEncoder) -> None:
    inst = _instance()
    try:
        a, b = _work(12, 0), _work(7, 1)
        began = time.perf_counter_ns()
        done_a = inst.executor.submit(inst.launch, [a]).result(timeout=60)
        assert held.started.acquire(timeout=30)  # a's encoding has begun and is held
        # The instance's thread is free: b's forward pass runs while a still waits to be finished.
        done_b = inst.executor.submit(inst.launch, [b]).result(timeout=60)
        assert seq_models.BATCHES == [(1, 12), (1, 7)]
        assert not done_a.done() and not done_b.done() and inst.busy
        held.release.set()
        ra, rb = done_a.result(timeout=60), done_b.result(timeout=60)
        ended = time.perf_counter_ns()
        assert torch.allclose(_logits(ra.per_request[0]), _reference(a), atol=1e-5)
        assert torch.allclose(_logits(rb.per_request[0]), _reference(b), atol=1e-5)
        # Overlapping batches count the instance's busy time once: their compute times add up to
        # no more than the time from a's start to b's end.
        assert ra.compute_ns > 0 and rb.compute_ns > 0 and ra.compute_ns + rb.compute_ns <= ended - began
        _wait("the instance to be idle", lambda: not inst.busy)
        # Finished on the calling thread (run), the answer is the same.
        assert inst.run([a]).per_request == ra.per_request
    finally:
        held.release.set()
        inst.close()


@pytest.mark.parametrize(("async_outputs", "ahead", "bound"),
                         [(True, 0, 2), (False, 0, 1), (None, 0, 1), (True, 1, 1), (True, 3, 3), (False, 3, 1)])
def test_an_instance_holds_at_most_two_batches_launched_and_not_answered(held: HeldEncoder, async_outputs: bool | None,
                                                                         ahead: int, bound: int) -> None:
    """Two with asynchronous outputs, one without; by default (None) a model on the CPU finishes
    on its instance's thread: there is no device work for a finishing thread to overlap.
    `batches_ahead` sets the bound instead (an instance that finishes its batches itself still
    runs one at a time)."""
    inst = _instance()

    async def main() -> None:
        b = DynamicBatcher([inst], BatchingConfig(enabled=False, async_outputs=async_outputs, batches_ahead=ahead))
        batches: list[int] = []
        b.on_batch(lambda samples, requests, ns: batches.append(requests))
        b.start()
        try:
            works = [_work(5 + i, i) for i in range(5)]
            tasks = [asyncio.create_task(b.submit(w)) for w in works]
            await _until("the instance to take its batches", lambda: len(seq_models.BATCHES) == bound)
            await asyncio.sleep(0.2)  # time for a third batch to start, were it allowed to
            assert len(seq_models.BATCHES) == bound and b.executing == bound and b.queue_depth == 5 - bound
            held.release.set()
            answers = await asyncio.gather(*tasks)
        finally:
            held.release.set()
            await b.close()
        assert len(seq_models.BATCHES) == 5 and batches == [1] * 5 and b.executing == 0
        for w, (outs, timing) in zip(works, answers, strict=True):
            assert torch.allclose(_logits(outs), _reference(w), atol=1e-5)
            assert timing.compute_ns > 0 and timing.batch_size == 1

    _run(main())


def test_a_failure_while_finishing_fails_only_that_batchs_requests(monkeypatch: pytest.MonkeyPatch) -> None:
    enc = HeldEncoder(fail_call=2)
    enc.release.set()
    enc.install(monkeypatch)
    inst = _instance()

    async def main() -> None:
        b = DynamicBatcher([inst], BatchingConfig(enabled=False, async_outputs=True))
        tokens: list[tuple[int, int]] = []
        b.on_tokens(lambda useful, computed: tokens.append((useful, computed)))
        b.start()
        try:
            works = [_work(6, 0), _work(8, 1), _work(10, 2)]
            answers = await asyncio.gather(*(b.submit(w) for w in works), return_exceptions=True)
            assert isinstance(answers[1], RuntimeError) and "encoding this batch broke" in str(answers[1])
            for i in (0, 2):
                outs, _ = answers[i]  # type: ignore[misc]
                assert torch.allclose(_logits(outs), _reference(works[i]), atol=1e-5)
            # The failed batch gave its slot back: the instance goes on serving.
            outs, _ = await b.submit(_work(4, 3))
            assert _logits(outs).shape == (1, 4, seq_models.VOCAB)
            assert b.executing == 0 and tokens == [(6, 6), (10, 10), (4, 4)]
        finally:
            await b.close()

    _run(main())


def test_closing_answers_a_batch_awaiting_its_finish_and_does_not_wait_for_it(held: HeldEncoder) -> None:
    inst = _instance()

    async def main() -> None:
        b = DynamicBatcher([inst], BatchingConfig(enabled=False, async_outputs=True))
        b.start()
        first = asyncio.create_task(b.submit(_work(9, 0)))
        await _until("the first batch's finishing to begin", lambda: held.calls == 1)
        second = asyncio.create_task(b.submit(_work(5, 1)))
        await _until("the second batch to be launched", lambda: len(seq_models.BATCHES) == 2)
        queued = asyncio.create_task(b.submit(_work(3, 2)))
        await asyncio.sleep(0.01)
        abandoned = await b.close()  # returns with the finishing stage still held
        for t in (first, second, queued):
            with pytest.raises(BatcherClosedError):
                await t
        assert abandoned == 1 and inst.busy
        held.release.set()
        await _until("the held finishing to end", lambda: not inst.busy)

    _run(main())


def test_no_async_outputs_is_a_flag_and_a_keyword() -> None:
    assert server_config(MODEL).batching.async_outputs is None  # chosen by the batcher from the device
    assert server_config(MODEL, async_outputs=False).batching.async_outputs is False
    values = flag_values(build_parser().parse_args(["--model", MODEL, "--no-async-outputs"]))
    assert values["async_outputs"] is False
    assert flag_values(build_parser().parse_args(["--model", MODEL]))["async_outputs"] is None


def test_batches_ahead_is_a_flag_and_a_keyword() -> None:
    assert server_config(MODEL).batching.batches_ahead == 0  # what the device wants
    assert server_config(MODEL, batches_ahead=2).batching.batches_ahead == 2
    assert flag_values(build_parser().parse_args(["--model", MODEL, "--batches-ahead", "2"]))["batches_ahead"] == 2
    with pytest.raises(SpecError, match="batches_ahead"):
        server_config(MODEL, batches_ahead=-1)
    with pytest.raises(ValueError, match="batches_ahead must be >= 0"):
        BatchingConfig(batches_ahead=-1)
