"""Teacher faults during one epoch, with real ``teacher-server`` processes.

Each test checks: every batch exactly once and in order, outputs equal to the in-process model's,
and the longest stall of the training loop, printed and attached to the JUnit record as
``max_stall_s``. Stall bounds are semantic (about one chunk deadline), never speed targets.

Not repeated here (tests/test_reader.py and tests/test_registry_e2e.py have them): two SIGKILLs
in an epoch, SIGSTOP/SIGCONT, SIGTERM drain, a straggler from the start, a teacher joining.
"""

from __future__ import annotations

import contextlib
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from distill import DistillReader
from distill.router import RouterConfig
from tests.etcd_fixtures import TcpProxy
from tests.faults.helpers import (
    LoopThread,
    PacedLoader,
    Respawner,
    assert_exactly_once,
    report_stall,
    run_epoch,
    start_teachers,
    stats_for,
)
from tests.faults.models import SLEEP_FILE_ENV, set_sleep_ms

pytestmark = pytest.mark.timeout(120)

DEADLINE_S = 5.0  # the reader's per-chunk deadline in these tests
MARGIN_S = 3.0  # scheduling slack on a loaded 2-core machine; far below the deadline it guards
SLEEPY = ["--model", "tests.models:sleepy", "--name", "affine", "--device", "cpu", "--max-batch-size", "8",
          "--max-queue-delay-us", "0"]
FAST_ENV = {"TEST_SLEEP_MS": "5"}
FAST_ROUTER = RouterConfig(backoff_max_s=0.5)  # a teacher back on its port is re-probed within ~0.5 s
SERVICE = "teachers"  # the service name a static teacher list gets in reader.stats()

RecordProperty = Callable[[str, object], None]


def test_teacher_sigkilled_three_times_in_one_epoch(tmp_path: Path, record_property: RecordProperty) -> None:
    """One teacher crashes three times; between crashes it comes back on the same port and serves
    again. Chunks it held are re-sent elsewhere: nothing lost, nothing delivered twice."""
    with contextlib.ExitStack() as stack:
        (_, stable), (first_proc, victim) = start_teachers(stack, [SLEEPY, SLEEPY], tmp_path, env=FAST_ENV)
        respawn = Respawner([*SLEEPY, "--port", str(victim["port"])], tmp_path, env=FAST_ENV)
        stack.callback(respawn.close)
        # The epoch ends 40 batches after the third kill; the cap (~2 min of batches) only bounds a
        # run where a restart never serves: on 2 busy cores one restart can take 10+ s.
        loader = PacedLoader(max_batches=12000, pace_s=0.01, tail=40)
        reader = stack.enter_context(DistillReader(
            loader, teachers=f"{stable['endpoint']},{victim['endpoint']}", inputs=["X"], timeout=DEADLINE_S,
            router=FAST_ROUTER))
        victim_proc = first_proc
        kills: list[int] = []
        ok_base = 0

        def on_batch(i: int) -> None:
            nonlocal victim_proc, ok_base
            if len(kills) == 3 or (kills and not respawn.ready.is_set()):
                return
            if kills:
                assert respawn.error is None, respawn.error
                assert respawn.current is not None
                victim_proc = respawn.current[0]
            # Kill only once the (re)started victim has really served: each kill must hit a teacher
            # the student was using, with chunks in flight.
            if int(stats_for(reader, SERVICE, victim["endpoint"]).get("ok", 0)) < ok_base + 5:
                return
            victim_proc.send_signal(signal.SIGKILL)
            victim_proc.wait(10)
            kills.append(i)
            if len(kills) < 3:
                ok_base = int(stats_for(reader, SERVICE, victim["endpoint"]).get("ok", 0))
                respawn.start()
            else:
                loader.stop.set()

        result = run_epoch(reader, on_batch)
        report_stall(record_property, "teacher SIGKILLed 3x", result)
    assert len(kills) == 3, f"the epoch ended after {len(kills)} kills (at batches {kills})"
    assert_exactly_once(result, loader.count)
    assert result.max_stall_s < DEADLINE_S + MARGIN_S, f"a crash cost {result.max_stall_s:.2f} s"


