"""W1 mesh efficiency and W5 failover (docs/design/workloads.md).

    .venv/bin/python -m benchmarks.mesh [--reps 5] [--quick] [--teachers 2 --w5-teachers 3]
                                        [--device cuda:0 --compute-dtype FP16] [--transport stream]

W1 asks how much of a training loop's speed survives when its teacher moves out of the loop and
behind the mesh. The accelerator is emulated (examples/emulated.py): the teacher sleeps 20 ms
per batch of 256, the student step 25 ms, both releasing the GIL, so what the mesh costs in CPU
and latency is all that separates the modes:
  pure     loader + student step, no teacher: the ceiling (256 / 25 ms = 10,240 samples/s);
  inline   the teacher's forward in the loop, then the student step (256 / 45 ms = 5,689);
  service  a DistillReader over 2 teacher-server subprocesses on loopback; each step is the
           student step on (batch, teacher outputs) the reader has ready.
Headlines: service / pure (goal >= 0.97; EDL reached 0.83) and service / inline (>= 1.75).

W5 asks whether a teacher dying mid-epoch costs the student anything but a short stall: three
teachers, one epoch of 300 distinct batches, SIGKILL to the busiest teacher after batch 100.
Every batch must arrive exactly once, in order, with the outputs the in-process model gives for
that very batch; the longest gap between consecutive batches is the stall (goal <= 1 s).

How the numbers are kept honest on a 2-core machine shared with other people's jobs:
  * the three W1 modes run once per repetition, interleaved (pure, inline, service, pure, ...),
    and each ratio is the median of the per-repetition paired ratios (at least 5 repetitions);
  * every repetition is a fixed number of steps after a warm-up; the teacher servers are
    started once and reused, and so is one DistillReader, which reads one epoch per
    repetition (what a training job does between epochs; connections and its learned
    in-flight limits persist, the pipeline starts empty and fills during the warm-up);
  * before every measurement a quiet gate waits (boundedly) until other processes leave the
    cores alone, and a measurement during which they took more than half a core is redone
    once; the CPU used by us, by the servers and by everyone else is reported per repetition.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch

from benchmarks.common import (
    EMULATED_MODEL_NAME,
    EMULATED_MODEL_REF,
    REPO_ROOT,
    SERVER_QUEUE_DELAY_US,
    interleave,
    machine_info,
    median,
    paired_ratios,
    ratio,
    run_and_report,
)
from benchmarks.cpu import CpuMeter, CpuUsage, QuietGate
from benchmarks.device import DeviceChoice, add_device_args
from benchmarks.mesh_report import ok, report
from distill import DistillReader
from distill.checks import TRANSPORTS
from examples.emulated import BATCH, TEACHER_MS_ENV, EmulatedTeacher, W1Loader, build, student_step
from teacher_server.launch import TeacherProcess, start_all

MODEL_REF = EMULATED_MODEL_REF
MODEL_NAME = EMULATED_MODEL_NAME
GOAL_SERVICE_VS_PURE = 0.97
GOAL_SERVICE_VS_INLINE = 1.75
GOAL_STALL_S = 1.0
REDO_FOREIGN_CORES = 0.5  # a measurement during which others used more than this is redone once
ATOL = 1e-5  # teacher outputs vs the in-process model (same ops, same threads: bitwise in practice)


@dataclass(frozen=True)
class Settings:
    """One run's knobs; recorded verbatim in the JSON so a result can be reproduced."""

    reps: int = 5
    warmup: int = 10  # steps per repetition before the clock starts
    steps: int = 60  # timed steps per repetition (~1.5 s of pure mode)
    batch: int = BATCH
    teacher_ms: float = 20.0
    student_ms: float = 25.0
    teachers: int = 2
    prefetch: int = 4  # DistillReader default
    timeout_s: float = 10.0  # DistillReader default chunk deadline
    hedge_after_s: float | str | None = "auto"  # DistillReader's default: adaptive hedging
    transport: str = "call"  # DistillReader's default: a call a chunk ("stream": one stream a teacher)
    server_threads: int = 1  # torch threads per teacher server: the "accelerator" needs no CPU
    client_threads: int = 1  # torch threads in this process
    max_queue_delay_us: int = SERVER_QUEUE_DELAY_US  # teacher-server default
    w5_batches: int = 300
    w5_teachers: int = 3
    w5_kill_after: int = 100  # batches delivered before the SIGKILL
    w5_signal: str = "KILL"  # or STOP: a hung teacher (open sockets, no answers) instead of a dead one
    only: str = ""  # "w1" or "w5" to run one workload
    quiet_budget_s: float = 30.0
    quick: bool = False
    device: str = "cpu"  # the teachers', the inline teacher's and the teacher outputs' (benchmarks/device.py)
    compute_dtype: str = "FP32"

    @property
    def choice(self) -> DeviceChoice:
        return DeviceChoice(self.device, self.compute_dtype)

    @property
    def atol(self) -> float:
        """Teacher outputs vs the in-process model: bitwise in FP32, a half-precision step otherwise."""
        return ATOL if self.compute_dtype == "FP32" else 5e-2


