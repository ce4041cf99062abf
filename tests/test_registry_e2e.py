"""Teachers registering in a real etcd, students finding them there: the mesh end to end."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import tritonclient.grpc as tg
from prometheus_client.parser import text_string_to_metric_families

from discovery import open_registry
from discovery.local_etcd import LocalEtcd
from distill import DistillReader, NoTeacherError
from tests.etcd_fixtures import arun, unique_service
from tests.faults.helpers import start_teachers
from tests.models import Affine
from tests.servers import teacher_process

AFFINE = Affine()
ARGS = ["--model", "tests.models:sleepy", "--name", "affine", "--device", "cpu", "--max-batch-size", "8",
        "--ttl", "3"]
ENV = {"TEST_SLEEP_MS": "5"}


@pytest.fixture(scope="module")
def etcd() -> Iterator[LocalEtcd]:
    with LocalEtcd() as server:
        yield server


def _batches(n: int, rows: int = 8) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [{"X": torch.randn(rows, 8, generator=g), "idx": torch.full((rows,), i)} for i in range(n)]


def _registered(etcd: LocalEtcd, service: str) -> dict[str, object]:
    async def read() -> dict[str, object]:
        async with open_registry(etcd.address) as reg:
            snapshot = await reg.teachers(service)
            return {iid: entry for iid, entry in snapshot.items()}

    return arun(read())


def _demand_while_training(etcd: LocalEtcd, service: str) -> list[object]:
    """The demand published for ``service``, polled (at most 10 s) from inside a training loop,
    the reader open, until a student's report shows consumption (a publish comes every second)."""

    async def demand() -> list[object]:
        async with open_registry(etcd.address) as reg:
            return list(await reg.demand(service))

    deadline = time.monotonic() + 10
    while not (published := arun(demand())) or not published[0].samples_per_s:  # type: ignore[attr-defined]
        assert time.monotonic() < deadline, f"no demand with samples_per_s > 0 published: {published}"
        time.sleep(0.1)
    return published


def test_teacher_server_registers_publishes_load_and_deregisters_on_sigterm(etcd: LocalEtcd,
                                                                            tmp_path: Path) -> None:
    """The teacher's record and load, and the student's demand while it trains, in the registry;
    SIGTERM leaves no key behind."""
    service = unique_service("reg")
    args = [*ARGS, "--registry", etcd.address, "--service", service, "--instance-id", "t-1"]
    with teacher_process(args, tmp_path, env=ENV) as (proc, info):
        entries = _registered(etcd, service)
        assert list(entries) == ["t-1"]
        rec = entries["t-1"].record  # type: ignore[attr-defined]
        assert rec.endpoint == info["endpoint"] and rec.model_name == "affine" and rec.max_batch_size == 8
        assert [(t.name, t.datatype, list(t.shape)) for t in rec.inputs] == [("X", "FP32", [8])]
        # Traffic, then the published load shows a measured capacity.
        published: list[object] = []
        seen = 0
        with DistillReader(_batches(100), registry=etcd.address, service=service, inputs=["X"],
                           student_id="student-7") as reader:
            for batch, _ in reader:
                seen += 1
                if int(batch["idx"][0]) == 99:
                    published = _demand_while_training(etcd, service)
        assert seen == 100
        assert [d.student_id for d in published] == ["student-7"]  # type: ignore[attr-defined]
        assert published[0].samples_per_s > 0 and published[0].teachers_in_use == 1  # type: ignore[attr-defined]

        async def load_seen() -> float:
            async with open_registry(etcd.address) as reg:
                for _ in range(50):
                    loads = await reg.loads(service)
                    if "t-1" in loads and loads["t-1"].capacity_samples_per_s > 0:
                        return loads["t-1"].capacity_samples_per_s
                    await asyncio.sleep(0.1)
            return 0.0

        assert arun(load_seen()) > 0
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    assert _registered(etcd, service) == {}, "a drained teacher leaves no key behind"


def _in_flight(metrics_port: int) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    for fam in text_string_to_metric_families(text):
        if fam.name == "teacher_in_flight_request_count":
            return float(fam.samples[0].value)
    raise AssertionError("/metrics has no teacher_in_flight_request_count")