def test_teacher_latency_jumps_tenfold_mid_epoch(tmp_path: Path, record_property: RecordProperty) -> None:
    """A teacher goes from 20 ms to 200 ms per batch (thermal throttling, a noisy neighbour): no
    chunk is lost or doubled by hedging, and the router moves most of the work to the other one."""
    files = [tmp_path / "sleep-a", tmp_path / "sleep-b"]
    for f in files:
        set_sleep_ms(f, 20)
    args = ["--model", "tests.faults.models:flag_sleepy", "--name", "affine", "--device", "cpu",
            "--max-batch-size", "8", "--max-queue-delay-us", "0"]
    with contextlib.ExitStack() as stack:
        # Different env per teacher: start them one after the other (two torch imports, ~2x 3 s).
        (_, slow), = start_teachers(stack, [args], tmp_path, env={SLEEP_FILE_ENV: str(files[0])})
        (_, fast), = start_teachers(stack, [args], tmp_path, env={SLEEP_FILE_ENV: str(files[1])})
        loader = PacedLoader(max_batches=240)
        reader = stack.enter_context(DistillReader(
            loader, teachers=f"{slow['endpoint']},{fast['endpoint']}", inputs=["X"], timeout=DEADLINE_S,
            prefetch=4))
        at_jump: dict[str, dict[str, object]] = {}

        def on_batch(i: int) -> None:
            if i == 40:
                at_jump.update({ep: stats_for(reader, SERVICE, ep) for ep in (slow["endpoint"], fast["endpoint"])})
                set_sleep_ms(files[0], 200)  # the slow one becomes ten times slower

        result = run_epoch(reader, on_batch)
        end = {ep: stats_for(reader, SERVICE, ep) for ep in (slow["endpoint"], fast["endpoint"])}
        hedges = reader.stats().hedges
        report_stall(record_property, "teacher latency 10x", result)
    assert_exactly_once(result, loader.count)
    after = {ep: int(end[ep]["samples"]) - int(at_jump[ep]["samples"]) for ep in end}  # type: ignore[call-overload]
    print(f"[fault] samples after the jump: {after}, hedges {hedges}")
    assert after[fast["endpoint"]] > after[slow["endpoint"]], f"the slowed teacher kept its share: {after}"
    assert result.max_stall_s < DEADLINE_S + MARGIN_S, f"a slow teacher cost {result.max_stall_s:.2f} s"


def test_teacher_port_refuses_connections_mid_epoch(tmp_path: Path, record_property: RecordProperty) -> None:
    """The path to a teacher breaks (open connections reset, new ones refused: a firewall rule, a
    dead node's port) while the process lives on; later the path comes back and the teacher is
    used again."""
    with contextlib.ExitStack() as stack:
        (_, direct), (_, behind) = start_teachers(stack, [SLEEPY, SLEEPY], tmp_path, env=FAST_ENV)
        loop = stack.enter_context(LoopThread())
        proxy = loop.run(TcpProxy(behind["port"]).start())
        stack.callback(lambda: loop.run(proxy.close()))
        loader = PacedLoader(max_batches=3000, pace_s=0.01, tail=20)
        reader = stack.enter_context(DistillReader(
            loader, teachers=f"{direct['endpoint']},{proxy.endpoint}", inputs=["X"], timeout=DEADLINE_S,
            router=FAST_ROUTER))
        phase = {"cut_at": -1, "resumed_at": -1, "ok_at_resume": 0}

        def ok_behind() -> int:
            return int(stats_for(reader, SERVICE, proxy.endpoint).get("ok", 0))

        def on_batch(i: int) -> None:
            if phase["cut_at"] < 0 and ok_behind() >= 5:
                loop.run(proxy.cut())
                phase["cut_at"] = i
            elif phase["cut_at"] >= 0 > phase["resumed_at"] and i >= phase["cut_at"] + 100:
                phase["ok_at_resume"] = ok_behind()
                loop.run(proxy.resume())
                phase["resumed_at"] = i
            elif phase["resumed_at"] >= 0 and not loader.stop.is_set() and ok_behind() > phase["ok_at_resume"]:
                loader.stop.set()  # it serves again: the fault is over

        t0 = time.monotonic()
        result = run_epoch(reader, on_batch)
        report_stall(record_property, "teacher port refuses connections", result)
        print(f"[fault] cut at batch {phase['cut_at']}, resumed at {phase['resumed_at']}, "
              f"epoch {time.monotonic() - t0:.1f} s")
    assert phase["cut_at"] >= 0 and phase["resumed_at"] >= 0, phase
    assert loader.stop.is_set(), "the teacher behind the restored path never served again"
    assert_exactly_once(result, loader.count)
    assert result.max_stall_s < DEADLINE_S + MARGIN_S, f"a refused port cost {result.max_stall_s:.2f} s"
