"""W2 serving efficiency and W3 small requests (docs/design/workloads.md).

    .venv/bin/python -m benchmarks.serving [--reps 7] [--quick] [--threads N --instances N --delay-us N]
                                           [--pytriton | --no-pytriton] [--device cuda:0 --compute-dtype FP16]
                                           [--server-cpus 0-1 --client-cpus 2-3] [--streams]

W2: how much of the machine's in-process RefTeacher throughput at batch 256 survives the trip
through teacher-server. A = `model(x)` in this process; B = the server kept saturated by a few
concurrent batch-256 requests. Headline: B / A (goal >= 0.95).

W3: what dynamic batching buys 64 concurrent clients that each send batch-8 requests. Server
with batching on vs off (`--no-dynamic-batching`), and against the in-process batch-256 rate, the
most batching can reach (the in-process batch-8 rate, what a client would get by running the
teacher itself, is measured beside them). Headlines: on / off (goal >= 3) and on / in-process
batch 256 (goal >= 0.85).

PyTriton side (W2 and W3): NVIDIA's PyTriton (the real Triton core) serves the same RefTeacher
(`examples.refteacher:build`, same seed, FP32, CPU) from its own cached virtualenv
(`benchmarks/pytriton_env.py`), laid out like the batching teacher-server: as many model
instances, the same torch threads, max batch size --max-batch and a dynamic batcher whose queue
delay is --delay-us. The same load generator drives it with the same requests, interleaved with
the other variants in every repetition. Headlines: W2 server / PyTriton (goal >= 1.3) and W3
batching on / PyTriton (goal > 1.0). With --streams a second PyTriton serves the stream variants
alone; a PyTriton that dies mid-run takes only its own variants out of the results (the JSON and
the table say why). It runs when PyTriton's virtualenv is built already (the
test suite builds it) and the run is on the CPU in FP32; `--pytriton` insists (and builds the
virtualenv, about 2 minutes once), `--no-pytriton` leaves it out. --server-arg flags are
teacher-server's only; --server-env applies to PyTriton too.

Clients send one ModelInfer call a request (tritonclient's `infer`). With --streams, each server
variant (teacher-server's and PyTriton's W2, W3 with batching) is also measured with every client
on one ModelStreamInfer stream of its own, a request written and its answer read in turn
(tritonclient's `start_stream` + `async_stream_infer`), in the same repetitions; those variants
and their ratios carry the suffix `_stream`. A message on an open stream costs gRPC's Python
server far less than a call, so the pair says what the calls themselves cost.

--compare FLAG (repeatable) is an A/B test of a server option in one run: a second batching
teacher-server starts with those flags added, and each batching variant of teacher-server (W2,
W3, and their stream twins) is measured on it too (suffix `_cmp`), in the same repetitions; the
ratios `*_over_compare` are the server as configured / the compared one, without a goal.
--compare-tree DIR runs the compared server from another checkout (a `git worktree` of an
earlier commit), with --compare's flags if any: two versions of the server in one run.

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

On a machine with cores to spare, `--server-cpus` and `--client-cpus` (core lists as `taskset -c`
writes them) keep the two sides apart: the servers and the in-process baselines run on the first
set (their default instances and threads count those cores), this process's load generator on
the second (`benchmarks.pinning`), so the client's CPU is no longer charged to the server.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import subprocess
import sys
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
from tritonclient.grpc import service_pb2_grpc

from benchmarks.common import (
    BATCHING_QUEUE_DELAY_US,
    REF_MODEL_REF,
    REPO_ROOT,
    ainterleave,
    format_table,
    machine_info,
    median,
    paired_ratios,
    ratio,
    redo_when_loaded,
    run_and_report,
)
from benchmarks.cpu import QuietGate
from benchmarks.device import DeviceChoice, InProcessModel, add_device_args
from benchmarks.pinning import CpuListError, on_cores, parse_split, pin_process
from benchmarks.pytriton_env import PyTritonServer, cached_venv, pytriton_server, pytriton_venv
from benchmarks.serving_measure import (
    CLASSES,
    INPUT_SHAPE,
    MODEL_NAME,
    THREAD_KINDS,
    Measurement,
    check_server_output,
    make_request,
    measure_inprocess,
    measure_server,
    open_channel,
)
from examples.refteacher import build
from teacher_server.launch import TeacherProcess
from teacher_server.server import default_instances, usable_cores

MODEL_REF = REF_MODEL_REF
# The goals of docs/design/workloads.md.
W2_GOAL = 0.95
W3_GOAL_VS_OFF = 3.0
W3_GOAL_VS_INPROC_256 = 0.85  # batch-8 requests batched, against the in-process batch-256 rate
W2_GOAL_VS_PYTRITON = 1.3  # at least 1.3x PyTriton serving the same model
W3_GOAL_VS_PYTRITON = 1.0  # ahead of PyTriton (strictly above)
PEER_EXIT_WAIT_S = 15.0  # how long a failed peer measurement waits to see whether the peer exited
STREAM_SUFFIX = "_stream"  # a variant's twin with every client on a ModelStreamInfer stream (--streams)
COMPARE_SUFFIX = "_cmp"  # a batching variant's twin on the server started with --compare's flags


@dataclass(frozen=True)
class Settings:
    """One run's knobs; recorded verbatim in the JSON so a result can be reproduced."""

    reps: int = 7
    warmup_s: float = 0.5
    duration_s: float = 2.0
    threads: int = 0  # torch threads in the server; 0: cores / instances (teacher-server's default)
    inproc_threads: int = 0  # torch threads for the in-process baselines; 0: the server's
    instances: int = 0  # 0: one per core (teacher-server's default on CPU)
    delay_us: int = BATCHING_QUEUE_DELAY_US  # --max-queue-delay-us of the batching server
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
    device: str = "cpu"  # servers and in-process baseline (benchmarks/device.py)
    compute_dtype: str = "FP32"
    pytriton: str = "auto"  # on | off | auto: on when its venv is built and the run is CPU FP32
    server_cpus: tuple[int, ...] = ()  # the servers' and the in-process baselines' cores; (): this process's
    client_cpus: tuple[int, ...] = ()  # the load generator's cores; () with server_cpus ()
    streams: bool = False  # measure each server variant over ModelStreamInfer streams too
    compare: tuple[str, ...] = ()  # flags of a second batching teacher-server measured beside the first (A/B)
    compare_tree: str = ""  # a checkout the second server runs from instead of this one (A/B of two versions)

    @property
    def comparing(self) -> bool:
        return bool(self.compare or self.compare_tree)

    @property
    def choice(self) -> DeviceChoice:
        return DeviceChoice(self.device, self.compute_dtype)

    @property
    def server_cores(self) -> int:
        """The cores the server side runs on: --server-cpus, else all this process may use."""
        return len(self.server_cpus) or usable_cores()

    @property
    def server_threads(self) -> int:
        return self.threads or max(1, self.server_cores // self.server_instances)

    @property
    def server_instances(self) -> int:
        """--instances, else the teacher's own default for the device (on CPU: one per server core)."""
        if self.instances:
            return self.instances
        return self.server_cores if not self.choice.cuda else default_instances(self.device)

    def server_side(self) -> contextlib.AbstractContextManager[None]:
        """A block whose servers and threads run on --server-cpus (no change without them)."""
        return on_cores(self.server_cpus) if self.server_cpus else contextlib.nullcontext()

    @property
    def requests_in_flight(self) -> int:
        return self.w2_in_flight or 2 * self.server_instances

    @property
    def server_env_pairs(self) -> list[tuple[str, str]]:
        """--server-env as (key, value) pairs."""
        return [(k, v) for k, _, v in (e.partition("=") for e in self.server_env)]

    @property
    def baseline_threads(self) -> int:
        return self.inproc_threads or self.server_threads


# ---- the run --------------------------------------------------------------------------------
def server_args(s: Settings, batching: bool) -> list[str]:
    args = [
        "--model", MODEL_REF, "--name", MODEL_NAME, *s.choice.server_args(), "--port", "0",
        "--max-batch-size", str(s.max_batch), "--instances", str(s.server_instances),
        "--threads", str(s.server_threads), "--log-level", "WARNING",
    ]
    args += ["--max-queue-delay-us", str(s.delay_us)] if batching else ["--no-dynamic-batching"]
    return [*args, *s.extra_server_args]


def pytriton_venv_for(s: Settings) -> tuple[Path | None, str]:
    """The PyTriton venv to serve from, or None; and why, for the JSON and the console.

    "auto" never builds the venv (a two-minute pip install is not something a benchmark run should
    start unasked); "on" builds it when missing and fails where PyTriton cannot run.
    """
    if s.pytriton == "off":
        return None, "left out (--no-pytriton)"
    if s.pytriton == "on":
        return pytriton_venv(), "on (--pytriton)"
    if s.device != "cpu" or s.compute_dtype != "FP32":
        return None, "left out: the PyTriton side runs on the CPU in FP32 only"
    venv = cached_venv()
    if venv is None:
        return None, ("left out: PyTriton's virtualenv is not built or cannot run here; --pytriton builds it "
                      "(about 2 minutes, once) and says why it cannot run where it cannot")
    return venv, "on (its virtualenv is built)"


def pytriton_args(s: Settings, venv: Path, env: dict[str, str]) -> dict[str, Any]:
    """pytriton_server() keywords: the batching teacher-server's model and layout under PyTriton."""
    return {
        "model": MODEL_NAME, "torch_model": MODEL_REF, "input_shape": INPUT_SHAPE, "classes": CLASSES,
        "max_batch_size": s.max_batch, "max_queue_delay_us": s.delay_us, "instances": s.server_instances,
        "threads": s.server_threads, "env": env, "venv": venv,
    }


def _peer_of(variant: str) -> str | None:
    """The PyTriton server a variant loads (its stream twins have one of their own), or None."""
    if "pytriton" not in variant:
        return None
    return "pytriton" + (STREAM_SUFFIX if variant.endswith(STREAM_SUFFIX) else "")


def survive_peer(measure: Callable[[], Awaitable[Measurement]], process: subprocess.Popen[bytes], log: Path,
                 died: list[str], load: str, *, exit_wait_s: float = PEER_EXIT_WAIT_S
                 ) -> Callable[[], Awaitable[Measurement | None]]:
    """A peer's measurement that ends the peer's side of the comparison, not the run, when the
    peer's process exits under it, within `exit_wait_s` of the failure (PyTriton has: Triton's
    Python backend, SIGSEGV under stream load). `died` gets why, once; every later call returns
    None without measuring. A failure while the process still runs is raised as it is."""

    async def peer() -> Measurement | None:
        if died:
            return None
        try:
            return await measure()
        except Exception as error:
            try:  # its launcher exits a moment after the server under it
                code = await asyncio.to_thread(process.wait, exit_wait_s)
            except subprocess.TimeoutExpired:
                raise error from None  # the peer still runs: the measurement's own failure
            died.append(f"PyTriton exited ({f'signal {-code}' if code < 0 else f'code {code}'}) while {load} "
                        f"loaded it; its log: {log}")
            print(f"  {died[0]}: its variants are left out", flush=True)
            return None

    return peer


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
    s.choice.check()
    model = InProcessModel(build(), s.choice, images=True)
    want_w2 = s.only in ("all", "w2")
    want_w3 = s.only in ("all", "w3")

    pt_venv, pt_why = pytriton_venv_for(s)
    print(f"PyTriton side: {pt_why}", flush=True)
    pt: PyTritonServer | None = None
    # With --streams, a second PyTriton for the stream variants alone: Triton's Python backend has
    # crashed (SIGSEGV) under W3's 64 streams, and that must not take the unary comparison with it.
    peers: dict[str, PyTritonServer] = {}
    with contextlib.ExitStack() as stack:
        env = dict(os.environ) | dict(s.server_env_pairs)
        servers = {"batching_on": TeacherProcess(server_args(s, batching=True), label="batching-on", env=env,
                                                 cwd=REPO_ROOT, stop_grace=20.0)}
        if want_w3:
            servers["batching_off"] = TeacherProcess(server_args(s, batching=False), label="batching-off", env=env,
                                                     cwd=REPO_ROOT, stop_grace=20.0)
        if s.comparing:
            tree = s.compare_tree or str(REPO_ROOT)
            servers["compare"] = TeacherProcess(
                [*server_args(s, batching=True), *s.compare], label="compare", cwd=tree, stop_grace=20.0,
                env=env | {"PYTHONPATH": os.pathsep.join([str(tree), *filter(None, [env.get("PYTHONPATH")])])})
        for p in servers.values():  # cleanups first: an error while any is starting stops them all
            stack.callback(p.cleanup)
        with s.server_side():  # a child process starts on the cores of the thread that forks it
            for p in servers.values():
                p.launch()
            if pt_venv is not None:  # PyTriton starts while the teacher-servers load
                for key in ("pytriton", *(["pytriton" + STREAM_SUFFIX] if s.streams else [])):
                    peers[key] = stack.enter_context(pytriton_server(**pytriton_args(s, pt_venv,
                                                                                    dict(s.server_env_pairs))))
                pt = peers["pytriton"]
        if s.client_cpus:  # before any channel: gRPC's threads are this process's too
            pin_process(s.client_cpus)
        for p in servers.values():
            p.wait_ready()
        pids = [p.pid for p in servers.values()]
        affinity = {k: sorted(os.sched_getaffinity(p.pid)) for k, p in servers.items()}
        print("servers: " + ", ".join(f"{k} pid {p.pid} at {p.endpoint}" for k, p in servers.items()), flush=True)
        endpoints = {k: p.endpoint for k, p in servers.items()}
        for key, peer in peers.items():
            endpoints[key] = peer.grpc_url
            pids += peer.pids()
            print(f"{key}: pids {peer.pids()} at {peer.grpc_url}, log {peer.log}", flush=True)

        chans = {k: [open_channel(e) for _ in range(max(1, s.channels))] for k, e in endpoints.items()}
        try:
            stubs = {k: [service_pb2_grpc.GRPCInferenceServiceStub(c) for c in cs] for k, cs in chans.items()}
            output_diffs: dict[str, float] = {}
            for k in endpoints:
                diff = await check_server_output(stubs[k][0], model, 1e-3 if s.compute_dtype == "FP32" else 5e-2)
                output_diffs[k] = diff
                print(f"{k}: output matches the in-process model (max |diff| {diff:.2e})", flush=True)
            w2_req, _ = make_request(s.w2_batch)
            w3_req, _ = make_request(s.w3_batch)

            async def inprocess(batch: int) -> Measurement:
                # Blocks the event loop on purpose: nothing else may run while the baseline does.
                with s.server_side():  # its loop threads start on the servers' cores
                    return measure_inprocess(model, batch, s.warmup_s, s.duration_s, server_pids=pids,
                                             workers=s.server_instances)

            died: dict[str, list[str]] = {k: [] for k in peers}  # why a PyTriton stopped: its variants leave

            def load(server: str, req: Any, batch: int, clients: int, *, transport: str,
                     profile: bool = False) -> Callable[[], Awaitable[Measurement | None]]:
                def measure() -> Awaitable[Measurement]:
                    return measure_server(
                        stubs[server], req, batch=batch, concurrency=clients, warmup_s=s.warmup_s,
                        duration_s=s.duration_s, server_pids=pids,
                        profile_pid=servers[server].pid if profile else None, transport=transport)

                if server not in peers:
                    return measure  # our own server failing fails the run
                return survive_peer(measure, peers[server].process, peers[server].log, died[server],
                                    f"{transport} clients")

            # Unary calls always; with --streams, each server variant's twin over streams beside it
            # ("_stream"), in the same repetitions (batching off only over unary calls).
            transports = [("unary", ""), *([("stream", STREAM_SUFFIX)] if s.streams else [])]
            variants: dict[str, Callable[[], Awaitable[Measurement | None]]] = {}

            def batching(server_key: str, pytriton_key: str, req: Any, batch: int, clients: int) -> None:
                """A workload's batching variants over each transport: teacher-server's, its twin on the
                --compare server, PyTriton's."""
                for transport, suffix in transports:
                    variants[server_key + suffix] = load("batching_on", req, batch, clients, transport=transport,
                                                         profile=True)
                    if s.comparing:
                        variants[server_key + suffix + COMPARE_SUFFIX] = load(
                            "compare", req, batch, clients, transport=transport, profile=True)
                    if pt is not None:
                        variants[pytriton_key + suffix] = load("pytriton" + suffix, req, batch, clients,
                                                               transport=transport)

            # W3's goal is against the in-process batch-256 rate: measured with --only w3 too.
            variants["w2_inprocess_256"] = lambda: inprocess(s.w2_batch)
            if want_w2:
                batching("w2_server_256", "w2_pytriton_256", w2_req, s.w2_batch, s.requests_in_flight)
            if want_w3:
                variants["w3_inprocess_8"] = lambda: inprocess(s.w3_batch)
                batching("w3_on", "w3_pytriton", w3_req, s.w3_batch, s.w3_clients)
                variants["w3_off"] = load("batching_off", w3_req, s.w3_batch, s.w3_clients, transport="unary")
            gate = QuietGate(pids, max_foreign_cores=s.max_foreign_cores, budget_s=s.gate_budget_s)
            contaminated = redo_when_loaded(s.max_foreign_cores, s.max_redos) if s.max_foreign_cores > 0 else None

            discarded: dict[str, list[Measurement | None]] = {}
            measured = await ainterleave(
                s.reps, variants, lambda rep, name, m: m is not None and print_rep(rep, name, m),
                before=gate.wait if s.max_foreign_cores > 0 else None,
                redo_if=None if contaminated is None else lambda m: m is not None and contaminated(m),
                discarded=discarded,
            )
            per_rep = {k: [m for m in v if m is not None] for k, v in measured.items()
                       if not any(why and _peer_of(k) == peer for peer, why in died.items())}
        finally:
            for cs in chans.values():
                for c in cs:
                    await c.close()
        exit_codes = {k: p.stop() for k, p in servers.items()}
    for key, peer in peers.items():  # stopped when the stack closed
        exit_codes[key] = peer.process.returncode

    doc = summarise(s, per_rep, exit_codes)
    doc["machine"]["servers_ran_on"] = affinity
    doc["output_max_abs_diff"] = output_diffs
    doc["pytriton"] = {"enabled": pt is not None, "why": pt_why, "venv": str(pt_venv) if pt_venv else None} | (
        {"instances": pt.instances, "torch_threads": s.server_threads, "max_batch_size": pt.max_batch_size,
         "max_queue_delay_us": s.delay_us, "log": str(pt.log)} if pt is not None else {}) | (
        {"stream_log": str(peers["pytriton" + STREAM_SUFFIX].log)} if "pytriton" + STREAM_SUFFIX in peers else {})
    doc["quiet_gate"] = gate.as_dict()
    doc["discarded"] = {k: [m.as_dict() for m in v if m is not None] for k, v in discarded.items()}
    for key, why in died.items():
        if why:
            doc["pytriton"]["died" + key.removeprefix("pytriton")] = why[0]
    return doc


MIN_QUIET_PAIRS = 5  # a headline is the median of at least 5 repetitions (docs/design/workloads.md)


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

    def add_ratio(name: str, num: str, den: str, goal: float | None, above: bool = False) -> None:
        """`above`: the goal is to be strictly above `goal` (ahead of), not at least it. No goal:
        a comparison (--compare), reported without a verdict."""
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
            "goal_op": ">" if above else ">=",
            "verdict": ("comparison" if goal is None else
                        ("PASS" if (headline > goal if above else headline >= goal) else "below goal")) if trusted
            else ("smoke test only" if s.quick else f"noisy: fewer than {MIN_QUIET_PAIRS} quiet pairs"),
        }

    for x in ("", STREAM_SUFFIX):  # the stream twins' ratios carry the same goals
        add_ratio("w2_server_over_inprocess" + x, "w2_server_256" + x, "w2_inprocess_256", W2_GOAL)
        add_ratio("w3_on_over_inprocess_256" + x, "w3_on" + x, "w2_inprocess_256", W3_GOAL_VS_INPROC_256)
        add_ratio("w2_server_over_pytriton" + x, "w2_server_256" + x, "w2_pytriton_256" + x, W2_GOAL_VS_PYTRITON)
        add_ratio("w3_on_over_pytriton" + x, "w3_on" + x, "w3_pytriton" + x, W3_GOAL_VS_PYTRITON, above=True)
    add_ratio("w3_on_over_off", "w3_on", "w3_off", W3_GOAL_VS_OFF)
    for x in ("", STREAM_SUFFIX):  # --compare: the server as it is / the one with the compared flags
        add_ratio("w2_server_over_compare" + x, "w2_server_256" + x, "w2_server_256" + x + COMPARE_SUFFIX, None)
        add_ratio("w3_on_over_compare" + x, "w3_on" + x, "w3_on" + x + COMPARE_SUFFIX, None)
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
        "machine": machine_info(s.baseline_threads) | s.choice.info() | {
            "inprocess_loops": s.server_instances, "server_torch_threads": s.server_threads,
            "server_instances": s.server_instances, "server_cpus": list(s.server_cpus) or None,
            "client_cpus": list(s.client_cpus) or None},
        "settings": asdict(s),
        "medians_samples_per_s": {k: round(v, 1) for k, v in medians.items()},
        "medians_all_reps_samples_per_s": {k: round(v, 1) for k, v in medians_all.items()},
        "quiet_reps": {k: sum(quiet(m) for m in v) for k, v in per_rep.items()},
        "ratios": ratios,
        "cpu_medians_cores": cpu_medians,
        "server_ms_per_request_medians": {
            k: {kind: round(median([m.server_ms_per_request[kind] for m in v if m.server_ms_per_request]), 3)
                for kind in THREAD_KINDS}
            for k, v in per_rep.items() if any(m.server_ms_per_request for m in v)
        },
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
        "w2_pytriton_256": "W2 PyTriton saturated, batch 256",
        "w3_pytriton": "W3 PyTriton batching, 64 x batch 8",
        "w2_server_256_stream": "W2 B server saturated, batch 256 (streams)",
        "w2_pytriton_256_stream": "W2 PyTriton saturated, batch 256 (streams)",
        "w3_on_stream": "W3 server batching ON, 64 x batch 8 (streams)",
        "w3_pytriton_stream": "W3 PyTriton batching, 64 x batch 8 (streams)",
    }
    settings = doc["settings"]
    compared = " ".join([*(settings.get("compare") or ()),
                         *([f"tree {settings['compare_tree']}"] if settings.get("compare_tree") else [])])
    for k in ("w2_server_256", "w3_on"):
        for x in ("", STREAM_SUFFIX):
            labels[k + x + COMPARE_SUFFIX] = f"{labels[k + x]} [{compared}]"
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
        "w3_on_over_inprocess_256": "W3 batching on / in-process batch 256",
        "w2_server_over_pytriton": "W2 server / PyTriton (batch 256)",
        "w3_on_over_pytriton": "W3 batching on / PyTriton (64 x batch 8)",
        "w2_server_over_inprocess_stream": "W2 streams: server / in-process",
        "w3_on_over_inprocess_256_stream": "W3 streams: batching on / in-process batch 256",
        "w2_server_over_pytriton_stream": "W2 streams: server / PyTriton",
        "w3_on_over_pytriton_stream": "W3 streams: batching on / PyTriton",
        "w2_server_over_compare": f"W2 server / server [{compared}]",
        "w3_on_over_compare": f"W3 batching on / batching on [{compared}]",
        "w2_server_over_compare_stream": f"W2 streams: server / server [{compared}]",
        "w3_on_over_compare_stream": f"W3 streams: batching on / batching on [{compared}]",
    }
    for k, label in names.items():
        if k in doc["ratios"]:
            r = doc["ratios"][k]
            quiet = r["median_of_quiet_pairs"]
            goal = "-" if r["goal"] is None else f"{r.get('goal_op', '>=')} {r['goal']}"
            rrows.append([label, float("nan") if quiet is None else quiet, f"{r['quiet_pairs']}/{r['pairs']}",
                          r["median_of_all_pairs"], goal, r["verdict"]])
    out.append(format_table(["ratio", "median, quiet pairs", "quiet", "median, all pairs", "goal", "verdict"],
                            rrows))
    by_thread = doc.get("server_ms_per_request_medians") or {}
    if by_thread:
        out.append("")
        out.append(format_table(["server CPU ms a request", *THREAD_KINDS],
                                [[labels[k], *(v[kind] for kind in THREAD_KINDS)] for k, v in by_thread.items()]))
    m = doc["machine"]
    out.append("")
    out.append("samples/s: median of the quiet repetitions (all, when fewer than "
               f"{MIN_QUIET_PAIRS}); cores: CPU-seconds per second during the window, client = this process.")
    out.append(f"machine: {m['cpu_model']}, {m['cpu_count']} CPUs, {m['platform']}, python {m['python']}, "
               f"torch {m['torch_version']}")
    out.append(f"layout: in-process {m['inprocess_loops']} model(x) loop(s) x {m['torch_threads']} torch thread(s); "
               f"server {m['server_instances']} instance(s) x {m['server_torch_threads']} torch thread(s)")
    if m.get("server_cpus"):
        out.append(f"cores: servers and in-process baselines {m['server_cpus']} (the servers ran on "
                   f"{sorted({c for cs in m['servers_ran_on'].values() for c in cs})}), load generator "
                   f"{m['client_cpus']}")
    out.append("clients send: one ModelInfer call a request" + (
        "; (streams): one ModelStreamInfer stream a client, a request at a time" if doc["settings"].get("streams")
        else ""))
    pt = doc.get("pytriton") or {}
    out.append(f"PyTriton side: {pt.get('why', 'not recorded')}" + (
        f"; {pt['instances']} instance(s) x {pt['torch_threads']} torch thread(s), max batch {pt['max_batch_size']}, "
        f"queue delay {pt['max_queue_delay_us']} us" if pt.get("enabled") else ""))
    for key, why in pt.items():
        if key.startswith("died"):
            out.append(f"PyTriton{' (streams)' if key.endswith(STREAM_SUFFIX) else ''} died: {why}; its variants "
                       "are left out")
    return "\n".join(out)


