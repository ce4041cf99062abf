"""Per-sample routing and the autoscaler: a real etcd, two expert services of real teacher-server
processes, and a routing student whose rows go 80/20 between them. Each service's published
demand is the student's in proportion to the rows routed there, so the autoscaler sizes each
expert's pool by its own share."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from discovery import open_registry
from discovery.local_etcd import LocalEtcd
from distill import DistillReader
from distill.autoscale.inputs import ScaleSnapshot, StudentSample, TeacherSample
from distill.autoscale.policy import PolicyConfig, PolicyState, decide
from tests.etcd_fixtures import arun, unique_service
from tests.models import Affine, Affine2
from tests.servers import teacher_process

pytestmark = pytest.mark.slow

ARGS = ["--device", "cpu", "--max-batch-size", "16", "--name", "expert", "--ttl", "3"]
ROWS = 10  # per batch: 8 to math, 2 to code


class Student(threading.Thread):
    """A training loop on its own thread, each batch's rows 80/20 between the two experts."""

    def __init__(self, registry: str, services: tuple[str, str]) -> None:
        super().__init__(name="test-route-student", daemon=True)
        self.registry, self.services = registry, services
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.reader: DistillReader | None = None
        self.batches = 0
        self.routed: dict[str, dict[str, int]] = {}

    def _loader(self) -> Iterator[dict[str, Any]]:
        g = torch.Generator().manual_seed(0)
        for _ in range(100_000):
            if self.stop.is_set():
                return
            names = [self.services[0]] * 8 + [self.services[1]] * 2
            order = torch.randperm(ROWS, generator=g).tolist()
            yield {"X": torch.randn(ROWS, 8, generator=g), "teacher": [names[i] for i in order]}

    def run(self) -> None:
        math, code = Affine(), Affine2()
        try:
            with DistillReader(self._loader(), registry=self.registry, service=list(self.services), route_by="teacher",
                               inputs=["X"], timeout=5.0, prefetch=4, student_id="router-student") as reader:
                self.reader = reader
                for batch, out in reader:
                    to_math = torch.tensor([t == self.services[0] for t in batch["teacher"]]).unsqueeze(1)
                    with torch.inference_mode():
                        want = torch.where(to_math, math(batch["X"]), code(batch["X"]))
                    assert torch.allclose(out["Y"], want, atol=1e-5)
                    self.batches += 1
                    time.sleep(0.02)  # the student's own step
                self.routed = reader.stats().routed
        except BaseException as e:
            self.error = e


@pytest.mark.timeout(120)
def test_each_expert_gets_demand_in_proportion_to_its_rows(tmp_path: Path) -> None:
    math, code = unique_service("math"), unique_service("code")
    with LocalEtcd() as etcd, \
            teacher_process([*ARGS, "--model", "tests.models:affine", "--registry", etcd.address, "--service", math],
                            tmp_path), \
            teacher_process([*ARGS, "--model", "tests.models:affine2", "--registry", etcd.address, "--service", code],
                            tmp_path):
        student = Student(etcd.address, (math, code))
        student.start()

        async def demands() -> dict[str, tuple[float, float, int, int]]:
            registry = open_registry(etcd.address, timeout=2.0)
            try:
                deadline = time.monotonic() + 45
                while True:  # until both services hold a settled demand of the student, at most 45 s
                    got = {s: [(d.samples_per_s, d.wait_fraction, d.rows_routed, d.tokens_routed)
                               for d in await registry.demand(s)] for s in (math, code)}
                    rates = {s: v[0] for s, v in got.items() if v and v[0][0] > 0}
                    if len(rates) == 2 and student.batches > 60:
                        return rates
                    assert time.monotonic() < deadline, f"no demand on both services: {got}"
                    await asyncio.sleep(0.5)
            finally:
                await registry.close()

        try:
            rates = arun(demands(), timeout=60)
        finally:
            student.stop.set()
            student.join(30)
    assert student.error is None, repr(student.error)
    ratio = rates[math][0] / rates[code][0]
    assert 2.5 <= ratio <= 6.0, f"demand should follow the 80/20 rows: {rates}"
    routed = student.routed
    assert routed[math]["rows"] == 4 * routed[code]["rows"]
    # The rows routed so far reach the registry with the demand (what distill top shows per teacher).
    assert rates[math][2] > 0 and rates[code][2] > 0 and rates[math][2] >= 3 * rates[code][2], rates
    assert rates[math][3] == rates[math][2] and rates[code][3] == rates[code][2], rates  # one token per row
    # What the autoscaler's policy makes of it: with teachers that each serve the code share, the math
    # pool needs about four times as many. The proportion is the rates'; the student's measured wait
    # fraction says how loaded this machine was (it adds teachers when the student waits), so the
    # policy reads the rates with no wait.
    needed: dict[str, int] = {}
    for service, (rate, _wait, _rows, _tokens) in rates.items():
        snapshot = ScaleSnapshot(current=1, teachers=(TeacherSample("t", capacity=rates[code][0] / 0.8),),
                                 students=(StudentSample("router-student", rate, 0.0),))
        decision = decide(snapshot, PolicyConfig(min_teachers=1, max_teachers=16), PolicyState(), time.monotonic())
        assert decision.needed is not None, decision.reason
        needed[service] = decision.needed
    assert needed[code] == 1 and needed[math] >= 3, needed
