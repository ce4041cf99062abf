"""DistillReader against real teacher servers: delivery semantics, routing under faults, bad input."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch

from discovery import subset
from distill import DistillReader, KDLoss, NoTeacherError, ReaderOptions, TeacherMismatchError, add_distill_args
from distill.errors import BatchRejectedError
from distill.router import RouterConfig
from protos.kserve import service_pb2, service_pb2_grpc
from teacher_server import BatchingConfig, ModelIO, ServerConfig
from tests.faults.helpers import assert_delivered_once_in_order, start_teachers
from tests.models import Affine, Affine2
from tests.servers import ServerThread, teacher_process

AFFINE = Affine()


def _affine_server(max_batch: int = 8, model: str = "tests.models:affine", name: str = "affine",
                   **kw: object) -> ServerThread:
    return ServerThread(ServerConfig(model=model, name=name, device="cpu",
                                     batching=BatchingConfig(max_batch_size=max_batch, max_queue_delay_us=200),
                                     **kw))  # type: ignore[arg-type]


def _batches(n: int, rows: int = 12, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [{"X": torch.randn(rows, 8, generator=g), "idx": torch.full((rows,), i)} for i in range(n)]


def _expected(x: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return AFFINE(x)


def _check_epoch(reader: DistillReader, data: list[dict[str, torch.Tensor]]) -> list[float]:
    """Every batch exactly once, in order, with the in-process model's outputs; returns arrival times."""
    seen = []
    times = []
    for batch, teacher in reader:
        i = int(batch["idx"][0])
        seen.append(i)
        times.append(time.monotonic())
        assert torch.allclose(teacher["Y"], _expected(batch["X"]), atol=1e-5), f"batch {i} has wrong outputs"
    assert seen == list(range(len(data))), f"lost, duplicated or reordered batches: {seen}"
    return times


@pytest.fixture(scope="module")
def two_teachers() -> Iterator[tuple[ServerThread, ServerThread]]:
    with _affine_server() as a, _affine_server() as b:
        yield a, b


SLEEPY = ["--model", "tests.models:sleepy", "--name", "affine", "--device", "cpu", "--max-batch-size", "8"]
SLEEPY_ENV = {"TEST_SLEEP_MS": "5"}


@pytest.fixture(scope="module")
def sleepy_pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[tuple[subprocess.Popen[bytes], str]]]:
    """Two teacher-server processes (5 ms a batch) for the fault tests: a test may stop one with
    SIGSTOP and resume it, never end it; teachers a test kills or drains are its own."""
    with contextlib.ExitStack() as stack:
        started = start_teachers(stack, [SLEEPY, SLEEPY], tmp_path_factory.mktemp("sleepy-pair"), env=SLEEPY_ENV)
        yield [(proc, info["endpoint"]) for proc, info in started]


def test_every_batch_once_in_order_with_correct_outputs(two_teachers: tuple[ServerThread, ServerThread]) -> None:
    a, b = two_teachers
    data = _batches(30, rows=20)  # 20 rows > max batch 8: each batch is split across chunks
    with DistillReader(data, teachers=f"{a.url},{b.url}", inputs=["X"], outputs=["Y"]) as reader:
        _check_epoch(reader, data)
        _check_epoch(reader, data)  # a second epoch over the same loader
        stats = reader.stats()
    assert stats.batches == 60 and stats.samples == 1200
    per_teacher = stats.teachers["teachers"]
    assert len(per_teacher) == 2 and all(t["samples"] > 0 for t in per_teacher.values()), per_teacher


def test_unordered_delivery_is_still_exactly_once(two_teachers: tuple[ServerThread, ServerThread]) -> None:
    a, b = two_teachers
    data = _batches(25)
    with DistillReader(data, teachers=f"{a.url},{b.url}", inputs=["X"], ordered=False, prefetch=6) as reader:
        seen = sorted(int(batch["idx"][0]) for batch, teacher in reader
                      if torch.allclose(teacher["Y"], _expected(batch["X"]), atol=1e-5))
    assert seen == list(range(25))


