"""Soak: 8 students x 4 teachers on a real etcd for 10 minutes, nothing restarted.

    .venv/bin/python -m benchmarks.soak [--minutes 10] [--students 8] [--teachers 4] [--quick]

A soak answers what a short benchmark cannot: does the mesh stay correct and flat when nothing
is restarted for a long time? Leaks (RSS creeping up), slow error accumulation (a batch lost
once in 100,000), throughput decay (a queue or a table that grows) only show over minutes.

What runs, all real and on loopback:
  * one etcd (``discovery.local_etcd.LocalEtcd``, the same flags tests and ``make demo`` use);
  * ``--teachers`` teacher-server subprocesses serving the emulated W1 teacher
    (``examples.emulated:build``), registered with ``--registry``/``--service`` and serving
    Prometheus ``/metrics`` (``--metrics-port 0``), from which their RSS is read as well;
  * ``--students`` student subprocesses, each a ``DistillReader`` on the registry iterating an
    endless W1-like loader with distinct inputs per batch, for the whole duration.

Sizing for a 2-core machine, and why: W1 proper is 256 x [3,32,32] fp32 per batch with a 25 ms
student step and 20 ms teacher step; 8 such students would push ~80 MB/s of tensors per student
through Python gRPC, which two shared cores cannot do, and the soak would then measure CPU
starvation instead of stability. The defaults are therefore batch 32 (the same [3,32,32] fp32
sample and [100] logits), a 50 ms emulated student step and a 5 ms emulated teacher step per
batch of up to 256 (``EMULATED_TEACHER_MS``): 8 students ask for at most 8 x 32 / 50 ms =
5,120 samples/s. ``--batch``, ``--student-ms`` and ``--teacher-ms`` change it.

Every student checks every batch it receives (an *error* is any of these):
  * the reader raised (the student then opens a new reader and goes on, counting it);
  * the batch index is not the next one expected (skipped indices: lost; a repeated or older
    index: duplicated / out of order; the reader is ``ordered=True``);
  * the teacher outputs differ from the in-process emulated model on the same inputs
    (recomputed from the loader, ``allclose`` with atol 1e-4: the server batches requests
    together, which may reorder float sums).

Reported: errors (target 0), total student samples/s per ``--interval`` (10 s) window, RSS of
every process (etcd, teachers, students) after the warm-up and at the end with growth % (target
< 5 %), printed as tables, written to benchmarks/results/soak.json (``soak_quick.json`` with
``--quick``) with a PNG of throughput and RSS over time. Everything started is stopped on exit,
errors, Ctrl-C and SIGTERM; students also get SIGTERM from the kernel if this process is killed.

Measure final figures on a quiet machine: on a shared 2-core box other jobs steal CPU, which
shows up as throughput dips (the JSON records the foreign CPU per window to tell them apart).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.common import (
    EMULATED_MODEL_NAME,
    EMULATED_MODEL_REF,
    REPO_ROOT,
    RESULTS_DIR,
    format_table,
    machine_info,
    sigterm_raises,
    write_results,
)
from benchmarks.cpu import CpuMeter
from benchmarks.procs import log_tail, process_rss_bytes
from benchmarks.students import StudentProc
from teacher_server.launch import TeacherProcess, start_all

SERVICE = "soak"
MODEL_REF = EMULATED_MODEL_REF
MODEL_NAME = EMULATED_MODEL_NAME
GOAL_ERRORS = 0
GOAL_RSS_GROWTH_PCT = 5.0
_REPORT_S = 1.0  # how often a student reports its counters


@dataclass(frozen=True)
class Settings:
    """One run's knobs; recorded verbatim in the JSON so a result can be reproduced."""

    minutes: float = 10.0
    students: int = 8
    teachers: int = 4
    batch: int = 32
    student_ms: float = 50.0
    teacher_ms: float = 5.0
    interval_s: float = 10.0
    warmup_s: float = 30.0
    max_teachers: int = 0  # the students' --distill_max_teachers (0: all)
    quick: bool = False

    @property
    def duration_s(self) -> float:
        return self.minutes * 60.0

    @property
    def demand_samples_per_s(self) -> float:
        """What the students would consume if the mesh never made them wait."""
        return self.students * self.batch * 1000.0 / self.student_ms


