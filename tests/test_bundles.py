"""Batches that reach the reader together share a teacher call (distill.bundles): each batch still
gets exactly its own rows, in order, once; a refused or failed bundle costs no batch but the
guilty one; a hedge that wins some of a bundle's batches leaves the rest to the bundle.

The engine runs against the in-memory teachers of tests/test_engine.py. To make a bunch arrive
deterministically, the scenario holds the event loop once the loader has started: the loader thread
reads the rest of the read-ahead meanwhile, and the loop then finds it all at once.
A last test sends small batches over the wire to a real teacher server.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

import grpc
import numpy as np
import pytest
import torch

from distill import DistillReader
from distill.batches import Chunk, Job, signature_of
from distill.bundles import bundle_pieces, fits_with, split_outputs
from distill.engine import Engine
from distill.teacher_client import encode_request
from distill.types import FieldArray
from protos.kserve import service_pb2
from teacher_server import BatchingConfig, ServerConfig
from tests.faults.helpers import assert_delivered_once_in_order
from tests.models import Affine
from tests.servers import ServerThread
from tests.test_engine import (
    LIMIT_S,
    MAX_BATCH,
    ChunkRequest,
    Collected,
    MemoryTeacher,
    batches,
    call_error,
    check_only_rejected,
    check_outputs,
    run,
)

POISON = 1.0e6  # a value no random batch holds: the marked batch is the one its teachers refuse


async def bunched_epoch(engine: Engine, sink: Collected, data: list[dict[str, torch.Tensor]]) -> None:
    """One pass in which every batch after the first reaches the event loop in one bunch: the loader
    pauses before its second batch until the loop is held, then reads the rest while it is."""
    sink.batches.clear()
    sink.rejections.clear()
    sink.ended.clear()
    paused, release, read_all = threading.Event(), threading.Event(), threading.Event()

    def loader() -> Iterator[dict[str, torch.Tensor]]:
        for i, b in enumerate(data):
            if i == 1:
                paused.set()
                release.wait(LIMIT_S)
            if i == len(data) - 1:
                read_all.set()
            yield b

    engine.begin_epoch(loader())
    for _ in range(int(LIMIT_S / 0.005)):
        if paused.is_set():
            break
        await asyncio.sleep(0.005)
    assert paused.is_set(), "the loader never started"
    # Holding the loop is the point: the loader reads the rest meanwhile, and the loop finds it all at once.
    release.set()
    assert read_all.wait(LIMIT_S), "the loader did not reach its last batch"
    time.sleep(0.05)  # noqa: ASYNC251 (the last batch's hand-over to the loop's feed)
    await sink.ended.wait()


@pytest.mark.parametrize("bundle", [True, False])
def test_batches_that_arrive_together_share_a_call_and_each_gets_its_own_rows(bundle: bool) -> None:
    data = batches(17, rows=2)

    async def scenario(engine: Engine, sink: Collected, mem: list[MemoryTeacher]) -> None:
        await bunched_epoch(engine, sink, data)
        assert not sink.errors and not sink.rejections, (sink.errors, sink.rejections)
        assert_delivered_once_in_order(sink.tags(), len(data))
        check_outputs(sink)
        sizes = [c.size for c in mem[0].calls]
        assert max(sizes) <= MAX_BATCH, sizes
        if bundle:  # 34 rows, most in one bunch: five or six calls, mostly of four batches (8 rows)
            assert sizes.count(MAX_BATCH) >= 3 and len(sizes) <= 6, sizes
            assert engine.stats().bundled >= 16
        else:
            assert sizes == [2] * len(data) and engine.stats().bundled == 0, sizes

    run(scenario, teachers=1, prefetch=17, hedge_after=None, bundle=bundle)


def test_a_bunch_is_spread_over_the_teachers_with_free_slots() -> None:
    data = batches(9, rows=1)

    async def scenario(engine: Engine, sink: Collected, mem: list[MemoryTeacher]) -> None:
        await bunched_epoch(engine, sink, data)
        assert_delivered_once_in_order(sink.tags(), len(data))
        check_outputs(sink)
        bunch_calls = {t.number: [c.size for c in t.calls if c.size > 1] for t in mem}
        assert all(bunch_calls.values()), f"both teachers took a share of the bunch: {bunch_calls}"
        most = max(max(sizes) for sizes in bunch_calls.values())
        assert most <= 5, f"8 or 9 rows over 2 teachers: at most 5 a call, got {bunch_calls}"

    run(scenario, teachers=2, prefetch=9, hedge_after=None)


def _poison(r: ChunkRequest) -> str | None:
    rows = r.rows("X")
    return "poison in the input" if bool((rows[:, 0] == POISON).any()) else None


@pytest.mark.parametrize("teachers", [1, 2])
def test_a_refused_bundle_sends_each_batch_alone_and_only_the_poison_fails(teachers: int) -> None:
    data = batches(17, rows=2)
    data[6]["X"][:, 0] = POISON

    def setup(mem: list[MemoryTeacher]) -> None:
        for t in mem:
            t.refuse = _poison

    async def scenario(engine: Engine, sink: Collected, mem: list[MemoryTeacher]) -> None:
        await bunched_epoch(engine, sink, data)
        check_only_rejected(sink, 6, 17, "poison in the input")
        refused = [c for t in mem for c in t.calls if _poison(c) is not None]
        assert any(c.size > 2 for c in refused), "the poison was refused inside a bundle first"
        assert sum(c.size == 2 for c in refused) == 2, "then alone, on at most two teachers, and no more"
        for t in mem:  # a bundle's refusal is held against neither the teacher nor its innocent batches
            state = engine.stats().teachers["teachers"][t.endpoint]
            assert state["usable"] and "incompatible" not in str(state["state"]), state
        assert engine.stats().rejected_batches == 1

    run(scenario, teachers=teachers, setup=setup, prefetch=17, hedge_after=None)


def test_a_failed_bundle_is_sent_again_and_every_batch_arrives_once() -> None:
    data = batches(17, rows=2)

    def fail_bundles(r: ChunkRequest) -> float:
        if r.size > 2:
            raise call_error(grpc.StatusCode.UNAVAILABLE, "scripted failure of a bundle")
        return 0.0

    def setup(mem: list[MemoryTeacher]) -> None:
        mem[0].delay_s = fail_bundles  # it answers a batch alone, and fails every request of several

    async def scenario(engine: Engine, sink: Collected, mem: list[MemoryTeacher]) -> None:
        await bunched_epoch(engine, sink, data)
        assert not sink.errors and not sink.rejections, (sink.errors, sink.rejections)
        assert_delivered_once_in_order(sink.tags(), len(data))
        check_outputs(sink)
        assert any(c.size > 2 for c in mem[0].calls), "the failing teacher got a bundle"
        assert engine.retries >= 2

    # Round robin: the bunch's two requests go one to each teacher.
    run(scenario, teachers=2, setup=setup, prefetch=17, hedge_after=None, routing="round_robin")


def test_a_late_bundle_is_raced_whole_and_cancelled_once_all_its_batches_are_answered() -> None:
    data = batches(9, rows=2)

    def setup(mem: list[MemoryTeacher]) -> None:
        mem[0].delay_s = lambda r: 5.0  # its share of the bunch is late; the other teacher is quick

    async def scenario(engine: Engine, sink: Collected, mem: list[MemoryTeacher]) -> None:
        started = time.monotonic()
        await bunched_epoch(engine, sink, data)
        assert not sink.errors and not sink.rejections, (sink.errors, sink.rejections)
        assert_delivered_once_in_order(sink.tags(), len(data))
        check_outputs(sink)
        assert time.monotonic() - started < 4.0, "the hedge answered the slow teacher's batches"
        assert engine.hedges >= 2
        assert all(int(out["WHO"].max()) == 1 for _, out in sink.batches), "every batch from the quick teacher"
        assert any(c.size > 2 for c in mem[0].calls), "the slow teacher got a bundle"
        assert mem[0].cancelled >= 1, "the late bundle was cancelled once all its batches were answered"

    # Round robin: the bunch's two requests go one to each teacher.
    run(scenario, teachers=2, setup=setup, prefetch=9, hedge_after=0.05, timeout=60.0, routing="round_robin")


def _job(seq: int, width: int, rows: int = 2) -> Job:
    fields = {"IDS": FieldArray(np.full((rows, width), seq, dtype=np.int64), "INT64")}
    return Job(1, seq, None, rows, fields, signature_of(fields))


def test_only_batches_with_the_same_input_shapes_share_a_call() -> None:
    a, b, c = (Chunk(_job(0, 16), "s", 0, 2), Chunk(_job(1, 16), "s", 0, 2), Chunk(_job(2, 24), "s", 0, 2))
    assert fits_with(a, b) and not fits_with(a, c), "a padded batch of another length cannot join"
    b.suspect = True
    assert not fits_with(a, b), "a refused batch goes alone"
    b.suspect = False
    request = ChunkRequest("m", "", "1:0:0+1", a.job.fields, 0, 4, ("Y",), pieces=bundle_pieces([a, b]))
    assert request.rows("IDS").shape == (4, 16) and request.rows("IDS")[:, 0].tolist() == [0, 0, 1, 1]
    wire = service_pb2.ModelInferRequest.FromString(encode_request(request))
    assert [list(i.shape) for i in wire.inputs] == [[4, 16]] and wire.id == "1:0:0+1"
    assert np.frombuffer(wire.raw_input_contents[0], dtype=np.int64).reshape(4, 16)[:, 0].tolist() == [0, 0, 1, 1]
    parts = split_outputs({"Y": torch.arange(4)}, [a, b])
    assert [p["Y"].tolist() for p in parts] == [[0, 1], [2, 3]]


def test_small_batches_through_a_real_teacher_get_their_own_rows() -> None:
    """Many one-row batches from a loader that never waits, over the wire to a real teacher server:
    some reach the reader together and share a call, and every batch gets the model's answer for
    its own row, in order."""
    model = Affine()
    g = torch.Generator().manual_seed(5)
    data = [{"X": torch.randn(1, 8, generator=g), "idx": torch.full((1,), i)} for i in range(400)]
    config = ServerConfig(model="tests.models:affine", name="affine", device="cpu",
                          batching=BatchingConfig(max_batch_size=16, max_queue_delay_us=200))
    with ServerThread(config) as server, DistillReader(data, teachers=server.url, inputs=["X"], prefetch=32,
                                                       timeout=30.0) as reader:
        got = list(reader)
        bundled = reader.stats().bundled
    assert [int(b["idx"][0]) for b, _ in got] == list(range(len(data))), "every batch once, in order"
    with torch.inference_mode():
        for batch, out in got:
            assert torch.allclose(out["Y"], model(batch["X"]), atol=1e-5), f"batch {int(batch['idx'][0])}"
    assert bundled > 0, "400 batches from a loader that never waits: some reached the reader together"
