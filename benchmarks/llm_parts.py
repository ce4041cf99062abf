"""The parts of W6 (benchmarks/llm_serving.py) that its reader mode (benchmarks/llm_reader.py)
shares: settings, the teacher and its sequences, in-process and server measurements, requests,
the server's command line and token metrics. Both modes import them from here."""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tritonclient.grpc import service_pb2

from benchmarks.common import (
    BATCHING_QUEUE_DELAY_US,
    sorted_groups,
)
from benchmarks.cpu import CpuMeter, CpuUsage, busiest_threads, thread_cpu_seconds
from benchmarks.device import DeviceChoice
from teacher_server.batch_rules import TYPICAL_LENGTH
from teacher_server.server import default_instances, usable_cores

MODEL_NAME = "llm_teacher"
RATIO_GOAL = 0.90
PADDING_GOAL = 0.85
BYTES_GOAL = 130.0
MIN_QUIET_PAIRS = 5
MAX_MESSAGE = 64 << 20


@dataclass(frozen=True)
class Settings:
    """One run's knobs; recorded verbatim in the JSON so a result can be reproduced."""

    reps: int = 5
    sequences: int = 1024
    batch: int = 16
    min_len: int = 8
    seed: int = 0
    top_k: int = 20
    clients: int = 0  # 0: eight times --batch
    delay_us: int = BATCHING_QUEUE_DELAY_US
    threads: int = 0  # 0: cores / instances
    instances: int = 0  # 0: one per core
    teacher: str = ""
    tiny: bool = False
    quick: bool = False
    max_foreign_cores: float = 0.15
    gate_budget_s: float = 60.0
    max_redos: int = 6
    out: str = "llm_serving"
    mode: str = "server"  # "server": W6 as below; "reader": the reader path (benchmarks/llm_reader.py)
    device: str = "cpu"  # servers and in-process baseline (benchmarks/device.py)
    compute_dtype: str = "FP32"
    extra_server_args: tuple[str, ...] = ()  # --server-arg: e.g. --no-async-outputs for an A/B
    buckets_off: bool = True  # W6 also measures a server with length buckets off (--skip-buckets-off: not)
    alt_server_args: tuple[str, ...] = ()  # --alt-server-arg: W6 also measures a server with these flags added
    student_batch: int = 0  # --mode reader: sequences per student batch (0: --batch)
    reader_rows: int = 0  # --mode reader: rows the matched reader keeps in flight (0: --clients)

    @property
    def choice(self) -> DeviceChoice:
        return DeviceChoice(self.device, self.compute_dtype)

    @property
    def reader_batch(self) -> int:
        """The student's batch in --mode reader: --student-batch, else --batch."""
        return self.student_batch or self.batch

    @property
    def reader_ahead(self) -> int:
        """Student batches the matched reader keeps in flight: --reader-rows (else --clients) of rows."""
        return max(1, (self.reader_rows or self.concurrency) // self.reader_batch)

    @property
    def token_budget(self) -> int:
        """The server's default token budget at --max-batch-size --batch (teacher_server.batcher)."""
        return self.batch * TYPICAL_LENGTH

    @property
    def server_instances(self) -> int:
        """--instances, else the teacher's own default for the device."""
        return self.instances or default_instances(self.device)

    @property
    def server_threads(self) -> int:
        return self.threads or max(1, usable_cores() // self.server_instances)

    @property
    def concurrency(self) -> int:
        return self.clients or 8 * self.batch


@dataclass
class Measurement:
    """One variant over all the sequences once."""

    tokens_per_s: float
    useful_tokens: int
    seconds: float
    cpu: CpuUsage | None = None
    computed_tokens: int | None = None  # positions computed, padding included
    wire_bytes: int | None = None  # raw output contents of all responses
    executions: int | None = None  # model executions on the server
    threads: list[dict[str, object]] | None = None  # the server's busiest threads (cpu.busiest_threads)
    # The server's fitted batch cost and padding floor at the end of the pass (batch_cost_of)
    batch_cost: dict[str, float] | None = None
    # On a GPU: what the server's caching allocator did during the pass (device_memory_change)
    device_memory: dict[str, float] | None = None

    @property
    def padding_efficiency(self) -> float | None:
        return self.useful_tokens / self.computed_tokens if self.computed_tokens else None

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["tokens_per_s"] = round(self.tokens_per_s, 1)
        d["seconds"] = round(self.seconds, 4)
        d["cpu"] = self.cpu.as_dict() if self.cpu else None
        eff = self.padding_efficiency
        d["padding_efficiency"] = round(eff, 4) if eff is not None else None
        return d


# ---- the teacher and the sequences ----------------------------------------------------------
def teacher_directory(s: Settings) -> Path:
    """--teacher, else the trained teacher in the cache, else the smoke teacher (trained if missing)."""
    from examples.llm import models

    if s.teacher:
        path = Path(s.teacher).expanduser()
        if not (path / "config.json").is_file():
            raise SystemExit(f"--teacher {path}: no config.json there; pass a save_pretrained directory")
        return path
    trained = models.teacher_dir()
    if not s.tiny and (trained / "config.json").is_file():
        return trained
    smoke = models.teacher_dir(smoke=True)
    if not (smoke / "config.json").is_file():
        from examples.llm import train_teacher

        print(f"no trained teacher at {trained}: training the smoke teacher into {smoke}", flush=True)
        if train_teacher.main(["--smoke"]) != 0:
            raise SystemExit("training the smoke teacher failed")
    return smoke


def draw_sequences(directory: Path, s: Settings, max_len: int) -> tuple[list[list[int]], int]:
    """Held-out sequences of mixed lengths (fixed seed) and the tokenizer's pad id."""
    from examples.llm.common import SMOKE_FILES
    from examples.llm.data import encode_files, load_corpus
    from examples.llm.tokenizer import load_tokenizer

    tok = load_tokenizer(directory)
    smoke = s.tiny or json.loads((directory / "config.json").read_text(encoding="utf-8")).get("vocab_size", 0) < 1024
    corpus = load_corpus(max_files=SMOKE_FILES if smoke else 0)
    pieces = [p for p in encode_files(tok, list(corpus.texts("held_out")), max_len) if len(p) >= s.min_len]
    if not pieces:
        raise SystemExit(f"no held-out sequence of at least --min-len {s.min_len} tokens")
    rng = random.Random(s.seed)
    out = []
    for _ in range(s.sequences):
        piece = rng.choice(pieces)
        out.append(piece[: rng.randint(s.min_len, len(piece))])
    return out, int(tok.pad_token_id)


def padded_batches(seqs: Sequence[list[int]], batch: int, pad_id: int) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
    """(input_ids, attention_mask, useful tokens) per batch, in order, padded per batch."""
    out = []
    for i in range(0, len(seqs), batch):
        rows = seqs[i : i + batch]
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for j, r in enumerate(rows):
            ids[j, : len(r)] = torch.tensor(r, dtype=torch.long)
            mask[j, : len(r)] = 1
        out.append((ids, mask, sum(len(r) for r in rows)))
    return out


def sorted_batches(seqs: Sequence[list[int]], budget: int, pad_id: int) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
    """The sequences sorted by length, in padded batches of at most `budget` positions (rows x
    longest): the best plain PyTorch batching of the same work at the server's token budget."""
    return [b for g in sorted_groups(seqs, budget, len) for b in padded_batches(g, len(g), pad_id)]


def load_inprocess(directory: Path, choice: DeviceChoice) -> torch.nn.Module:
    """The teacher in this process, weights in the compute dtype, on the device."""
    from transformers import AutoModelForCausalLM

    model: torch.nn.Module = AutoModelForCausalLM.from_pretrained(str(directory), local_files_only=True,
                                                                  dtype=choice.dtype)
    return model.to(choice.torch_device).eval()


def on_device(batches: list[tuple[torch.Tensor, torch.Tensor, int]],
              choice: DeviceChoice) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
    """Batches moved to the device once, before any timing."""
    return [(ids.to(choice.torch_device), mask.to(choice.torch_device), n) for ids, mask, n in batches]


def output_work(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What the server does to LOGITS for these requests: log-softmax, top-k, fp16 values, int32
    ids, the probability mass outside the top-k."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    values, indices = torch.topk(logp, k, dim=-1, sorted=True)
    tail = (1.0 - values.exp().sum(dim=-1)).clamp_(min=0.0)
    return values.half(), indices.int(), tail.half()


# ---- in-process ------------------------------------------------------------------------------
def measure_inprocess(model: torch.nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor, int]], k: int,
                      workers: int, server_pids: Sequence[int]) -> Measurement:
    """All batches once, `workers` loops pulling from one list (the twin of the server's instances)."""
    lock = threading.Lock()
    next_i = [0]

    def loop() -> int:
        done = 0
        with torch.inference_mode():
            while True:
                with lock:
                    i = next_i[0]
                    next_i[0] += 1
                if i >= len(batches):
                    if batches[0][0].is_cuda:
                        torch.cuda.synchronize(batches[0][0].device)
                    return done
                ids, mask, useful = batches[i]
                output_work(model(input_ids=ids, attention_mask=mask, use_cache=False).logits, k)
                done += useful

    meter = CpuMeter(server_pids)
    with ThreadPoolExecutor(workers, thread_name_prefix="inprocess") as pool:
        meter.start()
        t0 = time.perf_counter()
        useful = sum(f.result() for f in [pool.submit(loop) for _ in range(workers)])
        elapsed = time.perf_counter() - t0
        cpu = meter.stop()
    computed = sum(ids.numel() for ids, _, _ in batches)
    return Measurement(useful / elapsed, useful, elapsed, cpu, computed_tokens=computed)


# ---- server ----------------------------------------------------------------------------------
def make_request(seq: list[int], *, top_k: int, logprobs: bool = True, dtype: str = "FP16",
                 tail: bool = True) -> service_pb2.ModelInferRequest:
    """One sequence as a [1, L] request with its mask; the output transforms as request parameters."""
    ids = np.asarray([seq], dtype=np.int64)
    req = service_pb2.ModelInferRequest(model_name=MODEL_NAME)
    req.inputs.add(name="INPUT_IDS", datatype="INT64", shape=list(ids.shape))
    req.inputs.add(name="ATTENTION_MASK", datatype="INT64", shape=list(ids.shape))
    req.raw_input_contents.append(ids.tobytes())
    req.raw_input_contents.append(np.ones_like(ids).tobytes())
    req.parameters["top_k"].int64_param = top_k
    req.parameters["logprobs"].bool_param = logprobs
    req.parameters["output_dtype"].string_param = dtype
    req.parameters["topk_tail"].bool_param = tail and top_k > 0
    return req


def server_args(s: Settings, directory: Path, pad_id: int, vocab: int, buckets: bool, *,
                extra: Sequence[str] = ()) -> list[str]:
    # A causal LM served as hf:DIR declares these itself (padded with its config's pad_token_id);
    # stated here so the benchmark pads with the tokenizer's pad id whatever the config says.
    args = [
        "--model", f"hf:{directory}", "--name", MODEL_NAME, *s.choice.server_args(),
        "--input", f"INPUT_IDS:INT64:-1:pad={pad_id}", "--input", "ATTENTION_MASK:INT64:-1:mask",
        "--output", f"LOGITS:FP32:-1,{vocab}:per_position",
        "--max-batch-size", str(s.batch), "--max-queue-delay-us", str(s.delay_us),
        "--instances", str(s.server_instances), "--threads", str(s.server_threads),
        "--metrics-port", "0", "--log-level", "WARNING",
    ]
    args += [*s.extra_server_args, *extra]
    return args if buckets else [*args, "--no-length-buckets"]


def scrape_metrics(metrics_port: int, names: Sequence[str]) -> dict[str, float]:
    """The named families' values (one series each) from the server's Prometheus metrics (a blocking HTTP GET)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as r:
        text = r.read().decode("utf-8")
    values: dict[str, float] = {}
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in names:
            values[name] = float(line.rsplit(" ", 1)[1])
    return values


_TOKENS = ("teacher_useful_tokens_total", "teacher_padded_tokens_total")
_BATCH_COST = ("teacher_batch_fixed_seconds", "teacher_batch_position_seconds", "teacher_padding_floor")
_DEVICE_MEMORY = ("teacher_cuda_device_allocations_total", "teacher_cuda_device_frees_total",
                  "teacher_cuda_alloc_retries_total", "teacher_cuda_memory_reserved_bytes", "nv_gpu_memory_used_bytes")


def tokens_of(values: dict[str, float]) -> tuple[int, int]:
    """(useful, computed) positions from scraped values (`scrape_metrics`)."""
    return int(values.get("teacher_useful_tokens_total", 0)), int(values.get("teacher_padded_tokens_total", 0))


def batch_cost_of(values: dict[str, float]) -> dict[str, float]:
    """The server's fitted fixed and per-position device time of a batch and the padding floor it
    forms batches with (`teacher_server.batch_cost`), from scraped values; {} from a server without them."""
    if not any(name in values for name in _BATCH_COST):
        return {}
    per_position = values.get("teacher_batch_position_seconds", 0.0)
    return {"fixed_ms": round(values.get("teacher_batch_fixed_seconds", 0.0) * 1e3, 2),
            "positions_per_s": round(1 / per_position) if per_position > 0 else 0,
            "padding_floor": round(values.get("teacher_padding_floor", 0.0), 4)}


def device_memory_change(before: dict[str, float], after: dict[str, float]) -> dict[str, float] | None:
    """What the allocator did between two scrapes (`teacher_server.device_memory`): device
    allocations, frees (each waits for the whole device) and retries over the pass, and the memory
    reserved and used on the device at its end. None from a server on the CPU."""
    if not any(name in after for name in _DEVICE_MEMORY):
        return None

    def grew(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    return {"device_allocations": grew("teacher_cuda_device_allocations_total"),
            "device_frees": grew("teacher_cuda_device_frees_total"),
            "alloc_retries": grew("teacher_cuda_alloc_retries_total"),
            "reserved_gib": round(after.get("teacher_cuda_memory_reserved_bytes", 0.0) / 2**30, 2),
            "device_used_gib": round(after.get("nv_gpu_memory_used_bytes", 0.0) / 2**30, 2)}


async def executions(stub: Any) -> int:
    resp = await stub.ModelStatistics(service_pb2.ModelStatisticsRequest(name=MODEL_NAME), timeout=10)
    return int(resp.model_stats[0].execution_count)


@dataclass(frozen=True)
class ServerCounters:
    """What a pass reads of the server at its start and end: the Prometheus families (one GET) and
    the executions (ModelStatistics)."""

    values: dict[str, float]
    executions: int

    @property
    def tokens(self) -> tuple[int, int]:
        return tokens_of(self.values)


async def server_counters(stub: Any, metrics_port: int) -> ServerCounters:
    values = await asyncio.to_thread(scrape_metrics, metrics_port, (*_TOKENS, *_BATCH_COST, *_DEVICE_MEMORY))
    return ServerCounters(values, await executions(stub))


def server_side(before: ServerCounters, after: ServerCounters) -> dict[str, Any]:
    """A Measurement's fields that the server counted over a pass: positions computed, batches,
    the batch cost fitted at its end, and what the caching allocator did (on a GPU)."""
    return {"computed_tokens": after.tokens[1] - before.tokens[1],
            "executions": after.executions - before.executions,
            "batch_cost": batch_cost_of(after.values) or None,
            "device_memory": device_memory_change(before.values, after.values)}


async def measure_server(stub: Any, requests: list[service_pb2.ModelInferRequest], lengths: list[int], *,
                         clients: int, metrics_port: int, server_pids: Sequence[int],
                         server_pid: int | None = None) -> Measurement:
    """Every request once from `clients` concurrent clients; tokens/s over the whole pass, and, with
    `server_pid`, that server's busiest threads (which of its loop, instances and stages is the limit)."""
    next_i = 0
    wire = 0

    async def client() -> None:
        nonlocal next_i, wire
        while next_i < len(requests):
            i = next_i
            next_i += 1
            resp = await stub.ModelInfer(requests[i], timeout=60)
            wire += sum(len(c) for c in resp.raw_output_contents)

    before = await server_counters(stub, metrics_port)
    meter = CpuMeter(server_pids)
    threads0 = thread_cpu_seconds(server_pid) if server_pid else {}
    meter.start()
    t0 = time.perf_counter()
    tasks = [asyncio.create_task(client()) for _ in range(clients)]
    try:
        await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    elapsed = time.perf_counter() - t0
    cpu = meter.stop()
    threads = busiest_threads(server_pid, threads0, thread_cpu_seconds(server_pid), elapsed) if server_pid else None
    after = await server_counters(stub, metrics_port)
    useful, counted = sum(lengths), after.tokens[0] - before.tokens[0]
    if counted != useful:
        raise AssertionError(f"the server counted {counted} useful tokens, the client sent {useful}")
    return Measurement(useful / elapsed, useful, elapsed, cpu, wire_bytes=wire, threads=threads,
                       **server_side(before, after))


def print_rep(rep: int, name: str, m: Measurement) -> None:
    line = f"  rep {rep + 1} {name:<18} {m.tokens_per_s:9,.0f} tokens/s"
    if m.padding_efficiency is not None:
        line += f"  padding efficiency {m.padding_efficiency:.3f}"
    if m.executions:
        line += f"  {m.executions} batches"
    if m.device_memory and (m.device_memory["device_frees"] or m.device_memory["alloc_retries"]):
        line += (f"  allocator: {m.device_memory['device_frees']:.0f} cudaFree, "
                 f"{m.device_memory['alloc_retries']:.0f} retries")
    if m.threads:
        line += "  threads " + " ".join(f"{t['name']} {t['cores']}" for t in m.threads[:4])
    if m.cpu:
        line += (f"  cores: client {m.cpu.client_cores:.2f} server {m.cpu.server_cores:.2f} "
                 f"foreign {m.cpu.foreign_cores:.2f}")
    print(line, flush=True)


@dataclass
class Workload:
    """What both W6 modes measure: the teacher, its held-out sequences and the in-process model."""

    directory: Path
    max_len: int
    vocab: int
    seqs: list[list[int]]
    pad_id: int
    model: torch.nn.Module

    @property
    def lengths(self) -> list[int]:
        return [len(q) for q in self.seqs]


def prepare(s: Settings) -> Workload:
    """The teacher directory, its sequences (printed), the torch threads and the in-process model."""
    from transformers import AutoConfig

    directory = teacher_directory(s)
    config = AutoConfig.from_pretrained(str(directory), local_files_only=True)
    max_len, vocab = int(config.max_position_embeddings), int(config.vocab_size)
    seqs, pad_id = draw_sequences(directory, s, max_len)
    lengths = [len(q) for q in seqs]
    print(f"teacher {directory}: vocabulary {vocab}, context {max_len}; {len(seqs)} held-out sequences, "
          f"lengths {min(lengths)}..{max(lengths)} (mean {sum(lengths) / len(lengths):.1f})", flush=True)
    torch.set_num_threads(s.server_threads)
    s.choice.check()
    return Workload(directory, max_len, vocab, seqs, pad_id, load_inprocess(directory, s.choice))