def test_drain_revokes_the_registry_entry_before_in_flight_requests_finish(etcd: LocalEtcd,
                                                                           tmp_path: Path) -> None:
    """SIGTERM with a 5 s request running: the key is gone while the request still runs (students
    stop choosing the teacher at once), then the request completes and the process exits 0."""
    service = unique_service("revoke")
    args = [*ARGS, "--registry", etcd.address, "--service", service, "--instance-id", "t-drain",
            "--metrics-port", "0"]
    with teacher_process(args, tmp_path, env={"TEST_SLEEP_MS": "5000"}) as (proc, info):
        assert list(_registered(etcd, service)) == ["t-drain"]
        x = torch.randn(2, 8, generator=torch.Generator().manual_seed(5))
        answer: list[object] = []
        done = threading.Event()

        def request() -> None:
            try:
                with tg.InferenceServerClient(info["endpoint"]) as c:
                    inp = tg.InferInput("X", [2, 8], "FP32")
                    inp.set_data_from_numpy(x.numpy())
                    answer.append(c.infer("affine", [inp], client_timeout=60).as_numpy("Y"))
            except BaseException as e:  # reported by the assertions below
                answer.append(e)
            finally:
                done.set()

        worker = threading.Thread(target=request, daemon=True)
        worker.start()
        deadline = time.monotonic() + 30
        while _in_flight(info["metrics_port"]) != 1:
            assert time.monotonic() < deadline and not done.is_set(), f"the request was not admitted: {answer}"
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        while _registered(etcd, service):
            assert time.monotonic() < deadline, "the registry entry outlived SIGTERM by 30 s"
            time.sleep(0.02)
        assert not done.is_set(), f"the request finished before the key was revoked: {answer}"
        assert done.wait(60) and len(answer) == 1
        assert not isinstance(answer[0], BaseException), f"the in-flight request failed on drain: {answer[0]}"
        with torch.inference_mode():
            assert torch.allclose(torch.from_numpy(answer[0]), AFFINE(x), atol=1e-5)  # type: ignore[arg-type]
        assert proc.wait(30) == 0
        worker.join(10)


def test_student_uses_a_teacher_that_joins_mid_epoch(etcd: LocalEtcd, tmp_path: Path) -> None:
    service = unique_service("join")
    joined = threading.Event()

    class SlowLoader:
        """Paced so the epoch outlasts the second teacher's start-up by a few seconds."""

        def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
            for b in _batches(400, rows=8):
                if joined.is_set():
                    time.sleep(0.01)
                yield b

    with contextlib.ExitStack() as stack:
        stack.enter_context(teacher_process([*ARGS, "--registry", etcd.address, "--service", service,
                                             "--instance-id", "first"], tmp_path, env=ENV))
        reader = stack.enter_context(DistillReader(SlowLoader(), registry=etcd.address, service=service,
                                                   inputs=["X"], prefetch=2))
        seen = []
        second_endpoint = ""
        for batch, teacher in reader:
            i = int(batch["idx"][0])
            seen.append(i)
            assert torch.allclose(teacher["Y"], AFFINE(batch["X"]).detach(), atol=1e-5)
            if i == 20:
                _, info = stack.enter_context(teacher_process(
                    [*ARGS, "--registry", etcd.address, "--service", service, "--instance-id", "second"],
                    tmp_path, env=ENV))
                second_endpoint = info["endpoint"]
                joined.set()
        stats = reader.stats()
    assert seen == list(range(400))
    assert stats.teachers[service][second_endpoint]["samples"] > 0, "the new teacher got work mid-epoch"


def test_sigkilled_registered_teacher_loses_no_batch(etcd: LocalEtcd, tmp_path: Path) -> None:
    service = unique_service("kill")
    with contextlib.ExitStack() as stack:
        procs = start_teachers(stack, [[*ARGS, "--registry", etcd.address, "--service", service]] * 2, tmp_path,
                               env=ENV)
        reader = stack.enter_context(DistillReader(_batches(120), registry=etcd.address, service=service,
                                                   inputs=["X"], timeout=5.0))
        seen = []
        for batch, teacher in reader:
            i = int(batch["idx"][0])
            seen.append(i)
            assert torch.allclose(teacher["Y"], AFFINE(batch["X"]).detach(), atol=1e-5)
            if i == 40:
                procs[0][0].send_signal(signal.SIGKILL)
    assert seen == list(range(120))


def test_empty_service_raises_no_teacher_error_naming_it(etcd: LocalEtcd) -> None:
    service = unique_service("empty")
    with pytest.raises(NoTeacherError, match=f"service '{service}'.*registry {etcd.address}"):
        DistillReader(_batches(1), registry=etcd.address, service=service, inputs=["X"],
                      no_teacher_timeout=1.0).start()


def test_draining_registered_teacher_mid_epoch_loses_nothing(etcd: LocalEtcd, tmp_path: Path) -> None:
    """SIGTERM: the teacher refuses new work, deregisters, finishes what it holds and exits. The
    student's probe of it may then meet a closed channel; that must never reach the training loop."""
    service = unique_service("drain")
    with contextlib.ExitStack() as stack:
        procs = start_teachers(stack, [[*ARGS, "--registry", etcd.address, "--service", service]] * 3, tmp_path,
                               env={"TEST_SLEEP_MS": "20"})
        reader = stack.enter_context(DistillReader(_batches(150), registry=etcd.address, service=service,
                                                   inputs=["X"], timeout=5.0))
        seen = []
        for batch, teacher in reader:
            i = int(batch["idx"][0])
            seen.append(i)
            assert torch.allclose(teacher["Y"], AFFINE(batch["X"]).detach(), atol=1e-5)
            if i in (30, 80):
                procs[0 if i == 30 else 1][0].send_signal(signal.SIGTERM)
        assert procs[0][0].wait(30) == 0 and procs[1][0].wait(30) == 0
    assert seen == list(range(150))
