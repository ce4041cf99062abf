"""The controller end to end with the local backend: a real etcd, real teacher-server processes
(``tests.models:sleepy``, an emulated accelerator that sleeps 50 ms per batch of at most 16), and
a real student (``DistillReader`` on the registry) whose training step we speed up and slow down.

Demand up -> a teacher is added in one step; demand down -> after the down window the least
loaded teacher is drained (SIGTERM, exit code 0) while the student keeps training, and the student
sees every batch exactly once, in order, with correct teacher outputs.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from benchmarks.autoscale.pools import DecisionFollower
from discovery import open_registry
from discovery.local_etcd import LocalEtcd
from distill import DistillReader
from distill.autoscale import Controller, ControllerConfig, LocalBackend, PolicyConfig
from distill.autoscale.errors import BackendError
from tests.etcd_fixtures import REPO, arun, unique_service
from tests.models import affine

pytestmark = pytest.mark.slow

BATCH = 16
TEACHER = [
    sys.executable, "-m", "teacher_server", "--model", "tests.models:sleepy", "--name", "sleepy",
    # One instance: the sleepy model stands for one accelerator, whose capacity the test sizes against.
    "--max-batch-size", str(BATCH), "--max-queue-delay-us", "0", "--threads", "1", "--instances", "1", "--ttl", "3",
    "--drain-grace", "10", "--log-level", "WARNING",
]  # fmt: skip
TEACHER_ENV = {"TEST_SLEEP_MS": "50", "PYTHONPATH": str(REPO)}


class Student(threading.Thread):
    """A training loop on its own thread: pulls batches through a DistillReader, checks every
    teacher output, and sleeps ``step`` seconds per batch (its own compute)."""

    def __init__(self, registry: str, service: str, step: float) -> None:
        super().__init__(name="test-student", daemon=True)
        self.registry, self.service, self.step = registry, service, step
        self.stop = threading.Event()
        self.seen: list[int] = []
        self.error: BaseException | None = None
        self.reader: DistillReader | None = None
        self._model = affine()

    def _loader(self) -> Iterator[dict[str, Any]]:
        g = torch.Generator().manual_seed(0)
        i = 0
        while not self.stop.is_set() and i < 100_000:
            yield {"X": torch.randn(BATCH, 8, generator=g), "i": i}
            i += 1

    def run(self) -> None:
        try:
            with DistillReader(
                self._loader(), registry=self.registry, service=self.service, inputs=["X"], outputs=["Y"],
                timeout=5.0, no_teacher_timeout=60.0, prefetch=4, student_id=f"student-{self.service}",
            ) as reader:  # fmt: skip
                self.reader = reader
                for batch, out in reader:
                    with torch.inference_mode():
                        want = self._model(batch["X"])
                    assert torch.allclose(out["Y"], want, atol=1e-5), f"wrong teacher output for batch {batch['i']}"
                    self.seen.append(batch["i"])
                    time.sleep(self.step)
        except BaseException as e:
            self.error = e


def _changes(values: list[int]) -> list[int]:
    """`values` without consecutive repeats: the successive desired counts."""
    return [v for i, v in enumerate(values) if i == 0 or v != values[i - 1]]


async def wait_for(what: str, check: Any, timeout: float, ctl: Controller) -> float:
    start = time.monotonic()
    while not check():
        if time.monotonic() - start > timeout:
            reasons = "\n".join(d.reason for d in list(ctl.decisions)[-15:])
            raise AssertionError(f"{what}: not within {timeout} s; last decisions:\n{reasons}")
        await asyncio.sleep(0.1)
    return time.monotonic() - start


async def exercise(controller: Controller, backend: LocalBackend, student: Student) -> None:
    service = controller.service

    def ready(n: int) -> Any:
        return lambda: len(controller.teachers or {}) == n

    await wait_for("first teacher registered", ready(1), 60, controller)
    student.start()
    up = await wait_for("scaled up", lambda: len(backend.processes) >= 2, 40, controller)
    ups = [d for d in controller.decisions if d.action == "up"]
    assert len(ups) == 2 and ups[0].desired == 1, [d.reason for d in ups]  # min, then demand
    assert ups[1].cause == "demand" and ups[1].desired == ups[1].needed, ups[1].reason  # one step to the need
    assert 2 <= ups[1].desired <= 3, ups[1].reason  # ~400 / (320 x 0.8) = 1.6
    await wait_for("new teachers registered", ready(ups[1].desired), 60, controller)
    assert len([d for d in controller.decisions if d.action == "up"]) == 2  # no double scale-up
    batches_before = len(student.seen)

    student.step = 0.3  # demand drops to ~50 samples/s: one teacher is plenty
    await wait_for("drained back to 1", lambda: len(backend.processes) == 1 and not backend.draining, 60, controller)
    downs = [d for d in controller.decisions if d.action == "down"]
    assert downs and downs[-1].desired == 1, [d.reason for d in downs]
    assert set(backend.stopped.values()) == {0}, backend.stopped  # clean drains, not SIGKILL
    more = len(student.seen)
    await wait_for("student still training", lambda: len(student.seen) >= more + 5, 20, controller)
    assert len(student.seen) > batches_before

    url = f"http://127.0.0.1:{controller.metrics.port}/metrics"
    page = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read().decode())
    for name in ("desired_teachers", "current_teachers", "ready_teachers", "demand_samples_per_second",
                 "capacity_samples_per_second", "leader"):  # fmt: skip
        assert f'distill_autoscaler_{name}{{service="{service}"}}' in page, name
    assert f'distill_autoscaler_desired_teachers{{service="{service}"}} 1.0' in page
    assert f'distill_autoscaler_scale_events_total{{direction="up",service="{service}"}} 2.0' in page
    # The leader publishes its last decision for `distill top`, bound to its lease.
    got = await controller.registry.client().get(f"/distill/v1/{service}/autoscaler/decision".encode())
    published = json.loads(got.value)
    assert published["desired"] == 1 and published["action"] in ("down", "hold") and published["reason"]
    # ... and with it the last scale that landed, however many decisions came after it.
    last = published["last_scale"]
    assert (last["action"], last["to"], last["reason"]) == ("down", 1, downs[-1].reason), last
    assert last["from"] > 1 and last["at"] <= published["at"]
    print(f"scale-up decided {up:.1f} s after the student started")


# Real teacher processes scaled up and drained down: on a machine whose cores are busy with other
# work, starting them and the down window take minutes, not seconds; the test checks what happens,
# not how fast (W4 measures that), so it has a budget of its own beyond the suite's 120 s.
@pytest.mark.timeout(330)
def test_demand_up_adds_teachers_demand_down_drains_them_without_failed_requests() -> None:
    service = unique_service("auto")
    with LocalEtcd() as etcd:
        student = Student(etcd.address, service, step=0.04)  # wants ~400 samples/s; one teacher gives ~320

        async def scenario() -> None:
            registry = open_registry(etcd.address, timeout=2.0)
            backend = LocalBackend(TEACHER, registry=etcd.address, service=service, grace=20, env=TEACHER_ENV)
            policy = PolicyConfig(min_teachers=1, max_teachers=3, up_window=1.0, down_window=4.0, max_step=2)
            config = ControllerConfig(service, period=0.5, election_ttl=2, metrics_port=0, metrics_host="127.0.0.1")
            controller = Controller(registry, backend, policy, config)
            # What the W4 benchmark reads instead of the autoscaler's log: the published decisions.
            follower = DecisionFollower(registry, service, poll_s=0.1)
            try:
                async with controller:
                    following = asyncio.get_running_loop().create_task(follower.follow())
                    try:
                        await exercise(controller, backend, student)
                    finally:  # stop the student while teachers still serve its prefetched batches
                        following.cancel()
                        with contextlib.suppress(asyncio.CancelledError):
                            await following
                        student.stop.set()
                        if student.is_alive():
                            await asyncio.to_thread(student.join, 30)
            finally:
                await registry.close()
            assert not backend.processes and not backend.draining
            followed = follower.decisions(0.0)
            assert followed == sorted(followed, key=lambda d: d["t"])
            made = [d.desired for d in controller.decisions]
            assert _changes([d["desired"] for d in followed]) == _changes(made), (followed, made)
            assert {d["action"] for d in followed} >= {"up", "down"}

        arun(scenario(), timeout=300)
    assert not student.is_alive()
    assert student.error is None, repr(student.error)
    assert student.seen == list(range(len(student.seen))), "batches lost, duplicated or out of order"
    assert student.reader is not None and student.reader.stats().fallback_batches == 0


def test_the_follower_rebuilds_a_scale_whose_decision_it_never_saw() -> None:
    """A poll that comes after the next period's decision still learns of the scale, from last_scale;
    one that saw the scaling decision itself does not count it twice."""
    follower = DecisionFollower(None, "svc")
    scale = {"action": "up", "from": 1, "to": 2, "cause": "demand", "reason": "scale up 1 -> 2: busy", "at": 10.0}
    follower._note({"action": "hold", "cause": "steady", "current": 1, "desired": 1, "reason": "hold 1: ok",
                    "at": 5.0}, 0.0)
    follower._note({"action": "hold", "cause": "starting", "current": 2, "desired": 2, "reason": "hold 2: up",
                    "at": 11.0, "last_scale": scale}, 0.0)
    seen = [(d["action"], d["from"], d["desired"], d["cause"], d["t"]) for d in follower.decisions(0.0)]
    assert seen == [("hold", 1, 1, "steady", 5.0), ("up", 1, 2, "demand", 10.0), ("hold", 2, 2, "starting", 11.0)]
    down = {"action": "down", "from": 2, "to": 1, "cause": "demand", "reason": "scale down 2 -> 1: idle", "at": 20.0}
    follower._note({"action": "down", "cause": "demand", "current": 2, "desired": 1, "reason": down["reason"],
                    "at": 20.0, "last_scale": down}, 0.0)
    follower._note({"action": "hold", "cause": "steady", "current": 1, "desired": 1, "reason": "hold 1: ok",
                    "at": 21.0, "last_scale": down}, 0.0)
    assert [(d["action"], d["desired"]) for d in follower.decisions(0.0)][3:] == [("down", 1), ("hold", 1)]


def test_crashed_teacher_is_replaced_and_close_stops_everything() -> None:
    service = unique_service("crash")
    with LocalEtcd() as etcd:

        async def scenario() -> None:
            registry = open_registry(etcd.address, timeout=2.0)
            backend = LocalBackend(TEACHER, registry=etcd.address, service=service, grace=10, env=TEACHER_ENV,
                                   supervise_interval=0.1)  # fmt: skip
            policy = PolicyConfig(min_teachers=2, max_teachers=2)
            controller = Controller(registry, backend, policy, ControllerConfig(service, period=0.5, election_ttl=2))
            pids: dict[str, int] = {}
            try:
                async with controller:
                    await wait_for("two teachers running", lambda: len(backend.processes) == 2, 10, controller)
                    pids = dict(backend.processes)
                    victim = next(iter(pids))
                    os.kill(pids[victim], signal.SIGKILL)
                    await wait_for("crash noticed", lambda: backend.crashes == 1, 10, controller)
                    await wait_for("replaced", lambda: len(backend.processes) == 2, 10, controller)
                    assert victim not in backend.processes
                    assert all(d.desired == 2 for d in controller.decisions)
            finally:
                await registry.close()
            assert not backend.processes and not backend.draining
            for pid in pids.values():  # every process it started is gone (reaped)
                with pytest.raises(ProcessLookupError):
                    os.kill(pid, 0)

        arun(scenario(), timeout=60)


@pytest.mark.parametrize(
    ("command", "kwargs", "message"),
    [
        ([], {}, "needs a teacher command"),
        (["teacher-server", "--model", "{model}"], {}, "unknown placeholder {model}"),
        (["teacher-server", "--x", "{port"], {}, "bad braces"),
        (["no-such-binary-xyz"], {}, "not found on PATH"),
        (["teacher-server"], {"devices": ["gpu0"]}, "unknown device"),
        (["teacher-server"], {"devices": ["cuda:0", "cuda:0"]}, "listed twice"),
        (["teacher-server"], {"grace": 0}, "grace"),
    ],
)
def test_bad_local_backend_configuration_is_rejected(command: list[str], kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(BackendError, match=message):
        LocalBackend(command, registry="etcd://127.0.0.1:2379", service="s", **kwargs)


def test_template_gets_the_missing_flags_and_devices_are_spread() -> None:
    b = LocalBackend(
        ["teacher-server", "--model", "m:f", "--port={port}"], registry="etcd://h:1", service="svc",
        devices=["cuda:0", "cuda:1"],
    )  # fmt: skip
    argv = b.argv(port=5, device="cuda:1", instance_id="i1")
    assert argv[-11:] == ["--model", "m:f", "--port=5", "--device", "cuda:1", "--instance-id", "i1",
                          "--registry", "etcd://h:1", "--service", "svc"]  # fmt: skip
    assert argv.count("--port=5") == 1 and "--port" not in argv
    assert b.limit == 2
    assert LocalBackend(["teacher-server"], registry="etcd://h:1", service="s").limit is None


def test_min_above_device_slots_fails_at_start() -> None:
    backend = LocalBackend(["teacher-server"], registry="etcd://127.0.0.1:1", service="s", devices=["cuda:0"])
    registry = open_registry("etcd://127.0.0.1:1")
    controller = Controller(registry, backend, PolicyConfig(min_teachers=2), ControllerConfig("s"))

    async def go() -> None:
        try:
            await controller.start()
        finally:
            await controller.close()
            await registry.close()

    with pytest.raises(ValueError, match="do not fit"):
        arun(go(), timeout=20)
