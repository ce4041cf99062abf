"""W2/W3 measurements: the in-process baseline and the gRPC load generator against a teacher-server.

`measure_inprocess` times `model(x)` loops (the machine's ceiling); `measure_server` keeps a
number of KServe v2 requests in flight over raw gRPC stubs and reads the server's own statistics
(batches, compute and queue time) for the same window, so a result says whether batching happened.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, astuple, dataclass
from typing import Any

import grpc
import numpy as np
import torch
from tritonclient.grpc import service_pb2

from benchmarks.common import REF_MODEL_NAME
from benchmarks.cpu import CpuMeter, CpuUsage, thread_cpu_seconds

MODEL_NAME = REF_MODEL_NAME
INPUT_SHAPE = (3, 32, 32)
CLASSES = 100
MAX_MESSAGE = 64 << 20


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
    # CPU ms a request in the measured server, by kind of thread (`thread_kind`): where the work
    # outside the model goes
    server_ms_per_request: dict[str, float] | None = None

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["samples_per_s"] = round(self.samples_per_s, 1)
        d["window_s"] = round(self.window_s, 4)
        d["cpu"] = self.cpu.as_dict() if self.cpu else None
        for k in ("mean_server_batch", "server_compute_ms", "server_busy", "server_latency_ms", "server_queue_ms"):
            if d[k] is not None:
                d[k] = round(d[k], 3)
        if self.server_ms_per_request is not None:
            d["server_ms_per_request"] = {k: round(v, 3) for k, v in self.server_ms_per_request.items()}
        return d


THREAD_KINDS = ("event loop", "gRPC", "model instances", "other")


def thread_kind(name: str, main: bool) -> str:
    """Which of THREAD_KINDS a teacher-server thread is, by its OS name: the main thread runs the
    event loop (gRPC's asyncio server, decoding, the batcher); gRPC's core polls and writes on its
    `event_engine` and `grpc_*` threads; the model runs on `instance-N` (teacher_server.threads)."""
    if main:
        return "event loop"
    if name.startswith("instance-"):
        return "model instances"
    if name.startswith(("event_engine", "grpc")):
        return "gRPC"
    return "other"


def cpu_ms_per_request(pid: int, before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]],
                       requests: int) -> dict[str, float]:
    """CPU milliseconds a request by `thread_kind`, between two `thread_cpu_seconds` readings of `pid`."""
    out = dict.fromkeys(THREAD_KINDS, 0.0)
    for tid, (name, sec) in after.items():
        out[thread_kind(name, tid == pid)] += sec - before.get(tid, (name, 0.0))[1]
    return {k: 1e3 * v / max(requests, 1) for k, v in out.items()}


# ---- in-process baseline --------------------------------------------------------------------
Model = Callable[[torch.Tensor], torch.Tensor]
"""An nn.Module, or benchmarks.device.InProcessModel (the model as it runs on --device)."""


def _place(model: Model, x: torch.Tensor) -> torch.Tensor:
    """The input where the model wants it, before the timed loop (a CUDA baseline's inputs are on
    the GPU already)."""
    place = getattr(model, "place", None)
    return place(x) if place is not None else x


def measure_inprocess(
    model: Model,
    batch: int,
    warmup_s: float,
    duration_s: float,
    *,
    server_pids: Sequence[int] = (),
    workers: int = 1,
    sample: torch.Tensor | None = None,
) -> Measurement:
    """`model(x)` in a loop, timed over a whole number of calls (no partial-call error). `x` is
    `sample` (`batch` samples of another model's input) or random RefTeacher inputs.

    `workers` > 1 runs that many loops on their own threads at once, the in-process twin of a
    server with that many model instances (each thread uses the process-wide torch thread
    count). `server_pids` are our idle servers: counted apart from foreign load, expected ~0.
    """
    if workers > 1:
        return _measure_inprocess_threads(model, batch, warmup_s, duration_s, server_pids=server_pids, workers=workers,
                                          sample=sample)
    x = _place(model, _sample(batch, sample))
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


def _sample(batch: int, sample: torch.Tensor | None) -> torch.Tensor:
    return sample if sample is not None else torch.randn(batch, *INPUT_SHAPE)


def _measure_inprocess_threads(
    model: Model, batch: int, warmup_s: float, duration_s: float, *, server_pids: Sequence[int], workers: int,
    sample: torch.Tensor | None = None,
) -> Measurement:
    """Several model(x) loops at once; each is timed over its own whole calls and the rates add."""
    barrier = threading.Barrier(workers + 1)
    start = [0.0]

    def loop() -> tuple[int, float]:
        x = _place(model, _sample(batch, sample))
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


async def server_stats(stub: Any, model_name: str = MODEL_NAME) -> ServerStats:
    resp = await stub.ModelStatistics(service_pb2.ModelStatisticsRequest(name=model_name), timeout=10)
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
    profile_pid: int | None = None,
    transport: str = "unary",
) -> Measurement:
    """Keep `concurrency` requests in flight for warm-up + duration; rate over the window (the
    request's own model's statistics say how the server batched).

    `transport` is how each client sends: "unary", one ModelInfer call a request (tritonclient's
    `infer`), or "stream", one ModelStreamInfer stream a client for the whole run, a request
    written and its answer read in turn (tritonclient's `start_stream` + `async_stream_infer`).

    The rate comes from `burst_rate` over the completions seen in the window. Requests still in
    flight when the window ends are awaited, not cancelled, so the server is idle (not computing
    abandoned batches) when the next variant starts. With `profile_pid` (the measured server's),
    its CPU a request by kind of thread (`cpu_ms_per_request`) over the same window.
    """
    loop = asyncio.get_running_loop()
    stop = False
    window_open = False
    done: list[tuple[float, int]] = []  # (completion time, samples) inside the window
    errors = 0

    def failed(what: str) -> None:
        nonlocal errors
        errors += 1
        if errors > 100:
            raise RuntimeError(f"too many failed requests; last: {what}")

    async def unary_client(stub: Any) -> None:
        while not stop:
            try:
                await stub.ModelInfer(request, timeout=60)
            except grpc.aio.AioRpcError as e:
                failed(f"{e.code().name}: {e.details()}")
                continue
            if window_open:
                done.append((loop.time(), batch))

    async def stream_client(stub: Any) -> None:
        # One stream for the whole run (its deadline: warm-up, window and a margin to drain).
        call = stub.ModelStreamInfer(timeout=warmup_s + duration_s + 120)
        try:
            while not stop:
                await call.write(request)
                answer = await call.read()
                if answer is grpc.aio.EOF:
                    raise RuntimeError(f"the server ended the stream: {await call.code()} {await call.details()}")
                if answer.error_message:
                    failed(answer.error_message)
                    continue
                if window_open:
                    done.append((loop.time(), batch))
            await call.done_writing()
            await call.code()  # the server ends the stream once it has answered everything
        finally:
            if not call.done():
                call.cancel()

    if transport not in ("unary", "stream"):
        raise ValueError(f"transport {transport!r}: unary or stream")
    client = unary_client if transport == "unary" else stream_client

    tasks = [asyncio.create_task(client(stubs[i % len(stubs)])) for i in range(concurrency)]
    try:
        await sleep_or_fail(tasks, warmup_s)
        stats0 = await server_stats(stubs[0], request.model_name)
        meter = CpuMeter(server_pids)
        threads0 = thread_cpu_seconds(profile_pid) if profile_pid is not None else {}
        meter.start()
        window_open = True
        await sleep_or_fail(tasks, duration_s)
        window_open = False
        cpu = meter.stop()
        threads1 = thread_cpu_seconds(profile_pid) if profile_pid is not None else {}
        st = await server_stats(stubs[0], request.model_name) - stats0
        stop = True
        await asyncio.gather(*tasks)
    finally:
        stop = True
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    rate, span = burst_rate(done, cpu.wall_s / st.executions if st.executions else 0.0)
    m = Measurement(rate, len(done), span, cpu, st.executions, errors=errors)
    if profile_pid is not None and threads1:
        m.server_ms_per_request = cpu_ms_per_request(profile_pid, threads0, threads1, len(done))
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


async def sleep_or_fail(tasks: Sequence[asyncio.Task[None]], seconds: float) -> None:
    """Wait `seconds`, or raise at once what a client raised (its requests keep failing)."""
    done, _ = await asyncio.wait(tasks, timeout=seconds, return_when=asyncio.FIRST_EXCEPTION)
    for t in done:
        t.result()


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


async def check_server_output(stub: Any, model: Model, atol: float = 1e-3) -> float:
    """The server must compute what the model computes; returns the max abs difference (raise
    `atol` for FP16/BF16 compute)."""
    req, x = make_request(4, seed=1)
    resp = await stub.ModelInfer(req, timeout=60)
    got = np.frombuffer(resp.raw_output_contents[0], dtype=np.float32).reshape(4, CLASSES)
    with torch.inference_mode():
        want = model(torch.from_numpy(x)).float().cpu().numpy()
    diff = float(np.abs(got - want).max())
    if not np.allclose(got, want, atol=atol, rtol=atol):
        raise AssertionError(f"server logits differ from the in-process model by up to {diff}")
    return diff