def test_tuple_tensor_and_mapped_batches(two_teachers: tuple[ServerThread, ServerThread]) -> None:
    a, _ = two_teachers
    xs = [torch.randn(5, 8) for _ in range(3)]
    with DistillReader([(x, torch.zeros(5)) for x in xs], teachers=a.url, inputs={"X": 0}) as reader:
        got = [t["Y"] for _, t in reader]
    assert all(torch.allclose(g, _expected(x), atol=1e-5) for g, x in zip(got, xs, strict=True))
    with DistillReader(xs, teachers=a.url, inputs=["X"]) as reader:  # bare tensors
        assert all(torch.allclose(t["Y"], _expected(b), atol=1e-5) for b, t in reader)
    with DistillReader([{"feats": x} for x in xs], teachers=a.url, inputs={"X": "feats"}) as reader:
        assert all(torch.allclose(t["Y"], _expected(b["feats"]), atol=1e-5) for b, t in reader)
    numpy_batches = [{"X": x.numpy()} for x in xs]
    with DistillReader(numpy_batches, teachers=a.url, inputs=["X"]) as reader:
        assert all(torch.allclose(t["Y"], _expected(torch.from_numpy(b["X"])), atol=1e-5) for b, t in reader)


@pytest.mark.parametrize("batch,inputs,message", [
    ({"image": torch.zeros(2, 8)}, ["X"], "the batch has no key 'X'"),
    ({"X": [1.0, 2.0]}, ["X"], "teacher input 'X' is a list"),
    ((torch.zeros(2, 8),), ["X"], "its field must be a position"),
    ({"X": torch.tensor(3.0)}, ["X"], "is a scalar"),
    ("text", ["X"], "cannot take teacher input 'X' from a batch of type str"),
])
def test_unsplittable_batches_raise_type_error(two_teachers: tuple[ServerThread, ServerThread], batch: object,
                                               inputs: list[str], message: str) -> None:
    a, _ = two_teachers
    with DistillReader([batch], teachers=a.url, inputs=inputs) as reader, pytest.raises(TypeError, match=message):
        list(reader)


def test_loader_errors_surface_in_order(two_teachers: tuple[ServerThread, ServerThread]) -> None:
    a, _ = two_teachers

    def loader() -> Iterator[dict[str, torch.Tensor]]:
        yield from _batches(3)
        raise OSError("disk gone")

    class Loader:
        def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
            return loader()

    got = []
    with DistillReader(Loader(), teachers=a.url, inputs=["X"]) as reader, pytest.raises(OSError, match="disk gone"):
        for batch, _ in reader:
            got.append(int(batch["idx"][0]))
    assert got == [0, 1, 2]


def test_unknown_output_fails_at_start(two_teachers: tuple[ServerThread, ServerThread]) -> None:
    a, _ = two_teachers
    reader = DistillReader(_batches(1), teachers=a.url, inputs=["X"], outputs=["PROBS"])
    with pytest.raises(TeacherMismatchError, match="has no output 'PROBS'; its outputs are \\['Y'\\]"):
        reader.start()
    reader.close()
    with pytest.raises(TeacherMismatchError, match="has no input 'IMAGE'"):
        DistillReader(_batches(1), teachers=a.url, inputs={"IMAGE": "X"}).start()


def test_mismatched_teacher_is_ejected_and_others_serve(two_teachers: tuple[ServerThread, ServerThread],
                                                         caplog: pytest.LogCaptureFixture) -> None:
    good, _ = two_teachers
    # Same model name and tensor names, but this teacher expects X with 4 features, not 8: another
    # model, so another fingerprint. The reader is told the good one's (with a fixed list the first
    # teacher whose metadata arrives would fix it otherwise); the odd one out of equal fingerprints
    # (teachers that state none) is test_a_teacher_whose_inputs_fit_no_batch_fails_each_batch_at_once's.
    cfg = ServerConfig(model="tests.models:linear4", name="affine", device="cpu",
                       io=ModelIO.parse(["X:FP32:4"], ["Y:FP32:3"]))
    assert good.server is not None
    with ServerThread(cfg) as bad, caplog.at_level(logging.ERROR, logger="distill"):
        data = _batches(12)
        with DistillReader(data, teachers=f"{bad.url},{good.url}", inputs=["X"], outputs=["Y"],
                           fingerprint=good.server.record().fingerprint) as reader:
            for batch, teacher in reader:
                assert torch.allclose(teacher["Y"], _expected(batch["X"]), atol=1e-5)
            stats = reader.stats().teachers["teachers"]
    assert stats[bad.url]["samples"] == 0 and "incompatible" in str(stats[bad.url]["state"])
    assert any(f"teacher {bad.url}" in r.message and "its fingerprint" in r.message for r in caplog.records)