# ==== the student (its own process) ================================================================
def student_worker(argv: Sequence[str]) -> int:
    """``python -m benchmarks.soak _student ...``: train on the mesh for ``--seconds`` and check it.

    Protocol: prints ``{"ev": "ready"}`` once the reader delivered its first batch (torch
    imported, teachers found), waits for ``go`` on stdin (so all students start together), then
    trains; every second a ``{"ev": "r", ...}`` line with cumulative counters, finally
    ``{"ev": "done", ...}``. EOF on stdin before ``go`` exits: a dead benchmark leaves no student.
    """
    p = argparse.ArgumentParser(prog="python -m benchmarks.soak _student")
    p.add_argument("--registry", required=True)
    p.add_argument("--service", default=SERVICE)
    p.add_argument("--name", required=True)
    p.add_argument("--seconds", type=float, required=True)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--student-ms", type=float, default=50.0)
    p.add_argument("--max-teachers", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(list(argv))

    import torch

    from distill import DistillReader
    from examples.emulated import W1Loader, build, student_step

    torch.set_num_threads(1)
    model = build(step_ms=0.0)  # the same seeded weights as the teachers' model
    loader = W1Loader(10**9, batch_size=a.batch, distinct=True, seed=a.seed)
    lock = threading.Lock()

    def emit(**fields: Any) -> None:
        with lock:
            sys.stdout.write(json.dumps(fields) + "\n")
            sys.stdout.flush()

    counts: dict[str, int] = {"samples": 0, "batches": 0, "errors": 0, "exceptions": 0, "lost": 0,
                              "duplicated": 0, "wrong_output": 0, "readers": 0}
    first_errors: list[str] = []

    def error(kind: str, message: str, n: int = 1) -> None:
        counts["errors"] += n
        counts[kind] += n
        if len(first_errors) < 20:
            first_errors.append(f"{time.monotonic():.1f} {kind}: {message}")
        emit(ev="error", kind=kind, msg=message, t=time.monotonic())

    def open_reader() -> DistillReader:
        counts["readers"] += 1
        return DistillReader(loader, registry=a.registry, service=a.service, inputs=["INPUT"], outputs=["LOGITS"],
                             student_id=f"{a.name}-r{counts['readers']}", no_teacher_timeout=30.0,
                             max_teachers=a.max_teachers)

    def check(expected: int, batch: dict[str, Any], outputs: dict[str, Any]) -> int:
        """Check one delivered batch; return the next expected index."""
        index = int(batch["index"])
        if index > expected:
            error("lost", f"got batch {index}, expected {expected}", index - expected)
        elif index < expected:
            error("duplicated", f"got batch {index} again or out of order (expected {expected})")
        logits = outputs.get("LOGITS") if outputs else None
        want = model.logits(loader.inputs(index))
        if logits is None or tuple(logits.shape) != tuple(want.shape) or not torch.allclose(logits, want, atol=1e-4):
            error("wrong_output", f"batch {index}: teacher outputs differ from the in-process model")
        return max(expected, index + 1)

    # Warm up: open a reader and take one batch, so "ready" means the mesh works for this student.
    reader = open_reader()
    items = iter(reader)
    batch, outputs = next(items)
    expected = check(0, batch, outputs)
    emit(ev="ready", pid=os.getpid(), t=time.monotonic())
    line = sys.stdin.readline()
    if line.strip() != "go":
        reader.close()
        return 0
    stop_at = time.monotonic() + a.seconds
    done = threading.Event()

    def report() -> None:
        while not done.wait(_REPORT_S):
            emit(ev="r", t=time.monotonic(), **counts)

    reporter = threading.Thread(target=report, name="soak-report", daemon=True)
    reporter.start()
    try:
        while time.monotonic() < stop_at:
            try:
                batch, outputs = next(items)
            except Exception as e:  # a real job would crash here; count it and carry on
                error("exceptions", f"{type(e).__name__}: {e}")
                reader.close()
                time.sleep(0.5)
                reader = open_reader()
                items, expected = iter(reader), 0
                continue
            expected = check(expected, batch, outputs)
            student_step(batch, outputs["LOGITS"], a.student_ms)
            counts["samples"] += int(batch["INPUT"].shape[0])
            counts["batches"] += 1
    finally:
        done.set()
        reporter.join(5)
        reader.close()
        emit(ev="r", t=time.monotonic(), **counts)
        emit(ev="done", t=time.monotonic(), first_errors=first_errors, **counts)
    return 0


def student_command(index: int, registry: str, s: Settings) -> list[str]:
    """The argv of student `index`: this module's worker, reporting without sessions."""
    return [sys.executable, "-m", "benchmarks.soak", "_student", "--registry", registry,
            "--service", SERVICE, "--name", f"student{index}", "--seconds", str(s.duration_s),
            "--batch", str(s.batch), "--student-ms", str(s.student_ms),
            "--max-teachers", str(s.max_teachers), "--seed", str(index)]


def scrape_rss(metrics_port: int | None) -> int | None:
    """``process_resident_memory_bytes`` from a teacher's Prometheus endpoint (None if unavailable)."""
    if not metrics_port:
        return None
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=2.0) as resp:
            text = resp.read().decode("utf-8", "replace")
    except OSError:
        return None
    m = re.search(r"^process_resident_memory_bytes\s+([0-9.eE+]+)", text, re.MULTILINE)
    return int(float(m.group(1))) if m else None


