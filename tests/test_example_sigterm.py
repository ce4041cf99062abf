"""An example stopped with SIGTERM (a scheduler's stop, `kill`, `timeout`) takes its teacher
server and its etcd down with it, as Ctrl-C does: `examples.common.exit_on_sigterm`, which the
examples that start children call from their ``__main__`` guard. Without it Python ends at once,
no ``__exit__`` runs, and both children are left running."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

SCRIPT = """
import sys, time
from examples.common import exit_on_sigterm
from discovery.local_etcd import LocalEtcd
from teacher_server.launch import TeacherProcess
if sys.argv[1] == "handled":
    exit_on_sigterm()
args = ["--model", "tests.models:affine", "--port", "0", "--device", "cpu", "--threads", "1"]
with LocalEtcd(sys.argv[3]) as etcd, TeacherProcess(args, cwd=sys.argv[2], env={"PYTHONPATH": sys.argv[2]},
                                         ready_timeout=120, stop_grace=10) as teacher:
    print(etcd.pid, teacher.pid, flush=True)
    time.sleep(300)
"""


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie has exited; only its parent's wait is missing
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False


def run_and_terminate(mode: str, data_dir: Path) -> tuple[int, list[int]]:
    """Start the script, wait for its two children, SIGTERM it; its exit status and the children's pids."""
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT, mode, str(REPO), str(data_dir)], cwd=REPO,
                            stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # bounded: the teacher's ready_timeout ends the script otherwise
        children = [int(pid) for pid in line.split()]
        assert len(children) == 2, f"the script did not start its children: {line!r}"
        proc.send_signal(signal.SIGTERM)
        status = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    return status, children


@pytest.mark.timeout(240)
def test_sigterm_stops_the_children_of_an_example_that_handles_it(tmp_path: Path) -> None:
    status, children = run_and_terminate("handled", tmp_path / "etcd")
    assert status == 128 + signal.SIGTERM
    deadline = time.monotonic() + 15  # the teacher drains (nothing in flight), etcd stops on SIGTERM
    while any(alive(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in children if alive(pid)], "a child outlived its example"


@pytest.mark.timeout(240)
def test_without_the_handler_the_children_outlive_it(tmp_path: Path) -> None:
    """The failure the handler exists for: the same script without it leaves both children running."""
    status, children = run_and_terminate("default", tmp_path / "etcd")
    try:
        assert status == -signal.SIGTERM
        time.sleep(1.0)  # what the handled run allows its children, and more
        assert [pid for pid in children if alive(pid)] == children
    finally:
        for pid in children:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