def test_no_teacher_raises_after_timeout() -> None:
    with pytest.raises(NoTeacherError, match="no usable teacher for service 'teachers'"):
        DistillReader(_batches(1), teachers="127.0.0.1:1", inputs=["X"], no_teacher_timeout=1.0).start()


def test_hard_label_fallback_then_recovery_when_the_teacher_returns(tmp_path: Path) -> None:
    """Teacher dies: batches go on with None outputs; a teacher back on the same port is used again."""
    args = ["--model", "tests.models:affine", "--name", "affine", "--device", "cpu", "--max-batch-size", "8"]
    lost, back, served_again = threading.Event(), threading.Event(), threading.Event()
    yielded: list[int] = []

    class Loader:
        def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
            # After the restart, read on until a batch carries teacher outputs again (bounded: at most
            # 600 batches, 60 s), instead of guessing how many batches the reconnection takes.
            deadline = None
            for i, b in enumerate(_batches(600, rows=4)):
                if i == 10:
                    lost.wait(30)  # read on only after the teacher is dead
                if i == 30:
                    back.wait(60)  # ... and only after it is back
                    deadline = time.monotonic() + 60
                if i >= 30:
                    if served_again.is_set() or (deadline is not None and time.monotonic() > deadline):
                        return
                    time.sleep(0.05)
                yielded.append(i)
                yield b

    seen: list[int] = []
    results: dict[int, bool] = {}
    with contextlib.ExitStack() as stack:
        proc, info = stack.enter_context(teacher_process(args, tmp_path))
        reader = stack.enter_context(DistillReader(
            Loader(), teachers=info["endpoint"], inputs=["X"], no_teacher_timeout=0.5, fallback="hard_labels",
            timeout=2.0, prefetch=1, router=RouterConfig(backoff_max_s=0.5)))
        kd = KDLoss(temperature=2.0, alpha=0.5)
        for batch, teacher in reader:
            i = int(batch["idx"][0])
            seen.append(i)
            results[i] = teacher is not None
            student = torch.randn(4, 4, requires_grad=True)
            loss = kd(student, None if teacher is None else teacher["Y"], torch.zeros(4, dtype=torch.long))
            assert torch.isfinite(loss)  # a fallback batch still trains, on hard labels
            if teacher is not None:
                assert torch.allclose(teacher["Y"], _expected(batch["X"]), atol=1e-5)
                if i >= 30:
                    served_again.set()
            if i == 9:
                proc.send_signal(signal.SIGKILL)
                proc.wait(10)
                lost.set()
            if i == 20:
                stack.enter_context(teacher_process([*args, "--port", str(info["port"])], tmp_path))
                back.set()
    assert_delivered_once_in_order(seen, len(yielded))  # every batch exactly once and in order, fallback or not
    assert all(results[i] for i in range(10)), "batches before the loss carry teacher outputs"
    assert not any(results[i] for i in range(11, 21)), "batches while no teacher lived fell back to hard labels"
    assert any(results[i] for i in seen if i >= 30), "the teacher back on its port serves again"