@dataclass
class Rep:
    """One mode's measurement in one repetition."""

    mode: str
    samples_per_s: float
    wall_s: float
    fetch_ms_mean: float  # time the loop spent getting (batch, teacher outputs) per step
    fetch_ms_max: float
    cpu: CpuUsage
    extra: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode, "samples_per_s": round(self.samples_per_s, 1), "wall_s": round(self.wall_s, 4),
            "fetch_ms_mean": round(self.fetch_ms_mean, 3), "fetch_ms_max": round(self.fetch_ms_max, 3),
            "cpu": self.cpu.as_dict(), **self.extra,
        }


def server_args(s: Settings) -> list[str]:
    return [
        "--model", MODEL_REF, "--name", MODEL_NAME, *s.choice.server_args(), "--port", "0",
        "--threads", str(s.server_threads), "--instances", "1",  # one emulated accelerator per teacher
        "--max-batch-size", str(s.batch),
        "--max-queue-delay-us", str(s.max_queue_delay_us), "--log-level", "WARNING",
    ]


def server_env(s: Settings) -> dict[str, str]:
    return {**os.environ, TEACHER_MS_ENV: str(s.teacher_ms)}


# ---- W1 ---------------------------------------------------------------------------------------
def timed_loop(mode: str, s: Settings, batches: Iterator[tuple[dict[str, Any], torch.Tensor | None]],
               pids: list[int]) -> tuple[Rep, list[tuple[int, torch.Tensor]]]:
    """The training loop every mode shares: get (batch, teacher logits), run the student step.

    Only what differs between the modes is inside `batches`, so the clock sees the same loop
    around them. Returns the measurement and the (batch index, logits) pairs seen, for checking.
    """
    meter = CpuMeter(pids)
    fetch: list[float] = []
    seen: list[tuple[int, torch.Tensor]] = []
    started = 0.0
    for i in range(s.warmup + s.steps):
        if i == s.warmup:
            meter.start()
            started = time.perf_counter()
        t = time.perf_counter()
        batch, logits = next(batches)
        if i >= s.warmup:
            fetch.append(time.perf_counter() - t)
        if logits is not None:
            seen.append((batch["index"], logits))
        student_step(batch, logits, s.student_ms)
    wall = time.perf_counter() - started
    usage = meter.stop()
    rep = Rep(mode, s.steps * s.batch / wall, wall, 1000 * sum(fetch) / len(fetch), 1000 * max(fetch), usage)
    return rep, seen


def pure_batches(loader: W1Loader) -> Iterator[tuple[dict[str, Any], torch.Tensor | None]]:
    for batch in loader:
        yield batch, None


def inline_batches(loader: W1Loader, teacher: EmulatedTeacher,
                   choice: DeviceChoice) -> Iterator[tuple[dict[str, Any], torch.Tensor]]:
    for batch in loader:
        with torch.inference_mode(), choice.autocast():
            logits = teacher(batch["INPUT"].to(choice.torch_device))
        yield batch, logits


def service_batches(reader: DistillReader) -> Iterator[tuple[dict[str, Any], torch.Tensor]]:
    for batch, outputs in reader:  # one iter(reader) = one epoch
        yield batch, outputs["LOGITS"]


