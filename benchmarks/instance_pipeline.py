"""How busy one teacher instance keeps its device over a run of batches, without gRPC or a batcher.

    .venv/bin/python -m benchmarks.instance_pipeline --teacher DIR [--device cuda] [--compute-dtype BF16]
        [--sequences 512] [--budget 16384] [--ahead 3] [--trace DIR]

W6 on an H100 left the device idle 40-60 ms a batch with one server instance, and about 40 ms with
the one in-process loop, although issuing a batch takes a quarter of its device time
(`benchmarks/host_bound.py`). This narrows down where: W6's sequences (lengths uniform over
8-1,021) cut into length-sorted batches at the token budget, each batch's transforms as W6 asks
(top-20 log-probs in fp16 and the tail), run
  * alone, one at a time: the sum of their device times (CUDA events), the time a device that
    never waits would take;
  * by a plain loop on one thread (the forward pass and the transforms, nothing synchronised
    between batches): what the in-process baseline's structure costs;
  * through a `ModelInstance`, `--ahead` batches launched and unfinished at most, as the batcher
    drives it (staging, the forward pass and transforms on its own thread and CUDA stream, the
    host copies on its finishing thread);
each with the attention mask and without it (what the server now runs for a right-padded batch).
Busy fraction: the device-time sum over the wall time. With `--trace DIR`, the instance's and the
plain loop's runs are also recorded with torch.profiler (Chrome traces,
`DIR/{instance,loop}_{masked,unmasked}.json.gz`), which show every gap on the device's timeline,
and summarised where they were written (`benchmarks.trace_gaps`: the gaps and the host's CUDA calls
and operators during them). On CUDA each run also counts the caching allocator's device
allocations, frees and retries: a `cudaFree` waits for the device. On the CPU host and device are
one, so the fractions are near 1 there; the benchmark runs, and is tested, on any machine.
"""

from __future__ import annotations

import argparse
import functools
import gzip
import shutil
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from benchmarks.batching_sim import draw_lengths
from benchmarks.common import format_table, machine_info, run_and_report, sorted_groups
from benchmarks.device import DeviceChoice, add_device_args
from benchmarks.host_bound import W6_WANT, Probe
from benchmarks.llm_parts import padded_batches
from benchmarks.trace_gaps import load_trace, summarize
from benchmarks.trace_gaps import report as trace_report
from teacher_server.finishing import BatchResult
from teacher_server.instance import ModelInstance
from teacher_server.model import LoadedModel, load_model
from teacher_server.outputs import OutputContext, transform_output
from teacher_server.spec import TensorSpec
from teacher_server.validation import pad_plan
from teacher_server.work import Work


def make_works(model: LoadedModel, seqs: list[list[int]], *, masked: bool) -> list[Work]:
    """One Work a sequence; `masked=False` counts its mask as the server's RowSplitter does, so the
    instance may leave the mask out; `masked=True` leaves it uncounted, so the mask is passed."""
    plan = pad_plan(model.io)
    works = []
    for seq in seqs:
        ids = torch.tensor([seq], dtype=torch.long)
        works.append(Work([ids, torch.ones_like(ids)], 1, [W6_WANT], (), len(seq), plan,
                          useful=None if masked else len(seq)))
    return works


ALLOCATOR_COUNTS = ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams")


def allocator_counts(cuda: bool) -> dict[str, int]:
    """The CUDA caching allocator's counters so far (empty off CUDA)."""
    if not cuda:
        return {}
    stats = torch.cuda.memory_stats()
    return {k: int(stats.get(k, 0)) for k in ALLOCATOR_COUNTS}


def counted(fn: Callable[[], float], cuda: bool) -> tuple[float, dict[str, int]]:
    """`fn()` and how much each allocator counter grew during it."""
    before = allocator_counts(cuda)
    out = fn()
    after = allocator_counts(cuda)
    return out, {k: after[k] - before[k] for k in after}


