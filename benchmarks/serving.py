"""W2 serving efficiency and W3 small requests (DESIGN.md, "Reference workloads").

    .venv/bin/python -m benchmarks.serving [--reps 7] [--quick] [--threads N --instances N --delay-us N]

W2: how much of the machine's in-process RefTeacher throughput at batch 256 survives the trip
through teacher-server. A = `model(x)` in this process; B = the server kept saturated by a few
concurrent batch-256 requests. Headline: B / A (goal >= 0.90 in DESIGN.md, 0.95 for this run).

W3: what dynamic batching buys 64 concurrent clients that each send batch-8 requests. Server
with batching on vs off (`--no-dynamic-batching`), and the in-process batch-8 rate, which is
what a client would get by running the teacher itself. Headlines: on / off and on / batch-8.

The in-process baselines run the model exactly as the server is told to (`--threads` torch
threads, and `--instances` concurrent model(x) loops on their own threads; by default all cores
and one loop, the server's defaults), so a ratio measures what serving costs, not what a
different thread layout gains: that layout is open to an in-process user too. Compare the
A rates of runs with different layouts to see which layout is the limit on this machine.

How the numbers are kept honest on a 2-core machine shared with other people's jobs:
  * every variant runs once per repetition, interleaved (A, B, A, B, ...); each server is
    started once and sits idle while the others run; the headline ratio is the median of the
    per-repetition paired ratios;
  * a quiet gate waits (boundedly) before each measurement until other processes use little
    CPU, and a measurement they disturbed anyway is taken again (boundedly); disturbed
    repetitions are kept in the JSON and marked, and a ratio is only called PASS or below
    goal when at least 5 repetitions ran quiet on both sides;
  * each repetition is a fixed duration after a warm-up, with the load kept flowing through
    the warm-up into the window, so the server never starts cold or idles mid-window;
  * the load generator is as light as Python allows (raw gRPC stub, one pre-built request,
    responses not decoded), and its own CPU use is measured and reported, because it competes
    with the server for the same two cores; so is the CPU used by everyone else ("foreign").
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, astuple, dataclass
from typing import Any, TypeVar

import grpc
import numpy as np
import torch
from tritonclient.grpc import service_pb2, service_pb2_grpc

from benchmarks.common import (
    REPO_ROOT,
    ainterleave,
    format_table,
    machine_info,
    median,
    paired_ratios,
    ratio,
    sigterm_raises,
    write_results,
)
from benchmarks.cpu import CpuMeter, CpuUsage, QuietGate
from examples.refteacher import build
from teacher_server.launch import TeacherProcess

MODEL_NAME = "ref_teacher"
MODEL_REF = "examples.refteacher:build"
INPUT_SHAPE = (3, 32, 32)
CLASSES = 100
MAX_MESSAGE = 64 << 20
W2_GOAL = 0.95  # this benchmark's bar; DESIGN.md's W2 goal is 0.90
W3_GOAL_VS_OFF = 3.0  # DESIGN.md
W3_GOAL_VS_INPROC = 4.5


@dataclass(frozen=True)
class Settings:
    """One run's knobs; recorded verbatim in the JSON so a result can be reproduced."""

    reps: int = 7
    warmup_s: float = 0.5
    duration_s: float = 2.0
    threads: int = 0  # torch threads in the server; 0: cores / instances (teacher-server's default)
    inproc_threads: int = 0  # torch threads for the in-process baselines; 0: the server's
    instances: int = 0  # 0: one per core (teacher-server's default on CPU)
    delay_us: int = 2000  # --max-queue-delay-us of the batching server
    max_batch: int = 256
    w2_batch: int = 256
    w2_in_flight: int = 0  # 0: two per instance
    w3_batch: int = 8
    w3_clients: int = 64
    channels: int = 1
    only: str = "all"  # all | w2 | w3
    max_foreign_cores: float = 0.15  # quiet gate and redo threshold; 0 disables both
    gate_budget_s: float = 75.0
    max_redos: int = 10
    quick: bool = False
    extra_server_args: tuple[str, ...] = ()
    server_env: tuple[str, ...] = ()  # KEY=VALUE pairs added to the servers' environment
    out: str = "serving"  # results file name under benchmarks/results/

    @property
    def server_threads(self) -> int:
        return self.threads or max(1, (os.cpu_count() or 1) // self.server_instances)

    @property
    def server_instances(self) -> int:
        return self.instances or (os.cpu_count() or 1)

    @property
    def requests_in_flight(self) -> int:
        return self.w2_in_flight or 2 * self.server_instances

    @property
    def baseline_threads(self) -> int:
        return self.inproc_threads or self.server_threads


@dataclass
class Measurement:
    """One variant in one repetition: throughput plus who used the CPU meanwhile."""

    samples_per_s: float
    requests: int
    window_s: float
    cpu: CpuUsage | None = None
    server_batches: int | None = None  # model executions on the server during the window
    mean_server_batch: float | None = None  # samples per execution: did batching happen?
    errors: int = 0
    server_compute_ms: float | None = None  # mean time an instance spent on one batch
    server_busy: float | None = None  # instance-seconds computing per second (up to --instances)
    server_latency_ms: float | None = None  # mean request time inside the server (queue + compute + rest)
    server_queue_ms: float | None = None  # mean time a request waited for an instance

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["samples_per_s"] = round(self.samples_per_s, 1)
        d["window_s"] = round(self.window_s, 4)
        d["cpu"] = self.cpu.as_dict() if self.cpu else None
        for k in ("mean_server_batch", "server_compute_ms", "server_busy", "server_latency_ms", "server_queue_ms"):
            if d[k] is not None:
                d[k] = round(d[k], 3)
        return d


# ---- in-process baseline --------------------------------------------------------------------
def measure_inprocess(
    model: torch.nn.Module,
    batch: int,
    warmup_s: float,
    duration_s: float,
    *,
    server_pids: Sequence[int] = (),
    workers: int = 1,
) -> Measurement:
    """`model(x)` in a loop, timed over a whole number of calls (no partial-call error).

    `workers` > 1 runs that many loops on their own threads at once, the in-process twin of a
    server with that many model instances (each thread uses the process-wide torch thread
    count). `server_pids` are our idle servers: counted apart from foreign load, expected ~0.
    """
    if workers > 1:
        return _measure_inprocess_threads(model, batch, warmup_s, duration_s, server_pids=server_pids, workers=workers)
    x = torch.randn(batch, *INPUT_SHAPE)
    meter = CpuMeter(server_pids)
    with torch.inference_mode():
        end_warmup = time.perf_counter() + warmup_s
        model(x)
        while time.perf_counter() < end_warmup:
            model(x)
        meter.start()
        t0 = time.perf_counter()
        stop = t0 + duration_s
        calls = 0
        now = t0
        while now < stop:
            model(x)
            calls += 1
            now = time.perf_counter()
        cpu = meter.stop()
    elapsed = now - t0
    return Measurement(calls * batch / elapsed, calls, elapsed, cpu)


def _measure_inprocess_threads(
    model: torch.nn.Module, batch: int, warmup_s: float, duration_s: float, *, server_pids: Sequence[int], workers: int
) -> Measurement:
    """Several model(x) loops at once; each is timed over its own whole calls and the rates add."""
    barrier = threading.Barrier(workers + 1)
    start = [0.0]

    def loop() -> tuple[int, float]:
        x = torch.randn(batch, *INPUT_SHAPE)
        with torch.inference_mode():
            end_warmup = time.perf_counter() + warmup_s
            model(x)
            while time.perf_counter() < end_warmup:
                model(x)
            barrier.wait()  # all warm, then the window opens for everyone at once
            barrier.wait()
            t0 = start[0]
            stop = t0 + duration_s
            calls, now = 0, t0
            while now < stop:
                model(x)
                calls += 1
                now = time.perf_counter()
        return calls, now - t0

    meter = CpuMeter(server_pids)
    with ThreadPoolExecutor(workers, thread_name_prefix="inprocess") as pool:
        futures = [pool.submit(loop) for _ in range(workers)]
        barrier.wait()
        meter.start()
        start[0] = time.perf_counter()
        barrier.wait()
        results = [f.result() for f in futures]
        cpu = meter.stop()
    rate = sum(calls * batch / el for calls, el in results if el > 0)
    return Measurement(rate, sum(c for c, _ in results), max(el for _, el in results), cpu)


# ---- the gRPC load generator ----------------------------------------------------------------
def make_request(batch: int, seed: int = 0) -> tuple[service_pb2.ModelInferRequest, np.ndarray]:
    """One ModelInferRequest built once and reused: no per-call encoding cost in the client."""
    x = np.random.default_rng(seed).standard_normal((batch, *INPUT_SHAPE), dtype=np.float32)
    req = service_pb2.ModelInferRequest(model_name=MODEL_NAME)
    req.inputs.add(name="INPUT", datatype="FP32", shape=[batch, *INPUT_SHAPE])
    req.outputs.add(name="LOGITS")
    req.raw_input_contents.append(x.tobytes())
    return req, x


def open_channel(endpoint: str) -> grpc.aio.Channel:
    """A loopback channel that accepts our message sizes; its own subchannel so N channels = N TCP conns."""
    return grpc.aio.insecure_channel(
        endpoint,
        options=[
            ("grpc.max_send_message_length", MAX_MESSAGE),
            ("grpc.max_receive_message_length", MAX_MESSAGE),
            ("grpc.use_local_subchannel_pool", 1),
        ],
    )


@dataclass(frozen=True)
class ServerStats:
    """Cumulative counters from ModelStatistics; the difference of two says what the server did.

    They split the server's time into compute (the model instance running a batch, including
    gathering inputs and encoding outputs) and everything else, which is how we tell "the
    server idles between batches" from "each batch runs slower than in-process".
    """

    samples: int
    executions: int
    requests: int
    request_ns: int
    queue_ns: int
    compute_ns: int  # summed per request: a batch of r requests adds its compute time r times

    def __sub__(self, o: ServerStats) -> ServerStats:
        return ServerStats(*(a - b for a, b in zip(astuple(self), astuple(o), strict=True)))


async def server_stats(stub: Any) -> ServerStats:
    resp = await stub.ModelStatistics(service_pb2.ModelStatisticsRequest(name=MODEL_NAME), timeout=10)
    st = resp.model_stats[0]
    inf = st.inference_stats
    return ServerStats(int(st.inference_count), int(st.execution_count), int(inf.success.count),
                       int(inf.success.ns), int(inf.queue.ns), int(inf.compute_infer.ns))


async def measure_server(
    stubs: Sequence[Any],
    request: service_pb2.ModelInferRequest,
    *,
    batch: int,
    concurrency: int,
    warmup_s: float,
    duration_s: float,
    server_pids: Sequence[int],
) -> Measurement:
    """Keep `concurrency` requests in flight for warm-up + duration; rate over the window.

    The rate comes from `burst_rate` over the completions seen in the window. Requests still in
    flight when the window ends are awaited, not cancelled, so the server is idle (not computing
    abandoned batches) when the next variant starts.
    """
    loop = asyncio.get_running_loop()
    stop = False
    window_open = False
    done: list[tuple[float, int]] = []  # (completion time, samples) inside the window
    errors = 0

    async def client(stub: Any) -> None:
        nonlocal errors
        while not stop:
            try:
                await stub.ModelInfer(request, timeout=60)
            except grpc.aio.AioRpcError as e:
                errors += 1
                if errors > 100:
                    raise RuntimeError(f"too many failed requests; last: {e.code().name}: {e.details()}") from e
                continue
            if window_open:
                done.append((loop.time(), batch))

    tasks = [asyncio.create_task(client(stubs[i % len(stubs)])) for i in range(concurrency)]
    try:
        await asyncio.sleep(warmup_s)
        stats0 = await server_stats(stubs[0])
        meter = CpuMeter(server_pids)
        meter.start()
        window_open = True
        await asyncio.sleep(duration_s)
        window_open = False
        cpu = meter.stop()
        st = await server_stats(stubs[0]) - stats0
        stop = True
        await asyncio.gather(*tasks)
    finally:
        stop = True
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    rate, span = burst_rate(done, cpu.wall_s / st.executions if st.executions else 0.0)
    m = Measurement(rate, len(done), span, cpu, st.executions, errors=errors)
    if st.executions and st.requests:
        m.mean_server_batch = st.samples / st.executions
        # The server sums compute time per request, so compute_ns / requests is the mean compute
        # time of a batch weighted by its requests: exact when every batch holds the same number
        # of requests (W2; W3 with one instance), an estimate otherwise (partial batches with
        # several instances). Times the batches run: instance-seconds busy per second.
        per_batch_ns = st.compute_ns / st.requests
        m.server_compute_ms = per_batch_ns / 1e6
        m.server_busy = per_batch_ns * st.executions / 1e9 / cpu.wall_s
        m.server_latency_ms = st.request_ns / st.requests / 1e6
        m.server_queue_ms = st.queue_ns / st.requests / 1e6
    return m


def burst_rate(done: Sequence[tuple[float, int]], batch_interval_s: float) -> tuple[float, float]:
    """Samples/s from completion times, exact at the edges even when completions come in bursts.

    With dynamic batching, the 32 requests of one batch-256 execution complete within a
    millisecond, then nothing for a whole batch time. Counting completions in a fixed window
    is off by up to one burst at each edge; instead we cut the completions into bursts (a gap
    larger than a third of the server's mean batch interval starts a new one) and measure from
    the end of the first burst to the end of the last: whole bursts only, no edge error.
    Without batching every completion is its own burst and this is simply first-to-last.
    Returns (samples/s, seconds spanned).
    """
    if len(done) < 2:
        return 0.0, 0.0
    gap = batch_interval_s / 3
    burst_ends: list[tuple[float, int]] = []  # (time the burst ended, samples completed up to it)
    total = 0
    for i, (t, n) in enumerate(done):
        total += n
        if i + 1 == len(done) or done[i + 1][0] - t > gap:
            burst_ends.append((t, total))
    if len(burst_ends) < 2:
        return 0.0, 0.0
    (t0, n0), (t1, n1) = burst_ends[0], burst_ends[-1]
    return ((n1 - n0) / (t1 - t0), t1 - t0) if t1 > t0 else (0.0, 0.0)


async def check_server_output(stub: Any, model: torch.nn.Module) -> float:
    """The server must compute what the model computes; returns the max abs difference."""
    req, x = make_request(4, seed=1)
    resp = await stub.ModelInfer(req, timeout=60)
    got = np.frombuffer(resp.raw_output_contents[0], dtype=np.float32).reshape(4, CLASSES)
    with torch.inference_mode():
        want = model(torch.from_numpy(x)).numpy()
    diff = float(np.abs(got - want).max())
    if not np.allclose(got, want, atol=1e-3, rtol=1e-3):
        raise AssertionError(f"server logits differ from the in-process model by up to {diff}")
    return diff


# ---- the run --------------------------------------------------------------------------------
def server_args(s: Settings, batching: bool) -> list[str]:
    args = [
        "--model", MODEL_REF, "--name", MODEL_NAME, "--device", "cpu", "--port", "0",
        "--max-batch-size", str(s.max_batch), "--instances", str(s.server_instances),
        "--threads", str(s.server_threads), "--log-level", "WARNING",
    ]
    args += ["--max-queue-delay-us", str(s.delay_us)] if batching else ["--no-dynamic-batching"]
    return [*args, *s.extra_server_args]


def print_rep(rep: int, name: str, m: Measurement) -> None:
    """One progress line per measurement, so a long run shows noise as it happens."""
    line = f"  rep {rep + 1} {name:<16} {m.samples_per_s:9,.0f} samples/s"
    if m.cpu:
        c = m.cpu
        line += f"  cores: client {c.client_cores:.2f} server {c.server_cores:.2f} foreign {c.foreign_cores:.2f}"
    if m.mean_server_batch is not None:
        line += f"  batches {m.server_batches} x {m.mean_server_batch:.0f}"
    if m.server_compute_ms is not None and m.server_busy is not None:
        line += f", {m.server_compute_ms:.1f} ms each, busy {m.server_busy:.0%}"
    elif m.mean_server_batch is None and m.requests:
        line += f"  {m.window_s / m.requests * 1e3:.1f} ms per call"
    print(line, flush=True)


async def run(s: Settings) -> dict[str, Any]:
    """Start the servers once, interleave every variant per repetition, return the JSON document."""
    torch.set_num_threads(s.baseline_threads)
    model = build().eval()
    want_w2 = s.only in ("all", "w2")
    want_w3 = s.only in ("all", "w3")

    with contextlib.ExitStack() as stack:
        env = dict(os.environ) | dict(e.split("=", 1) for e in s.server_env)
        on = stack.enter_context(TeacherProcess(server_args(s, batching=True), label="batching-on", env=env,
                                                       cwd=REPO_ROOT, stop_grace=20.0))
        off = None
        if want_w3:
            off = stack.enter_context(TeacherProcess(server_args(s, batching=False), label="batching-off", env=env,
                                                            cwd=REPO_ROOT, stop_grace=20.0))
        servers = {"batching_on": on, **({"batching_off": off} if off else {})}
        pids = [p.pid for p in servers.values()]
        print("servers: " + ", ".join(f"{k} pid {p.pid} at {p.endpoint}" for k, p in servers.items()), flush=True)

        chans = {k: [open_channel(p.endpoint) for _ in range(max(1, s.channels))] for k, p in servers.items()}
        try:
            stubs = {k: [service_pb2_grpc.GRPCInferenceServiceStub(c) for c in cs] for k, cs in chans.items()}
            for k in servers:
                diff = await check_server_output(stubs[k][0], model)
                print(f"{k}: output matches the in-process model (max |diff| {diff:.2e})", flush=True)
            w2_req, _ = make_request(s.w2_batch)
            w3_req, _ = make_request(s.w3_batch)

            async def inprocess(batch: int) -> Measurement:
                # Blocks the event loop on purpose: nothing else may run while the baseline does.
                return measure_inprocess(model, batch, s.warmup_s, s.duration_s, server_pids=pids,
                                         workers=s.server_instances)

            variants: dict[str, Callable[[], Awaitable[Measurement]]] = {}
            if want_w2:
                variants["w2_inprocess_256"] = lambda: inprocess(s.w2_batch)
                variants["w2_server_256"] = lambda: measure_server(
                    stubs["batching_on"], w2_req, batch=s.w2_batch, concurrency=s.requests_in_flight,
                    warmup_s=s.warmup_s, duration_s=s.duration_s, server_pids=pids)
            if want_w3:
                assert off is not None
                variants["w3_inprocess_8"] = lambda: inprocess(s.w3_batch)
                variants["w3_on"] = lambda: measure_server(
                    stubs["batching_on"], w3_req, batch=s.w3_batch, concurrency=s.w3_clients,
                    warmup_s=s.warmup_s, duration_s=s.duration_s, server_pids=pids)
                variants["w3_off"] = lambda: measure_server(
                    stubs["batching_off"], w3_req, batch=s.w3_batch, concurrency=s.w3_clients,
                    warmup_s=s.warmup_s, duration_s=s.duration_s, server_pids=pids)
            gate = QuietGate(pids, max_foreign_cores=s.max_foreign_cores, budget_s=s.gate_budget_s)
            redos_left = s.max_redos

            def contaminated(m: Measurement) -> bool:
                nonlocal redos_left
                if m.cpu is None or m.cpu.foreign_cores <= s.max_foreign_cores or redos_left <= 0:
                    return False
                redos_left -= 1
                print(f"  (foreign load {m.cpu.foreign_cores:.2f} cores: measuring again)", flush=True)
                return True

            discarded: dict[str, list[Measurement]] = {}
            per_rep = await ainterleave(
                s.reps, variants, print_rep, before=gate.wait if s.max_foreign_cores > 0 else None,
                redo_if=contaminated, discarded=discarded,
            )
        finally:
            for cs in chans.values():
                for c in cs:
                    await c.close()
        exit_codes = {k: p.stop() for k, p in servers.items()}

    doc = summarise(s, per_rep, exit_codes)
    doc["quiet_gate"] = gate.as_dict()
    doc["discarded"] = {k: [m.as_dict() for m in v] for k, v in discarded.items()}
    return doc


MIN_QUIET_PAIRS = 5  # DESIGN.md: median of at least 5 repetitions


def summarise(s: Settings, per_rep: dict[str, list[Measurement]], exit_codes: dict[str, int | None]) -> dict[str, Any]:
    """Medians and paired ratios; a repetition disturbed by foreign load is kept but not trusted.

    A measurement is "quiet" when other processes used at most `max_foreign_cores` during it.
    Headline figures use the quiet repetitions (quiet pairs, for ratios) when there are at least
    MIN_QUIET_PAIRS of them, else all repetitions, and then say so ("noisy"): on a shared
    2-core machine a 2-thread model loses half or more of its speed to one busy neighbour, and
    a ratio of two disturbed numbers says more about the neighbour than about the server.
    """
    limit = s.max_foreign_cores if s.max_foreign_cores > 0 else float("inf")

    def quiet(m: Measurement) -> bool:
        return m.cpu is None or m.cpu.foreign_cores <= limit

    rates = {k: [m.samples_per_s for m in v] for k, v in per_rep.items()}
    medians_all = {k: median(v) for k, v in rates.items()}
    medians: dict[str, float] = {}
    for k, v in per_rep.items():
        q = [m.samples_per_s for m in v if quiet(m)]
        medians[k] = median(q) if len(q) >= MIN_QUIET_PAIRS else medians_all[k]
    ratios: dict[str, dict[str, Any]] = {}

    def add_ratio(name: str, num: str, den: str, goal: float) -> None:
        if num not in rates or den not in rates:
            return
        paired = paired_ratios(rates[num], rates[den])
        clean = [r for r, a, b in zip(paired, per_rep[num], per_rep[den], strict=True) if quiet(a) and quiet(b)]
        trusted = len(clean) >= MIN_QUIET_PAIRS
        headline = median(clean) if trusted else median(paired)
        ratios[name] = {
            "headline": headline,
            "median_of_quiet_pairs": median(clean) if clean else None,
            "median_of_all_pairs": median(paired),
            "of_medians": ratio(medians[num], medians[den]),
            "quiet_pairs": len(clean),
            "pairs": len(paired),
            "trusted": trusted,
            "per_rep": [round(r, 4) for r in paired],
            "goal": goal,
            "verdict": ("PASS" if headline >= goal else "below goal") if trusted else (
                "smoke test only" if s.quick else f"noisy: fewer than {MIN_QUIET_PAIRS} quiet pairs"),
        }

    add_ratio("w2_server_over_inprocess", "w2_server_256", "w2_inprocess_256", W2_GOAL)
    add_ratio("w3_on_over_off", "w3_on", "w3_off", W3_GOAL_VS_OFF)
    add_ratio("w3_on_over_inprocess_8", "w3_on", "w3_inprocess_8", W3_GOAL_VS_INPROC)
    cpu_medians = {
        k: {
            "client_cores": median([m.cpu.client_cores for m in v if m.cpu]),
            "server_cores": median([m.cpu.server_cores for m in v if m.cpu]),
            "foreign_cores": median([m.cpu.foreign_cores for m in v if m.cpu]),
        }
        for k, v in per_rep.items()
    }
    return {
        "benchmark": "serving (W2, W3)",
        "machine": machine_info(s.baseline_threads) | {
            "inprocess_loops": s.server_instances, "server_torch_threads": s.server_threads,
            "server_instances": s.server_instances},
        "settings": asdict(s),
        "medians_samples_per_s": {k: round(v, 1) for k, v in medians.items()},
        "medians_all_reps_samples_per_s": {k: round(v, 1) for k, v in medians_all.items()},
        "quiet_reps": {k: sum(quiet(m) for m in v) for k, v in per_rep.items()},
        "ratios": ratios,
        "cpu_medians_cores": cpu_medians,
        "per_rep": {k: [m.as_dict() | {"quiet": quiet(m)} for m in v] for k, v in per_rep.items()},
        "server_exit_codes": exit_codes,
    }


def report(doc: dict[str, Any]) -> str:
    """The plain-text table: medians, paired ratios against their goals, CPU split."""
    med = doc["medians_samples_per_s"]
    cpu = doc["cpu_medians_cores"]
    labels = {
        "w2_inprocess_256": "W2 A in-process model(x), batch 256",
        "w2_server_256": "W2 B server saturated, batch 256",
        "w3_inprocess_8": "W3 in-process model(x), batch 8",
        "w3_on": "W3 server batching ON, 64 x batch 8",
        "w3_off": "W3 server batching OFF, 64 x batch 8",
    }
    rows = []
    for k, label in labels.items():
        if k in med:
            reps = ", ".join(f"{m['samples_per_s']:,.0f}{'' if m['quiet'] else '*'}" for m in doc["per_rep"][k])
            rows.append([label, med[k], cpu[k]["client_cores"], cpu[k]["server_cores"], cpu[k]["foreign_cores"], reps])
    out = [format_table(["variant", "samples/s", "client cores", "server cores", "foreign cores",
                         "per rep (* = disturbed)"], rows), ""]
    rrows = []
    names = {
        "w2_server_over_inprocess": "W2 server / in-process (batch 256)",
        "w3_on_over_off": "W3 batching on / off",
        "w3_on_over_inprocess_8": "W3 batching on / in-process batch 8",
    }
    for k, label in names.items():
        if k in doc["ratios"]:
            r = doc["ratios"][k]
            quiet = r["median_of_quiet_pairs"]
            rrows.append([label, float("nan") if quiet is None else quiet, f"{r['quiet_pairs']}/{r['pairs']}",
                          r["median_of_all_pairs"], f">= {r['goal']}", r["verdict"]])
    out.append(format_table(["ratio", "median, quiet pairs", "quiet", "median, all pairs", "goal", "verdict"],
                            rrows))
    m = doc["machine"]
    out.append("")
    out.append("samples/s: median of the quiet repetitions (all, when fewer than "
               f"{MIN_QUIET_PAIRS}); cores: CPU-seconds per second during the window, client = this process.")
    out.append(f"machine: {m['cpu_model']}, {m['cpu_count']} CPUs, {m['platform']}, python {m['python']}, "
               f"torch {m['torch_version']}")
    out.append(f"layout: in-process {m['inprocess_loops']} model(x) loop(s) x {m['torch_threads']} torch thread(s); "
               f"server {m['server_instances']} instance(s) x {m['server_torch_threads']} torch thread(s)")
    return "\n".join(out)


N = TypeVar("N", int, float)


def _pick(given: N | None, quick: bool, quick_default: N, default: N) -> N:
    """An explicit flag wins; otherwise --quick picks the short smoke-test default."""
    if given is not None:
        return given
    return quick_default if quick else default


def parse_args(argv: Sequence[str] | None) -> Settings:
    p = argparse.ArgumentParser(prog="python -m benchmarks.serving", description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=None, help="repetitions (default 7; 2 with --quick)")
    p.add_argument("--quick", action="store_true", help="short windows for a smoke test (numbers are rough)")
    p.add_argument("--warmup", type=float, default=None, help="seconds of warm-up per measurement (default 0.5)")
    p.add_argument("--duration", type=float, default=None, help="seconds measured per measurement (default 2)")
    p.add_argument("--threads", type=int, default=0, help="server torch threads (default: cores / instances)")
    p.add_argument("--inproc-threads", type=int, default=0,
                   help="in-process torch threads (default: the server's --threads)")
    p.add_argument("--instances", type=int, default=0, help="server model instances (default: one per core)")
    p.add_argument("--delay-us", type=int, default=2000, help="--max-queue-delay-us of the batching server")
    p.add_argument("--w2-in-flight", type=int, default=0,
                   help="concurrent batch-256 requests for W2 (default: two per instance)")
    p.add_argument("--w3-clients", type=int, default=64, help="concurrent batch-8 clients for W3 (default 64)")
    p.add_argument("--channels", type=int, default=1, help="gRPC channels per server in the client (default 1)")
    p.add_argument("--only", choices=["all", "w2", "w3"], default="all")
    p.add_argument("--max-foreign-cores", type=float, default=Settings.max_foreign_cores,
                   help="wait for, and re-measure past, this much CPU used by other processes (0: off)")
    p.add_argument("--gate-budget", type=float, default=None,
                   help=f"total seconds the run may wait for a quiet machine (default {Settings.gate_budget_s:.0f}, "
                   "10 with --quick)")
    p.add_argument("--max-redos", type=int, default=None,
                   help=f"disturbed measurements that may be taken again (default {Settings.max_redos}, "
                   "2 with --quick)")
    p.add_argument("--server-arg", action="append", default=[], help="extra teacher-server flag (repeatable)")
    p.add_argument("--server-env", action="append", default=[], metavar="KEY=VALUE",
                   help="environment variable for the servers, e.g. OMP_WAIT_POLICY=PASSIVE (repeatable)")
    p.add_argument("--out", default="serving", help="results file: benchmarks/results/<OUT>.json (default serving)")
    a = p.parse_args(argv)
    reps = _pick(a.reps, a.quick, 2, Settings.reps)
    if reps < 1:
        p.error("--reps must be >= 1")
    if any("=" not in e for e in a.server_env):
        p.error("--server-env takes KEY=VALUE")
    return Settings(
        reps=reps,
        warmup_s=_pick(a.warmup, a.quick, 0.3, Settings.warmup_s),
        duration_s=_pick(a.duration, a.quick, 0.7, Settings.duration_s),
        threads=a.threads, inproc_threads=a.inproc_threads, instances=a.instances, delay_us=a.delay_us,
        w2_in_flight=a.w2_in_flight, w3_clients=a.w3_clients, channels=a.channels, only=a.only,
        quick=a.quick, max_foreign_cores=a.max_foreign_cores,
        gate_budget_s=_pick(a.gate_budget, a.quick, 10.0, Settings.gate_budget_s),
        max_redos=_pick(a.max_redos, a.quick, 2, Settings.max_redos),
        extra_server_args=tuple(a.server_arg), server_env=tuple(a.server_env), out=a.out,
    )


def main(argv: Sequence[str] | None = None) -> int:
    s = parse_args(argv)
    started = time.perf_counter()
    try:
        with sigterm_raises():
            doc = asyncio.run(run(s))
    except KeyboardInterrupt:
        print("\ninterrupted: servers stopped, no results written", file=sys.stderr)
        return 130
    doc["total_wall_s"] = round(time.perf_counter() - started, 1)
    path = write_results(s.out, doc)
    print()
    print(report(doc))
    print(f"\nwrote {path} ({doc['total_wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
