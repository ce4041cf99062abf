"""W8, per-sample routing: one reader routing each batch's rows to two teacher services against two
readers each fed its own rows (the same rows, the same teachers).

Two teacher-server processes stand for two experts ("math" and "code"), each an emulated
accelerator (`Expert`: an affine map plus a fixed sleep per batch, the GIL released) of its own
weights. The batches' rows name their expert, 70/30:

  routed   DistillReader(loader, teachers={"math": ..., "code": ...}, route_by="teacher"): one
           training loop gets each batch with one dict of outputs, its rows in order
  split    two DistillReaders, one per expert, each iterating that expert's rows of the same
           batches, on two threads: what a user does without routing (and then has to join the
           two halves of every batch back together, which is not timed here)

Both sides send the same rows to the same servers; the variants are interleaved per repetition and
the headline is the median of the per-repetition ratios (routed / split rows per second). Every
routed batch's outputs are checked against the experts' in-process answers once per run. Each side
also reports its calls in flight per expert (the reader's stats every `SAMPLE_EVERY` batches,
averaged over the repetitions): what the router's adaptive in-flight limits let each teacher hold,
a figure steadier than rows per second on a busy machine.

    python -m benchmarks.routing            # 5 repetitions of 1,500 batches
    python -m benchmarks.routing --quick    # 3 repetitions of 300 batches
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from collections.abc import Sequence
from statistics import median
from typing import Any

import torch
from torch import nn

from benchmarks.common import (
    REPO_ROOT,
    interleave,
    machine_info,
    paired_ratios,
    rate_fields,
    rate_report,
    run_and_report,
)
from benchmarks.cpu import process_cpu_seconds, self_cpu_seconds
from teacher_server.launch import TeacherProcess
from teacher_server.spec import ModelIO

WIDTH = 16
ROWS = 32  # per batch
MATH_SHARE = 0.7
SLEEP_S = 0.002  # per teacher batch: an emulated accelerator's step
GOAL = 0.95
SAMPLE_EVERY = 10  # batches between two looks at a reader's calls in flight


class Expert(nn.Module):
    """y = x @ W + b, after a fixed sleep per batch; `scale` gives each expert weights of its own."""

    io_spec = ModelIO.parse([f"X:FP32:{WIDTH}"], [f"Y:FP32:{WIDTH}"])

    def __init__(self, scale: float) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.w = nn.Parameter(torch.randn(WIDTH, WIDTH, generator=g) * scale)
        self.b = nn.Parameter(torch.full((WIDTH,), scale))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(SLEEP_S)
        return x @ self.w + self.b


def build_math() -> Expert:
    return Expert(1.0)


def build_code() -> Expert:
    return Expert(-0.5)


def _batches(n: int) -> list[dict[str, Any]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        to_math = torch.rand(ROWS, generator=g) < MATH_SHARE
        out.append({"X": torch.randn(ROWS, WIDTH, generator=g), "teacher": ["math" if m else "code" for m in to_math],
                    "to_math": to_math})
    return out


def _own_rows(batches: list[dict[str, Any]], math: bool) -> list[dict[str, torch.Tensor]]:
    """Each batch's rows of one expert (a batch with none of them is left out)."""
    parts = []
    for b in batches:
        mask = b["to_math"] if math else ~b["to_math"]
        if bool(mask.any()):
            parts.append({"X": b["X"][mask].contiguous()})
    return parts


def _check(batches: list[dict[str, Any]], outputs: list[torch.Tensor]) -> None:
    math, code = build_math(), build_code()
    with torch.inference_mode():
        for b, y in zip(batches, outputs, strict=True):
            want = torch.where(b["to_math"].unsqueeze(1), b["X"] @ math.w + math.b, b["X"] @ code.w + code.b)
            assert torch.allclose(y, want, atol=1e-4), "a routed row got another expert's answer"