# ==== the benchmark ================================================================================
@dataclass
class Proc:
    """A process whose RSS the soak tracks."""

    name: str
    pid: int
    metrics_port: int | None = None
    rss: list[tuple[float, int]] = field(default_factory=list)  # (t since start, bytes)
    rss_metrics: list[tuple[float, int]] = field(default_factory=list)


def run(s: Settings) -> dict[str, Any]:
    """Start everything, soak for ``s.minutes``, stop everything; return the result document."""
    from discovery.local_etcd import LocalEtcd

    info = machine_info(torch_threads=1)
    timeline: list[dict[str, Any]] = []
    procs: list[Proc] = []
    log_dir = Path(tempfile.mkdtemp(prefix="soak-"))
    students: list[StudentProc] = []
    with sigterm_raises(), contextlib.ExitStack() as stack:
        etcd = LocalEtcd()
        stack.callback(etcd.close)
        etcd.start()
        assert etcd.pid is not None
        procs.append(Proc("etcd", etcd.pid))
        env = {"EMULATED_TEACHER_MS": str(s.teacher_ms)}
        teachers = [
            TeacherProcess(["--model", MODEL_REF, "--name", MODEL_NAME, "--port", "0", "--metrics-port", "0",
                            "--threads", "1", "--instances", "1", "--registry", etcd.address, "--service", SERVICE,
                            "--instance-id", f"soak-t{i}", "--log-level", "WARNING"],
                           label=f"teacher{i}", env=env, cwd=REPO_ROOT, stop_grace=20.0)
            for i in range(s.teachers)
        ]
        print(f"starting etcd, {s.teachers} teachers and {s.students} students ...", flush=True)
        start_all(stack, teachers)
        for i, t in enumerate(teachers):
            procs.append(Proc(f"teacher{i}", t.pid, metrics_port=t.ready.get("metrics_port")))
        for i in range(s.students):
            st = StudentProc(i, student_command(i, etcd.address, s), log_dir)
            stack.callback(st.close)
            students.append(st)
            st.launch()
        deadline = time.monotonic() + 180.0
        for st in students:
            st.wait_ready(deadline)
            procs.append(Proc(st.name, st.pid))
        for st in students:
            st.go()
        t0 = time.monotonic()
        print(f"soaking for {s.minutes:g} min (RSS baseline after {s.warmup_s:g} s) ...", flush=True)

        def sample_rss(now: float) -> None:
            for p in procs:
                rss = process_rss_bytes(p.pid)
                if rss is not None:
                    p.rss.append((round(now - t0, 2), rss))
                scraped = scrape_rss(p.metrics_port)
                if scraped is not None:
                    p.rss_metrics.append((round(now - t0, 2), scraped))

        sample_rss(t0)
        baseline_taken = False
        windows = max(1, round(s.duration_s / s.interval_s))
        meter = CpuMeter([p.pid for p in procs])
        meter.start()
        for w in range(1, windows + 1):  # bounded: one iteration per window
            edge = t0 + min(w * s.interval_s, s.duration_s)
            time.sleep(max(0.0, edge - time.monotonic()))
            time.sleep(_REPORT_S * 1.2)  # let the reports straddling the edge arrive
            now = time.monotonic()
            cpu = meter.stop()
            meter = CpuMeter([p.pid for p in procs])
            meter.start()
            lo = edge - min(s.interval_s, s.duration_s)
            per_student = [st.value_at("samples", edge) - st.value_at("samples", lo) for st in students]
            errors = sum(int(st.counters().get("errors", 0)) for st in students)
            row = {"t_end_s": round(edge - t0, 1), "samples_per_s": round(sum(per_student) / (edge - lo), 1),
                   "per_student_samples_per_s": [round(x / (edge - lo), 1) for x in per_student],
                   "errors_cumulative": errors, "mesh_cores": round(cpu.server_cores, 2),
                   "foreign_cores": round(cpu.foreign_cores, 2)}
            timeline.append(row)
            if not baseline_taken and edge - t0 >= s.warmup_s:
                baseline_taken = True
            sample_rss(now)
            print(f"  t={row['t_end_s']:6.0f}s  {row['samples_per_s']:8.0f} samples/s  errors={errors}  "
                  f"mesh {row['mesh_cores']:.2f} cores, others {row['foreign_cores']:.2f}", flush=True)
        sample_rss(time.monotonic())  # the end figure, before anything is stopped
        # The students stop by themselves after --seconds; wait (bounded) for their final counts.
        end_wait = time.monotonic() + 30.0
        while time.monotonic() < end_wait and any(st.done is None for st in students):
            time.sleep(0.2)
        final = {st.name: st.counters() for st in students}
        error_events = [dict(e, student=st.name) for st in students for e in st.errors]
        logs = {st.name: log_tail(st.log_path, 10) for st in students if st.done is None}
    return summarise(s, info, timeline, procs, final=final, error_events=error_events, logs=logs)