def count_mismatches(seen: list[tuple[int, torch.Tensor]], expected: Callable[[int], torch.Tensor],
                     atol: float = ATOL) -> int:
    """Teacher outputs that are not what the in-process model gives for the batch they came with."""
    return sum(1 for index, logits in seen
               if not torch.allclose(logits.float().cpu(), expected(index), rtol=max(1e-5, atol), atol=atol))


def run_w1(s: Settings, stack: contextlib.ExitStack, gate: QuietGate, pids: list[int],
           endpoints: list[str]) -> dict[str, Any]:
    loader = W1Loader(s.warmup + s.steps, batch_size=s.batch)
    teacher = build(step_ms=s.teacher_ms).to(s.choice.torch_device)
    reference = build(step_ms=0)
    with torch.inference_mode():
        pool_logits = [reference.logits(loader.inputs(i)) for i in range(4)]  # the loader's pool of 4

    def expected(index: int) -> torch.Tensor:
        return pool_logits[index % 4]

    reader = stack.enter_context(DistillReader(
        loader, teachers=",".join(endpoints), inputs=["INPUT"], outputs=["LOGITS"], prefetch=s.prefetch,
        timeout=s.timeout_s, hedge_after=s.hedge_after_s, device=s.device if s.choice.cuda else None,
        transport=s.transport,
    ))
    mismatches = 0
    checked = 0

    def pure() -> Rep:
        return timed_loop("pure", s, pure_batches(loader), pids)[0]

    def inline() -> Rep:
        return timed_loop("inline", s, inline_batches(loader, teacher, s.choice), pids)[0]

    def service() -> Rep:
        nonlocal mismatches, checked
        before = reader.stats()
        rep, seen = timed_loop("service", s, service_batches(reader), pids)
        after = reader.stats()
        bad = count_mismatches(seen, expected, s.atol)
        mismatches += bad
        checked += len(seen)
        rep.extra = {
            "wrong_outputs": bad, "retries": after.retries - before.retries, "hedges": after.hedges - before.hedges,
            "reader_wait_fraction": round(after.wait_fraction, 4),
            "teachers": {ep: {k: v for k, v in f.items() if k in ("limit", "latency_ms", "ok", "errors")}
                         for ep, f in next(iter(after.teachers.values()), {}).items()},
        }
        return rep

    def show(rep: int, name: str, r: Rep) -> None:
        print(f"  rep {rep + 1}/{s.reps} {name:8s} {r.samples_per_s:9,.0f} samples/s  fetch {r.fetch_ms_mean:6.2f} ms"
              f" (max {r.fetch_ms_max:6.1f})  cores: ours {r.cpu.client_cores:.2f} servers {r.cpu.server_cores:.2f}"
              f" others {r.cpu.foreign_cores:.2f}", flush=True)

    discarded: dict[str, list[Rep]] = {}
    reps = interleave(
        s.reps, {"pure": pure, "inline": inline, "service": service}, show,
        before=gate.wait_blocking, redo_if=lambda r: r.cpu.foreign_cores > REDO_FOREIGN_CORES, discarded=discarded,
    )
    rates = {m: [r.samples_per_s for r in rs] for m, rs in reps.items()}
    medians = {m: median(v) for m, v in rates.items()}
    vs_pure = paired_ratios(rates["service"], rates["pure"])
    vs_inline = paired_ratios(rates["service"], rates["inline"])
    inline_vs_pure = paired_ratios(rates["inline"], rates["pure"])
    return {
        "reader": "one DistillReader for the whole run, one epoch (warm-up + timed steps) per repetition",
        "ideal_samples_per_s": {"pure": s.batch * 1000 / s.student_ms,
                                "inline": s.batch * 1000 / (s.student_ms + s.teacher_ms),
                                "service": s.batch * 1000 / s.student_ms},
        "medians_samples_per_s": {m: round(v, 1) for m, v in medians.items()},
        "ratios": {
            "service_vs_pure": round(median(vs_pure), 4), "service_vs_inline": round(median(vs_inline), 4),
            "inline_vs_pure": round(median(inline_vs_pure), 4),
            "ratio_of_medians_service_vs_pure": round(ratio(medians["service"], medians["pure"]), 4),
        },
        "per_rep_ratios": {"service_vs_pure": [round(x, 4) for x in vs_pure],
                           "service_vs_inline": [round(x, 4) for x in vs_inline]},
        "goals": {"service_vs_pure": GOAL_SERVICE_VS_PURE, "service_vs_inline": GOAL_SERVICE_VS_INLINE},
        "met": {"service_vs_pure": median(vs_pure) >= GOAL_SERVICE_VS_PURE,
                "service_vs_inline": median(vs_inline) >= GOAL_SERVICE_VS_INLINE},
        "outputs_checked": checked, "wrong_outputs": mismatches,
        "median_cpu_cores": {m: {k: round(median([getattr(r.cpu, k) for r in rs]), 3)
                                 for k in ("client_cores", "server_cores", "foreign_cores")}
                             for m, rs in reps.items()},
        "per_rep": {m: [r.as_dict() for r in rs] for m, rs in reps.items()},
        "discarded": {m: [r.as_dict() for r in rs] for m, rs in discarded.items()},
    }