def test_sigkill_teachers_mid_epoch_lose_nothing(sleepy_pair: list[tuple[subprocess.Popen[bytes], str]],
                                                 tmp_path: Path) -> None:
    with contextlib.ExitStack() as stack:
        procs = start_teachers(stack, [[*SLEEPY, "--max-queue-delay-us", "0"]] * 2, tmp_path, env=SLEEPY_ENV)
        data = _batches(90, rows=16)
        kill_at = {25: procs[0][0], 55: procs[1][0]}  # two teachers die during one epoch; the shared one lives
        endpoints = [i["endpoint"] for _, i in procs] + [sleepy_pair[0][1]]
        reader = stack.enter_context(DistillReader(data, teachers=",".join(endpoints), inputs=["X"], timeout=5.0))
        seen = []
        gaps = []
        last = time.monotonic()
        for batch, teacher in reader:
            i = int(batch["idx"][0])
            seen.append(i)
            assert torch.allclose(teacher["Y"], _expected(batch["X"]), atol=1e-5)
            now = time.monotonic()
            gaps.append(now - last)
            last = now
            if i in kill_at:
                kill_at[i].send_signal(signal.SIGKILL)
        stats = reader.stats()
    assert seen == list(range(90))
    assert stats.samples == 90 * 16
    # Not a speed check: a dead teacher may cost about one deadline (5 s), never a hang.
    assert max(gaps) < 5.0 + 3.0, f"a dead teacher cost more than one deadline: {max(gaps):.2f}s"


def test_sigterm_drain_mid_epoch_loses_nothing(sleepy_pair: list[tuple[subprocess.Popen[bytes], str]],
                                               tmp_path: Path) -> None:
    with contextlib.ExitStack() as stack:
        procs = [stack.enter_context(teacher_process(SLEEPY, tmp_path, env={"TEST_SLEEP_MS": "20"}))]
        data = _batches(40, rows=8)
        reader = stack.enter_context(DistillReader(
            data, teachers=f"{procs[0][1]['endpoint']},{sleepy_pair[0][1]}", inputs=["X"], timeout=5.0))
        seen = []
        for batch, teacher in reader:
            i = int(batch["idx"][0])
            seen.append(i)
            assert torch.allclose(teacher["Y"], _expected(batch["X"]), atol=1e-5)
            if i == 10:
                procs[0][0].send_signal(signal.SIGTERM)
        assert procs[0][0].wait(30) == 0
    assert seen == list(range(40))


def test_straggler_gets_less_work_and_hedging_races_it() -> None:
    fast = _affine_server(model="tests.models:sleepy_20")
    slow = _affine_server(model="tests.models:sleepy_200")  # ten times slower
    with fast as f, slow as s:
        data = _batches(40, rows=8)
        with DistillReader(data, teachers=f"{f.url},{s.url}", inputs=["X"], hedge_after=0.05, prefetch=4) as reader:
            _check_epoch(reader, data)
            stats = reader.stats()
    per = stats.teachers["teachers"]
    assert per[f.url]["samples"] > 3 * per[s.url]["samples"], per
    assert stats.hedges > 0, "chunks late on the straggler are raced on the fast teacher"


def test_many_students_share_teachers(two_teachers: tuple[ServerThread, ServerThread]) -> None:
    a, b = two_teachers
    errors: list[BaseException] = []

    def student(k: int) -> None:
        try:
            data = _batches(15, rows=10, seed=k)
            with DistillReader(data, teachers=f"{a.url},{b.url}", inputs=["X"], student_id=f"s{k}") as r:
                _check_epoch(r, data)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=student, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors[0]


def test_top_k_and_half_precision_outputs(two_teachers: tuple[ServerThread, ServerThread]) -> None:
    a, _ = two_teachers
    data = _batches(3)
    with DistillReader(data, teachers=a.url, inputs=["X"], outputs=["Y"], top_k=2, output_dtype="fp16") as reader:
        for batch, teacher in reader:
            want_v, want_i = torch.topk(_expected(batch["X"]), 2)
            assert set(teacher) == {"Y_TOPK_VALUES", "Y_TOPK_INDICES"}
            assert teacher["Y_TOPK_VALUES"].dtype == torch.float16
            assert torch.equal(teacher["Y_TOPK_INDICES"], want_i)
            assert torch.allclose(teacher["Y_TOPK_VALUES"].float(), want_v, atol=1e-2)


def test_mixture_of_teacher_services() -> None:
    with _affine_server() as a, _affine_server(model="tests.models:affine2") as b:
        data = _batches(5)
        with DistillReader(data, teachers={"one": a.url, "two": b.url}, inputs=["X"]) as reader:
            for batch, teacher in reader:
                assert set(teacher) == {"one", "two"}
                with torch.inference_mode():
                    want_two = Affine2()(batch["X"])
                assert torch.allclose(teacher["one"]["Y"], _expected(batch["X"]), atol=1e-5)
                assert torch.allclose(teacher["two"]["Y"], want_two, atol=1e-5)
                loss = KDLoss()(torch.zeros(12, 4), [t["Y"] for t in teacher.values()], torch.zeros(12).long())
                assert torch.isfinite(loss)