def _per_service(reader: Any, figure: str, into: dict[str, list[int]] | None, name: dict[str, str]) -> None:
    """Append each service's `figure` of the reader's teacher stats, summed over its teachers, to
    `into[name[service]]` (None: not kept): "in_flight", its calls in flight now; "ok", the calls
    it has had answered."""
    if into is None:
        return
    for service, teachers in reader.stats().teachers.items():
        into[name[service]].append(sum(int(figures[figure]) for figures in teachers.values()))


def routed_rate(endpoints: dict[str, str], batches: list[dict[str, Any]], check: bool = False,
                in_flight: dict[str, list[int]] | None = None, calls: dict[str, list[int]] | None = None) -> float:
    """Rows per second of one routing reader over `batches` (connecting is not timed); samples of its
    calls in flight per service go to `in_flight`, the calls it made per service to `calls`."""
    from distill import DistillReader

    outputs = []
    with DistillReader(batches, teachers=endpoints, route_by="teacher", inputs=["X"], outputs=["Y"],
                       hedge_after=None, prefetch=16) as reader:
        started = time.perf_counter()
        rows = 0
        for i, (batch, teacher) in enumerate(reader):
            rows += len(batch["teacher"])
            if check:
                outputs.append(teacher["Y"])
            if i % SAMPLE_EVERY == SAMPLE_EVERY - 1:
                _per_service(reader, "in_flight", in_flight, {s: s for s in endpoints})
        elapsed = time.perf_counter() - started
        _per_service(reader, "ok", calls, {s: s for s in endpoints})
    if check:
        _check(batches, outputs)
    return rows / elapsed


