"""The W4 student worker: ``python -m benchmarks.autoscale _student ...``, in its own process.

The benchmark drives it through `benchmarks.students.StudentProc` (see that module for the
protocol): ``go SERVICE SESSION`` trains on the registry's teachers until ``stop``.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.autoscale.settings import BATCH, Settings
from benchmarks.students import StudentProc


def student_worker(argv: Sequence[str]) -> int:
    """``python -m benchmarks.autoscale _student ...``: a training loop that follows commands.

    stdin: ``go SERVICE SESSION`` opens a DistillReader on the registry and trains (emulated
    step) until ``stop``; ``quit`` or EOF exits (EOF too: a dead benchmark leaves no student).
    stdout: JSON lines; every ``report_s`` the session's cumulative samples, batches and seconds
    spent waiting for (batch, teacher outputs), stamped with ``time.monotonic()``, which on Linux
    is one clock for every process, so the benchmark can line them up with its own samples.
    """
    p = argparse.ArgumentParser(prog="python -m benchmarks.autoscale _student")
    p.add_argument("--registry", required=True)
    p.add_argument("--name", required=True)
    p.add_argument("--student-ms", type=float, default=25.0)
    p.add_argument("--batch", type=int, default=BATCH)
    p.add_argument("--report-s", type=float, default=0.25)
    a = p.parse_args(list(argv))

    import torch

    from distill import DistillReader
    from examples.emulated import W1Loader, student_step

    torch.set_num_threads(1)
    out_lock = threading.Lock()

    def emit(**fields: Any) -> None:
        with out_lock:
            sys.stdout.write(json.dumps(fields) + "\n")
            sys.stdout.flush()

    commands: queue.Queue[list[str]] = queue.Queue()

    def read_stdin() -> None:
        for line in sys.stdin:
            if line.split():
                commands.put(line.split())
        commands.put(["quit"])

    threading.Thread(target=read_stdin, name="student-stdin", daemon=True).start()
    loader = W1Loader(10**9, batch_size=a.batch)
    emit(ev="ready", pid=os.getpid(), t=time.monotonic())

    def session(service: str, sid: str) -> bool:
        """Train until told to stop; True when told to quit."""
        counts = {"s": 0, "b": 0, "w": 0.0}
        done = threading.Event()

        def report() -> None:
            while not done.wait(a.report_s):
                emit(ev="r", session=sid, t=time.monotonic(), **counts)

        reporter = threading.Thread(target=report, name="student-report", daemon=True)
        quit_ = stop = False
        failures = 0
        started = time.monotonic()
        emit(ev="started", session=sid, t=started)
        reporter.start()
        try:
            while not stop:
                # Opening the reader (registry, watch, first teacher) counts as waiting: the loop
                # is not training meanwhile, with or without an autoscaler.
                mark = time.perf_counter()
                try:
                    with DistillReader(loader, registry=a.registry, service=service, inputs=["INPUT"],
                                       outputs=["LOGITS"], student_id=f"{a.name}-{sid}",
                                       no_teacher_timeout=60.0) as reader:
                        items = iter(reader)
                        while True:
                            try:
                                cmd = commands.get_nowait()
                            except queue.Empty:
                                cmd = []
                            if cmd and cmd[0] in ("stop", "quit"):
                                quit_, stop = cmd[0] == "quit", True
                                break
                            batch, outputs = next(items)
                            now = time.perf_counter()
                            counts["w"] += now - mark
                            student_step(batch, outputs["LOGITS"], a.student_ms)
                            counts["s"] += int(batch["INPUT"].shape[0])
                            counts["b"] += 1
                            mark = time.perf_counter()
                except Exception as e:
                    # A real job would have crashed here. The benchmark reports it (and fails),
                    # then opens a new reader so that the rest of the profile is still measured.
                    failures += 1
                    counts["w"] += time.perf_counter() - mark
                    emit(ev="error", session=sid, t=time.monotonic(), msg=f"{type(e).__name__}: {e}")
                    if failures >= 20:
                        break
                    time.sleep(0.1)
        finally:
            done.set()
            reporter.join()
            emit(ev="r", session=sid, t=time.monotonic(), **counts)
            emit(ev="stopped", session=sid, t=time.monotonic(), lived=time.monotonic() - started)
        return quit_

    while True:
        cmd = commands.get()
        if cmd[0] == "quit":
            return 0
        if cmd[0] == "go" and len(cmd) == 3 and session(cmd[1], cmd[2]):
            return 0


def student_proc(index: int, registry: str, s: Settings, log_dir: Path) -> StudentProc:
    """The benchmark's handle on student `index` running this worker; ``quit`` closes its reader
    cleanly, and a student still blocked 10 s later gets SIGTERM."""
    argv = [sys.executable, "-m", "benchmarks.autoscale", "_student", "--registry", registry,
            "--name", f"student{index}", "--student-ms", str(s.student_ms), "--batch", str(s.batch)]
    return StudentProc(index, argv, log_dir, quit_command="quit", close_wait_s=10.0)