# ---- W5 ---------------------------------------------------------------------------------------
@dataclass
class Kill:
    """What the killer did: whom, when (perf_counter), and how much work the victim held."""

    victim: TeacherProcess | None = None
    at: float = 0.0
    in_flight: int = 0
    waited_ms: float = 0.0


def kill_busy_teacher(reader: DistillReader, servers: list[TeacherProcess], sig: str, result: Kill,
                      max_wait_s: float = 2.0) -> None:
    """Signal the first teacher seen with a chunk in flight (the busiest after `max_wait_s`).

    Runs on its own thread so that the training loop's timing is the reader's alone. Waiting
    for in-flight work matters: with the read-ahead full, teachers are idle most of the time,
    and killing an idle one tests nothing but the router's bookkeeping.
    """
    started = time.perf_counter()
    while True:
        figures = next(iter(reader.stats().teachers.values()), {})
        load = {p: int(figures.get(p.endpoint, {}).get("in_flight", 0)) for p in servers}
        victim = max(servers, key=load.__getitem__)
        if load[victim] > 0 or time.perf_counter() - started > max_wait_s:
            break
        time.sleep(0.001)
    if sig == "KILL":
        victim.kill()
    else:
        os.kill(victim.pid, signal.SIGSTOP)  # frozen: its sockets stay open, nothing answers
    result.at = time.perf_counter()
    result.victim, result.in_flight, result.waited_ms = victim, load[victim], 1000 * (result.at - started)


