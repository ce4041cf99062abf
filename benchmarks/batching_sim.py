"""The teacher's batching of a padded LLM on an emulated GPU: how close its batches come to the
in-process baseline's length-sorted ones when the device, not the host, is the limit.

    .venv/bin/python -m benchmarks.batching_sim [--sequences 1024] [--clients 256] [--fixed-ms 5]
        [--tokens-per-s 72000] [--budget 16384] [--reps 3] [--server-arg=--min-padding-efficiency=0.8]

W6 on a GPU mixes two costs: the server's own host and device work (decoding, launches, chunked
transforms, copies) and the batches it forms, which are only as full and as tightly padded as the
sequences queued at the time allow. This measures the second alone, on any machine. The teacher is
`teacher-server --model benchmarks.batching_sim:build`, a padded causal LM whose device is
emulated: a forward pass takes `fixed_ms + computed positions / tokens_per_s` (defaults: the
Qwen2.5-1.5B shape on an H200, 72k tokens/s in length-sorted batches of 16k tokens) on one device
timeline, and returns at once, as a CUDA launch does; the finishing stage waits until the device
would have finished that batch, as it waits on a CUDA event, and batches are formed ahead of their
instance as on CUDA. The baseline is the same device running W6's in-process batches: all sequences
sorted by length, cut at the token budget. Ratio: baseline time / served time, for the same
sequences (W6's lengths, uniform over 8-1,021), one per request from `--clients` clients.

`--student-batch N` measures the reader path instead: `DistillReader` over a student's padded
batches of N sequences in loader order, one `[N, L_max]` request each, `--clients` rows read ahead,
the router pinned to keep them all in flight (`--router pinned`, `RouterConfig.min_limit`) or left
to its defaults (`--router default`: the teacher says it batches by length, so the router keeps
`RouterConfig.by_length_rows` rows in flight to it, as far as `--clients` rows read ahead allow);
`--router defaults` leaves the read-ahead to the reader too (`prefetch` unset: `--clients` does not
apply; the reader reads those rows ahead). One reader kept across repetitions, as a training
job keeps it across epochs. `--students N`: N readers share the teacher, each over every N-th
batch, at once; `--teachers N`: N teacher processes, each its own emulated device (the ratio then
against 1/N of the sorted time; positions computed twice are counted); `--hedge`: the reader's
adaptive hedging on; `--timeout`: the readers' deadline for a chunk (60 s; the reader's own default
is 10 s, which a slow emulated device shows the router keeping to).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import functools
import random
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from benchmarks.common import REPO_ROOT, format_table, machine_info, median, run_and_report, sorted_groups
from teacher_server.spec import ModelIO

VOCAB = 8


class _Timeline:
    """One emulated device: batches run one after another; each instance's finishing stage waits
    for its own batches' ends, in launch order."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.free_at = 0.0
        self.ends: dict[str, collections.deque[float]] = collections.defaultdict(collections.deque)

    def launch(self, seconds: float) -> None:
        with self.lock:
            start = max(time.perf_counter(), self.free_at)
            self.free_at = start + seconds
            self.ends[_instance_key()].append(self.free_at)

    def wait(self) -> None:
        with self.lock:
            queue = self.ends[_instance_key()]
            end = queue.popleft() if queue else 0.0
        delay = end - time.perf_counter()
        if delay > 0:
            time.sleep(delay)


def _instance_key() -> str:
    """instance-N and finish-N (the threads the teacher names) share the key N."""
    name = threading.current_thread().name
    return name.rsplit("-", 1)[-1].split("_", 1)[0]


class EmulatedLM(nn.Module):
    """Token ids and mask to [B, T, 8] zeros, at the emulated device's cost."""

    def __init__(self, timeline: _Timeline, fixed_ms: float, tokens_per_s: float) -> None:
        super().__init__()
        self.timeline, self.fixed_s, self.per_token_s = timeline, fixed_ms / 1e3, 1.0 / tokens_per_s
        self.io_spec = ModelIO.parse(["INPUT_IDS:INT64:-1:pad=0", "ATTENTION_MASK:INT64:-1:mask"],
                                     [f"LOGITS:FP32:-1,{VOCAB}:per_position"])

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        self.timeline.launch(self.fixed_s + self.per_token_s * ids.numel())
        return torch.zeros((*ids.shape, VOCAB))