def summarise(s: Settings, info: dict[str, Any], timeline: list[dict[str, Any]], procs: list[Proc], *,
              final: dict[str, dict[str, Any]], error_events: list[dict[str, Any]],
              logs: dict[str, str]) -> dict[str, Any]:
    """The result document: settings, machine, timeline, RSS table, error totals and verdicts."""
    rss_rows: list[dict[str, Any]] = []
    growths: list[float] = []
    for p in procs:
        after = [v for t, v in p.rss if t >= s.warmup_s]
        start = after[0] if after else (p.rss[0][1] if p.rss else None)
        start_t = next((t for t, _ in p.rss if t >= s.warmup_s), p.rss[0][0] if p.rss else None)
        end = p.rss[-1][1] if p.rss else None
        growth = (end - start) / start * 100.0 if start and end else float("nan")
        if not math.isnan(growth):
            growths.append(growth)
        rss_rows.append({"process": p.name, "pid": p.pid, "rss_at_launch_mb": _mb(p.rss[0][1]) if p.rss else None,
                         "rss_start_mb": _mb(start), "rss_start_t_s": start_t, "rss_end_mb": _mb(end),
                         "growth_pct": round(growth, 2),
                         "metrics_rss_start_mb": _mb(_first_after(p.rss_metrics, s.warmup_s)),
                         "metrics_rss_end_mb": _mb(p.rss_metrics[-1][1]) if p.rss_metrics else None,
                         "samples": p.rss})
    totals = {k: sum(int(c.get(k, 0)) for c in final.values())
              for k in ("samples", "batches", "errors", "exceptions", "lost", "duplicated", "wrong_output")}
    missing = [n for n, c in final.items() if not c]
    steady = [r["samples_per_s"] for r in timeline]
    worst_growth = max(growths, default=float("nan"))
    return {
        "benchmark": "soak",
        "machine": info,
        "settings": asdict(s),
        "notes": ("Development figure on a shared 2-core machine unless stated otherwise; final figures must be "
                  "measured on a quiet machine (foreign_cores in the timeline shows other jobs' CPU)."),
        "goals": {"errors": GOAL_ERRORS, "rss_growth_pct_below": GOAL_RSS_GROWTH_PCT},
        "demand_samples_per_s": s.demand_samples_per_s,
        "totals": totals,
        "students": final,
        "students_without_final_report": missing,
        "error_events": error_events[:200],
        "student_log_tails": logs,
        "timeline": timeline,
        "throughput": {"mean_samples_per_s": round(sum(steady) / len(steady), 1) if steady else None,
                       "min_window": min(steady) if steady else None, "max_window": max(steady) if steady else None},
        "rss": rss_rows,
        "verdict": {"errors_ok": totals["errors"] == GOAL_ERRORS and not missing,
                    "worst_rss_growth_pct": worst_growth,
                    "rss_ok": worst_growth < GOAL_RSS_GROWTH_PCT},
    }