def wall_s(fn: Callable[[], Any], choice: DeviceChoice) -> float:
    """Wall time of `fn`, the device drained before and after."""
    choice.synchronize()
    t0 = time.perf_counter()
    fn()
    choice.synchronize()
    return time.perf_counter() - t0


def plain_step(model: LoadedModel, inputs: tuple[torch.Tensor, torch.Tensor], mask: bool) -> None:
    """The forward pass to hidden states and W6's transforms, as an instance runs them, on this thread."""
    module: Any = model.module
    ids, attention = inputs
    hidden = module.hidden(ids, attention if mask else None)[0]
    spec = TensorSpec("LOGITS", "FP32", (-1, int(module.width)), per_position=True)
    transform_output(hidden, spec, W6_WANT, OutputContext(None, module.head, int(module.width)))


def run_instance(inst: ModelInstance, batches: list[list[Work]], ahead: int) -> None:
    """Launch every batch, at most `ahead` unfinished, as the batcher does (from this thread, not
    the instance's own, so that a trace records the launches' host work too; the device work is
    the same: the instance's CUDA stream, its staging and its finishing thread)."""
    pending: list[Future[BatchResult]] = []
    for works in batches:
        while len(pending) >= ahead:
            pending.pop(0).result()
        pending.append(inst.launch(works))
    for f in pending:
        f.result()


@contextmanager
def traced(path: Path | None, cuda: bool) -> Iterator[None]:
    """torch.profiler over the region, written as a gzipped Chrome trace to `path` (None: off)."""
    if path is None:
        yield
        return
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        yield
    raw = path.with_suffix("")  # .json
    prof.export_chrome_trace(str(raw))
    with raw.open("rb") as src, gzip.open(path, "wb") as dst:
        shutil.copyfileobj(src, dst)
    raw.unlink()


def measure(model: LoadedModel, inst: ModelInstance, cut: list[list[list[int]]], choice: DeviceChoice, *,
            masked: bool, ahead: int, trace: Path | None) -> dict[str, Any]:
    """The three runs of the batches with or without the mask (see the module's doc)."""
    works = [make_works(model, seqs, masked=masked) for seqs in cut]
    inputs = [(ids.to(model.device), mask.to(model.device))
              for ids, mask, _ in (padded_batches(seqs, len(seqs), 0)[0] for seqs in cut)]
    probe = Probe(model.device)

    def loop() -> None:
        for x in inputs:
            plain_step(model, x, masked)

    run_instance(inst, works[:2], ahead)  # warm-up: kernels chosen, memory cached
    for x in inputs[:2]:
        plain_step(model, x, masked)
    device_s = sum(probe.stage(functools.partial(plain_step, model, x, masked))[2] for x in inputs) / 1e3
    loop_s, loop_alloc = counted(functools.partial(wall_s, loop, choice), choice.cuda)
    instance_s, instance_alloc = counted(
        functools.partial(wall_s, functools.partial(run_instance, inst, works, ahead), choice), choice.cuda)
    gaps: dict[str, Any] = {}
    loop_gaps: dict[str, Any] = {}
    if trace is not None:
        with traced(trace, choice.cuda):
            run_instance(inst, works, ahead)
        gaps = summarize(load_trace(trace))
        loop_trace = trace.with_name(trace.name.replace("instance_", "loop_", 1))
        with traced(loop_trace, choice.cuda):
            loop()
            choice.synchronize()
        loop_gaps = summarize(load_trace(loop_trace))
    n, useful = len(cut), sum(len(q) for seqs in cut for q in seqs)
    return {"loop_allocator": loop_alloc, "instance_allocator": instance_alloc, "trace_gaps": gaps,
            "loop_trace_gaps": loop_gaps,
            "device_s": round(device_s, 4), "loop_s": round(loop_s, 4), "instance_s": round(instance_s, 4),
            "loop_busy": round(device_s / loop_s, 3), "instance_busy": round(device_s / instance_s, 3),
            "loop_idle_ms_per_batch": round(1e3 * max(0.0, loop_s - device_s) / n, 2),
            "instance_idle_ms_per_batch": round(1e3 * max(0.0, instance_s - device_s) / n, 2),
            "instance_useful_tokens_per_s": round(useful / instance_s)}


