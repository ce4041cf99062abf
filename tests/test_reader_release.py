"""DistillReader.close() releases everything gRPC-related at once, by reference counting alone.

A grpc.aio channel that outlives close() is finalised whenever the cyclic garbage collector gets
to it: on any thread, perhaps at interpreter exit after the reader's event-loop thread is gone,
which is where gRPC's C++ core aborts ("terminate called without an active exception"). So these
tests run with the cyclic collector disabled and check, through weak references, that the teacher
clients, their channels, the engine and the objects its event-loop thread ran are freed the moment
close() returns, and that no thread the reader started (its loop, its loader, gRPC's poller) lives on.

Teachers run as subprocesses, so every thread of this process that appears during a test was
started by the reader.
"""

from __future__ import annotations

import contextlib
import gc
import signal
import threading
import time
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from distill import DistillReader
from distill.router import RouterConfig
from tests.servers import teacher_process

SLEEPY = ["--model", "tests.models:sleepy", "--name", "affine", "--device", "cpu", "--max-batch-size", "8",
          "--max-queue-delay-us", "0"]


@pytest.fixture(scope="module")
def teachers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Two teacher processes, a few ms per call: enough for hedges and late-call checks to run."""
    tmp = tmp_path_factory.mktemp("release")
    with contextlib.ExitStack() as stack:
        procs = [stack.enter_context(teacher_process(SLEEPY, tmp, env={"TEST_SLEEP_MS": "5"})) for _ in range(2)]
        yield ",".join(info["endpoint"] for _, info in procs)


@contextlib.contextmanager
def _no_cyclic_gc() -> Iterator[None]:
    """Only reference counting frees objects inside; what a cycle holds stays and is seen."""
    gc.collect()  # earlier tests' garbage is not this test's
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _batches(n: int, rows: int = 12) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [{"X": torch.randn(rows, 8, generator=g), "idx": torch.full((rows,), i)} for i in range(n)]


def _watch(reader: DistillReader) -> dict[str, weakref.ref[Any]]:
    """Weak references to what the running reader owns: engine, loop, threads, and per teacher its
    state, client and channel. Called in its own frame so the test keeps no strong reference."""
    engine = reader._engine
    assert engine is not None and reader._thread is not None
    refs: dict[str, weakref.ref[Any]] = {
        # Not the event loop object itself: gRPC's completion queue (module state) keeps a reference to
        # the last loop it polled for, closed or not. What the loop ran is checked: engine, tasks' owners.
        "engine": weakref.ref(engine),
        "reader thread": weakref.ref(reader._thread),
        "loader thread": weakref.ref(engine._loader._thread),
        "call watch": weakref.ref(engine._watch),
    }
    for name, svc in engine._services.items():
        refs[f"pool {name}"] = weakref.ref(svc.pool)
        refs[f"router {name}"] = weakref.ref(svc.router)
        for t in svc.router.teachers.values():
            refs[f"teacher {t.endpoint}"] = weakref.ref(t)
            refs[f"client {t.endpoint}"] = weakref.ref(t.client)
            refs[f"channel {t.endpoint}"] = weakref.ref(t.client._channel)
    assert any(k.startswith("channel ") for k in refs), "the reader has no teacher channel to watch"
    return refs


def _alive(refs: dict[str, weakref.ref[Any]], prefixes: tuple[str, ...] = ("",)) -> list[str]:
    return sorted(k for k, r in refs.items() if k.startswith(prefixes) and r() is not None)


def _new_threads(before: set[threading.Thread]) -> list[str]:
    """Threads started since `before` that do not end: each is given a generous join, since the
    loader thread ends just after close() (a user's loader may block, so close() cannot join it),
    whereas gRPC's poller thread lives exactly as long as some channel does."""
    new = [t for t in threading.enumerate() if t not in before]
    for t in new:
        t.join(10)
    return sorted(t.name for t in new if t.is_alive())


def _assert_released(refs: dict[str, weakref.ref[Any]], before: set[threading.Thread]) -> None:
    # The loader thread's object lives while the thread runs (threading keeps it), and close() does
    # not wait for that thread: it is checked once the thread has had its join.
    alive = [k for k in _alive(refs) if k != "loader thread"]
    assert not alive, f"still alive right after close(), held by reference cycles: {alive}"
    threads = _new_threads(before)
    assert not threads, f"threads the reader started outlive close(): {threads}"
    alive = _alive(refs)
    assert not alive, f"still alive once the reader's threads ended, held by reference cycles: {alive}"


def _take(it: Iterator[tuple[Any, Any]], n: int) -> list[int]:
    seen = []
    for _ in range(n):
        batch, teacher = next(it)
        assert teacher is not None and teacher["Y"].shape[0] == batch["X"].shape[0]
        seen.append(int(batch["idx"][0]))
    return seen


def test_a_closed_reader_frees_its_channels_engine_and_threads(teachers: str) -> None:
    data = _batches(12, rows=12)  # 12 rows > max batch 8: chunks, and some hedges at 20 ms
    with _no_cyclic_gc():
        before = set(threading.enumerate())
        reader = DistillReader(data, teachers=teachers, inputs=["X"], outputs=["Y"], hedge_after=0.02)
        try:
            refs = _watch(reader.start())
            seen = [int(batch["idx"][0]) for batch, _ in reader]
            seen += [int(batch["idx"][0]) for batch, _ in reader]  # a second epoch
            assert seen == list(range(12)) * 2
        finally:
            reader.close()
        _assert_released(refs, before)


def test_an_iterator_abandoned_mid_epoch_pins_no_channel(teachers: str) -> None:
    data = _batches(40, rows=12)
    with _no_cyclic_gc():
        before = set(threading.enumerate())
        reader = DistillReader(data, teachers=teachers, inputs=["X"], outputs=["Y"], prefetch=8, hedge_after=0.02)
        try:
            refs = _watch(reader.start())
            it = iter(reader)
            assert _take(it, 5) == list(range(5))  # then the loop breaks out, with chunks in flight
        finally:
            reader.close()
        # Even while the training loop still holds its iterator, nothing gRPC-related is left...
        alive = _alive(refs, ("client ", "channel ", "teacher "))
        assert not alive, f"a kept iterator pins these after close(): {alive}"
        assert not _new_threads(before), f"threads outlive close(): {_new_threads(before)}"
        del it  # ... and once it drops the iterator, nothing at all
        _assert_released(refs, before)


def test_a_teacher_killed_mid_epoch_leaves_nothing_behind_close(tmp_path: Path) -> None:
    """A SIGKILLed teacher (failed calls, ejection, readiness probes, re-sent chunks) and a SIGSTOPped
    one (late calls, the liveness check, abandoned calls, hedges) exercise every owner of a call."""
    with contextlib.ExitStack() as stack:
        procs = [stack.enter_context(teacher_process(SLEEPY, tmp_path, env={"TEST_SLEEP_MS": "5"})) for _ in range(3)]
        killed, stopped = procs[0][0], procs[1][0]
        stack.callback(lambda: stopped.poll() is None and stopped.send_signal(signal.SIGCONT))
        endpoints = ",".join(info["endpoint"] for _, info in procs)
        data = _batches(200, rows=12)
        with _no_cyclic_gc():
            before = set(threading.enumerate())
            reader = DistillReader(data, teachers=endpoints, inputs=["X"], outputs=["Y"], timeout=5.0,
                                   hedge_after=0.05, router=RouterConfig(backoff_max_s=0.2, probe_timeout_s=0.2))
            try:
                refs = _watch(reader.start())
                it = iter(reader)
                seen = _take(it, 10)
                killed.send_signal(signal.SIGKILL)
                stopped.send_signal(signal.SIGSTOP)
                seen += _take(it, 30)
                assert seen == list(range(40))
                deadline = time.monotonic() + 30  # bounded: give the liveness check time to find the hung one
                while reader.stats().hung_ejections == 0 and len(seen) < 150 and time.monotonic() < deadline:
                    seen += _take(it, 1)
                ejected = {e: s["ejections"] for e, s in reader.stats().teachers["teachers"].items()}
                del it
            finally:
                reader.close()
            _assert_released(refs, before)
        assert ejected[procs[0][1]["endpoint"]] > 0, f"the killed teacher was ejected: {ejected}"
