"""etcd faults while students train through registered teachers (real etcd, real teacher-servers).

The registry is for finding teachers, not for serving them: while etcd is down, students keep
their last snapshot and train on; when etcd comes back (same data, or wiped and empty), teachers
register again by themselves and students see teachers that join afterwards.
"""

from __future__ import annotations

import contextlib
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from discovery.local_etcd import LocalEtcd
from distill import DistillReader
from distill.router import RouterConfig
from tests.etcd_fixtures import arun, unique_service
from tests.faults.helpers import (
    PacedLoader,
    assert_exactly_once,
    registered,
    report_stall,
    run_epoch,
    start_teachers,
    stats_for,
    wait_until,
)

DEADLINE_S = 5.0
# etcd's floor: with its default election timeout it grants no lease shorter than 2 s.
TTL_S = 2.0
PACE_S = 0.02
ENV = {"TEST_SLEEP_MS": "5"}

RecordProperty = Callable[[str, object], None]


def _teacher_args(etcd: LocalEtcd, service: str, instance_id: str) -> list[str]:
    return ["--model", "tests.models:sleepy", "--name", "affine", "--device", "cpu", "--max-batch-size", "8",
            "--registry", etcd.address, "--service", service, "--instance-id", instance_id, "--ttl", str(TTL_S)]


@dataclass
class _Mesh:
    """One etcd and two registered teachers (t-a, t-b), shared by the module's tests: each test
    kills and restarts the etcd, and the teachers must come back by themselves every time."""

    etcd: LocalEtcd
    service: str
    tmp: Path


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[_Mesh]:
    tmp = tmp_path_factory.mktemp("etcd-faults")
    service = unique_service("etcd-fault")
    etcd = LocalEtcd(tmp / "etcd").start()
    with contextlib.ExitStack() as stack:
        stack.callback(etcd.close)
        start_teachers(stack, [_teacher_args(etcd, service, "t-a"), _teacher_args(etcd, service, "t-b")], tmp,
                       env=ENV)
        yield _Mesh(etcd, service, tmp)


def _ids(etcd: LocalEtcd, service: str) -> set[str]:
    try:
        return set(arun(registered(etcd.address, service), timeout=10))
    except Exception:  # etcd still starting: not registered yet, as far as this check goes
        return set()


class _Deliveries:
    """Delivery times of the training loop, to count batches trained while the fault lasted (and
    before, during, after: the semantics are that training went on, not how fast)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def between(self, start: float, end: float) -> int:
        return sum(start <= t < end for t in self.times)


def _etcd_outage(mesh: _Mesh, record_property: RecordProperty, outage_s: float, wipe: bool) -> None:
    etcd, service, tmp_path = mesh.etcd, mesh.service, mesh.tmp
    if not etcd.running:  # a test that failed mid-outage left it down
        etcd.restart()
    with contextlib.ExitStack() as stack:
        wait_until(lambda: _ids(etcd, service) == {"t-a", "t-b"}, 15, "both teachers registered")
        loader = PacedLoader(max_batches=int((outage_s + 60) / PACE_S), pace_s=PACE_S, tail=30)
        reader = stack.enter_context(DistillReader(
            loader, registry=etcd.address, service=service, inputs=["X"], timeout=DEADLINE_S,
            router=RouterConfig(backoff_max_s=0.5)))
        deliveries = _Deliveries()
        marks: dict[str, float] = {}
        joined: dict[str, str] = {}
        errors: list[BaseException] = []

        def fault() -> None:
            """Runs beside the training loop: down, wait, up, then check what must have recovered."""
            try:
                marks["down"] = time.monotonic()
                etcd.kill()
                if wipe:
                    shutil.rmtree(etcd.data_dir)  # a new, empty cluster on the same port
                time.sleep(outage_s)
                etcd.restart()
                marks["up"] = time.monotonic()
                wait_until(lambda: _ids(etcd, service) >= {"t-a", "t-b"}, 30, "teachers registered again")
                marks["reregistered"] = time.monotonic()
                if wipe:
                    # A teacher that joins the new cluster must reach the student that watched the old one.
                    (_, info), = start_teachers(stack, [_teacher_args(etcd, service, "t-c")], tmp_path, env=ENV)
                    joined["endpoint"] = info["endpoint"]
                    wait_until(lambda: int(stats_for(reader, service, info["endpoint"]).get("samples", 0)) > 0,
                               20, "the student uses the teacher that joined after the wipe")
                else:
                    # Still there after more than a TTL: the leases are kept alive again, not stale.
                    time.sleep(TTL_S + 1)
                    assert _ids(etcd, service) == {"t-a", "t-b"}, "a teacher's registration lapsed"
                marks["done"] = time.monotonic()
            except BaseException as e:
                errors.append(e)
            finally:
                loader.stop.set()

        thread = threading.Thread(target=fault, daemon=True, name="etcd-fault")

        def on_batch(i: int) -> None:
            deliveries.times.append(time.monotonic())
            if i == 30:
                thread.start()

        result = run_epoch(reader, on_batch)
        thread.join(outage_s + 90)
        report_stall(record_property, f"etcd {'wiped' if wipe else 'SIGKILLed'} for {outage_s:g} s", result)
    assert not errors, errors[0]
    # Nothing lost, duplicated or out of order, every output right (run_epoch checked each one).
    assert_exactly_once(result, loader.count)
    trained = deliveries.between(marks["down"], marks["up"])
    record_property("batches_while_etcd_down", trained)
    record_property("reregister_s", round(marks["reregistered"] - marks["up"], 3))
    print(f"[fault] {trained} batches trained while etcd was down; teachers back "
          f"{marks['reregistered'] - marks['up']:.2f} s after etcd")
    # Training went on through the outage: batches came in its second half too, so the loop did not
    # merely drain what was in flight when etcd died (how many is a benchmark's business, not this
    # test's), and it went on after etcd came back.
    middle = (marks["down"] + marks["up"]) / 2
    assert deliveries.between(middle, marks["up"]) > 0, (
        f"no batch trained in the second half of the {outage_s:g} s etcd outage ({trained} in all while it was "
        "down): the training loop waited for etcd"
    )
    assert deliveries.between(marks["up"], float("inf")) > 0, "no batch trained after etcd came back"


@pytest.mark.timeout(90)
def test_etcd_sigkilled_then_restarted_on_same_data(mesh: _Mesh, record_property: RecordProperty) -> None:
    """The compressed form that runs on every change: down for longer than a lease TTL."""
    _etcd_outage(mesh, record_property, outage_s=TTL_S + 1, wipe=False)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_etcd_sigkilled_for_ten_ttls_then_restarted(mesh: _Mesh, record_property: RecordProperty) -> None:
    """The long outage: ten lease TTLs, four times the retry backoff's cap (5 s), so every client
    retries at its cap for a while; teachers must come back without help."""
    _etcd_outage(mesh, record_property, outage_s=10 * TTL_S, wipe=False)


@pytest.mark.timeout(90)
def test_etcd_restarted_with_a_wiped_data_dir(mesh: _Mesh, record_property: RecordProperty) -> None:
    """All keys and leases are gone and revisions restart from 1: teachers re-register, the
    student's watch re-syncs to the new cluster and picks up a teacher that joins after it."""
    _etcd_outage(mesh, record_property, outage_s=2.0, wipe=True)
