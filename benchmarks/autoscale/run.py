"""Runs W4: the repetitions, autoscaled and fixed interleaved, then the report (see the package
docstring, :mod:`benchmarks.autoscale`, for what and why)."""


from __future__ import annotations

import argparse
import asyncio
import contextlib
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, replace
from pathlib import Path
from types import FrameType
from typing import Any

from benchmarks.autoscale.analysis import compare, summarise
from benchmarks.autoscale.pools import AutoscaledPool, FixedPool
from benchmarks.autoscale.profile import run_profile
from benchmarks.autoscale.report import _num, columnar, plot, report
from benchmarks.autoscale.settings import Settings
from benchmarks.autoscale.worker import student_proc, student_worker
from benchmarks.common import RESULTS_DIR, machine_info, shown_path, sigterm_raises, write_results
from benchmarks.students import close_students, stop_sessions


def run(s: Settings) -> dict[str, Any]:
    from discovery.local_etcd import LocalEtcd

    log_dir = Path(tempfile.mkdtemp(prefix="bench-autoscale-"))
    doc: dict[str, Any] = {
        "benchmark": "autoscale (W4: students 1 -> 3 -> 1 on W1 teachers)",
        "machine": machine_info(1) | {"server_torch_threads": s.server_threads},
        "settings": asdict(s),
        "oracle": {"needed": s.oracle, "student_samples_per_s": s.student_rate,
                   "teacher_capacity_samples_per_s": s.teacher_capacity,
                   "rule": "ceil(students x student rate / teacher capacity): the smallest pool at which no student "
                           "waits; it spends exactly that count per phase, start-up free"},
        "method": ("one etcd; the distill-autoscaler CLI (local backend) as a subprocess starting teacher-server "
                   "subprocesses; three student subprocesses (DistillReader on the registry, emulated 25 ms step) "
                   "following the profile; the same profile against a fixed pool of the oracle's peak size. "
                   f"{s.reps} repetition(s), autoscaled then fixed in each; ratios are medians of per-repetition "
                   "ratios (one repetition by default to fit the ~6 min budget; docs/design/workloads.md asks 5 "
                   "for ratios: use --reps 5)."),
        "runs": [],
        "summaries": [],
    }
    print(f"logs in {log_dir}", flush=True)
    try:
        with contextlib.ExitStack() as stack:
            etcd = stack.enter_context(LocalEtcd())
            students = [student_proc(i, etcd.address, s, log_dir) for i in range(max(s.students))]
            stack.callback(close_students, students)
            for st in students:
                st.launch()
            for st in students:
                st.wait_ready(time.monotonic() + 90)
            print(f"etcd at {etcd.address}; {len(students)} students ready (pids "
                  f"{', '.join(str(st.pid) for st in students)})", flush=True)
            for rep in range(s.reps):
                for mode in ("autoscaled", "fixed"):
                    service = f"w4-{mode}-r{rep}"
                    started = time.monotonic()
                    with contextlib.ExitStack() as run_stack:
                        pool: AutoscaledPool | FixedPool
                        if mode == "autoscaled":
                            pool = AutoscaledPool(etcd.address, service, s, log_dir)
                            run_stack.callback(pool.close)
                            pool.launch()
                        else:
                            pool = FixedPool(etcd.address, service, s, run_stack)
                            pool.launch()
                        # Unwound first (on errors and Ctrl-C): the students end their sessions
                        # while the pool still serves them, instead of waiting on teachers that left.
                        run_stack.callback(stop_sessions, students)
                        result = asyncio.run(run_profile(mode, rep, s, registry_address=etcd.address, students=students,
                                                         pool=pool))
                    summary = summarise(result, s)
                    doc["runs"].append(asdict(result))
                    doc["summaries"].append(summary)
                    print(f"  rep {rep + 1}/{s.reps} {mode:10s} warm-up {result.warmup_s:.1f} s, samples"
                          f" {summary['samples']:,} ({summary['samples_per_s']:,.0f}/s), teacher-s"
                          f" {summary['teacher_seconds']:.0f}, steps "
                          + ", ".join(f"{x['needed']}@{_num(x['reached_after_s'])}s" for x in summary["steps"])
                          + f" [{time.monotonic() - started:.0f} s]", flush=True)
    finally:
        if not s.keep_logs:
            shutil.rmtree(log_dir, ignore_errors=True)
        else:
            print(f"logs kept in {log_dir}")
    doc["comparison"] = compare(doc["summaries"], s)
    return doc