def test_flags_build_a_reader(two_teachers: tuple[ServerThread, ServerThread]) -> None:
    a, b = two_teachers
    parser = argparse.ArgumentParser()
    add_distill_args(parser)
    args = parser.parse_args(["--distill_teachers", f"{a.url},{b.url}", "--distill_timeout", "3"])
    data = _batches(4)
    with DistillReader.from_args(args, data, inputs=["X"], outputs=["Y"]) as reader:
        _check_epoch(reader, data)


def _threads_left(before: set[threading.Thread], timeout: float = 10.0) -> list[threading.Thread]:
    """The reader threads (engine loop, loader) started since `before` that are still alive after
    waiting up to `timeout` for each to end. Identities, not names: every reader names its threads
    alike, so a name check cannot tell a leaked reader from one that was already running."""
    new = [t for t in threading.enumerate() if t not in before and t.name.startswith("distill-")]
    deadline = time.monotonic() + timeout
    for t in new:
        t.join(max(0.0, deadline - time.monotonic()))
    return [t for t in new if t.is_alive()]


def test_close_stops_the_engine_thread(two_teachers: tuple[ServerThread, ServerThread]) -> None:
    a, _ = two_teachers
    before = set(threading.enumerate())
    reader = DistillReader(_batches(50), teachers=a.url, inputs=["X"])
    it = iter(reader)
    next(it)  # mid-epoch
    assert {t.name for t in threading.enumerate() if t not in before} >= {"distill-reader", "distill-loader"}
    reader.close()
    leftover = _threads_left(before)
    assert not leftover, leftover
    with pytest.raises(Exception, match="closed"):
        next(it)


def test_the_thread_check_catches_a_reader_left_open(two_teachers: tuple[ServerThread, ServerThread]) -> None:
    """The check above must fail on a leak, even while another reader (with threads of the same
    names) is open: here one reader stays open throughout and a second one is leaked on purpose."""
    a, _ = two_teachers
    with DistillReader(_batches(5), teachers=a.url, inputs=["X"]) as already_open:
        next(iter(already_open))
        before = set(threading.enumerate())
        leaked = DistillReader(_batches(5), teachers=a.url, inputs=["X"]).start()
        try:
            left = _threads_left(before, timeout=1.0)  # its threads run on: the wait ends at the timeout
            assert {t.name for t in left} == {"distill-reader", "distill-loader"}, left
        finally:
            leaked.close()
        assert not _threads_left(before), "closing the leaked reader ends its threads"


def test_a_loader_that_answers_after_close_raises_nothing(two_teachers: tuple[ServerThread, ServerThread]) -> None:
    """The user's loader may still be inside next() when the reader closes; its late answer has
    nobody to go to and must vanish quietly, not raise on the loader thread."""
    a, _ = two_teachers
    data = _batches(3)
    release = threading.Event()

    def slow_loader() -> Iterator[dict[str, torch.Tensor]]:
        yield data[0]
        release.wait(10)
        yield from data[1:]

    errors: list[BaseException | None] = []
    previous = threading.excepthook
    threading.excepthook = lambda args: errors.append(args.exc_value)
    try:
        before = set(threading.enumerate())
        reader = DistillReader(slow_loader(), teachers=a.url, inputs=["X"], prefetch=1)
        it = iter(reader)
        next(it)
        loader_threads = [t for t in threading.enumerate() if t not in before and t.name == "distill-loader"]
        assert len(loader_threads) == 1, loader_threads
        reader.close()
        release.set()
        # The loader thread answers into the closed reader, then ends: an exception would reach
        # the excepthook before the thread ends.
        loader_threads[0].join(10)
        assert not loader_threads[0].is_alive(), "the loader thread ends once its late answer is dropped"
    finally:
        threading.excepthook = previous
    assert errors == [], errors


