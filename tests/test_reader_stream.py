"""`transport="stream"`: chunks on one ModelStreamInfer stream a teacher (`distill.teacher_stream`),
against real teacher servers. The stream keeps a call's contract: each answer reaches its own
request, a refusal is typed by its code and keeps its facts, a deadline fails only its request, a
request given up mid-write leaves the others on the stream alone, a stream that ends fails what
waits on it and the next request opens another; and a reader over streams delivers every batch
once, in order, through a teacher's SIGKILL."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import signal
import socket
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch

from discovery.base import TeacherRecord
from distill import DistillReader
from distill.call_errors import RequestRejectedError, TeacherCallError, TeacherGoneError
from distill.connector import grpc_connector
from distill.teacher_client import TeacherClient
from distill.teacher_stream import StreamingTeacherClient
from distill.types import ChunkRequest, FieldArray
from teacher_server import BatchingConfig, ServerConfig
from tests.faults.helpers import start_teachers
from tests.models import Affine
from tests.servers import ServerThread

AFFINE = Affine()


def _server(model: str = "tests.models:affine") -> ServerThread:
    return ServerThread(ServerConfig(model=model, name="affine", device="cpu",
                                     batching=BatchingConfig(max_batch_size=8, max_queue_delay_us=200)))


@pytest.fixture(scope="module")
def affine() -> Iterator[ServerThread]:
    with _server() as s:
        yield s


@pytest.fixture(scope="module")
def slow() -> Iterator[ServerThread]:
    with _server("tests.models:sleepy_200") as s:  # 200 ms a batch
        yield s


def _chunk(x: np.ndarray, rid: str) -> ChunkRequest:
    return ChunkRequest("affine", "", rid, {"X": FieldArray(x, "FP32")}, 0, len(x), ("Y",))


def _rows(seed: int, n: int = 4, width: int = 8) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, width), dtype=np.float32)


def _expected(x: np.ndarray) -> torch.Tensor:
    with torch.inference_mode():
        return AFFINE(torch.from_numpy(x))


def test_the_reader_connects_over_streams_when_asked() -> None:
    async def main() -> None:  # a grpc.aio channel belongs to the loop it is made on
        record = TeacherRecord(endpoint="127.0.0.1:1")
        stream = grpc_connector(None, None, "stream")("127.0.0.1:1", record)
        call = grpc_connector(None, None)("127.0.0.1:1", record)
        assert isinstance(stream, StreamingTeacherClient)
        assert type(call) is TeacherClient
        await stream.close()
        await call.close()

    asyncio.run(main())


def test_concurrent_requests_each_get_their_own_answer_on_one_stream(affine: ServerThread) -> None:
    async def main() -> None:
        async with StreamingTeacherClient(affine.url) as client:
            xs = [_rows(i) for i in range(40)]
            # the same chunk id for all: the stream's own ids keep the answers apart
            outs = await asyncio.gather(*(client.infer(_chunk(x, "7:0:0"), timeout=30) for x in xs))
            for x, out in zip(xs, outs, strict=True):
                assert torch.allclose(out["Y"], _expected(x), atol=1e-5)
            first = client._stream
            await client.infer(_chunk(xs[0], "8:0:0"), timeout=30)
            assert client._stream is first and first is not None and not first.ended  # one stream throughout

    asyncio.run(main())


def test_a_refusal_is_typed_by_its_code_keeps_its_facts_and_the_stream_goes_on(affine: ServerThread) -> None:
    async def main() -> None:
        async with StreamingTeacherClient(affine.url) as client:
            with pytest.raises(RequestRejectedError) as refused:
                await client.infer(_chunk(_rows(1, width=7), "1:0:0"), timeout=30)  # the model takes 8 features
            assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
            assert "X" in refused.value.details
            stream = client._stream
            x = _rows(2)
            out = await client.infer(_chunk(x, "2:0:0"), timeout=30)
            assert torch.allclose(out["Y"], _expected(x), atol=1e-5)
            assert client._stream is stream

    asyncio.run(main())


def test_a_deadline_fails_its_own_request_and_a_late_answer_is_dropped(slow: ServerThread) -> None:
    async def main() -> None:
        async with StreamingTeacherClient(slow.url) as client:
            with pytest.raises(TeacherCallError) as late:
                await client.infer(_chunk(_rows(3), "5:0:0"), timeout=0.05)
            assert late.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
            x = _rows(4)  # same chunk id as the one given up: its late answer must not be taken for this one
            out = await client.infer(_chunk(x, "5:0:0"), timeout=30)
            assert torch.allclose(out["Y"], _expected(x), atol=1e-5)

    asyncio.run(main())


def test_a_request_given_up_mid_write_leaves_the_others_on_the_stream(slow: ServerThread) -> None:
    async def main() -> None:
        async with StreamingTeacherClient(slow.url) as client:
            await client.infer(_chunk(_rows(0), "0:0:0"), timeout=30)  # the stream is open
            stream = client._stream
            assert stream is not None
            big = asyncio.create_task(client.infer(_chunk(_rows(1, n=500_000), "1:0:0"), timeout=30))  # 16 MB
            xs = [_rows(10 + i) for i in range(6)]
            small = [asyncio.create_task(client.infer(_chunk(x, f"{i + 2}:0:0"), timeout=30))
                     for i, x in enumerate(xs)]
            for _ in range(1000):  # bounded: until the writer has taken the big request, the small ones queued
                if stream.outbox.qsize() == len(xs):
                    break
                await asyncio.sleep(0)
            assert stream.outbox.qsize() == len(xs)
            big.cancel()  # a hedge's loser, a closing reader: given up while its bytes go out
            with pytest.raises(asyncio.CancelledError):
                await big
            outs = await asyncio.gather(*small)
            for x, out in zip(xs, outs, strict=True):
                assert torch.allclose(out["Y"], _expected(x), atol=1e-5)
            assert client._stream is stream and not stream.ended

    asyncio.run(main())


def test_closing_the_client_fails_what_waits_on_its_stream(slow: ServerThread) -> None:
    async def main() -> None:
        client = StreamingTeacherClient(slow.url)
        waiting = asyncio.create_task(client.infer(_chunk(_rows(5), "1:0:0"), timeout=30))
        await asyncio.sleep(0.05)
        await client.close()
        with pytest.raises(TeacherGoneError):
            await asyncio.wait_for(waiting, timeout=10)
        with pytest.raises(TeacherGoneError):
            await client.infer(_chunk(_rows(6), "2:0:0"), timeout=30)

    asyncio.run(main())


SLEEPY = ["--model", "tests.models:sleepy", "--name", "affine", "--device", "cpu", "--max-batch-size", "8"]


def test_a_teacher_killed_under_its_stream_fails_what_waits_and_the_next_request_opens_another(
        tmp_path: Path) -> None:
    with contextlib.ExitStack() as stack:
        ((proc, info),) = start_teachers(stack, [SLEEPY], tmp_path, env={"TEST_SLEEP_MS": "300"})

        async def main() -> None:
            async with StreamingTeacherClient(info["endpoint"]) as client:
                x = _rows(7)
                assert torch.allclose((await client.infer(_chunk(x, "0:0:0"), timeout=30))["Y"], _expected(x),
                                      atol=1e-5)
                first = client._stream
                waiting = asyncio.create_task(client.infer(_chunk(_rows(8), "1:0:0"), timeout=30))
                await asyncio.sleep(0.1)
                proc.send_signal(signal.SIGKILL)
                with pytest.raises(TeacherCallError) as gone:
                    await asyncio.wait_for(waiting, timeout=20)  # well within its own deadline of 30 s
                assert gone.value.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN,
                                           grpc.StatusCode.INTERNAL)
                with pytest.raises(TeacherCallError):
                    await client.infer(_chunk(_rows(9), "2:0:0"), timeout=5)
                assert client._stream is not first  # a new stream was opened for it

        asyncio.run(main())


def _batches(n: int, rows: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [{"X": torch.randn(rows, 8, generator=g), "idx": torch.full((rows,), i)} for i in range(n)]


def test_a_reader_over_streams_delivers_every_batch_once_through_a_sigkill(tmp_path: Path) -> None:
    with contextlib.ExitStack() as stack:
        procs = start_teachers(stack, [[*SLEEPY, "--max-queue-delay-us", "0"]] * 2, tmp_path,
                               env={"TEST_SLEEP_MS": "5"})
        data = _batches(60, rows=16)
        reader = stack.enter_context(DistillReader(data, teachers=",".join(i["endpoint"] for _, i in procs),
                                                   inputs=["X"], timeout=5.0, transport="stream"))
        seen = []
        for batch, teacher in reader:
            i = int(batch["idx"][0])
            seen.append(i)
            with torch.inference_mode():
                assert torch.allclose(teacher["Y"], AFFINE(batch["X"]), atol=1e-5), f"batch {i}"
            if i == 20:
                procs[0][0].send_signal(signal.SIGKILL)
        stats = reader.stats()
    assert seen == list(range(60))
    assert stats.samples == 60 * 16


def test_a_teacher_not_listening_fails_the_request_at_once_and_nothing_is_left_unread() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there

    async def main() -> None:
        reported: list[dict[str, object]] = []
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: reported.append(context))
        async with StreamingTeacherClient(f"127.0.0.1:{port}") as client:
            for i in range(3):  # each request opens a stream again, and fails the same way
                with pytest.raises(TeacherCallError) as refused:
                    await asyncio.wait_for(client.infer(_chunk(_rows(i), f"{i}:0:0"), timeout=30), timeout=20)
                assert refused.value.code == grpc.StatusCode.UNAVAILABLE
        gc.collect()
        await asyncio.sleep(0.1)
        assert not reported, reported  # no failure set on a future nobody awaited

    asyncio.run(main())