def _package_doc() -> str:
    import benchmarks.autoscale

    return benchmarks.autoscale.__doc__ or ""


def parse_args(argv: Sequence[str] | None) -> tuple[Settings, str]:
    """The settings and the result file's name (autoscale, autoscale_quick, or --name)."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.autoscale", description=_package_doc().split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a ~1 minute smoke run: 5/10/10 s phases, 4 s down window")
    p.add_argument("--reps", type=int, default=None, help="repetitions, autoscaled and fixed interleaved (default 1)")
    p.add_argument("--phases", default=None, help="phase lengths in seconds, e.g. 30,40,50")
    p.add_argument("--target-utilisation", type=float, default=None)
    p.add_argument("--busy-threshold", type=float, default=None)
    p.add_argument("--up-window", type=float, default=None)
    p.add_argument("--down-window", type=float, default=None)
    p.add_argument("--period", type=float, default=None, help="the autoscaler's --period")
    p.add_argument("--autoscaler-log-level", choices=["DEBUG", "INFO"], default=None,
                   help="DEBUG logs every decision (INFO: every change and every change of cause)")
    p.add_argument("--keep-logs", action="store_true", help="keep the autoscaler, teacher and student logs")
    p.add_argument("--name", default=None, help="result file name (default autoscale, autoscale_quick)")
    a = p.parse_args(argv)
    s = Settings(keep_logs=a.keep_logs)
    if a.quick:
        s = replace(s, phases_s=(5.0, 10.0, 10.0), down_window_s=4.0, quick=True)
    for flag, key in (("reps", "reps"), ("target_utilisation", "target_utilisation"),
                      ("busy_threshold", "busy_threshold"), ("up_window", "up_window_s"),
                      ("down_window", "down_window_s"), ("period", "period_s"),
                      ("autoscaler_log_level", "autoscaler_log_level")):
        if getattr(a, flag) is not None:
            s = replace(s, **{key: getattr(a, flag)})
    if a.phases:
        s = replace(s, phases_s=tuple(float(x) for x in a.phases.split(",")))
    if len(s.phases_s) != len(s.students) or s.reps < 1:
        p.error("--phases needs one length per phase (3) and --reps must be >= 1")
    return s, a.name or ("autoscale_quick" if s.quick else "autoscale")


@contextlib.contextmanager
def sigint_raises() -> Iterator[None]:
    """Ctrl-C raises KeyboardInterrupt at once, also inside ``asyncio.run``.

    ``asyncio.run`` turns the first Ctrl-C into a cancellation of its main task, which any await
    on the way may absorb (``wait_for`` in 3.11 does when its inner call finishes at that moment);
    the benchmark would then run on. With a handler of our own installed, asyncio leaves SIGINT
    alone, and the ``finally:`` clauses stop every process in order.
    """

    def handler(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["_student"]:
        return student_worker(args[1:])
    s, name = parse_args(args)
    try:
        with sigterm_raises(), sigint_raises():
            doc = run(s)
    except KeyboardInterrupt:
        print("interrupted; every process this benchmark started is stopped", file=sys.stderr)
        return 130
    print()
    print(report(doc))
    png = RESULTS_DIR / f"{name}.png"
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    problem = plot(doc, png)
    doc["plot"] = problem or shown_path(png)
    path = write_results(name, columnar(doc))
    print(f"\nwrote {shown_path(path)}" + (f" and {doc['plot']}" if problem is None else f" ({problem})"))
    errors = [e for x in doc["summaries"] for e in x["errors"]]
    return 1 if errors else 0
