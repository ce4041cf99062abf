"""The floor under W2 and W3: what gRPC's Python server alone costs a request, with nothing else.

    .venv/bin/python -m benchmarks.grpc_floor [--reps 5] [--duration 3] [--quick]
                                              [--server-cpus 1 --client-cpus 0] [--out NAME]

A bare `grpc.aio` server on uvloop (teacher-server's event loop and message limits) answers every
message with a fixed answer at once: no parsing, no model, no batching. It is loaded with W2's
and W3's message sizes (a batch-256 and a batch-8 RefTeacher request, 3 MB and 96 KB, answered
with their logits' bytes) and clients (`benchmarks.serving`'s: 4 and 64), once with a ModelInfer
-style unary call a request and once with one bidirectional stream a client, a message written
and its answer read in turn. Each variant runs once per repetition, interleaved; the figure is
the server process's CPU (user + system, every thread) a message, median over repetitions.

Against the model's own CPU a request (`benchmarks.serving`'s in-process rows), this floor is the
most any server built on grpcio's asyncio server can reach on the machine: with the model at
`m` ms a request and the floor at `f`, the server's CPU cannot go below `m + f`, so its rate on
the same cores is at most `m / (m + f)` of in process, and lower still while the load generator
shares the cores.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import grpc
import uvloop

from benchmarks.common import format_table, interleave, machine_info, median, run_and_report
from benchmarks.cpu import process_cpu_seconds
from benchmarks.pinning import CpuListError, on_cores, parse_split, pin_process
from benchmarks.procs import ReportingChild
from benchmarks.serving_measure import sleep_or_fail

SERVICE = "floor.Floor"
ROW_BYTES = 3 * 32 * 32 * 4  # a RefTeacher row: FP32 [3, 32, 32]
ANSWER_ROW_BYTES = 100 * 4  # its logits: FP32 [100]
# name: (rows a request, concurrent clients), as benchmarks.serving loads W2 and W3 on two cores
WORKLOADS = {"w2": (256, 4), "w3": (8, 64)}
TRANSPORTS = ("unary", "stream")
MAX_MESSAGE = 64 << 20


@dataclass(frozen=True)
class Settings:
    reps: int = 5
    warmup_s: float = 0.5
    duration_s: float = 3.0
    quick: bool = False
    server_cpus: tuple[int, ...] = ()
    client_cpus: tuple[int, ...] = ()
    out: str = "grpc_floor"  # results file name under benchmarks/results/


# ---- the server (a process of its own) -----------------------------------------------------------
def serve() -> None:
    """Answer every unary call and every stream message with the answer its size asks for; say
    `{"ev": "ready", "port": N}` on stdout once listening, and stop at EOF on stdin (`FloorServer`)."""
    answers = {rows * ROW_BYTES: b"\0" * (rows * ANSWER_ROW_BYTES) for rows, _ in WORKLOADS.values()}

    def answer(request: bytes) -> bytes:
        return answers.get(len(request), b"")

    async def unary(request: bytes, context: Any) -> bytes:
        return answer(request)

    async def stream(requests: Any, context: Any) -> Any:
        async for request in requests:
            yield answer(request)

    async def main() -> None:
        server = grpc.aio.server(options=[("grpc.max_receive_message_length", MAX_MESSAGE),
                                          ("grpc.max_send_message_length", MAX_MESSAGE), ("grpc.so_reuseport", 0)])
        raw = None  # bytes in, bytes out: nothing is parsed
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {
            "Unary": grpc.unary_unary_rpc_method_handler(unary, raw, raw),
            "Stream": grpc.stream_stream_rpc_method_handler(stream, raw, raw),
        }),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        print(json.dumps({"ev": "ready", "port": port}), flush=True)
        await asyncio.to_thread(sys.stdin.read)  # until the benchmark closes our stdin
        await server.stop(None)

    uvloop.run(main())


class FloorServer(ReportingChild):
    """The floor server as a child of the benchmark (`procs.ReportingChild`): its port once ready."""

    port = 0

    def command(self) -> list[str]:
        return [sys.executable, "-m", "benchmarks.grpc_floor", "--serve"]

    def on_event(self, ev: dict[str, Any]) -> None:
        if ev.get("ev") == "ready":
            self.port = int(ev["port"])


# ---- the load ------------------------------------------------------------------------------------
@dataclass
class Measurement:
    messages: int
    window_s: float
    server_cpu_s: float

    @property
    def per_s(self) -> float:
        return self.messages / self.window_s

    @property
    def server_ms_per_message(self) -> float:
        return 1e3 * self.server_cpu_s / self.messages if self.messages else float("nan")


async def load(port: int, server_pid: int, rows: int, clients: int, *, transport: str, s: Settings
               ) -> Measurement:
    """`clients` clients sending `rows`-row messages for warm-up + duration; the window's count and
    the server's CPU over it. Clients still mid-message when the window ends finish it, uncounted."""
    body = b"\1" * (rows * ROW_BYTES)
    counting = False
    stop = False
    count = 0
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE), ("grpc.max_send_message_length", MAX_MESSAGE)]) as ch:
        unary = ch.unary_unary(f"/{SERVICE}/Unary")
        streams = ch.stream_stream(f"/{SERVICE}/Stream")

        async def client() -> None:
            nonlocal count
            if transport == "unary":
                while not stop:
                    await unary(body, timeout=60)
                    count += counting
                return
            call = streams(timeout=s.warmup_s + s.duration_s + 60)
            while not stop:
                await call.write(body)
                if await call.read() is grpc.aio.EOF:
                    raise RuntimeError("the floor server ended a stream")
                count += counting
            await call.done_writing()
            await call.code()

        tasks = [asyncio.create_task(client()) for _ in range(clients)]
        try:
            await sleep_or_fail(tasks, s.warmup_s)
            cpu0, t0 = process_cpu_seconds(server_pid), time.perf_counter()
            counting = True
            await sleep_or_fail(tasks, s.duration_s)
            counting = False
            cpu1, t1 = process_cpu_seconds(server_pid), time.perf_counter()
            messages = count
            stop = True
            await asyncio.wait_for(asyncio.gather(*tasks), timeout=60)
        finally:
            stop = True
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    return Measurement(messages, t1 - t0, cpu1 - cpu0)