def run_w5(s: Settings, gate: QuietGate) -> dict[str, Any]:
    loader = W1Loader(s.w5_batches, batch_size=s.batch, distinct=True)
    reference = build(step_ms=0)
    with contextlib.ExitStack() as stack:
        servers = start_all(stack, [TeacherProcess(server_args(s), label=f"w5-teacher-{i}", env=server_env(s),
                                                  cwd=REPO_ROOT, stop_grace=20.0)
                                    for i in range(s.w5_teachers)])
        print("W5 teachers: " + ", ".join(f"pid {p.pid} at {p.endpoint}" for p in servers), flush=True)
        reader = stack.enter_context(DistillReader(
            loader, teachers=",".join(p.endpoint for p in servers), inputs=["INPUT"], outputs=["LOGITS"],
            prefetch=s.prefetch, timeout=s.timeout_s, hedge_after=s.hedge_after_s, transport=s.transport,
        ))
        gate.own_pids = [os.getpid(), *(p.pid for p in servers)]
        gate.wait_blocking()
        indices: list[int] = []
        arrived: list[float] = []
        waited: list[float] = []
        outputs: list[torch.Tensor] = []
        kill = Kill()
        killer: threading.Thread | None = None
        epoch_start = time.perf_counter()
        items = iter(reader)
        while True:
            t = time.perf_counter()
            try:
                batch, out = next(items)
            except StopIteration:
                break
            now = time.perf_counter()
            indices.append(batch["index"])
            arrived.append(now)
            waited.append(now - t)
            outputs.append(out["LOGITS"])
            if len(indices) == s.w5_kill_after:
                killer = threading.Thread(target=kill_busy_teacher, args=(reader, servers, s.w5_signal, kill),
                                          name="w5-killer", daemon=True)
                killer.start()
            student_step(batch, out["LOGITS"], s.student_ms)
        epoch_s = time.perf_counter() - epoch_start
        stats = reader.stats()
        assert killer is not None, "the epoch ended before the kill"
        killer.join()
        victim = kill.victim
        assert victim is not None
        print(f"  SIG{s.w5_signal} to teacher pid {victim.pid} at {victim.endpoint} after batch {s.w5_kill_after}"
              f" (+{kill.waited_ms:.0f} ms, {kill.in_flight} chunk(s) in flight there)", flush=True)
        victim.kill()  # a SIGSTOPped teacher is killed now; SIGKILL again is harmless
        victim.stop()
        victim_exit = victim.exit_code
        killed_at = kill.at

    # Exactly once, in order, and each batch with its own teacher outputs.
    unique = set(indices)
    lost = sorted(set(range(s.w5_batches)) - unique)
    duplicated = len(indices) - len(unique)
    out_of_order = sum(1 for i, idx in enumerate(indices) if idx != i)
    with torch.inference_mode():
        wrong = sum(1 for idx, logits in zip(indices, outputs, strict=True)
                    if not torch.allclose(logits.float().cpu(), reference.logits(loader.inputs(idx)),
                                          rtol=max(1e-5, s.atol), atol=s.atol))

    gaps = [b - a for a, b in itertools.pairwise(arrived)]
    longest = max(range(len(gaps)), key=gaps.__getitem__)
    after_kill = [g for g, t in zip(gaps, arrived[1:], strict=True) if t >= killed_at]
    first_after = next(i for i, t in enumerate(arrived) if t >= killed_at)
    return {
        "teachers": s.w5_teachers, "batches": s.w5_batches, "kill_after_batch": s.w5_kill_after,
        "signal": f"SIG{s.w5_signal}", "victim_in_flight_at_kill": kill.in_flight,
        "kill_waited_for_in_flight_ms": round(kill.waited_ms, 1), "victim_exit_code": victim_exit,
        "delivered": len(indices), "lost": len(lost), "lost_indices": lost[:20], "duplicated": duplicated,
        "out_of_order": out_of_order, "wrong_outputs": wrong,
        "epoch_s": round(epoch_s, 3), "first_batch_ms": round(1000 * (arrived[0] - epoch_start), 1),
        "median_gap_ms": round(1000 * median(gaps), 2),
        "longest_gap_ms": round(1000 * gaps[longest], 2), "longest_gap_before_batch": longest + 1,
        "longest_gap_after_kill_ms": round(1000 * max(after_kill), 2) if after_kill else None,
        "kill_to_next_batch_ms": round(1000 * (arrived[first_after] - killed_at), 2),
        "longest_wait_in_next_ms": round(1000 * max(waited[1:]), 2),
        "long_gaps": [[i + 1, round(1000 * g, 1)] for i, g in enumerate(gaps) if g > 4 * median(gaps)][:20],
        "stall_goal_s": GOAL_STALL_S,
        "met": not lost and not duplicated and not out_of_order and not wrong and gaps[longest] <= GOAL_STALL_S,
        "reader": {"retries": stats.retries, "hedges": stats.hedges,
                   "teachers": next(iter(stats.teachers.values()), {})},
    }


# ---- the run ----------------------------------------------------------------------------------
def run(s: Settings) -> dict[str, Any]:
    torch.set_num_threads(s.client_threads)
    s.choice.check()
    gate = QuietGate(max_foreign_cores=0.25, budget_s=s.quiet_budget_s)
    doc: dict[str, Any] = {
        "benchmark": "mesh (W1 mesh efficiency, W5 failover)",
        "machine": machine_info(s.client_threads) | s.choice.info() | {"server_torch_threads": s.server_threads},
        "settings": asdict(s),
    }
    if s.only in ("", "w1"):
        started = time.perf_counter()
        with contextlib.ExitStack() as stack:
            servers = start_all(stack, [TeacherProcess(server_args(s), label=f"w1-teacher-{i}", env=server_env(s),
                                                      cwd=REPO_ROOT, stop_grace=20.0)
                                        for i in range(s.teachers)])
            print("W1 teachers: " + ", ".join(f"pid {p.pid} at {p.endpoint}" for p in servers)
                  + f" (ready after {time.perf_counter() - started:.1f} s)", flush=True)
            pids = [p.pid for p in servers]
            gate.own_pids = [os.getpid(), *pids]
            w1 = run_w1(s, stack, gate, pids, [p.endpoint for p in servers])
        doc["w1"] = w1 | {"server_exit_codes": [p.exit_code for p in servers]}
    if s.only in ("", "w5"):
        print("W5 failover", flush=True)
        doc["w5"] = run_w5(s, gate)
    doc["quiet_gate"] = gate.as_dict()
    doc["plot"] = ("none: matplotlib is not installed and the project adds no dependency for a picture; "
                   "the tables carry the numbers")
    return doc


