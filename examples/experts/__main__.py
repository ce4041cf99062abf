"""``python -m examples.experts``: train two experts and a generalist, serve them, train the student four ways.

The whole comparison in one command: the teachers (an expert per task, trained on that task only,
and a generalist of the same size trained on both for the same steps and batch size), their
teacher servers on loopback, then for each seed the four arms of ``examples.experts.arms`` on the
same batches and step budget. Prints the held-out exact-match accuracy per arm and task (mean ±
std over the seeds) and writes every figure as JSON. ``--jobs`` worker processes (``runs.run_all``)
train the teachers and run the seeds side by side. ``--quick``: small step counts and one seed,
the pipeline end to end (what the test runs).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from examples.common import cache_dir, exit_on_sigterm
from examples.experts import arms, mesh
from examples.experts import runs as runs_
from examples.experts.models import TinyLM, parameter_count
from examples.experts.tasks import TASKS

RESULTS = Path(__file__).with_name("results.json")
TEACHERS = {"add": ("add",), "rev": ("rev",), "generalist": TASKS}
"""Each teacher and the tasks it trains on; the experts are named after their task."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m examples.experts", description=__doc__.split("\n")[0])
    p.add_argument("--teacher-steps", type=int, default=800, help="training steps of each teacher (default: 800)")
    p.add_argument("--steps", type=int, default=400, help="training steps of each student arm (default: 400)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="student seeds (default: 0 1 2)")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate, teachers and students (default: 3e-3)")
    p.add_argument("--eval", type=int, default=300, help="held-out problems per task (default: 300)")
    p.add_argument("--threads", type=int, default=1, help="torch threads of the student, and of each teacher server")
    p.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1),
                   help="worker processes for the teachers' training and the seeds (default: 2, or 1 on one core)")
    p.add_argument("--out", type=Path, default=None,
                   help="the JSON results (default: examples/experts/results.json; with --quick, "
                        "<cache>/experts/results-quick.json)")
    p.add_argument("--quick", action="store_true", help="120 teacher steps, 10 student steps, one seed, 50 problems")
    return p


def summary(runs: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, float]]]:
    """Per arm and task: the mean and standard deviation (0 for one seed) of the accuracy over seeds."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for arm in arms.ARMS:
        per_task = {}
        for task in TASKS:
            values = [r["accuracy"][task] for r in runs if r["arm"] == arm]
            per_task[task] = {"mean": statistics.fmean(values),
                              "std": statistics.stdev(values) if len(values) > 1 else 0.0}
        out[arm] = per_task
    return out


def table(teachers: dict[str, Any], means: dict[str, dict[str, dict[str, float]]], seeds: int) -> str:
    lines = [f"{'':<22}" + "".join(f"{t:>16}" for t in TASKS)]
    for name, t in teachers.items():
        lines.append(f"{'teacher ' + name:<22}" + "".join(f"{t['accuracy'][task]:>16.3f}" for task in TASKS))
    lines.append(f"student ({seeds} seed{'s' if seeds > 1 else ''}, mean ± std)")
    for arm, per_task in means.items():
        lines.append(f"{arm:<22}" + "".join(f"{per_task[t]['mean']:>9.3f} ± {per_task[t]['std']:.3f}" for t in TASKS))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.quick:
        args.teacher_steps, args.steps, args.seeds, args.eval = 120, 10, args.seeds[:1], 50
    out = args.out or (cache_dir() / "experts" / "results-quick.json" if args.quick else RESULTS)
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    directory = cache_dir() / "experts" / ("quick" if args.quick else "teachers")
    directory.mkdir(parents=True, exist_ok=True)
    files = {name: directory / f"{name}.pt" for name in TEACHERS}
    work = {"lr": args.lr, "evaluate": args.eval, "threads": args.threads}
    infos = runs_.run_all(runs_.teacher, [((name, tasks, files[name]), {"steps": args.teacher_steps, **work})
                                          for name, tasks in TEACHERS.items()], args.jobs)
    teachers = dict(zip(TEACHERS, infos, strict=True))
    student_parameters = parameter_count(TinyLM("student"))
    with mesh.serve(files, max_batch_size=runs_.BATCH, threads=args.threads) as endpoints:
        print(f"teachers served: {', '.join(f'{n} {e}' for n, e in endpoints.items())}", flush=True)
        per_seed = runs_.run_all(runs_.seed, [((s, endpoints), {"steps": args.steps, **work}) for s in args.seeds],
                                 args.jobs)
    runs = [r for rs in per_seed for r in rs]
    means = summary(runs)
    seconds = time.perf_counter() - started
    print(table(teachers, means, len(args.seeds)))
    print(f"total {seconds:.0f} s (teachers' training included)")
    result = {"settings": {"teacher_steps": args.teacher_steps, "student_steps": args.steps, "batch_size": runs_.BATCH,
                           "seeds": args.seeds, "lr": args.lr, "held_out_per_task": args.eval, "top_k": arms.K,
                           "alpha": arms.ALPHA, "threads": args.threads, "jobs": args.jobs,
                           "quick": args.quick},
              "parameters": {"teacher": teachers["add"]["parameters"], "student": student_parameters},
              "teachers": teachers, "summary": means, "runs": runs, "seconds": round(seconds, 1),
              "machine": {"python": platform.python_version(), "torch": torch.__version__,
                          "cpus": os.cpu_count()}}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    exit_on_sigterm()  # the teacher servers and etcd it starts stop with it
    sys.exit(main())