def split_rate(endpoints: dict[str, str], batches: list[dict[str, Any]],
               in_flight: dict[str, list[int]] | None = None, calls: dict[str, list[int]] | None = None) -> float:
    """Rows per second of two readers, one per expert, each over its own rows, on two threads;
    samples of each one's calls in flight go to `in_flight` under its expert, its calls to `calls`."""
    from distill import DistillReader

    parts = {"math": _own_rows(batches, True), "code": _own_rows(batches, False)}
    readers = {s: DistillReader(parts[s], teachers=endpoints[s], inputs=["X"], outputs=["Y"], hedge_after=None,
                                prefetch=16).start() for s in parts}
    counts: dict[str, int] = {}
    errors: list[BaseException] = []

    def drain(service: str) -> None:
        try:
            rows = 0
            for i, (b, _) in enumerate(readers[service]):
                rows += len(b["X"])
                if i % SAMPLE_EVERY == SAMPLE_EVERY - 1:
                    _per_service(readers[service], "in_flight", in_flight, {"teachers": service})
            counts[service] = rows
        except BaseException as e:  # surfaced below
            errors.append(e)

    try:
        threads = [threading.Thread(target=drain, args=(s,), name=f"w8-{s}") for s in parts]
        started = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.perf_counter() - started
        for service, r in readers.items():
            _per_service(r, "ok", calls, {"teachers": service})
    finally:
        for r in readers.values():
            r.close()
    if errors:
        raise errors[0]
    return sum(counts.values()) / elapsed


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(1)
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}

    def server(factory: str) -> TeacherProcess:
        return TeacherProcess(["--model", f"benchmarks.routing:{factory}", "--name", "expert", "--device", "cpu",
                               "--port", "0", "--max-batch-size", "64", "--instances", "1", "--log-level", "WARNING"],
                              label=factory, cwd=REPO_ROOT, env=env, stop_grace=20.0)

    batches = _batches(args.batches)
    with server("build_math") as math, server("build_code") as code:
        endpoints = {"math": math.endpoint, "code": code.endpoint}
        routed_rate(endpoints, batches[: max(20, args.batches // 10)], check=True)  # warm both paths, and check
        split_rate(endpoints, batches[: max(20, args.batches // 10)])

        def show(rep: int, name: str, rate: float) -> None:
            print(f"rep {rep}  {name:<7} {rate:9.0f} rows/s", flush=True)

        in_flight: dict[str, dict[str, list[int]]] = {v: {s: [] for s in endpoints} for v in ("routed", "split")}
        cpu: dict[str, dict[str, list[float]]] = {v: {"readers": [], "teachers": []} for v in ("routed", "split")}
        calls: dict[str, dict[str, list[int]]] = {v: {s: [] for s in endpoints} for v in ("routed", "split")}
        rows = sum(len(b["teacher"]) for b in batches)
        math_rows = sum(int(b["to_math"].sum()) for b in batches)
        expert_rows = {"math": math_rows, "code": rows - math_rows}

        def teachers_cpu() -> float:
            return process_cpu_seconds(math.pid) + process_cpu_seconds(code.pid)

        def counted(variant: str, measure: Any) -> Any:
            """`measure` with this process's and the teachers' CPU seconds per row recorded."""
            def run_it() -> float:
                ours, theirs = self_cpu_seconds(), teachers_cpu()
                rate = float(measure())
                cpu[variant]["readers"].append((self_cpu_seconds() - ours) / rows * 1e6)
                cpu[variant]["teachers"].append((teachers_cpu() - theirs) / rows * 1e6)
                return rate
            return run_it

        rates = interleave(args.reps, {
            "routed": counted("routed", lambda: routed_rate(endpoints, batches, in_flight=in_flight["routed"],
                                                            calls=calls["routed"])),
            "split": counted("split", lambda: split_rate(endpoints, batches, in_flight["split"], calls["split"])),
        }, show)
    ratios = paired_ratios(rates["routed"], rates["split"])
    return {
        "benchmark": "routing",
        "workload": "W8",
        "settings": {"batches": args.batches, "rows_per_batch": ROWS, "math_share": MATH_SHARE,
                     "sample": f"FP32[{WIDTH}]", "reps": args.reps,
                     "teachers": f"2 experts, affine + {SLEEP_S * 1000:g} ms sleep per batch, max batch 64, 1 instance",
                     "routed": "one DistillReader(route_by='teacher', prefetch=16)",
                     "split": "two DistillReaders (prefetch=16 each), one per expert's rows, on two threads"},
        "machine": machine_info(),
        **rate_fields(rates, ratios, "ratio_routed_vs_split", GOAL),
        "calls_in_flight": {v: {s: round(sum(xs) / len(xs), 2) if xs else None for s, xs in by_service.items()}
                            for v, by_service in in_flight.items()},
        "cpu_us_per_row": {v: {k: round(median(xs), 1) for k, xs in by_part.items()} for v, by_part in cpu.items()},
        "rows_per_call": {v: {s: _rows_per_call(expert_rows[s], xs) for s, xs in by_service.items()}
                          for v, by_service in calls.items()},
    }


def _rows_per_call(rows: int, calls: list[int]) -> float | None:
    """An expert's rows over the median calls of a pass (None when no pass called it)."""
    typical = median(calls) if calls else 0
    return round(rows / typical, 1) if typical else None


def report(doc: dict[str, Any]) -> str:
    table = rate_report(doc, ("routed", "split"), "ratio_routed_vs_split")
    shown = "; ".join(f"{v} " + ", ".join(f"{s} {n}" for s, n in by_service.items())
                      for v, by_service in doc["calls_in_flight"].items())
    cpu = "; ".join(f"{v} readers {x['readers']}, teachers {x['teachers']}"
                    for v, x in doc.get("cpu_us_per_row", {}).items())
    per_call = "; ".join(f"{v} " + ", ".join(f"{s} {n}" for s, n in by_service.items())
                         for v, by_service in doc.get("rows_per_call", {}).items())
    return (f"{table}\ncalls in flight per expert (mean): {shown}\nCPU µs per row (median): {cpu}\n"
            f"rows per call to each expert (median calls of a pass): {per_call}")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--quick", action="store_true", help="3 repetitions of 300 batches")
    p.add_argument("--reps", type=int, default=None)
    p.add_argument("--batches", type=int, default=None)
    args = p.parse_args(argv)
    args.reps = args.reps or (3 if args.quick else 5)
    args.batches = args.batches or (300 if args.quick else 1500)
    name = "routing_quick" if args.quick else "routing"
    return run_and_report(lambda: run(args), name, report)


if __name__ == "__main__":
    sys.exit(main())
