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
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from distill import DistillReader
from distill.router import RouterConfig
from teacher_server.launch import TeacherProcess, start_all
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
from tests.servers import REPO

pytestmark = pytest.mark.timeout(120)

DEADLINE_S = 5.0  # the reader's per-chunk deadline in these tests
MARGIN_S = 3.0  # scheduling slack on a loaded 2-core machine; far below the deadline it guards
# A teacher whose per-batch sleep a test can change while it runs (tests.faults.models.FlagSleepy).
FLAG_SLEEPY = ["--model", "tests.faults.models:flag_sleepy", "--name", "affine", "--device", "cpu",
               "--max-batch-size", "8", "--max-queue-delay-us", "0"]
FAST_MS = 5  # the per-batch sleep the shared teachers are left at between tests
FAST_ROUTER = RouterConfig(backoff_max_s=0.5)  # a teacher back on its port is re-probed within ~0.5 s
SERVICE = "teachers"  # the service name a static teacher list gets in reader.stats()

RecordProperty = Callable[[str, object], None]


@dataclass
class _Teacher:
    """A running FlagSleepy teacher-server and the file that sets its per-batch sleep."""

    endpoint: str
    port: int
    sleep_file: Path


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[_Teacher]]:
    """Two teacher processes shared by the module's tests; a test may slow one down (and must leave
    it at FAST_MS again) or cut the path to it, never stop it."""
    tmp = tmp_path_factory.mktemp("teacher-faults")
    files = [tmp / "sleep-a", tmp / "sleep-b"]
    for f in files:
        set_sleep_ms(f, FAST_MS)
    with contextlib.ExitStack() as stack:
        servers = start_all(stack, [TeacherProcess(FLAG_SLEEPY, env={SLEEP_FILE_ENV: str(f)}, cwd=REPO,
                                                   log=tmp / f"{f.name}.log", ready_timeout=90, stop_grace=5.0)
                                    for f in files])
        yield [_Teacher(s.endpoint, int(s.ready["port"]), f) for s, f in zip(servers, files, strict=True)]


def _own_teacher(tmp_path: Path) -> tuple[list[str], dict[str, str]]:
    """Args and env for a FlagSleepy teacher of the test's own, at FAST_MS."""
    sleep_file = tmp_path / "sleep-own"
    set_sleep_ms(sleep_file, FAST_MS)
    return FLAG_SLEEPY, {SLEEP_FILE_ENV: str(sleep_file)}


def test_teacher_sigkilled_three_times_in_one_epoch(pair: list[_Teacher], tmp_path: Path,
                                                   record_property: RecordProperty) -> None:
    """One teacher crashes three times; between crashes it comes back on the same port and serves
    again. Chunks it held are re-sent elsewhere: nothing lost, nothing delivered twice."""
    stable = pair[0]
    args, env = _own_teacher(tmp_path)
    with contextlib.ExitStack() as stack:
        (first_proc, victim), = start_teachers(stack, [args], tmp_path, env=env)
        respawn = Respawner([*args, "--port", str(victim["port"])], tmp_path, env=env)
        stack.callback(respawn.close)
        # The epoch ends 40 batches after the third kill; the cap (~2 min of batches) only bounds a
        # run where a restart never serves: on 2 busy cores one restart can take 10+ s.
        loader = PacedLoader(max_batches=6000, pace_s=0.02, tail=40)
        reader = stack.enter_context(DistillReader(
            loader, teachers=f"{stable.endpoint},{victim['endpoint']}", inputs=["X"], timeout=DEADLINE_S,
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


def test_teacher_latency_jumps_tenfold_mid_epoch(pair: list[_Teacher], record_property: RecordProperty) -> None:
    """A teacher goes from 20 ms to 200 ms per batch (thermal throttling, a noisy neighbour): no
    chunk is lost or doubled by hedging, and the router moves most of the work to the other one."""
    slow, fast = pair
    with contextlib.ExitStack() as stack:
        for t in pair:
            set_sleep_ms(t.sleep_file, 20)
            stack.callback(set_sleep_ms, t.sleep_file, FAST_MS)
        loader = PacedLoader(max_batches=240)
        reader = stack.enter_context(DistillReader(
            loader, teachers=f"{slow.endpoint},{fast.endpoint}", inputs=["X"], timeout=DEADLINE_S, prefetch=4))
        at_jump: dict[str, dict[str, object]] = {}

        def on_batch(i: int) -> None:
            if i == 40:
                at_jump.update({t.endpoint: stats_for(reader, SERVICE, t.endpoint) for t in pair})
                set_sleep_ms(slow.sleep_file, 200)  # the slow one becomes ten times slower

        result = run_epoch(reader, on_batch)
        end = {t.endpoint: stats_for(reader, SERVICE, t.endpoint) for t in pair}
        hedges = reader.stats().hedges
        report_stall(record_property, "teacher latency 10x", result)
    assert_exactly_once(result, loader.count)
    after = {ep: int(end[ep]["samples"]) - int(at_jump[ep]["samples"]) for ep in end}  # type: ignore[call-overload]
    print(f"[fault] samples after the jump: {after}, hedges {hedges}")
    assert after[fast.endpoint] > after[slow.endpoint], f"the slowed teacher kept its share: {after}"
    assert result.max_stall_s < DEADLINE_S + MARGIN_S, f"a slow teacher cost {result.max_stall_s:.2f} s"


def test_teacher_port_refuses_connections_mid_epoch(pair: list[_Teacher], record_property: RecordProperty) -> None:
    """The path to a teacher breaks (open connections reset, new ones refused: a firewall rule, a
    dead node's port) while the process lives on; later the path comes back and the teacher is
    used again."""
    direct, behind = pair
    with contextlib.ExitStack() as stack:
        loop = stack.enter_context(LoopThread())
        proxy = loop.run(TcpProxy(behind.port).start())
        stack.callback(lambda: loop.run(proxy.close()))
        loader = PacedLoader(max_batches=3000, pace_s=0.01, tail=20)
        reader = stack.enter_context(DistillReader(
            loader, teachers=f"{direct.endpoint},{proxy.endpoint}", inputs=["X"], timeout=DEADLINE_S,
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