def build(fixed_ms: float = 5.0, tokens_per_s: float = 72000.0) -> EmulatedLM:
    """The emulated teacher. Loaded in the teacher-server process, it makes that server treat its
    CPU as it treats a GPU: batches formed and staged ahead of their instance, finished on a thread
    of their own, the padding floor lowered by the batches' measured fixed cost (what the server
    chooses on CUDA), at the time the emulated device ends them."""
    from teacher_server import batcher, finishing, staging

    timeline = _Timeline()
    finish = finishing.Finisher.finish
    init = batcher.DynamicBatcher.__init__

    def finish_at_device_time(self: finishing.Finisher, launched: Any) -> Any:
        timeline.wait()
        return finish(self, launched)

    def init_as_on_cuda(self: batcher.DynamicBatcher, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        self._async_outputs = True
        self._cost_aware = self._config.cost_aware_floor is not False

    staging.wanted = lambda device: True  # type: ignore[assignment]
    finishing.Finisher.finish = finish_at_device_time  # type: ignore[method-assign]
    batcher.DynamicBatcher.__init__ = init_as_on_cuda  # type: ignore[method-assign]
    return EmulatedLM(timeline, fixed_ms, tokens_per_s)


def draw_lengths(n: int, seed: int, low: int = 8, high: int = 1021) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(low, high) for _ in range(n)]


def sorted_baseline(lengths: Sequence[int], budget: int, fixed_s: float, per_token_s: float) -> dict[str, Any]:
    """The device's time for the in-process baseline's batches: sorted by length, cut at the budget."""
    groups = sorted_groups(lengths, budget, int)
    positions = [len(g) * g[-1] for g in groups]
    return {"seconds": sum(fixed_s + per_token_s * p for p in positions), "batches": len(groups),
            "padding_efficiency": sum(lengths) / sum(positions)}


async def serve_once(endpoint: str, metrics_port: int, lengths: list[int], clients: int,
                  server_pid: int) -> dict[str, Any]:
    """One pass of `lengths`, one sequence a request, through W6's own client (`measure_server`)."""
    import grpc
    from tritonclient.grpc import service_pb2_grpc

    from benchmarks.llm_parts import make_request, measure_server

    requests = [make_request(list(range(1, n + 1)), top_k=0, logprobs=False, dtype="FP32", tail=False)
                for n in lengths]
    async with grpc.aio.insecure_channel(endpoint) as channel:
        m = await measure_server(service_pb2_grpc.GRPCInferenceServiceStub(channel), requests, lengths,
                                 clients=clients, metrics_port=metrics_port, server_pids=[server_pid])
    return {"seconds": m.seconds, "batches": m.executions, "padding_efficiency": m.padding_efficiency,
            "batch_cost": m.batch_cost}


def _student_batches(lengths: Sequence[int], batch: int) -> list[dict[str, torch.Tensor]]:
    """The loader's padded batches, in order (the same token ids as the one-per-request pass)."""
    from benchmarks.llm_parts import padded_batches

    seqs = [list(range(1, n + 1)) for n in lengths]
    return [{"input_ids": ids, "attention_mask": mask} for ids, mask, _ in padded_batches(seqs, batch, 0)]


def reader_router(kind: str, ahead: int, rows: int = 1) -> Any:
    """The reader's router: `pinned` keeps `ahead` requests of `rows` rows in flight; `default(s)` is
    RouterConfig()."""
    from benchmarks.llm_reader import pinned_router
    from distill import RouterConfig

    return pinned_router(ahead, rows) if kind == "pinned" else RouterConfig()


async def _read(reader: Any, useful: int, endpoint: str, metrics_port: int, server_pid: int) -> dict[str, Any]:
    """One pass of the reader over its loader (W6's reader measurement, `llm_reader.measure_reader`)."""
    import grpc
    from tritonclient.grpc import service_pb2_grpc

    from benchmarks.llm_reader import measure_reader

    async with grpc.aio.insecure_channel(endpoint) as channel:
        m = await measure_reader(reader, useful, metrics_port=metrics_port,
                                 stub=service_pb2_grpc.GRPCInferenceServiceStub(channel), server_pids=[server_pid])
    return {"seconds": m.seconds, "batches": m.executions, "padding_efficiency": m.padding_efficiency,
            "batch_cost": m.batch_cost}


