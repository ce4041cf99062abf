"""The engine on its own, against in-memory teachers: ordering, exactly-once delivery, retry,
ejection with probe-gated readmission, hedging, fallback and subsetting.

The teachers here implement the engine's client interface (`distill.teacher_client.InferenceClient`)
in memory, with scripted failures, delays and hangs; the wire itself is covered by the real-server
tests (tests/test_reader.py, tests/faults/). Every wait is bounded by `asyncio.wait_for`.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import pytest
import torch

from discovery import subset
from distill.batches import extract_inputs
from distill.engine import Engine
from distill.errors import BatchRejectedError, NoTeacherError
from distill.reader import ReaderOptions
from distill.router import RouterConfig
from distill.stats import ConsumptionMeter
from distill.teacher_client import (
    ChunkRequest,
    InferenceClient,
    MalformedAnswerError,
    TeacherCallError,
    TeacherMetadata,
    TensorMeta,
    call_error,
    decode_response,
    encode_request,
)
from protos.kserve import service_pb2
from tests.faults.helpers import assert_delivered_once_in_order

MAX_BATCH = 8
META = TeacherMetadata("affine", "1", MAX_BATCH, {"X": TensorMeta("X", "FP32", (8,))},
                       {"Y": TensorMeta("Y", "FP32", (4,)), "WHO": TensorMeta("WHO", "INT64", (1,))})
W = torch.randn(8, 4, generator=torch.Generator().manual_seed(3))
FAST = RouterConfig(backoff_base_s=0.01, backoff_max_s=0.05, probe_timeout_s=0.5)
LIMIT_S = 30.0  # the longest any one test waits for the engine


class MemoryTeacher:
    """A teacher in memory: Y = X @ W, and WHO = its own number, so a test sees who answered.

    `delay_s(request)` is how long it takes; `fail` answers with that status instead (typed as the
    gRPC client types it); `refuse(request)` returns a model error message for inputs it refuses;
    `shed_every` sheds every n-th call with CANCELLED (overload); `hang` never answers (the call
    ends at its deadline, as a hung server's would); `frozen` hangs readiness probes too (a stopped
    process); `slow_probe` hangs readiness probes alone (an engine that serves its health route
    behind a long queue); `ready` is what a readiness probe hears; `lose_cancel` loses the first cancellation of
    a call and goes on to its deadline (grpc.aio loses one that meets the call's answer).
    """

    def __init__(self, number: int, endpoint: str) -> None:
        self.number = number
        self.endpoint = endpoint
        self.delay_s: Callable[[ChunkRequest], float] = lambda _: 0.0
        self.fail: grpc.StatusCode | None = None
        self.hang = False
        self.frozen = False
        self.slow_probe = False
        self.refuse: Callable[[ChunkRequest], str | None] = lambda _: None
        self.shed_every = 0
        self.ready_ok = True
        self.lose_cancel = False
        self.calls: list[ChunkRequest] = []
        self.answered = 0
        self.cancelled = 0
        self.probes = 0
        self.probe_passed = asyncio.Event()
        self.probe_failed = asyncio.Event()

    async def infer(self, request: ChunkRequest, timeout: float) -> dict[str, torch.Tensor]:
        self.calls.append(request)
        if self.shed_every and len(self.calls) % self.shed_every == 0:
            raise call_error(grpc.StatusCode.CANCELLED, "shed: too many pending requests")
        try:
            if self.hang or self.frozen:
                await asyncio.sleep(timeout)
                raise TeacherCallError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
            await asyncio.sleep(self.delay_s(request))
        except asyncio.CancelledError:
            self.cancelled += 1
            if not self.lose_cancel:
                raise
            self.lose_cancel = False
            await asyncio.sleep(timeout)  # goes on as if never cancelled; a second cancel ends it
            raise
        if self.fail is not None:
            raise call_error(self.fail, f"scripted failure of teacher {self.number}")
        refused = self.refuse(request)
        if refused is not None:
            raise call_error(grpc.StatusCode.INTERNAL, f"model execution failed: {refused}")
        x = torch.from_numpy(request.rows("X"))
        self.answered += 1
        return {"Y": x @ W, "WHO": torch.full((request.size, 1), self.number, dtype=torch.int64)}

    async def ready(self, model: str, timeout: float) -> bool:
        if self.frozen or self.slow_probe:
            await asyncio.sleep(timeout)
            raise TeacherCallError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
        self.probes += 1
        # The engine applies the outcome before anything else runs, so a waiter sees it applied.
        (self.probe_passed if self.ready_ok else self.probe_failed).set()
        return self.ready_ok

    async def fetch_metadata(self, model: str | None, version: str, timeout: float) -> TeacherMetadata:
        return META

    async def close(self) -> None:
        pass


class Collected:
    """The engine's sink: keeps what it delivers and hands the prefetch slot straight back, as a
    training loop that never waits would."""

    def __init__(self) -> None:
        self.engine: Engine | None = None
        self.batches: list[tuple[Any, Any]] = []
        self.errors: list[BaseException] = []
        self.rejections: dict[int, BaseException] = {}  # position in the pass -> the batch's error
        self.ended = asyncio.Event()

    def batch(self, epoch: int, batch: Any, outputs: Any, size: int) -> None:
        self.batches.append((batch, outputs))
        assert self.engine is not None
        self.engine.consumed(epoch)

    def end(self, epoch: int) -> None:
        self.ended.set()

    def error(self, epoch: int, error: BaseException) -> None:
        self.errors.append(error)
        self.ended.set()

    def rejected(self, epoch: int, error: BaseException) -> None:
        self.rejections[len(self.batches) + len(self.rejections)] = error
        assert self.engine is not None
        self.engine.consumed(epoch)

    def tags(self) -> list[int]:
        return [int(b["idx"][0]) for b, _ in self.batches]


def batches(n: int, rows: int = 20) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    return [{"X": torch.randn(rows, 8, generator=g), "idx": torch.full((rows,), i)} for i in range(n)]


def endpoints(n: int) -> list[str]:
    return [f"127.0.0.1:{10001 + i}" for i in range(n)]


Scenario = Callable[[Engine, Collected, list[MemoryTeacher]], Awaitable[None]]


def run(scenario: Scenario, teachers: int = 2, setup: Callable[[list[MemoryTeacher]], None] | None = None,
        **options: Any) -> list[MemoryTeacher]:
    """Start an engine over in-memory teachers, run `scenario`, close; returns the teachers."""
    mem = [MemoryTeacher(i, ep) for i, ep in enumerate(endpoints(teachers))]
    if setup is not None:
        setup(mem)
    by_endpoint = {t.endpoint: t for t in mem}

    def connect(endpoint: str, registered_tls: bool) -> InferenceClient:
        return by_endpoint[endpoint]

    opts = ReaderOptions(inputs=["X"], teachers=",".join(by_endpoint), **{"router": FAST, **options})

    async def main() -> None:
        sink = Collected()
        engine = Engine(opts, sink, ConsumptionMeter(), connect=connect)
        sink.engine = engine
        try:
            await asyncio.wait_for(engine.start(), LIMIT_S)
            await asyncio.wait_for(scenario(engine, sink, mem), LIMIT_S)
        finally:
            await asyncio.wait_for(engine.close(), LIMIT_S)

    asyncio.run(main())
    return mem


async def epoch(engine: Engine, sink: Collected, data: list[dict[str, torch.Tensor]]) -> None:
    """One pass over `data`; returns when the engine says the epoch ended (or failed)."""
    sink.batches.clear()
    sink.rejections.clear()
    sink.ended.clear()
    engine.begin_epoch(data)
    await sink.ended.wait()


def check_outputs(sink: Collected) -> None:
    for batch, out in sink.batches:
        assert out is not None, f"batch {int(batch['idx'][0])} came without teacher outputs"
        assert torch.allclose(out["Y"], batch["X"] @ W, atol=1e-5), f"batch {int(batch['idx'][0])} is wrong"


def check_only_rejected(sink: Collected, poison: int, total: int, message: str) -> None:
    """Batch `poison` alone was rejected, with `message` in its error; the other `total` - 1
    batches were delivered once each, in order, with the model's outputs."""
    assert not sink.errors, sink.errors
    assert list(sink.rejections) == [poison], sink.rejections
    error = sink.rejections[poison]
    assert isinstance(error, BatchRejectedError) and message in str(error)
    assert sink.tags() == [i for i in range(total) if i != poison], "every other batch, once, in order"
    check_outputs(sink)


def test_out_of_order_answers_are_delivered_once_in_loader_order() -> None:
    data = batches(30)  # 20 rows: three chunks per batch at max batch 8

    def setup(mem: list[MemoryTeacher]) -> None:
        # Later chunks answer first: completion order is roughly the reverse of loader order.
        for t in mem:
            t.delay_s = lambda r: 0.02 * ((30 - int(r.request_id.split(":")[1])) % 5)

    async def scenario(engine: Engine, sink: Collected, mem: list[MemoryTeacher]) -> None:
        await epoch(engine, sink, data)
        assert not sink.errors, sink.errors
        assert_delivered_once_in_order(sink.tags(), len(data))
        check_outputs(sink)
        await epoch(engine, sink, data)  # a second epoch over the same loader
        assert_delivered_once_in_order(sink.tags(), len(data))

    mem = run(scenario, setup=setup, prefetch=6, hedge_after=None)
    assert all(t.answered > 0 for t in mem), "both teachers took work"
    assert all(len(r.calls) and max(c.size for c in r.calls) <= MAX_BATCH for r in mem)


def test_unordered_delivery_is_exactly_once() -> None:
    data = batches(25)

    def setup(mem: list[MemoryTeacher]) -> None:
        mem[0].delay_s = lambda r: 0.03
        mem[1].delay_s = lambda r: 0.0

    async def scenario(engine: Engine, sink: Collected, mem: list[MemoryTeacher]) -> None:
        await epoch(engine, sink, data)
        tags = sink.tags()
        assert sorted(tags) == list(range(25)) and len(tags) == 25, tags
        check_outputs(sink)

    run(scenario, setup=setup, ordered=False, prefetch=6, hedge_after=None)


def test_failed_chunks_are_retried_elsewhere_and_the_teacher_waits_for_its_probe() -> None:
    data = batches(20)

    def setup(mem: list[MemoryTeacher]) -> None:
        mem[0].fail = grpc.StatusCode.UNAVAILABLE
        mem[0].ready_ok = False  # ejected and its probe fails: it must get no more work

    async def scenario(engine: Engine, sink: Collected, mem: list[MemoryTeacher]) -> None:
        await epoch(engine, sink, data)
        assert not sink.errors, sink.errors
        assert_delivered_once_in_order(sink.tags(), len(data))
        check_outputs(sink)
        assert engine.retries >= 1
        assert all(int(out["WHO"].max()) == 1 for _, out in sink.batches), "only the healthy teacher answered"
        await mem[0].probe_failed.wait()
        assert len(mem[0].calls) <= int(FAST.initial_limit), "an ejected teacher got work before its probe passed"
        state = engine.stats().teachers["teachers"][mem[0].endpoint]
        assert state["usable"] is False and "ejected" in str(state["state"]), state

        # It recovers: the next probe passes and it serves again.
        mem[0].fail, mem[0].ready_ok = None, True
        await mem[0].probe_passed.wait()  # the probe backs off at most FAST.backoff_max_s
        assert engine.stats().teachers["teachers"][mem[0].endpoint]["usable"] is True
        await epoch(engine, sink, data)
        assert_delivered_once_in_order(sink.tags(), len(data))
        assert mem[0].answered > 0, "the readmitted teacher serves again"
        assert mem[0].probes >= 2

    run(scenario, setup=setup, hedge_after=None)


def test_a_teacher_refusing_what_others_accept_is_marked_incompatible() -> None:
    """INVALID_ARGUMENT is first the request's fault; a teacher that keeps refusing inputs the other
    teacher accepts is the odd one out after `reject_strikes` of them."""
    data = batches(10)

    def setup(mem: list[MemoryTeacher]) -> None:
        mem[0].fail = grpc.StatusCode.INVALID_ARGUMENT

    async def scenario(engine: Engine, sink: Collected, mem: list[MemoryTeacher]) -> None:
        await epoch(engine, sink, data)
        assert_delivered_once_in_order(sink.tags(), len(data))
        assert not sink.rejections, sink.rejections
        state = engine.stats().teachers["teachers"][mem[0].endpoint]
        assert "incompatible" in str(state["state"]) and "requests in a row that other teachers accepted" in str(
            state["state"]), state
        # Strikes come as refused chunks succeed elsewhere (one at a time): a handful of the 30 chunks.
        assert len(mem[0].calls) <= 10, f"it kept getting work: {len(mem[0].calls)} calls"
        assert mem[0].probes == 0, "a teacher that refused the request is not probed back in"

    run(scenario, setup=setup, hedge_after=None)


def test_hedge_winner_is_delivered_and_the_hung_loser_cancelled() -> None:
    data = batches(12, rows=8)

    def setup(mem: list[MemoryTeacher]) -> None:
        mem[0].hang = True

    async def scenario(engine: Engine, sink: Collected, mem: list[MemoryTeacher]) -> None:
        await epoch(engine, sink, data)
        assert not sink.errors, sink.errors
        assert_delivered_once_in_order(sink.tags(), len(data))
        check_outputs(sink)
        assert engine.hedges >= 1, "late chunks were raced on the other teacher"
        assert mem[0].cancelled >= 1, "the loser's call was cancelled once the winner answered"
        assert all(int(out["WHO"].min()) == 1 for _, out in sink.batches), "every row came from the winner"
        assert engine.retries == 0, "the hedge answered before any deadline"

    # A deadline far beyond the test's own limit: only hedging can finish this epoch in time.
    run(scenario, setup=setup, hedge_after=0.05, timeout=120.0)


def test_no_teacher_falls_back_to_hard_labels_once_per_batch() -> None:
    data = batches(6)

    def setup(mem: list[MemoryTeacher]) -> None:
        mem[0].fail = grpc.StatusCode.UNAVAILABLE
        mem[0].ready_ok = False

    async def scenario(engine: Engine, sink: Collected, mem: list[MemoryTeacher]) -> None:
        await epoch(engine, sink, data)
        assert not sink.errors, sink.errors
        assert_delivered_once_in_order(sink.tags(), len(data))
        assert all(out is None for _, out in sink.batches)
        assert engine.fallback_batches == len(data)

    run(scenario, teachers=1, setup=setup, fallback="hard_labels", no_teacher_timeout=0.3, hedge_after=None)


def test_no_teacher_error_names_every_teacher_and_its_state() -> None:
    data = batches(3)

    def setup(mem: list[MemoryTeacher]) -> None:
        mem[0].fail = grpc.StatusCode.UNAVAILABLE
        mem[0].ready_ok = False
        mem[1].fail = grpc.StatusCode.NOT_FOUND  # it does not serve the model: incompatible

    async def scenario(engine: Engine, sink: Collected, mem: list[MemoryTeacher]) -> None:
        await epoch(engine, sink, data)
        assert sink.batches == [] and sink.errors
        error = sink.errors[0]
        assert isinstance(error, NoTeacherError)
        text = str(error)
        assert f"{mem[0].endpoint} [ejected (" in text, text
        assert f"{mem[1].endpoint} [incompatible: it refused the request" in text, text

    run(scenario, setup=setup, no_teacher_timeout=0.3, hedge_after=None)


def test_max_teachers_keeps_the_rendezvous_subset() -> None:
    data = batches(20)
    student = "student-a"

    async def scenario(engine: Engine, sink: Collected, mem: list[MemoryTeacher]) -> None:
        await epoch(engine, sink, data)
        assert_delivered_once_in_order(sink.tags(), len(data))

    mem = run(scenario, teachers=5, max_teachers=2, student_id=student, hedge_after=None)
    used = {t.endpoint for t in mem if t.calls}
    assert used == set(subset(student, endpoints(5), 2)), collections.Counter(t.endpoint for t in mem if t.calls)


@pytest.mark.parametrize("services", [("one", "two")])
def test_a_mixture_waits_for_every_service(services: tuple[str, ...]) -> None:
    """Each batch carries one answer per service, and comes once."""
    data = batches(8)
    mem = [MemoryTeacher(i, ep) for i, ep in enumerate(endpoints(2))]
    mem[1].delay_s = lambda r: 0.02  # the second service is slower
    by_endpoint = {t.endpoint: t for t in mem}
    opts = ReaderOptions(inputs=["X"], teachers=dict(zip(services, by_endpoint, strict=True)), hedge_after=None)

    async def main() -> None:
        sink = Collected()
        engine = Engine(opts, sink, ConsumptionMeter(), connect=lambda ep, tls: by_endpoint[ep])
        sink.engine = engine
        try:
            await asyncio.wait_for(engine.start(), LIMIT_S)
            await asyncio.wait_for(epoch(engine, sink, data), LIMIT_S)
        finally:
            await engine.close()
        assert_delivered_once_in_order(sink.tags(), len(data))
        for batch, out in sink.batches:
            assert set(out) == set(services)
            assert int(out["one"]["WHO"].max()) == 0 and int(out["two"]["WHO"].max()) == 1
            assert torch.allclose(out["two"]["Y"], batch["X"] @ W, atol=1e-5)

    asyncio.run(main())


def test_a_chunk_request_on_the_wire_and_its_answer_checked() -> None:
    """The client's encoding carries only the chunk's rows, and its decoding refuses answers that do
    not fit the request (the engine then marks the teacher incompatible)."""
    x = torch.arange(40, dtype=torch.float32).reshape(5, 8)
    _, fields = extract_inputs({"X": x}, {"X": "X"})
    req = ChunkRequest("affine", "1", "3:7:2", fields, start=2, stop=4, outputs=("Y",), top_k=0,
                       output_dtype="FP16")
    wire = service_pb2.ModelInferRequest.FromString(encode_request(req))
    assert (wire.model_name, wire.model_version, wire.id) == ("affine", "1", "3:7:2")
    assert [(i.name, i.datatype, list(i.shape)) for i in wire.inputs] == [("X", "FP32", [2, 8])]
    assert wire.raw_input_contents[0] == x[2:4].numpy().tobytes()
    assert [o.name for o in wire.outputs] == ["Y"]
    assert wire.parameters["top_k"].int64_param == 0 and wire.parameters["output_dtype"].string_param == "FP16"

    y = torch.ones(2, 4)
    answer = service_pb2.ModelInferResponse()
    answer.outputs.add(name="Y", datatype="FP32", shape=[2, 4])
    answer.raw_output_contents.append(y.numpy().tobytes())
    assert torch.equal(decode_response(answer, req)["Y"], y)
    short = service_pb2.ModelInferResponse()
    short.outputs.add(name="Y", datatype="FP32", shape=[3, 4])
    short.raw_output_contents.append(torch.ones(3, 4).numpy().tobytes())
    with pytest.raises(MalformedAnswerError, match="shape \\[3, 4\\] for a chunk of 2"):
        decode_response(short, req)
    other = service_pb2.ModelInferResponse()
    other.outputs.add(name="Z", datatype="FP32", shape=[2, 4])
    other.raw_output_contents.append(y.numpy().tobytes())
    with pytest.raises(MalformedAnswerError, match="lacks outputs \\['Y'\\]"):
        decode_response(other, req)


# ---- issue #13: the batch's fault is not the teachers' ---------------------------------------------

def _poison_at(seq: int) -> Callable[[ChunkRequest], str | None]:
    """Refuses every chunk of batch `seq` of the first pass (request ids are epoch:seq:start)."""
    return lambda r: "poison in the input" if r.request_id.startswith(f"1:{seq}:") else None


def test_a_poison_batch_fails_alone_after_two_teachers_and_nobody_is_ejected() -> None:
    data = batches(10)

    def setup(mem: list[MemoryTeacher]) -> None:
        for t in mem:
            t.refuse = _poison_at(4)

    async def scenario(engine: Engine, sink: Collected, mem: list[MemoryTeacher]) -> None:
        await epoch(engine, sink, data)
        check_only_rejected(sink, 4, 10, "model execution failed: poison in the input")
        poisoned = [c for t in mem for c in t.calls if c.request_id.startswith("1:4:")]
        starts = collections.Counter(c.start for c in poisoned)
        assert max(starts.values()) <= 2, f"a refused chunk went to more than two teachers: {starts}"
        for t in mem:
            state = engine.stats().teachers["teachers"][t.endpoint]
            assert state["usable"] and state["ejections"] == 0, state
        assert engine.stats().rejected_batches == 1
        await epoch(engine, sink, batches(5))  # the next pass is served as usual
        assert_delivered_once_in_order(sink.tags(), 5)

    run(scenario, setup=setup, hedge_after=None)


def test_an_input_refused_once_is_delivered_from_the_other_teacher() -> None:
    """An innocent chunk that shared a failing batch on the teacher is refused once: it goes to the
    other teacher, alone, and arrives; the refusing teacher gets a strike, not an ejection."""
    data = batches(6)
    refused: set[str] = set()

    def once(r: ChunkRequest) -> str | None:
        if r.request_id.startswith("1:2:") and r.request_id not in refused:
            refused.add(r.request_id)
            return "a co-batched request raised"
        return None

    def setup(mem: list[MemoryTeacher]) -> None:
        for t in mem:
            t.refuse = once

    async def scenario(engine: Engine, sink: Collected, mem: list[MemoryTeacher]) -> None:
        await epoch(engine, sink, data)
        assert not sink.errors and not sink.rejections, (sink.errors, sink.rejections)
        assert_delivered_once_in_order(sink.tags(), len(data))
        check_outputs(sink)
        assert refused, "the scenario refused nothing"
        assert all(engine.stats().teachers["teachers"][t.endpoint]["usable"] for t in mem)

    run(scenario, setup=setup, hedge_after=None)


def test_a_misshapen_batch_is_refused_before_sending_and_the_teachers_stay() -> None:
    data = batches(6)
    data[3] = {"X": torch.randn(20, 9), "idx": torch.full((20,), 3)}

    async def scenario(engine: Engine, sink: Collected, mem: list[MemoryTeacher]) -> None:
        await epoch(engine, sink, data)
        assert not sink.errors, sink.errors
        assert list(sink.rejections) == [3] and "FP32[9] per sample here, the teacher expects FP32[8]" in str(
            sink.rejections[3])
        assert sink.tags() == [0, 1, 2, 4, 5]
        assert not any(c.request_id.startswith("1:3:") for t in mem for c in t.calls), "nothing was sent"
        await epoch(engine, sink, batches(4))
        assert_delivered_once_in_order(sink.tags(), 4)

    run(scenario, hedge_after=None, no_teacher_timeout=0.5)


def test_overload_answers_back_off_without_ejection() -> None:
    data = batches(12)

    def setup(mem: list[MemoryTeacher]) -> None:
        mem[0].shed_every = 2  # every other call is shed, as grpc.aio does over its pending limit

    async def scenario(engine: Engine, sink: Collected, mem: list[MemoryTeacher]) -> None:
        await epoch(engine, sink, data)
        assert not sink.errors and not sink.rejections
        assert_delivered_once_in_order(sink.tags(), len(data))
        check_outputs(sink)
        state = engine.stats().teachers["teachers"][mem[0].endpoint]
        assert state["overloaded"] >= 1 and state["ejections"] == 0 and state["usable"], state

    run(scenario, teachers=1, setup=setup, hedge_after=None)


def test_every_teacher_frozen_raises_no_teacher_soon_after_the_freeze() -> None:
    """Stopped teachers accept calls and never answer. The deadline here (60 s) is beyond the test's
    limit: only a late chunk's readiness probe can end this pass in time."""

    async def scenario(engine: Engine, sink: Collected, mem: list[MemoryTeacher]) -> None:
        await epoch(engine, sink, batches(3))
        assert_delivered_once_in_order(sink.tags(), 3)
        for t in mem:
            t.frozen = True
        loop = asyncio.get_running_loop()
        frozen_at = loop.time()
        await epoch(engine, sink, batches(3))
        after = loop.time() - frozen_at
        assert sink.errors and isinstance(sink.errors[0], NoTeacherError), sink.errors
        # late (0.25 s) + probe deadline (0.5 s) + no_teacher_timeout (1 s), with slack
        assert after < 1.0 + 0.25 + 0.5 + 2.0, f"NoTeacherError came {after:.2f} s after the freeze"
        assert engine.hung_ejections >= 1

    run(scenario, hedge_after=None, timeout=60.0, no_teacher_timeout=1.0)


def test_a_teacher_answering_calls_while_its_probe_times_out_is_busy_not_hung() -> None:
    """One batch's calls are late and the readiness probe never answers in time, but the other
    batches' calls keep answering meanwhile: the teacher is busy, so nothing is ejected or given up."""

    def setup(mem: list[MemoryTeacher]) -> None:
        mem[0].delay_s = lambda r: 0.9 if int(r.request_id.split(":")[1]) == 1 else 0.02  # batch 1 is late

    async def scenario(engine: Engine, sink: Collected, mem: list[MemoryTeacher]) -> None:
        mem[0].slow_probe = True  # once in use: its first probe let it in
        await epoch(engine, sink, batches(12))
        assert_delivered_once_in_order(sink.tags(), 12)
        check_outputs(sink)
        assert engine.hung_ejections == 0, "answers during the probe show the teacher is alive"

    busy = dataclasses.replace(FAST, initial_limit=4.0, min_limit=4.0)  # calls besides the late one
    run(scenario, teachers=1, setup=setup, prefetch=12, hedge_after=None, timeout=60.0, router=busy)


def test_an_answer_contradicting_the_metadata_is_refused_by_the_client() -> None:
    x = torch.zeros(2, 8)
    _, fields = extract_inputs({"X": x}, {"X": "X"})
    req = ChunkRequest("affine", "1", "1:0:0", fields, 0, 2, outputs=("Y",), declared=META.outputs)
    answer = service_pb2.ModelInferResponse()
    answer.outputs.add(name="Y", datatype="FP32", shape=[2, 2])  # declared [4]
    answer.raw_output_contents.append(torch.ones(2, 2).numpy().tobytes())
    with pytest.raises(MalformedAnswerError, match="'Y' came as \\[2\\] per sample; the teacher's metadata declares"):
        decode_response(answer, req)
    topk = ChunkRequest("affine", "1", "1:0:0", fields, 0, 2, outputs=("Y",), top_k=3, declared=META.outputs)
    ok = service_pb2.ModelInferResponse()
    for name, dtype, data in (("Y_TOPK_VALUES", "FP32", torch.ones(2, 3)),
                              ("Y_TOPK_INDICES", "INT64", torch.zeros(2, 3, dtype=torch.int64))):
        ok.outputs.add(name=name, datatype=dtype, shape=[2, 3])
        ok.raw_output_contents.append(data.numpy().tobytes())
    assert set(decode_response(ok, topk)) == {"Y_TOPK_VALUES", "Y_TOPK_INDICES"}


def test_close_ends_a_call_that_lost_its_cancellation() -> None:
    """A chunk call that goes on after the engine cancels it (as grpc.aio lets one do) is cancelled
    again: close does not wait for its 120 s deadline."""
    async def scenario(engine: Engine, sink: Collected, mem: list[MemoryTeacher]) -> None:
        engine.begin_epoch(batches(2))
        for _ in range(3000):  # until the call is in flight; bounded
            if mem[0].calls:
                return
            await asyncio.sleep(0.01)
        raise AssertionError("the engine never called the teacher")

    def setup(mem: list[MemoryTeacher]) -> None:
        mem[0].hang = mem[0].lose_cancel = True

    mem = run(scenario, teachers=1, setup=setup, timeout=120.0)
    assert not mem[0].lose_cancel, "the call was never cancelled, so nothing was lost"
