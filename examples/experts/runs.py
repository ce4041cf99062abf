"""The example's units of work, each a function of plain arguments so that ``run_all`` may run
them in worker processes: one teacher's training (``teacher``), one seed's four student arms
(``seed``). A worker sets its own torch threads; its figures come back as plain data, in the
order of the jobs, so the results do not depend on how many workers ran them.
"""

from __future__ import annotations

import multiprocessing
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import torch

from examples.experts import arms
from examples.experts.models import TinyLM, parameter_count, save
from examples.experts.tasks import TASKS, mixed_batches
from examples.experts.train import accuracy, answer_ce, fit, held_out

BATCH = 32
TEACHER_SEED = 7
_T = TypeVar("_T")


def row(acc: Mapping[str, float]) -> str:
    return ", ".join(f"{t} {acc[t]:.3f}" for t in TASKS)


def teacher(name: str, tasks: Sequence[str], file: Path, *, steps: int, lr: float, evaluate: int,
            threads: int) -> dict[str, Any]:
    """One teacher trained on ``tasks``' reference answers and saved to ``file``; its size,
    seconds and held-out accuracy."""
    torch.set_num_threads(threads)
    torch.manual_seed(TEACHER_SEED)
    model = TinyLM("teacher")
    started = time.perf_counter()
    fit(model, mixed_batches(steps, BATCH, TEACHER_SEED, tuple(tasks)), answer_ce, lr=lr)
    save(model, file)
    seconds, acc = round(time.perf_counter() - started, 1), accuracy(model, held_out(evaluate))
    print(f"teacher {name:<10} trained on {'+'.join(tasks)}: {steps} steps in {seconds} s; "
          f"held-out accuracy {row(acc)}", flush=True)
    return {"tasks": list(tasks), "parameters": parameter_count(model), "seconds": seconds, "accuracy": acc}


def seed(seed: int, endpoints: Mapping[str, str], *, steps: int, lr: float, evaluate: int,
         threads: int) -> list[dict[str, Any]]:
    """The four arms of one seed on the same batches, each from the same initial weights."""
    torch.set_num_threads(threads)
    batches = mixed_batches(steps, BATCH, 1000 + seed)
    problems = held_out(evaluate)
    runs = []
    for arm in arms.ARMS:
        torch.manual_seed(seed)
        student = TinyLM("student")
        started = time.perf_counter()
        losses = arms.run(arm, student, batches, endpoints, lr=lr, seed=seed)
        acc = accuracy(student, problems)
        runs.append({"arm": arm, "seed": seed, "accuracy": acc, "final_loss": losses[-1],
                     "seconds": round(time.perf_counter() - started, 1)})
        print(f"seed {seed} {arm:<18} {row(acc)} ({runs[-1]['seconds']} s)", flush=True)
    return runs


def run_all(fn: Callable[..., _T], jobs: Sequence[tuple[tuple[Any, ...], dict[str, Any]]], workers: int) -> list[_T]:
    """``fn(*args, **kwargs)`` for each job, in ``workers`` spawned processes (in this one for 1);
    the results in the jobs' order."""
    if workers <= 1 or len(jobs) <= 1:
        return [fn(*a, **kw) for a, kw in jobs]
    with ProcessPoolExecutor(min(workers, len(jobs)), mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = [pool.submit(fn, *a, **kw) for a, kw in jobs]
        return [f.result() for f in futures]