def _first_after(points: Sequence[tuple[float, int]], t: float) -> int | None:
    after = [v for tt, v in points if tt >= t]
    return after[0] if after else (points[0][1] if points else None)


def _mb(v: int | None) -> float | None:
    return None if v is None else round(v / 2**20, 1)


def print_report(doc: dict[str, Any]) -> None:
    s = doc["settings"]
    print(f"\nSoak: {s['students']} students x {s['teachers']} teachers, {s['minutes']:g} min, batch {s['batch']}, "
          f"student {s['student_ms']:g} ms, teacher {s['teacher_ms']:g} ms  ({doc['machine']['cpu_model']}, "
          f"{doc['machine']['cpu_count']} cores)")
    print(format_table(["t (s)", "samples/s", "errors so far", "mesh cores", "other cores"],
                       [[int(r["t_end_s"]), r["samples_per_s"], r["errors_cumulative"], r["mesh_cores"],
                         r["foreign_cores"]] for r in doc["timeline"]]))
    print()
    print(format_table(["process", "RSS start (MB)", "RSS end (MB)", "growth %", "/metrics start", "/metrics end"],
                       [[r["process"], r["rss_start_mb"], r["rss_end_mb"], r["growth_pct"],
                         r["metrics_rss_start_mb"] if r["metrics_rss_start_mb"] is not None else "-",
                         r["metrics_rss_end_mb"] if r["metrics_rss_end_mb"] is not None else "-"]
                        for r in doc["rss"]]))
    t = doc["totals"]
    v = doc["verdict"]
    print(f"\nbatches {t['batches']:,}, samples {t['samples']:,}; errors {t['errors']} (exceptions {t['exceptions']}, "
          f"lost {t['lost']}, duplicated {t['duplicated']}, wrong outputs {t['wrong_output']}) "
          f"[{'OK' if v['errors_ok'] else 'FAIL'}, goal 0]")
    print(f"worst RSS growth {v['worst_rss_growth_pct']:.2f} % [{'OK' if v['rss_ok'] else 'FAIL'}, goal < "
          f"{GOAL_RSS_GROWTH_PCT:g} %]; mean {doc['throughput']['mean_samples_per_s']} samples/s of "
          f"{doc['demand_samples_per_s']:,.0f} demanded")
    for e in doc["error_events"][:10]:
        print(f"  error: {e['student']} {e.get('kind')}: {e.get('msg')}")


