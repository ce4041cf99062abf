"""The pipelined batcher (teacher_server.staging): the next batch is formed and its inputs built
while the current batch runs. The server does this on CUDA only; here it is forced on a CPU model
(the stager then builds the inputs ahead on its own thread, the same scheduling without copies),
with a real model instance, so the scheduling and the answers are checked without a GPU."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest
import torch

from teacher_server.batcher import BatcherClosedError, BatchingConfig, DynamicBatcher
from teacher_server.instance import ModelInstance
from teacher_server.model import load_model
from teacher_server.outputs import OutputTransform
from teacher_server.staging import Stager, take_staged, wanted
from teacher_server.validation import pad_plan
from teacher_server.work import Work
from tests import seq_models

MODEL = "tests.seq_models:causal_conv_lm"


@pytest.fixture(autouse=True)
def _open_gate() -> Iterator[None]:
    seq_models.GATE.set()
    yield
    seq_models.GATE.set()


def _run(coro: Awaitable[Any], timeout: float = 60.0) -> Any:
    async def bounded() -> Any:
        return await asyncio.wait_for(coro, timeout)
    return asyncio.run(bounded())


def _work(length: int, seed: int) -> Work:
    io = seq_models.CausalConvLM.io_spec
    tokens = torch.randint(1, seq_models.VOCAB, (1, length), generator=torch.Generator().manual_seed(seed))
    return Work([tokens, torch.ones_like(tokens)], 1, [OutputTransform("LOGITS")], (), length, pad_plan(io))


async def _until(what: str, cond: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.002)


def _batcher() -> DynamicBatcher:
    model = load_model(MODEL, device="cpu")
    return DynamicBatcher([ModelInstance(model, 0, 64)], BatchingConfig(max_batch_size=64, max_queue_delay_us=2000),
                          stage_ahead=True)


def test_the_server_stages_ahead_on_cuda_only() -> None:
    assert wanted(torch.device("cuda", 0)) and not wanted(torch.device("cpu"))
    model = load_model(MODEL, device="cpu")
    assert DynamicBatcher([ModelInstance(model, 0, 8)], BatchingConfig()).stagers == []


def test_the_next_batch_is_staged_while_one_runs_and_answers_are_right() -> None:
    ref = seq_models.causal_conv_lm()

    async def main() -> None:
        b = _batcher()
        b.start()
        try:
            seq_models.GATE.clear()
            seq_models.BATCHES.clear()
            works = [_work(20, 0)]
            tasks = [asyncio.create_task(b.submit(works[0]))]
            await _until("the first batch to run", lambda: b.executing == 1)
            for k, length in enumerate((9, 12, 30, 5), start=1):
                works.append(_work(length, k))
                tasks.append(asyncio.create_task(b.submit(works[-1])))
            # While the first batch still runs, the next one is formed and its inputs built.
            [stager] = b.stagers
            await _until("the next batch to be staged", lambda: stager.staged == 2)
            assert b.executing == 1 and len(seq_models.BATCHES) == 0
            staged = works[1].staged
            assert staged is not None and staged.tensors[0].shape == (2, 12)  # 9 and 12, padded to 12
            seq_models.GATE.set()
            answers = await asyncio.gather(*tasks)
        finally:
            seq_models.GATE.set()
            await b.close()
        assert seq_models.BATCHES == [(1, 20), (2, 12), (1, 30), (1, 5)]
        assert stager.staged == 4
        for w, (outs, _) in zip(works, answers, strict=True):
            [(name, dtype, shape, raw)] = outs
            assert (name, dtype, shape) == ("LOGITS", "FP32", [1, w.length, seq_models.VOCAB])
            got = torch.frombuffer(bytearray(raw), dtype=torch.float32).reshape(shape)
            with torch.inference_mode():
                want = ref(w.inputs[0], w.inputs[1])["LOGITS"]
            assert torch.allclose(got, want, atol=1e-5)

    _run(main())


def test_closing_answers_a_staged_batch() -> None:
    async def main() -> None:
        b = _batcher()
        b.start()
        seq_models.GATE.clear()
        first = asyncio.create_task(b.submit(_work(10, 0)))
        await _until("the first batch to run", lambda: b.executing == 1)
        staged = asyncio.create_task(b.submit(_work(11, 1)))
        await _until("the next batch to be staged", lambda: b.stagers[0].staged == 2)
        queued = asyncio.create_task(b.submit(_work(40, 2)))
        await asyncio.sleep(0.01)
        closing = asyncio.create_task(b.close())
        for t in (first, staged, queued):
            with pytest.raises(BatcherClosedError):
                await t
        seq_models.GATE.set()
        assert await closing in (0, 1)  # the first batch may still be in its forward pass

    _run(main())


def test_staged_inputs_are_used_only_by_the_batch_they_were_built_for() -> None:
    a, b = _work(6, 0), _work(7, 1)
    stager = Stager(torch.device("cpu"))
    try:
        stager.stage([a, b])
    finally:
        stager.close()
    assert take_staged([a]) is None  # another batch led by the same work gathers its own inputs
    tensors = take_staged([a, b])
    assert tensors is not None and tensors[0].shape == (2, 7) and tensors[1][0].tolist() == [1] * 6 + [0]
    assert take_staged([a, b]) is None  # taken once