async def _read_together(readers: Sequence[Any], useful: int, endpoints: Sequence[str],
                         metrics_ports: Sequence[int]) -> dict[str, Any]:
    """One pass of several readers at once, each over its own loader (students sharing the
    teachers), from the first batch asked to the last one answered, counted over every teacher.
    Positions computed more than once (a chunk sent again after its deadline, or raced by a hedge)
    show as `duplicated`, their share of the pass's useful positions."""
    import grpc
    from tritonclient.grpc import service_pb2_grpc

    from benchmarks.llm_parts import ServerCounters, server_counters, server_side

    async def counts() -> list[ServerCounters]:
        read = []
        for endpoint, port in zip(endpoints, metrics_ports, strict=True):
            async with grpc.aio.insecure_channel(endpoint) as channel:
                read.append(await server_counters(service_pb2_grpc.GRPCInferenceServiceStub(channel), port))
        return read

    before = await counts()
    t0 = time.perf_counter()
    await asyncio.gather(*(asyncio.to_thread(lambda r=r: sum(1 for _ in r)) for r in readers))
    seconds = time.perf_counter() - t0
    after = await counts()
    counted = sum(a.tokens[0] - b.tokens[0] for b, a in zip(before, after, strict=True))
    if counted < useful:
        raise AssertionError(f"the teachers counted {counted} useful tokens, the loaders hold {useful}")
    sides = [server_side(b, a) for b, a in zip(before, after, strict=True)]
    return {"seconds": seconds, "batches": sum(s["executions"] for s in sides),
            "padding_efficiency": counted / sum(s["computed_tokens"] for s in sides),
            "duplicated": (counted - useful) / useful, "batch_cost": sides[0]["batch_cost"]}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from benchmarks.llm_parts import MODEL_NAME
    from teacher_server.launch import TeacherProcess

    lengths = draw_lengths(args.sequences, args.seed)
    baseline = sorted_baseline(lengths, args.budget, args.fixed_ms / 1e3, 1.0 / args.tokens_per_s)

    server = ["--model", "benchmarks.batching_sim:build", "--name", MODEL_NAME, "--device", "cpu",
              "--model-arg", f"fixed_ms={args.fixed_ms}", "--model-arg", f"tokens_per_s={args.tokens_per_s}",
              "--max-batch-size", "256", "--max-batch-tokens", str(args.budget),
              "--max-queue-delay-us", str(args.delay_us),
              "--instances", str(args.instances), "--threads", "1", "--metrics-port", "0",
              "--log-level", "WARNING", *args.server_arg]
    reps = []
    with contextlib.ExitStack() as stack:
        procs = [stack.enter_context(TeacherProcess(server, label=f"batching_sim-{i}", cwd=REPO_ROOT, stop_grace=10.0))
                 for i in range(args.teachers)]
        endpoints, ports = [p.endpoint for p in procs], [int(p.ready["metrics_port"]) for p in procs]
        endpoint, port, pid = endpoints[0], ports[0], procs[0].pid
        asyncio.run(serve_once(endpoint, port, lengths[: 2 * args.clients], args.clients, pid))  # warm-up
        pass_once = functools.partial(serve_once, endpoint, port, lengths, args.clients, pid)
        if args.student_batch:
            from distill import DistillReader

            ahead = max(1, args.clients // args.student_batch)
            reader_memory = {} if args.read_ahead_mb is None else {"read_ahead_mb": args.read_ahead_mb}
            batches = _student_batches(lengths, args.student_batch)
            readers = [stack.enter_context(DistillReader(
                batches[i::args.students], teachers=",".join(endpoints), model=MODEL_NAME,
                inputs={"INPUT_IDS": "input_ids", "ATTENTION_MASK": "attention_mask"}, outputs=["LOGITS"],
                output_dtype="FP16", timeout=args.timeout, prefetch=None if args.router == "defaults" else ahead,
                hedge_after="auto" if args.hedge else None, **reader_memory,
                router=reader_router(args.router, ahead, args.student_batch))) for i in range(args.students)]
            pass_once = (functools.partial(_read, readers[0], sum(lengths), endpoint, port, pid)
                         if args.students == 1 and args.teachers == 1
                         else functools.partial(_read_together, readers, sum(lengths), endpoints, ports))
        elif args.teachers > 1:
            raise SystemExit("--teachers N > 1 measures the reader path: give --student-batch")
        for rep in range(args.reps):
            served = asyncio.run(pass_once())
            served["ratio"] = baseline["seconds"] / (served["seconds"] * args.teachers)  # N devices: 1/N the time
            reps.append(served)
            print(f"  rep {rep + 1}: {served['seconds']:.2f} s against {baseline['seconds']:.2f} s sorted: "
                  f"{served['ratio']:.3f}; {served['batches']} batches (sorted: {baseline['batches']}), padding "
                  f"efficiency {served['padding_efficiency']:.3f} ({baseline['padding_efficiency']:.3f}); "
                  f"fitted {served['batch_cost']}"
                  + (f"; computed twice: {served['duplicated']:.3f}" if "duplicated" in served else ""), flush=True)
    return {"settings": {k: v for k, v in vars(args).items() if k != "out"}, "baseline": baseline, "reps": reps,
            "ratio_median": median([r["ratio"] for r in reps]),
            "batches_median": median([float(r["batches"]) for r in reps]),
            "padding_efficiency_median": median([r["padding_efficiency"] for r in reps]),
            "machine": machine_info()}


def report(doc: dict[str, Any]) -> str:
    s, b = doc["settings"], doc["baseline"]
    rows: list[list[object]] = [
        ["in process: length-sorted batches at the budget", f"{b['seconds']:.2f}", b["batches"],
         f"{b['padding_efficiency']:.3f}", ""],
        [(f"served: {s.get('students', 1)} x DistillReader, batches of {s['student_batch']} in loader order, "
          f"{s['router']} router"
          if s["student_batch"] else f"served: {s['clients']} clients, one sequence a request")
         + f" (median of {len(doc['reps'])})",
         f"{median([r['seconds'] for r in doc['reps']]):.2f}", f"{doc['batches_median']:.0f}",
         f"{doc['padding_efficiency_median']:.3f}", f"{doc['ratio_median']:.3f}"],
    ]
    return (f"{s['sequences']} sequences, emulated device {s['fixed_ms']} ms + 1/{s['tokens_per_s']:,.0f} s a "
            f"position, budget {s['budget']:,} positions, {s['instances']} instance(s)\n"
            + format_table(["batches", "seconds", "batches", "padding eff.", "ratio"], rows))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sequences", type=int, default=1024)
    p.add_argument("--clients", type=int, default=256)
    p.add_argument("--fixed-ms", type=float, default=5.0, help="device time a forward pass costs whatever its size")
    p.add_argument("--tokens-per-s", type=float, default=72000.0, help="device positions a second beyond that")
    p.add_argument("--budget", type=int, default=16384, help="--max-batch-tokens, and the baseline's batches")
    p.add_argument("--delay-us", type=int, default=2000, help="--max-queue-delay-us (W6's)")
    p.add_argument("--instances", type=int, default=1)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--server-arg", action="append", default=[], help="an extra teacher-server flag (repeatable)")
    p.add_argument("--student-batch", type=int, default=0,
                   help="measure DistillReader with padded batches of this many sequences instead (0: off)")
    p.add_argument("--timeout", type=float, default=60.0, help="--student-batch: the reader's deadline for a chunk")
    p.add_argument("--read-ahead-mb", type=float, default=None,
                   help="--student-batch with --router defaults: the reader's read_ahead_mb (default: the reader's)")
    p.add_argument("--teachers", type=int, default=1,
                   help="--student-batch: this many teacher processes, each its own emulated device")
    p.add_argument("--hedge", action="store_true",
                   help="--student-batch: the reader's adaptive hedging on (its default; off otherwise here)")
    p.add_argument("--students", type=int, default=1,
                   help="--student-batch: this many readers share the teacher, each over every N-th batch")
    p.add_argument("--router", choices=("pinned", "default", "defaults"), default="pinned",
                   help="--student-batch: the reader keeps --clients rows in flight, or its router decides "
                   "(default), or the reader decides its read-ahead as well (defaults)")
    p.add_argument("--out", default="batching_sim", help="results file: benchmarks/results/<OUT>.json")
    args = p.parse_args(argv)
    if min(args.sequences, args.clients, args.budget, args.reps, args.instances, args.students, args.teachers) < 1 \
            or min(args.tokens_per_s, args.timeout) <= 0 \
            or args.student_batch < 0:
        p.error("--sequences, --clients, --budget, --reps, --instances, --students, --teachers, --tokens-per-s and "
                "--timeout must be positive, --student-batch at least 0")
    return run_and_report(lambda: run(args), args.out, report)


if __name__ == "__main__":
    raise SystemExit(main())