def _hedge(text: str) -> float | str | None:
    if text in ("auto", "off"):
        return None if text == "off" else "auto"
    return float(text)


def parse_args(argv: list[str] | None) -> Settings:
    p = argparse.ArgumentParser(prog="python -m benchmarks.mesh", description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=None, help="repetitions (default 5; the rules want >= 5)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per repetition (default 60)")
    p.add_argument("--quick", action="store_true", help="a smoke run (2 reps, short epochs)")
    p.add_argument("--only", choices=["w1", "w5"], default="", help="run one workload")
    p.add_argument("--w5-signal", choices=["KILL", "STOP"], default="KILL",
                   help="KILL: a dead teacher (default); STOP: a hung one, whose sockets stay open")
    p.add_argument("--timeout", type=float, default=None, help="the reader's chunk deadline (default 10 s)")
    p.add_argument("--teachers", type=int, default=None, help="W1's teacher servers (default 2)")
    p.add_argument("--w5-teachers", type=int, default=None,
                   help="W5's teacher servers, one of them killed (default 3; at least 2)")
    p.add_argument("--hedge-after", type=_hedge, default="auto",
                   help="the reader's hedge_after: auto (the reader's default), off, or seconds")
    p.add_argument("--transport", choices=TRANSPORTS, default="call",
                   help="the reader's transport: a call a chunk (default) or one stream a teacher")
    add_device_args(p)
    a = p.parse_args(argv)
    s = Settings(only=a.only, w5_signal=a.w5_signal, device=a.device, compute_dtype=a.compute_dtype)
    if a.quick:
        s = replace(s, reps=2, warmup=5, steps=20, w5_batches=60, w5_kill_after=20, quiet_budget_s=5.0, quick=True)
    if a.reps is not None:
        s = replace(s, reps=a.reps)
    if a.steps is not None:
        s = replace(s, steps=a.steps)
    if a.timeout is not None:
        s = replace(s, timeout_s=a.timeout)
    if a.teachers is not None:
        s = replace(s, teachers=a.teachers)
    if a.w5_teachers is not None:
        s = replace(s, w5_teachers=a.w5_teachers)
    s = replace(s, hedge_after_s=a.hedge_after, transport=a.transport)
    if s.reps < 1 or s.steps < 1 or s.teachers < 1:
        p.error("--reps, --steps and --teachers must be >= 1")
    if s.w5_teachers < 2:
        p.error("--w5-teachers must be >= 2: one is killed, the others take its work")
    return s


def result_name(s: Settings) -> str:
    """mesh.json for the standard run; variants get their own file so they never replace it."""
    parts = ["mesh"]
    if s.device != "cpu" or s.compute_dtype != "FP32":
        parts.append(f"{s.device.replace(':', '')}_{s.compute_dtype.lower()}")
    if s.quick:
        parts.append("quick")
    if s.only:
        parts.append(s.only)
    if s.w5_signal != "KILL":
        parts.append(s.w5_signal.lower())
    if s.teachers != Settings.teachers:
        parts.append(f"teachers{s.teachers}")
    if s.w5_teachers != Settings.w5_teachers:
        parts.append(f"w5teachers{s.w5_teachers}")
    if s.timeout_s != Settings.timeout_s:
        parts.append(f"timeout{s.timeout_s:g}")
    if s.hedge_after_s != Settings.hedge_after_s:
        parts.append("hedgeoff" if s.hedge_after_s is None else f"hedge{s.hedge_after_s:g}")
    if s.transport != Settings.transport:
        parts.append(s.transport)
    return "_".join(parts)


def main(argv: list[str] | None = None) -> int:
    s = parse_args(argv)
    return run_and_report(lambda: run(s), result_name(s), lambda doc: report(doc, REDO_FOREIGN_CORES), ok)


if __name__ == "__main__":
    sys.exit(main())
