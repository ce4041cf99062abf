"""`distill top` against a real etcd, a real registered teacher-server and a real student.

Plus the view's pure parts (grouping keys into services, rendering autoscaler records of any
format, skipping values that do not parse), which need no etcd.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aetcd
import pytest
import torch

from discovery import open_registry
from discovery import top as dtop
from discovery.etcd.view import parse_kvs
from discovery.local_etcd import LocalEtcd, free_port
from distill import DistillReader
from protos import registry_pb2
from tests.etcd_fixtures import arun, unique_service
from tests.servers import REPO, teacher_process

_CLEAR = "\x1b[H\x1b[2J"  # what starts each redraw
TEACHER = ["--model", "tests.models:affine", "--name", "affine", "--device", "cpu", "--max-batch-size", "8",
           "--ttl", "5"]


@pytest.fixture(scope="module")
def etcd() -> Iterator[LocalEtcd]:
    with LocalEtcd() as server:
        yield server


def _top(*args: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "distill.cli", "top", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout, check=False)


class _Student:
    """A DistillReader iterating slowly on a thread, so that it keeps publishing demand."""

    def __init__(self, registry: str, service: str) -> None:
        batches = [{"X": torch.randn(8, 8)} for _ in range(10_000)]
        self.reader = DistillReader(batches, registry=registry, service=service, inputs=["X"],
                                    student_id="top-test-student")
        self.stop = threading.Event()
        self.consumed = 0
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        for _batch, _outputs in self.reader:
            self.consumed += 1
            if self.stop.wait(0.01):
                return

    def __enter__(self) -> _Student:
        self.reader.start()
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(30)
        self.reader.close()


def _wait_for_demand(etcd: LocalEtcd, service: str, student_id: str, timeout: float = 15.0) -> None:
    async def poll() -> None:
        async with open_registry(etcd.address) as reg:
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                if any(d.student_id == student_id and d.samples_per_s > 0 for d in await reg.demand(service)):
                    return
                await asyncio.sleep(0.1)
        raise AssertionError(f"student {student_id} published no demand on {service} within {timeout} s")

    arun(poll(), timeout + 5)


def test_top_once_shows_the_teacher_the_student_and_the_autoscaler_decision(etcd: LocalEtcd,
                                                                           tmp_path: Path) -> None:
    service = unique_service("top")
    args = [*TEACHER, "--registry", etcd.address, "--service", service, "--instance-id", "top-t1"]
    with teacher_process(args, tmp_path) as (_proc, info), _Student(etcd.address, service) as student:
        _wait_for_demand(etcd, service, "top-test-student")
        assert student.consumed > 0

        async def decide() -> None:  # what an autoscaler may publish; top must show it, whatever it is
            client = aetcd.Client(host="127.0.0.1", port=etcd.client_port, timeout=5)
            try:
                record = {"action": "up", "current": 1, "desired": 2, "reason": "students stall 30% > 10%",
                          "at": time.time() - 3}
                await client.put(f"/distill/v1/{service}/autoscaler/decision".encode(), json.dumps(record).encode())
                await client.put(f"/distill/v1/{service}/autoscaler/leader".encode(), b"scaler-host-42")
            finally:
                await client.close()

        arun(decide())
        out = _top("--registry", etcd.address, "--once")
        assert out.returncode == 0, out.stderr
        text = out.stdout
        assert f"service {service}: 1 teacher(s)" in text, text
        assert info["endpoint"] in text and "top-t1" in text and "affine:1" in text, text
        assert "top-test-student" in text, text
        assert 'autoscaler decision: action=up current=1 desired=2 reason="students stall 30% > 10%"' in text
        assert "autoscaler leader: scaler-host-42" in text

        as_json = _top("--registry", etcd.address, "--service", service, "--once", "--json")
        assert as_json.returncode == 0, as_json.stderr
        snap = json.loads(as_json.stdout)
        [svc] = snap["services"]
        assert svc["name"] == service
        assert [t["record"]["endpoint"] for t in svc["teachers"]] == [info["endpoint"]]
        assert svc["teachers"][0]["load"]["capacity_samples_per_s"] >= 0
        assert [s["student_id"] for s in svc["students"]] == ["top-test-student"]
        assert svc["students"][0]["samples_per_s"] > 0


def test_top_filters_by_service_and_reports_an_empty_registry(etcd: LocalEtcd) -> None:
    out = _top("--registry", etcd.address, "--service", "no-such-service", "--once")
    assert out.returncode == 0, out.stderr
    assert "no services named no-such-service" in out.stdout


def test_top_says_clearly_when_the_registry_is_unreachable(capsys: pytest.CaptureFixture[str]) -> None:
    """Both end at the first read, so `distill`'s entry point runs in this process: an exception
    escaping it (a traceback in a process) fails the test as well."""
    from distill.cli import main

    dead = f"etcd://127.0.0.1:{free_port()}"
    assert main(["top", "--registry", dead, "--once", "--timeout", "2"]) == 1
    err = capsys.readouterr().err
    assert "cannot read the registry at" in err and dead in err, err
    assert main(["top", "--registry", "static://127.0.0.1:9898", "--once"]) == 2
    assert "reads etcd" in capsys.readouterr().err


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_top_refreshes_until_interrupted(etcd: LocalEtcd, sig: signal.Signals) -> None:
    """Either signal ends the view with exit 0, whatever the disposition it inherited: a script's
    background job starts with SIGINT ignored (as this test's parent may have been)."""
    # The fault handler: should Ctrl-C not stop it, SIGABRT makes it print where every thread is.
    proc = subprocess.Popen([sys.executable, "-X", "faulthandler", "-m", "distill.cli", "top", "--registry",
                             etcd.address, "--interval", "0.2"], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    seen: list[str] = []
    redrawn = threading.Event()

    def read() -> None:  # until the view has been drawn twice: the event the Ctrl-C waits for
        assert proc.stdout is not None
        while chunk := proc.stdout.read(1):
            seen.append(chunk)
            if "".join(seen[-4096:]).count(_CLEAR) >= 2 or len(seen) > 200_000:
                redrawn.set()
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert redrawn.wait(60), f"distill top did not redraw its view in 60 s: {''.join(seen)[-500:]!r}"
        reader.join(10)
        proc.send_signal(sig)
        try:
            rest, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            status = Path(f"/proc/{proc.pid}/status").read_text()
            signals = " ".join(line for line in status.splitlines() if line.startswith(("State", "Sig")))
            proc.send_signal(signal.SIGABRT)
            late, err = proc.communicate(timeout=30)
            pytest.fail(f"{sig.name} did not stop distill top in 30 s; {late.count(_CLEAR)} views drawn after it; "
                        f"{signals}; where its threads were:\n{err[-8000:]}")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    stdout = "".join(seen) + rest
    assert proc.returncode == 0
    assert stdout.count(_CLEAR) >= 2, "the view should have been redrawn"
    assert "Ctrl-C to quit" in stdout


def test_a_ctrl_c_that_a_read_loses_still_stops_the_view(etcd: LocalEtcd, monkeypatch: pytest.MonkeyPatch) -> None:
    """grpc.aio loses a cancellation that reaches a call in the loop turn its answer arrives in: the
    read returns its answer and the task goes on. The view must still stop at that Ctrl-C (asyncio.run
    sends it as one cancellation of the main task), not refresh until a second one."""
    real_read = dtop.read_view
    reads = 0

    async def read_losing_a_cancel(*args: Any, **kwargs: Any) -> dtop.MeshView:
        nonlocal reads
        view = await real_read(*args, **kwargs)
        reads += 1
        if reads == 2:  # Ctrl-C lands as the answer comes back, and gRPC returns the answer
            task = asyncio.current_task()
            assert task is not None
            task.cancel()
            try:
                await asyncio.sleep(0)
            except asyncio.CancelledError:
                pass
        return view

    monkeypatch.setattr(dtop, "read_view", read_losing_a_cancel)
    parser = argparse.ArgumentParser()
    dtop.add_arguments(parser)
    args = parser.parse_args(["--registry", etcd.address, "--interval", "0.05"])

    async def main() -> None:
        view = asyncio.create_task(dtop._run(args, io.StringIO()))
        done, _ = await asyncio.wait([view], timeout=30)
        if not done:
            view.cancel()
            await asyncio.wait([view], timeout=10)
        assert done, f"the view went on refreshing after its cancellation was lost ({reads} reads)"
        assert view.cancelled() and reads == 2, (view, reads)

    arun(main(), timeout=60)


# ---- the pure parts ---------------------------------------------------------------------------------


def _kv(key: str, msg: object) -> tuple[bytes, bytes]:
    return key.encode(), msg.SerializeToString()  # type: ignore[attr-defined]


def test_parse_groups_services_joins_loads_and_skips_garbage() -> None:
    rec = registry_pb2.TeacherRecord(instance_id="t1", endpoint="10.0.0.1:9898", model_name="m", device="cuda:0")
    load = registry_pb2.TeacherLoad(instance_id="t1", queue_depth=3, samples_per_s=1200.0, busy_fraction=0.5,
                                    capacity_samples_per_s=2400.0)
    demand = registry_pb2.StudentDemand(samples_per_s=800.0, wait_fraction=0.25, teachers_in_use=1)
    views = parse_kvs([
        _kv("/distill/v1/b/teachers/t1", rec),
        _kv("/distill/v1/b/load/t1", load),
        _kv("/distill/v1/b/load/gone", load),  # load without a record: the teacher is leaving
        _kv("/distill/v1/b/students/s1", demand),  # student_id filled in from the key
        (b"/distill/v1/b/students/bad", b"\xff\xff\xff"),
        (b"/distill/v1/a/autoscaler/leader", b"host-1"),
        (b"/distill/v1/a/other/x", b"ignored"),
        (b"/elsewhere/key", b"ignored"),
    ])
    assert [v.name for v in views] == ["a", "b"]
    a, b = views
    assert a.teachers == [] and a.autoscaler[0].name == "leader"
    assert [t.instance_id for t in b.teachers] == ["t1"] and b.teachers[0].load == load
    assert [d.student_id for d in b.students] == ["s1"] and b.unparsable == 1
    assert [v.name for v in parse_kvs([_kv("/distill/v1/b/teachers/t1", rec)], only=["a"])] == []

    text = dtop.render(dtop.MeshView("etcd://x:2379", 7, 1000.0, views))
    assert "10.0.0.1:9898" in text and "cuda:0" in text and "1,200" in text and "50%" in text and "2,400" in text
    assert "s1" in text and "25%" in text
    assert "autoscaler leader: host-1" in text and "autoscaler: none running" in text
    assert "1 value(s) under this service did not parse" in text


def test_autoscaler_records_of_any_format_are_readable() -> None:
    decision = json.dumps({"reason": "steady", "desired": 3, "action": "hold", "figures": {"busy": 0.5},
                           "at": 100.0}).encode()
    assert dtop.describe_value(decision, now=112.0) == \
        'action=hold desired=3 reason=steady figures={"busy":0.5} (12.0s ago)'
    assert dtop.describe_value(b"plain   text\nvalue") == "plain text value"
    assert dtop.describe_value(b"\xff\x00\x01") == "<3 bytes of binary data>"
    assert dtop.describe_value(b"[1, 2]") == "[1, 2]"
    # The last scale that landed, as the controller publishes it: the counts and its age, not its JSON.
    scaled = json.dumps({"action": "hold", "desired": 1, "at": 100.0, "last_scale": {
        "action": "up", "from": 0, "to": 1, "reason": "scale up 0 -> 1: demand", "at": 40.0}}).encode()
    assert dtop.describe_value(scaled, now=112.0) == \
        'action=hold desired=1 last_scale="0 -> 1, 1m12s ago" (12.0s ago)'
    odd = json.dumps({"last_scale": {"from": "x", "to": 1, "at": 40.0}}).encode()  # not the controller's shape
    assert dtop.describe_value(odd, now=112.0) == 'last_scale={"from":"x","to":1,"at":40.0}'


def test_render_fits_80_columns_and_keeps_the_throughput_columns() -> None:
    kvs = []
    for i in range(3):
        iid = f"teacher-instance-with-a-long-generated-name-{i:04d}"
        rec = registry_pb2.TeacherRecord(instance_id=iid, endpoint=f"teacher-{i}.gpu-pool.cluster.example.org:9898",
                                         model_name="a_rather_long_teacher_model_name_for_distillation",
                                         model_version="12", device="cuda:0", max_batch_size=256, started_at=900.0)
        load = registry_pb2.TeacherLoad(instance_id=iid, queue_depth=12, in_flight=3, samples_per_s=123456.0 + i,
                                        busy_fraction=0.87, capacity_samples_per_s=234567.0, updated_at=999.0)
        kvs += [_kv(f"/distill/v1/cv-teacher-with-a-long-service-name/teachers/{iid}", rec),
                _kv(f"/distill/v1/cv-teacher-with-a-long-service-name/load/{iid}", load)]
    demand = registry_pb2.StudentDemand(student_id="student-rank-0-of-a-very-long-job-name-abcdef",
                                        samples_per_s=9999.0, wait_fraction=0.05, in_flight=4, teachers_in_use=3,
                                        updated_at=999.0)
    kvs.append(_kv("/distill/v1/cv-teacher-with-a-long-service-name/students/s0", demand))
    decision = {"action": "up", "current": 3, "desired": 4, "reason": "students stall 30% > 10% " * 4, "at": 990.0}
    kvs.append((b"/distill/v1/cv-teacher-with-a-long-service-name/autoscaler/decision", json.dumps(decision).encode()))
    view = dtop.MeshView("etcd://etcd-0.etcd.cluster.example.org:2379,etcd-1.etcd.cluster.example.org:2379", 7,
                         1000.0, parse_kvs(kvs))

    wide = dtop.render(view)
    assert max(len(line) for line in wide.splitlines()) > 80, "the snapshot should need fitting"
    text = dtop.render(view, width=80)
    lines = text.splitlines()
    assert all(len(line) <= 80 for line in lines), "\n".join(line for line in lines if len(line) > 80)
    [header] = [line for line in lines if "ENDPOINT" in line]
    for column in ("SAMPLES/S", "BUSY", "CAPACITY/S", "MODEL", "STATE"):
        assert column in header, header
    assert "INSTANCE" in wide and "INSTANCE" not in header  # what gave way
    rows = [line for line in lines if "87%" in line]
    assert len(rows) == 3, text
    for i, row in enumerate(rows):
        assert f"123,45{6 + i}" in row and "87%" in row and "234,567" in row, row
        assert row.lstrip().startswith("teacher-") and ":9898" in row, row  # both ends of a cut endpoint
    assert "STUDENT" in text and "9,999" in text and "5%" in text
    assert "ROWS ROUTED" not in wide  # no routing student: no routed columns
    assert "autoscaler decision: action=up" in text and "desired=4" in text
    assert "etcd-1.etcd" in text  # the title wraps instead of losing its end


def test_top_shows_each_services_rows_and_tokens_routed_by_a_routing_student() -> None:
    kvs = []
    for service, rows, tokens in (("math", 8_000, 512_000), ("code", 2_000, 96_000)):
        demand = registry_pb2.StudentDemand(student_id="router", samples_per_s=50.0, updated_at=999.0,
                                            rows_routed=rows, tokens_routed=tokens)
        kvs.append(_kv(f"/distill/v1/{service}/students/router", demand))
    text = dtop.render(dtop.MeshView("etcd://127.0.0.1:2379", 7, 1000.0, parse_kvs(kvs)), width=160)
    assert "ROWS ROUTED" in text and "TOKENS ROUTED" in text, text
    sections = {part.split(":", 1)[0]: part for part in text.split("service ")[1:]}
    math_part, code_part = sections["math"], sections["code"]
    assert "8,000" in math_part and "512,000" in math_part, text
    assert "2,000" in code_part and "96,000" in code_part, text