N = TypeVar("N", int, float)


def _pick(given: N | None, quick: bool, quick_default: N, default: N) -> N:
    """An explicit flag wins; otherwise --quick picks the short smoke-test default."""
    if given is not None:
        return given
    return quick_default if quick else default


def _checkout(p: argparse.ArgumentParser, tree: str) -> str:
    """--compare-tree as an absolute path, refused when it holds no teacher_server package."""
    if not tree:
        return ""
    path = Path(tree).resolve()
    if not (path / "teacher_server" / "__main__.py").is_file():
        p.error(f"--compare-tree {tree}: no teacher_server/ there; give a checkout of this project "
                "(git worktree add DIR COMMIT)")
    return str(path)


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
    p.add_argument("--delay-us", type=int, default=BATCHING_QUEUE_DELAY_US,
                   help="--max-queue-delay-us of the batching server")
    p.add_argument("--w2-in-flight", type=int, default=0,
                   help="concurrent batch-256 requests for W2 (default: two per instance)")
    p.add_argument("--w3-clients", type=int, default=64, help="concurrent batch-8 clients for W3 (default 64)")
    p.add_argument("--channels", type=int, default=1, help="gRPC channels per server in the client (default 1)")
    p.add_argument("--only", choices=["all", "w2", "w3"], default="all")
    p.add_argument("--streams", action="store_true",
                   help="measure each server variant (teacher-server and PyTriton, W2 and W3 with batching) a "
                   "second time with every client on one ModelStreamInfer stream of its own, in the same "
                   "repetitions")
    p.add_argument("--max-foreign-cores", type=float, default=Settings.max_foreign_cores,
                   help="wait for, and re-measure past, this much CPU used by other processes (0: off)")
    p.add_argument("--gate-budget", type=float, default=None,
                   help=f"total seconds the run may wait for a quiet machine (default {Settings.gate_budget_s:.0f}, "
                   "10 with --quick)")
    p.add_argument("--max-redos", type=int, default=None,
                   help=f"disturbed measurements that may be taken again (default {Settings.max_redos}, "
                   "2 with --quick)")
    p.add_argument("--server-arg", action="append", default=[], help="extra teacher-server flag (repeatable)")
    p.add_argument("--compare", action="append", default=[], metavar="FLAG",
                   help="start a second batching teacher-server with this flag added (repeatable) and measure "
                   "it beside the first in every repetition: W2 and W3 with batching, over streams too with "
                   "--streams; ratios first / second (write it --compare=--flag or --compare=--flag=value)")
    p.add_argument("--compare-tree", default="", metavar="DIR",
                   help="run the compared server (see --compare) from this checkout of the project instead, "
                   "e.g. a `git worktree` of an earlier commit: this run's code against that one's")
    p.add_argument("--server-env", action="append", default=[], metavar="KEY=VALUE",
                   help="environment variable for the servers, e.g. OMP_WAIT_POLICY=PASSIVE (repeatable)")
    p.add_argument("--out", default="serving", help="results file: benchmarks/results/<OUT>.json (default serving)")
    p.add_argument("--server-cpus", default="", metavar="LIST",
                   help="cores for the servers and the in-process baselines, e.g. 0-1 (with --client-cpus)")
    p.add_argument("--client-cpus", default="", metavar="LIST",
                   help="cores for this process's load generator, e.g. 2-3 (with --server-cpus)")
    p.add_argument("--pytriton", action=argparse.BooleanOptionalAction, default=None,
                   help="serve the model with PyTriton too and compare (default: when its virtualenv is built "
                   "and the run is CPU FP32; --pytriton builds the virtualenv, about 2 minutes once)")
    add_device_args(p)
    a = p.parse_args(argv)
    reps = _pick(a.reps, a.quick, 2, Settings.reps)
    if reps < 1:
        p.error("--reps must be >= 1")
    if any("=" not in e for e in a.server_env):
        p.error("--server-env takes KEY=VALUE")
    if a.pytriton and (a.device != "cpu" or a.compute_dtype != "FP32"):
        p.error("--pytriton serves the model on the CPU in FP32: drop --device/--compute-dtype, or --pytriton")
    try:
        server_cpus, client_cpus = parse_split(a.server_cpus, a.client_cpus)
    except CpuListError as e:
        p.error(str(e))
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
        device=a.device, compute_dtype=a.compute_dtype,
        pytriton={True: "on", False: "off", None: "auto"}[a.pytriton],
        server_cpus=server_cpus, client_cpus=client_cpus, streams=a.streams, compare=tuple(a.compare),
        compare_tree=_checkout(p, a.compare_tree),
    )


def main(argv: Sequence[str] | None = None) -> int:
    s = parse_args(argv)
    return run_and_report(lambda: asyncio.run(run(s)), s.out, report)


if __name__ == "__main__":
    sys.exit(main())