def plot(doc: dict[str, Any], path: Path) -> Path | None:
    """Throughput per window and every process's RSS over time, one figure, two panels."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    tl = doc["timeline"]
    ax1.step([r["t_end_s"] for r in tl], [r["samples_per_s"] for r in tl], where="pre", label="all students")
    ax1.axhline(doc["demand_samples_per_s"], color="grey", ls="--", lw=0.8, label="demand (never waiting)")
    ax1.set_ylabel("student samples/s")
    ax1.set_ylim(bottom=0)
    ax1.legend(loc="lower right")
    s = doc["settings"]
    ax1.set_title(f"Soak: {s['students']} students x {s['teachers']} teachers, batch {s['batch']}, "
                  f"errors {doc['totals']['errors']}")
    for r in doc["rss"]:
        pts = r["samples"]
        ax2.plot([t for t, _ in pts], [v / 2**20 for _, v in pts], lw=1, label=r["process"])
    ax2.axvline(s["warmup_s"], color="grey", ls=":", lw=0.8)
    ax2.set_ylabel("RSS (MiB)")
    ax2.set_xlabel("seconds since start")
    ax2.legend(fontsize=7, ncol=4)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def parse_args(argv: Sequence[str] | None) -> Settings:
    p = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=None, help="soak duration (default 10; 1 with --quick)")
    p.add_argument("--students", type=int, default=8)
    p.add_argument("--teachers", type=int, default=4)
    p.add_argument("--batch", type=int, default=32, help="samples per batch (default 32; W1 is 256)")
    p.add_argument("--student-ms", type=float, default=50.0, help="emulated student step per batch")
    p.add_argument("--teacher-ms", type=float, default=5.0, help="emulated teacher step per batch of up to 256")
    p.add_argument("--interval", type=float, default=10.0, help="throughput window, seconds")
    p.add_argument("--warmup", type=float, default=None, help="RSS baseline after this many seconds "
                   "(default 60; 20 with --quick)")
    p.add_argument("--max-teachers", type=int, default=0, help="students' --distill_max_teachers (0: all)")
    p.add_argument("--quick", action="store_true", help="1 minute, 20 s warm-up; writes soak_quick.json")
    a = p.parse_args(argv)
    minutes = a.minutes if a.minutes is not None else (1.0 if a.quick else 10.0)
    warmup = a.warmup if a.warmup is not None else (20.0 if a.quick else 60.0)
    if minutes <= 0 or a.students < 1 or a.teachers < 1 or a.batch < 1 or a.interval <= 0:
        p.error("--minutes, --interval must be > 0; --students, --teachers, --batch >= 1")
    if warmup >= minutes * 60:
        p.error("--warmup must be shorter than the soak")
    return Settings(minutes=minutes, students=a.students, teachers=a.teachers, batch=a.batch,
                    student_ms=a.student_ms, teacher_ms=a.teacher_ms, interval_s=a.interval, warmup_s=warmup,
                    max_teachers=a.max_teachers, quick=a.quick)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "_student":
        return student_worker(argv[1:])
    s = parse_args(argv)
    doc = run(s)
    name = "soak_quick" if s.quick else "soak"
    path = write_results(name, doc)
    png = plot(doc, RESULTS_DIR / f"{name}.png")
    print_report(doc)
    print(f"\nwrote {path}" + (f" and {png}" if png else ""))
    return 0 if doc["verdict"]["errors_ok"] and doc["verdict"]["rss_ok"] else 1


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
    sys.exit(130)
