"""What a model instance adds to the forward pass: one batch of small requests run the way
teacher-server runs it, against the model's own call on the same rows.

    .venv/bin/python -m benchmarks.instance_path [--reps 7] [--requests 32] [--rows 8] [--cpus 1]
                                                 [--quick] [--out instance_path]

A `ModelInstance` runs `--requests` requests of `--rows` RefTeacher rows each as one batch, on the
calling thread: the requests' inputs concatenated, the forward pass, the check for non-finite
outputs, the transforms, and each request's answer encoded for the wire. The in-process variant
calls `model(x)` on the same rows already in one tensor (W2's and W3's baseline). Both run once
per repetition, interleaved, for RefTeacher and for the same MLP with a hidden width of 8, whose
forward pass is small enough for the instance's own cost to show. No gRPC, no event loop, no
batcher: what is left over is the instance's share of a served request's host CPU, the part that
a GPU does not take off the host (`benchmarks.serving` measures the whole request).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from benchmarks.common import format_table, interleave, machine_info, median, run_and_report
from benchmarks.pinning import CpuListError, parse_cpu_list, pin_process
from benchmarks.serving_measure import INPUT_SHAPE
from examples.refteacher import RefTeacher
from teacher_server.instance import ModelInstance
from teacher_server.malloc_tuning import tune_malloc
from teacher_server.model import load_model
from teacher_server.transforms import OutputTransform
from teacher_server.work import Work

# name: RefTeacher's hidden width
MODELS = {"ref": 2048, "ref_hidden8": 8}


@dataclass(frozen=True)
class Settings:
    reps: int = 7
    requests: int = 32
    rows: int = 8
    duration_s: float = 1.0
    quick: bool = False
    cpus: tuple[int, ...] = ()
    threads: int = 1
    out: str = "instance_path"


def build(hidden: int) -> RefTeacher:
    """RefTeacher at `hidden` width, seeded (the factory `load_model` calls)."""
    torch.manual_seed(0)
    return RefTeacher(hidden=hidden).eval()


def _timed(call: Callable[[], object], duration_s: float) -> float:
    """Seconds a call, over whole calls filling `duration_s` (one at least)."""
    call()  # warm
    calls, start = 0, time.perf_counter()
    now = start
    while calls == 0 or now - start < duration_s:
        call()
        calls += 1
        now = time.perf_counter()
    return (now - start) / calls


def run(s: Settings) -> dict[str, Any]:
    torch.set_num_threads(s.threads)
    tune_malloc()  # as teacher-server does before its model loads
    if s.cpus:
        pin_process(s.cpus)
    gen = torch.Generator().manual_seed(0)
    inputs = [torch.randn(s.rows, *INPUT_SHAPE, generator=gen) for _ in range(s.requests)]
    works = [Work([x], s.rows, [OutputTransform("LOGITS")], (INPUT_SHAPE,)) for x in inputs]
    batch = torch.cat(inputs)
    instances: dict[str, ModelInstance] = {}
    variants: dict[str, Callable[[], float]] = {}
    try:
        for name, hidden in MODELS.items():
            model = load_model("benchmarks.instance_path:build", device="cpu", model_args={"hidden": hidden})
            inst = instances[name] = ModelInstance(model, 0, max_batch_size=s.requests * s.rows)
            module = model.module

            def forward(module: Any = module) -> None:
                with torch.inference_mode():
                    module(batch)

            variants[f"{name}_inprocess"] = lambda f=forward: _timed(f, s.duration_s)
            variants[f"{name}_instance"] = lambda i=inst: _timed(lambda: i.run(works), s.duration_s)

        def progress(rep: int, name: str, seconds: float) -> None:
            print(f"  rep {rep + 1} {name:<22} {seconds * 1e3:8.3f} ms a batch", flush=True)

        per_rep = interleave(s.reps, variants, progress)
    finally:
        for inst in instances.values():
            inst.close()
    ms = {k: round(median(v) * 1e3, 4) for k, v in per_rep.items()}
    models = {}
    for name in MODELS:
        own, inst_ms = ms[f"{name}_inprocess"], ms[f"{name}_instance"]
        ratios = [a / b for a, b in zip(per_rep[f"{name}_inprocess"], per_rep[f"{name}_instance"], strict=True)]
        models[name] = {"inprocess_ms": own, "instance_ms": inst_ms,
                        "added_us_a_request": round((inst_ms - own) * 1e3 / s.requests, 2),
                        "inprocess_over_instance": round(median(ratios), 4)}
    return {
        "benchmark": "instance_path (a ModelInstance's batch against model(x) on the same rows)",
        "machine": machine_info(s.threads) | {"cpus": list(s.cpus) or None},
        "settings": asdict(s),
        "ms_a_batch_medians": ms,
        "models": models,
        "per_rep_ms": {k: [round(v * 1e3, 4) for v in vs] for k, vs in per_rep.items()},
    }


def report(doc: dict[str, Any]) -> str:
    s = doc["settings"]
    rows = [[f"RefTeacher, hidden {MODELS[name]}", m["inprocess_ms"], m["instance_ms"], m["added_us_a_request"],
             m["inprocess_over_instance"]] for name, m in doc["models"].items()]
    return "\n".join([
        format_table(["model", "model(x) ms", "instance ms", "added us a request", "model(x) / instance"], rows),
        "",
        f"one batch of {s['requests']} requests x {s['rows']} rows; ms: median of {s['reps']} interleaved "
        "repetitions; ratio: median of the paired ratios.",
        f"machine: {doc['machine']['cpu_model']}, {s['threads']} torch thread(s)"
        + (f", on cores {doc['machine']['cpus']}" if doc["machine"]["cpus"] else ""),
    ])


def parse_args(argv: Sequence[str] | None) -> Settings:
    p = argparse.ArgumentParser(prog="python -m benchmarks.instance_path", description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=None, help="repetitions (default 7; 1 with --quick)")
    p.add_argument("--requests", type=int, default=Settings.requests, help="requests in the batch (default 32)")
    p.add_argument("--rows", type=int, default=Settings.rows, help="rows a request (default 8, W3's)")
    p.add_argument("--duration", type=float, default=None, help="seconds measured a variant (default 1)")
    p.add_argument("--threads", type=int, default=Settings.threads, help="torch threads (default 1)")
    p.add_argument("--cpus", default="", metavar="LIST", help="cores to run on (taskset -c notation)")
    p.add_argument("--quick", action="store_true", help="a smoke run: one short repetition")
    p.add_argument("--out", default=Settings.out, help="results file: benchmarks/results/<OUT>.json")
    a = p.parse_args(argv)
    reps = a.reps if a.reps is not None else (1 if a.quick else Settings.reps)
    if reps < 1 or a.requests < 1 or a.rows < 1 or a.threads < 1:
        p.error("--reps, --requests, --rows and --threads must be >= 1")
    try:
        cpus = parse_cpu_list(a.cpus) if a.cpus else ()
    except CpuListError as e:
        p.error(str(e))
    if not set(cpus) <= os.sched_getaffinity(0):
        p.error(f"--cpus {a.cpus}: this process may run on cores {sorted(os.sched_getaffinity(0))} only")
    duration = a.duration if a.duration is not None else (0.1 if a.quick else Settings.duration_s)
    return Settings(reps=reps, requests=a.requests, rows=a.rows, duration_s=duration, quick=a.quick,
                    cpus=cpus, threads=a.threads, out=a.out)


def main(argv: Sequence[str] | None = None) -> int:
    s = parse_args(sys.argv[1:] if argv is None else argv)
    return run_and_report(lambda: run(s), s.out, report)


if __name__ == "__main__":
    sys.exit(main())