def run(s: Settings) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="grpc-floor-") as tmp:
        server = FloorServer("grpc-floor-server", Path(tmp) / "server.log")
        try:
            with on_cores(s.server_cpus) if s.server_cpus else contextlib.nullcontext():
                server.launch()
            server.wait_ready(time.monotonic() + 60)
            return _run(s, server.port, server.pid)
        finally:
            server.close(10.0)


def _run(s: Settings, port: int, server_pid: int) -> dict[str, Any]:
    if s.client_cpus:
        pin_process(s.client_cpus)

    def variant(workload: str, transport: str) -> Callable[[], Measurement]:
        rows, clients = WORKLOADS[workload]
        return lambda: uvloop.run(load(port, server_pid, rows, clients, transport=transport, s=s))

    def progress(rep: int, name: str, m: Measurement) -> None:
        print(f"  rep {rep + 1} {name:<10} {m.per_s:9,.0f} messages/s  server {m.server_ms_per_message:.3f} "
              "CPU ms a message", flush=True)

    per_rep = interleave(s.reps, {f"{w}_{t}": variant(w, t) for w in WORKLOADS for t in TRANSPORTS}, progress)
    return {
        "benchmark": "grpc_floor (gRPC's Python server alone, W2 and W3 message sizes)",
        "machine": machine_info() | {"server_cpus": list(s.server_cpus) or None,
                                     "client_cpus": list(s.client_cpus) or None},
        "settings": asdict(s),
        "workloads": {w: {"rows": r, "clients": c, "request_bytes": r * ROW_BYTES, "answer_bytes": r * ANSWER_ROW_BYTES}
                      for w, (r, c) in WORKLOADS.items()},
        "server_ms_per_message_medians": {k: round(median([m.server_ms_per_message for m in v]), 4)
                                          for k, v in per_rep.items()},
        "messages_per_s_medians": {k: round(median([m.per_s for m in v]), 1) for k, v in per_rep.items()},
        "per_rep": {k: [asdict(m) | {"server_ms_per_message": round(m.server_ms_per_message, 4)} for m in v]
                    for k, v in per_rep.items()},
    }


def report(doc: dict[str, Any]) -> str:
    cost, rate = doc["server_ms_per_message_medians"], doc["messages_per_s_medians"]
    rows = []
    for w, spec in doc["workloads"].items():
        u, st = cost[f"{w}_unary"], cost[f"{w}_stream"]
        rows.append([f"{w.upper()}: {spec['rows']} rows ({spec['request_bytes']:,} B), {spec['clients']} clients",
                     u, st, rate[f"{w}_unary"], rate[f"{w}_stream"]])
    m = doc["machine"]
    return "\n".join([
        format_table(["message", "unary: server CPU ms", "stream: server CPU ms", "unary: /s", "stream: /s"], rows),
        "",
        "server CPU ms: the bare server process's CPU a message (every thread), median of the repetitions.",
        f"machine: {m['cpu_model']}, {m['cpu_count']} CPUs, grpc {m.get('grpc_version', '?')}"
        + (f"; server on {m['server_cpus']}, load generator on {m['client_cpus']}" if m.get("server_cpus") else ""),
    ])


def parse_args(argv: Sequence[str] | None) -> Settings:
    p = argparse.ArgumentParser(prog="python -m benchmarks.grpc_floor", description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=None, help="repetitions (default 5; 1 with --quick)")
    p.add_argument("--duration", type=float, default=None, help="seconds measured a variant (default 3)")
    p.add_argument("--quick", action="store_true", help="a smoke run: one short repetition")
    p.add_argument("--server-cpus", default="", metavar="LIST", help="the server's cores (taskset -c notation)")
    p.add_argument("--client-cpus", default="", metavar="LIST", help="the load generator's cores")
    p.add_argument("--out", default=Settings.out, help="results file: benchmarks/results/<OUT>.json")
    a = p.parse_args(argv)
    reps = a.reps if a.reps is not None else (1 if a.quick else Settings.reps)
    if reps < 1:
        p.error("--reps must be >= 1")
    try:
        server_cpus, client_cpus = parse_split(a.server_cpus, a.client_cpus)
    except CpuListError as e:
        p.error(str(e))
    duration = a.duration if a.duration is not None else (0.5 if a.quick else Settings.duration_s)
    return Settings(reps=reps, warmup_s=0.2 if a.quick else Settings.warmup_s, duration_s=duration, quick=a.quick,
                    server_cpus=server_cpus, client_cpus=client_cpus, out=a.out)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--serve"]:
        serve()
        return 0
    s = parse_args(args)
    return run_and_report(lambda: run(s), s.out, report)


if __name__ == "__main__":
    sys.exit(main())
