"""The teacher's instance, finishing and stager threads carry their names where the OS shows them
(teacher_server.threads), so a profile or `top -H` of a real teacher process tells them apart; and
benchmarks/cpu.py reads per-thread CPU from /proc."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as tg

from benchmarks.cpu import busiest_threads, thread_cpu_seconds
from teacher_server import BatchingConfig, ServerConfig
from teacher_server.threads import name_this_thread, named_executor
from tests.servers import ServerThread, teacher_process

pytestmark = pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux /proc")


def _os_names(pid: int) -> set[str]:
    return {(p / "comm").read_text().strip() for p in Path(f"/proc/{pid}/task").iterdir() if (p / "comm").exists()}


def test_a_named_executor_names_its_os_thread() -> None:
    with named_executor("stager-7") as ex:
        tid = ex.submit(threading.get_native_id).result(timeout=10)
        assert Path(f"/proc/self/task/{tid}/comm").read_text().strip() == "stager-7"
    seen: list[str] = []

    def long_name() -> None:
        name_this_thread("a-name-longer-than-fifteen-bytes")
        seen.append(Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text().strip())

    t = threading.Thread(target=long_name)
    t.start()
    t.join(10)
    assert seen == ["a-name-longer-t"]  # the OS keeps 15 bytes


def _infer(endpoint: str) -> None:
    with tg.InferenceServerClient(endpoint) as client:
        inp = tg.InferInput("X", [1, 8], "FP32")
        inp.set_data_from_numpy(np.ones((1, 8), dtype=np.float32))
        assert client.infer("affine", [inp], client_timeout=30).as_numpy("Y").shape == (1, 4)


def test_a_teacher_process_names_its_instance_thread(tmp_path: Path) -> None:
    args = ["--model", "tests.models:affine", "--name", "affine", "--device", "cpu", "--instances", "1"]
    with teacher_process(args, tmp_path) as (proc, info):
        _infer(info["endpoint"])  # an instance's thread starts with its first batch
        assert "instance-0" in _os_names(proc.pid)
        before = thread_cpu_seconds(proc.pid)
        assert before and all(sec >= 0 for _, sec in before.values())
        every = busiest_threads(proc.pid, {}, before, wall_s=1.0, top=len(before))
        assert {"main", "instance-0"} <= {t["name"] for t in every}


def test_finishing_threads_are_named_too() -> None:
    cfg = ServerConfig(model="tests.models:affine", name="affine", device="cpu", instances=1,
                       batching=BatchingConfig(async_outputs=True))
    with ServerThread(cfg) as s:
        _infer(s.url)
        assert {"instance-0", "finish-0"} <= _os_names(os.getpid())


def test_busiest_threads_ranks_by_cpu_between_readings() -> None:
    pid = os.getpid()
    ready, done = threading.Event(), threading.Event()

    def spin_until() -> None:
        name_this_thread("spinner")
        ready.set()
        end = time.monotonic() + 10  # spins through the whole measured window, however late it starts
        while not done.is_set() and time.monotonic() < end:
            pass

    t = threading.Thread(target=spin_until)
    t.start()
    assert ready.wait(10)
    before = thread_cpu_seconds(pid)
    time.sleep(0.6)
    after = thread_cpu_seconds(pid)
    done.set()
    t.join(10)
    top = busiest_threads(pid, before, after, wall_s=0.6, top=1)
    assert top[0]["name"] == "spinner" and float(str(top[0]["cores"])) > 0.05