def test_reader_argument_errors() -> None:
    with pytest.raises(ValueError, match="exactly one of"):
        DistillReader([], inputs=["X"])
    with pytest.raises(ValueError, match="needs service"):
        DistillReader([], inputs=["X"], registry="etcd://127.0.0.1:2379")
    with pytest.raises(ValueError, match="fallback"):
        DistillReader([], inputs=["X"], teachers="h:1", fallback="labels")
    with pytest.raises(TypeError, match="positions"):
        DistillReader([], inputs=[0], teachers="h:1")
    with pytest.raises(ValueError, match="prefetch: must be an integer >= 1, got 0"):
        DistillReader([], inputs=["X"], teachers="h:1", prefetch=0)
    with pytest.raises(ValueError, match="hedge_after must be between 0 and timeout"):
        DistillReader([], inputs=["X"], teachers="h:1", timeout=1.0, hedge_after=2.0)
    with pytest.raises(TypeError, match="unexpected keyword argument 'prefech'"):
        DistillReader([], inputs=["X"], teachers="h:1", prefech=2)


def test_reader_options_are_one_validated_frozen_record() -> None:
    """Flags, keywords and a built ReaderOptions meet in the same normalised record."""
    args = add_distill_args(argparse.ArgumentParser()).parse_args(
        ["--distill_teachers", "127.0.0.1:9898", "--distill_hedge_ms", "50", "--distill_prefetch", "3"])
    opts = ReaderOptions.from_args(args, inputs=["X"], outputs=["Y"], student_id="s1")
    assert opts == ReaderOptions(inputs={"X": "X"}, outputs=("Y",), teachers="127.0.0.1:9898", hedge_after=0.05,
                                 prefetch=3, student_id="s1")
    assert opts.services == ("teachers",) and opts.static == {"teachers": "127.0.0.1:9898"}
    assert opts.hedge_s == 0.05 and not opts.adaptive_hedge and opts.client_tls is None
    field_name = "prefetch"
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(opts, field_name, 5)
    reader = DistillReader([], opts)
    assert reader.options is opts and reader.student_id == "s1"
    assert DistillReader.from_args(args, [], inputs=["X"], outputs=["Y"], student_id="s1").options == opts


def test_bf16_inputs_travel_untouched() -> None:
    cfg = ServerConfig(model="tests.models:bf16_in", name="bf", device="cpu")
    with ServerThread(cfg) as srv:
        xs = [torch.randn(3, 8).to(torch.bfloat16) for _ in range(2)]
        with DistillReader([{"X": x} for x in xs], teachers=srv.url, inputs=["X"]) as reader:
            for batch, teacher in reader:
                assert torch.equal(teacher["Y"], batch["X"].float() * 2)


def test_hung_teacher_costs_less_than_a_deadline_and_returns_after_resume(
        sleepy_pair: list[tuple[subprocess.Popen[bytes], str]]) -> None:
    """SIGSTOP: the port still accepts connections but nothing answers. Hedging and the readiness
    probe keep the loop going; after SIGCONT the teacher passes the probe and gets work again."""
    with contextlib.ExitStack() as stack:
        (hung_proc, hung_endpoint), (_, other) = sleepy_pair
        stack.callback(lambda: hung_proc.poll() is None and hung_proc.send_signal(signal.SIGCONT))
        data = _batches(400, rows=8)  # 260 batches (>= 2.6 s) after the resume: time to probe and serve
        reader = stack.enter_context(DistillReader(
            data, teachers=f"{hung_endpoint},{other}", inputs=["X"], timeout=5.0,
            router=RouterConfig(backoff_max_s=0.5)))
        seen, gaps, last = [], [], time.monotonic()
        ok_at_resume = 0
        for batch, teacher in reader:
            i = int(batch["idx"][0])
            seen.append(i)
            assert torch.allclose(teacher["Y"], _expected(batch["X"]), atol=1e-5)
            now = time.monotonic()
            gaps.append(now - last)
            last = now
            if i == 40:
                hung_proc.send_signal(signal.SIGSTOP)
            if i == 140:
                hung_proc.send_signal(signal.SIGCONT)
                ok_at_resume = int(reader.stats().teachers["teachers"][hung_endpoint]["ok"])
            if i > 140:
                time.sleep(0.01)  # leave the probe time to readmit it before the epoch ends
        final = reader.stats().teachers["teachers"][hung_endpoint]
    assert seen == list(range(400))
    # A deadline is 5 s; a hung teacher must not cost one per batch, nor even one in total.
    assert max(gaps) < 5.0, f"the loop stalled {max(gaps):.2f}s on a hung teacher"
    assert int(final["ok"]) > ok_at_resume, "the resumed teacher passed its probe and served again"