def run(a: argparse.Namespace) -> dict[str, Any]:
    choice = DeviceChoice.from_args(a)
    choice.check()
    model = load_model(f"hf:{a.teacher}", device=choice.device, compute_dtype=a.compute_dtype)
    lengths = draw_lengths(a.sequences, a.seed)
    gen = torch.Generator().manual_seed(a.seed)
    seqs = [torch.randint(1, int(model.module.width), (n,), generator=gen).tolist() for n in lengths]
    cut = sorted_groups(seqs, a.budget, len, a.max_rows)
    trace_dir = Path(a.trace) if a.trace else None
    if trace_dir is not None:
        trace_dir.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"batches": len(cut), "positions": sum(len(g) * len(g[-1]) for g in cut),
                              "useful": sum(lengths)}
    inst = ModelInstance(model, 0, max_batch_size=a.max_rows)
    try:
        with torch.inference_mode():
            for masked in (True, False):
                label = "masked" if masked else "unmasked"
                trace = trace_dir / f"instance_{label}.json.gz" if trace_dir is not None else None
                result[label] = measure(model, inst, cut, choice, masked=masked, ahead=a.ahead, trace=trace)
                print(f"  {label}: {result[label]}", flush=True)
    finally:
        inst.close()
    return {"teacher": a.teacher, **choice.info(), "sequences": a.sequences, "budget": a.budget, "ahead": a.ahead,
            "max_rows": a.max_rows, **result, "torch": torch.__version__, "machine": machine_info(),
            "traces": sorted(str(p) for p in trace_dir.glob("*.json.gz")) if trace_dir else []}


def report(doc: dict[str, Any]) -> str:
    rows, notes = [], []
    for label in ("masked", "unmasked"):
        r = doc[label]
        rows.append([label, f"{r['device_s']:.3f}", f"{r['loop_s']:.3f}", r["loop_busy"], r["loop_idle_ms_per_batch"],
                     f"{r['instance_s']:.3f}", r["instance_busy"], r["instance_idle_ms_per_batch"]])
        if r.get("instance_allocator"):
            notes.append(f"{label}: allocator during the plain loop {r['loop_allocator']}, the instance "
                         f"{r['instance_allocator']}")
        for kind, key in (("instance", "trace_gaps"), ("loop", "loop_trace_gaps")):
            if r.get(key):
                notes.append(trace_report(f"{label} {kind} trace", r[key]))
    return (f"{doc['gpu'] or doc['device']}, {doc['compute_dtype']}: {doc['sequences']} sequences in {doc['batches']} "
            f"length-sorted batches of at most {doc['budget']:,} positions; instance {doc['ahead']} batches ahead\n"
            + format_table(["attention mask", "device s (alone)", "plain loop s", "loop busy", "loop idle ms/batch",
                            "instance s", "instance busy", "instance idle ms/batch"], rows)
            + "".join(f"\n{n}" for n in notes))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--teacher", required=True, help="a save_pretrained causal LM directory")
    add_device_args(p)
    p.add_argument("--sequences", type=int, default=512)
    p.add_argument("--budget", type=int, default=16384, help="positions a batch (rows x the longest)")
    p.add_argument("--max-rows", type=int, default=256)
    p.add_argument("--ahead", type=int, default=3, help="batches launched and unfinished at most (the GPU default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--trace", default="", help="write torch.profiler Chrome traces of the instance's runs here")
    p.add_argument("--out", default="instance_pipeline", help="results file: benchmarks/results/<OUT>.json")
    a = p.parse_args(argv)
    if min(a.sequences, a.budget, a.max_rows, a.ahead) < 1:
        p.error("--sequences, --budget, --max-rows and --ahead must be at least 1")
    return run_and_report(lambda: run(a), a.out, report)


if __name__ == "__main__":
    raise SystemExit(main())
