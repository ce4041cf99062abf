"""The student's per-batch cost: DistillReader against NVIDIA's generic async client, same teacher.

A teacher that costs nothing (`Echo`: its output is its input, [16] float32 per sample) leaves
only what each side spends per batch: encoding, the gRPC call, decoding, and for the reader its
loader thread, routing, delivery in order and the hand-over to the training loop. Batches of 8:

  reader      DistillReader(loader, prefetch=16) iterated by a loop that does nothing else; batches
              that reach it together share a request (distill.bundles)
  reader_per_batch  the same with bundle=False: one request per batch, as the generic client
  reader_per_batch_stream  the same with transport="stream": every request on one ModelStreamInfer
                stream instead of a call each
  tritonclient  tritonclient.grpc.aio.InferenceServerClient with 16 requests in flight, each
                building its InferInput from the batch's numpy array (what a generic client does)

All talk to the same teacher-server process; the variants are interleaved per repetition and
the headline is the median of the per-repetition ratios (reader / tritonclient batches/s). The
teacher's CPU per batch is read from its process over each pass.
`--profile` runs one reader pass under cProfile (engine thread and training-loop thread) instead.

    python -m benchmarks.reader_overhead            # 7 repetitions of 3,000 batches
    python -m benchmarks.reader_overhead --quick    # 3 repetitions of 600 batches
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import os
import pstats
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from benchmarks.common import REPO_ROOT, interleave, machine_info, median, paired_ratios, run_and_report
from benchmarks.cpu import process_cpu_seconds
from teacher_server.launch import TeacherProcess
from teacher_server.spec import ModelIO

WIDTH = 16
ROWS = 8
IN_FLIGHT = 16


class Echo(nn.Module):
    """A teacher that costs nothing: Y is X (copied, as any model's output is a new tensor)."""

    io_spec = ModelIO.parse([f"X:FP32:{WIDTH}"], [f"Y:FP32:{WIDTH}"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.clone()


def build() -> Echo:
    return Echo()


def _batches(n: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [{"X": torch.randn(ROWS, WIDTH, generator=g)} for _ in range(n)]


@dataclass(frozen=True)
class Pass:
    """One measured pass: batches per second of wall time, and this process's CPU time per batch
    (all its threads: the loop's, the loader's, gRPC's), which other processes on the machine
    barely disturb."""

    batches_per_s: float
    cpu_us_per_batch: float
    bundled: float = 0.0  # the share of batches that went in a request with others
    teacher_cpu_us_per_batch: float = 0.0  # the teacher process's CPU over the pass, per batch


def reader_rate(endpoint: str, batches: list[dict[str, torch.Tensor]], bundle: bool = True, *,
                transport: str = "call", teacher_pid: int | None = None) -> Pass:
    """One pass of a started DistillReader (connecting is not timed); `bundle=False`: a call per batch;
    `transport="stream"`: requests on one stream."""
    from distill import DistillReader

    with DistillReader(batches, teachers=endpoint, inputs=["X"], outputs=["Y"], prefetch=IN_FLIGHT,
                       hedge_after=None, bundle=bundle, transport=transport) as reader:
        started, cpu = time.perf_counter(), time.process_time()
        teacher_cpu = process_cpu_seconds(teacher_pid) if teacher_pid else 0.0
        n = 0
        last: Any = None
        for _, last in reader:  # noqa: B007 (the last answer is checked below)
            n += 1
        elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
        teacher_cpu = process_cpu_seconds(teacher_pid) - teacher_cpu if teacher_pid else 0.0
        bundled = reader.stats().bundled
    assert n == len(batches) and last["Y"].shape == (ROWS, WIDTH)
    assert bundle or bundled == 0
    return Pass(n / elapsed, cpu / n * 1e6, bundled / n, teacher_cpu / n * 1e6)


async def _triton_pass(endpoint: str, arrays: list[np.ndarray], teacher_pid: int | None) -> Pass:
    from tritonclient.grpc import InferInput, InferRequestedOutput
    from tritonclient.grpc.aio import InferenceServerClient

    client = InferenceServerClient(endpoint)
    try:
        await client.infer("echo", [_input(InferInput, arrays[0])], outputs=[InferRequestedOutput("Y")])  # connect
        next_index = 0

        async def worker() -> int:
            nonlocal next_index
            done = 0
            while next_index < len(arrays):
                x = arrays[next_index]
                next_index += 1
                result = await client.infer("echo", [_input(InferInput, x)], outputs=[InferRequestedOutput("Y")])
                assert result.as_numpy("Y").shape == (ROWS, WIDTH)
                done += 1
            return done

        started, cpu = time.perf_counter(), time.process_time()
        teacher_cpu = process_cpu_seconds(teacher_pid) if teacher_pid else 0.0
        counts = await asyncio.gather(*(worker() for _ in range(IN_FLIGHT)))
        elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
        teacher_cpu = process_cpu_seconds(teacher_pid) - teacher_cpu if teacher_pid else 0.0
    finally:
        await client.close()
    assert sum(counts) == len(arrays)
    return Pass(len(arrays) / elapsed, cpu / len(arrays) * 1e6, 0.0, teacher_cpu / len(arrays) * 1e6)


def _input(cls: Any, x: np.ndarray) -> Any:
    inp = cls("X", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    return inp


def triton_rate(endpoint: str, batches: list[dict[str, torch.Tensor]], teacher_pid: int | None = None) -> Pass:
    """Batches/s of tritonclient.grpc.aio with IN_FLIGHT requests in flight, on its own event loop."""
    arrays = [b["X"].numpy() for b in batches]
    return asyncio.run(_triton_pass(endpoint, arrays, teacher_pid))


def profile(endpoint: str, batches: list[dict[str, torch.Tensor]], top: int) -> None:
    """One reader pass under cProfile: the engine's thread and the training loop's, printed apart."""
    from distill import DistillReader

    engine_prof, loop_prof = cProfile.Profile(), cProfile.Profile()
    with DistillReader(batches, teachers=endpoint, inputs=["X"], outputs=["Y"], prefetch=IN_FLIGHT,
                       hedge_after=None) as reader:
        ev = reader._loop  # the engine's event loop (a private attribute: profiling only)
        assert ev is not None
        ev.call_soon_threadsafe(engine_prof.enable)
        loop_prof.enable()
        for _ in reader:
            pass
        loop_prof.disable()
        done = asyncio.run_coroutine_threadsafe(_disable(engine_prof), ev)
        done.result(10)
    for name, prof in (("engine thread", engine_prof), ("training-loop thread", loop_prof)):
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
        print(f"==== {name} ====\n{out.getvalue()}")


async def _disable(prof: cProfile.Profile) -> None:
    prof.disable()


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(1)
    server = ["--model", "benchmarks.reader_overhead:build", "--name", "echo", "--device", "cpu", "--port", "0",
              "--max-batch-size", "128", "--instances", "1", "--log-level", "WARNING"]
    batches = _batches(args.batches)
    with TeacherProcess(server, label="echo", cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
                        stop_grace=20.0) as teacher:
        endpoint = teacher.endpoint
        reader_rate(endpoint, batches[: args.batches // 10])  # warm both paths (imports, the server's batcher)
        triton_rate(endpoint, batches[: args.batches // 10])

        pid = teacher.pid

        def show(rep: int, name: str, p: Pass) -> None:
            print(f"rep {rep}  {name:<24} {p.batches_per_s:8.0f} batches/s  {p.cpu_us_per_batch:6.0f} us CPU/batch"
                  f"  teacher {p.teacher_cpu_us_per_batch:6.0f} us  {p.bundled:4.0%} bundled", flush=True)

        passes = interleave(args.reps, {
            "reader": lambda: reader_rate(endpoint, batches, teacher_pid=pid),
            "reader_per_batch": lambda: reader_rate(endpoint, batches, bundle=False, teacher_pid=pid),
            "reader_per_batch_stream": lambda: reader_rate(endpoint, batches, bundle=False, transport="stream",
                                                           teacher_pid=pid),
            "tritonclient": lambda: triton_rate(endpoint, batches, pid)}, show)
    per_rep = {name: [p.batches_per_s for p in ps] for name, ps in passes.items()}
    cpu = {name: [p.cpu_us_per_batch for p in ps] for name, ps in passes.items()}
    readers = ("reader", "reader_per_batch", "reader_per_batch_stream")
    ratios = {name: paired_ratios(per_rep[name], per_rep["tritonclient"]) for name in readers}
    cpu_ratios = {name: paired_ratios(cpu["tritonclient"], cpu[name]) for name in readers}
    teacher_cpu = {name: [p.teacher_cpu_us_per_batch for p in ps] for name, ps in passes.items()}
    stream_vs_call = paired_ratios(per_rep["reader_per_batch_stream"], per_rep["reader_per_batch"])
    return {
        "benchmark": "reader_overhead",
        "settings": {"batches": args.batches, "rows_per_batch": ROWS, "sample": f"FP32[{WIDTH}]",
                     "requests_in_flight": IN_FLIGHT, "reps": args.reps, "teacher": "Echo (Y = X), 1 instance",
                     "reader": "DistillReader defaults (bundle=True)",
                     "reader_per_batch": "DistillReader(bundle=False)",
                     "reader_per_batch_stream": "DistillReader(bundle=False, transport='stream')"},
        "machine": machine_info(),
        "batches_per_s": {name: [round(r, 1) for r in rates] for name, rates in per_rep.items()},
        "median_batches_per_s": {name: round(median(rates), 1) for name, rates in per_rep.items()},
        "bundled_share": [round(p.bundled, 3) for p in passes["reader"]],
        "ratios": {name: [round(r, 3) for r in rs] for name, rs in ratios.items()},
        "ratio_reader_vs_tritonclient": round(median(ratios["reader"]), 3),
        "ratio_reader_per_batch_vs_tritonclient": round(median(ratios["reader_per_batch"]), 3),
        "ratio_reader_per_batch_stream_vs_tritonclient": round(median(ratios["reader_per_batch_stream"]), 3),
        "ratios_stream_vs_call": [round(r, 3) for r in stream_vs_call],
        "ratio_stream_vs_call": round(median(stream_vs_call), 3),
        "median_teacher_cpu_us_per_batch": {name: round(median(cs), 1) for name, cs in teacher_cpu.items()},
        "cpu_us_per_batch": {name: [round(c, 1) for c in cs] for name, cs in cpu.items()},
        "median_cpu_us_per_batch": {name: round(median(cs), 1) for name, cs in cpu.items()},
        "cpu_ratios": {name: [round(r, 3) for r in rs] for name, rs in cpu_ratios.items()},
        "cpu_ratio_tritonclient_vs_reader": round(median(cpu_ratios["reader"]), 3),
        "cpu_ratio_tritonclient_vs_reader_per_batch": round(median(cpu_ratios["reader_per_batch"]), 3),
        "goal": ">= 1.0",
    }


def report(doc: dict[str, Any]) -> str:
    med, rates, cpu = doc["median_batches_per_s"], doc["batches_per_s"], doc["median_cpu_us_per_batch"]
    teacher = doc.get("median_teacher_cpu_us_per_batch", {})
    lines = [f"{name:<24} {med[name]:8.0f} batches/s, {cpu[name]:5.0f} us CPU/batch, teacher "
             f"{teacher.get(name, float('nan')):5.0f} us (medians; per rep {rates[name]})"
             for name in ("reader", "reader_per_batch", "reader_per_batch_stream", "tritonclient")]
    lines += [f"reader / tritonclient            {doc['ratio_reader_vs_tritonclient']:.3f} batches/s (per rep "
              f"{doc['ratios']['reader']}; goal {doc['goal']}); batches bundled per rep {doc['bundled_share']}",
              f"reader per batch / tritonclient  {doc['ratio_reader_per_batch_vs_tritonclient']:.3f} (per rep "
              f"{doc['ratios']['reader_per_batch']})",
              f"reader per batch, stream / call  {doc['ratio_stream_vs_call']:.3f} (per rep "
              f"{doc['ratios_stream_vs_call']}); / tritonclient "
              f"{doc['ratio_reader_per_batch_stream_vs_tritonclient']:.3f}",
              f"CPU per batch, tritonclient / reader {doc['cpu_ratio_tritonclient_vs_reader']:.3f}, "
              f"/ reader per batch {doc['cpu_ratio_tritonclient_vs_reader_per_batch']:.3f}"]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="3 repetitions of 600 batches")
    p.add_argument("--reps", type=int, default=None)
    p.add_argument("--batches", type=int, default=None)
    p.add_argument("--profile", action="store_true", help="profile one reader pass instead of measuring")
    p.add_argument("--top", type=int, default=30, help="functions shown per thread with --profile")
    args = p.parse_args(argv)
    args.reps = args.reps or (3 if args.quick else 7)
    args.batches = args.batches or (600 if args.quick else 3000)
    if args.profile:
        with TeacherProcess(["--model", "benchmarks.reader_overhead:build", "--name", "echo", "--device", "cpu",
                             "--port", "0", "--max-batch-size", "128", "--instances", "1", "--log-level", "WARNING"],
                            label="echo", cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}) as t:
            reader_rate(t.endpoint, _batches(200))
            profile(t.endpoint, _batches(args.batches), args.top)
        return 0
    name = "reader_overhead_quick" if args.quick else "reader_overhead"
    return run_and_report(lambda: run(args), name, report)


if __name__ == "__main__":
    sys.exit(main())