def test_full_outputs_even_from_a_server_with_a_top_k_default() -> None:
    cfg = ServerConfig(model="tests.models:affine", name="affine", device="cpu", top_k=2)
    with ServerThread(cfg) as srv:
        data = _batches(3)
        with DistillReader(data, teachers=srv.url, inputs=["X"], outputs=["Y"]) as reader:
            _check_epoch(reader, data)


def _inference_count(url: str) -> int:
    """Samples the teacher itself says it inferred (KServe ModelStatistics)."""
    with grpc.insecure_channel(url) as channel:
        stats = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelStatistics(
            service_pb2.ModelStatisticsRequest(), timeout=10)
    return int(stats.model_stats[0].inference_count)


def test_max_teachers_uses_only_the_students_rendezvous_subset() -> None:
    student = "student-7"
    with contextlib.ExitStack() as stack:
        servers = [stack.enter_context(_affine_server()) for _ in range(4)]
        urls = [s.url for s in servers]
        before = {u: _inference_count(u) for u in urls}
        data = _batches(20)
        with DistillReader(data, teachers=",".join(urls), inputs=["X"], max_teachers=2, student_id=student) as r:
            _check_epoch(r, data)
        served = {u for u in urls if _inference_count(u) > before[u]}
    assert served == set(subset(student, urls, 2)), f"teachers that got requests: {served}"


def test_no_teacher_error_names_every_teacher_and_its_state() -> None:
    dead = "127.0.0.1:1"  # nothing listens: its metadata never comes
    # Declares Affine's Y:FP32:4 but answers [N, 2]: ejected at its first answer.
    cfg = ServerConfig(model="tests.bad_models:wrong_shape", name="affine", device="cpu")
    with ServerThread(cfg) as liar:
        reader = DistillReader(_batches(2), teachers=f"{dead},{liar.url}", inputs=["X"], no_teacher_timeout=5.0)
        with reader, pytest.raises(NoTeacherError) as caught:
            list(reader)
    text = str(caught.value)
    assert f"{dead} [waiting for metadata (UNAVAILABLE: " in text, text
    assert (f"{liar.url} [incompatible: its answer does not match its metadata: output 'Y' came as [2] per "
            "sample; the teacher's metadata declares [4]]") in text, text
    assert "no usable teacher for service 'teachers' for 5 s (from the static teacher list)" in text, text


def test_a_teacher_whose_inputs_fit_no_batch_fails_each_batch_at_once() -> None:
    """The only teacher with metadata expects 4 features and the batches have 8: that is the batches'
    problem as far as the reader can tell (no teacher takes them), so each fails at once with the
    shapes named, instead of a NoTeacherError after no_teacher_timeout."""
    dead = "127.0.0.1:1"
    cfg = ServerConfig(model="tests.models:linear4", name="affine", device="cpu",
                       io=ModelIO.parse(["X:FP32:4"], ["Y:FP32:3"]))
    with ServerThread(cfg) as wrong:
        reader = DistillReader(_batches(2), teachers=f"{dead},{wrong.url}", inputs=["X"], no_teacher_timeout=30.0)
        with reader:
            it = iter(reader)
            for _ in range(2):
                with pytest.raises(BatchRejectedError) as caught:
                    next(it)
                assert (f"teacher {wrong.url} (model 'affine'): input 'X' is FP32[8] per sample here, the teacher "
                        "expects FP32[4]") in str(caught.value), str(caught.value)
            with pytest.raises(StopIteration):
                next(it)
            state = reader.stats().teachers["teachers"][wrong.url]
    assert state["usable"] is True, state
