"""What vLLM's JSON scoring protocol costs against the binary KServe v2 path, on one teacher.

    .venv/bin/python -m benchmarks.vllm_json [--reps 3] [--quick] [--device cuda --compute-dtype BF16]

One `teacher-server --model hf:DIR --http-port 0` process serves a tiny random Llama (vocabulary
32,000 like Llama 2's, 2 layers, hidden 64: the model is cheap, so the protocol's own cost
shows) to the same sequences (fixed seed, lengths uniform in [--min-len, --max-len]) through:

  * json:      `POST /v1/completions` per sequence, `max_tokens: 1`, `prompt_logprobs: k`, the
               request TRL's `VLLMClient.get_sequence_logprobs` sends; the client parses the
               answer with `json.loads`, as every JSON client must;
  * grpc-fp32: tritonclient.grpc.aio ModelInfer per sequence with `top_k: k`, `logprobs`,
               `token_logprobs`, `token_ranks` (the same facts: top-k log-probs and ids per
               position, the sequence's own tokens' log-probs and ranks) in fp32, decoded with
               `as_numpy`;
  * grpc-fp16: the same with `output_dtype: FP16`, the mesh's usual setting.

--clients requests are in flight at a time; variants are interleaved per repetition and the
median over repetitions is reported. Tokens/s counts the sequences' tokens (scored positions);
bytes/token is the answer's payload (the JSON body; the protobuf ModelInferResponse) per token.
CPU µs/token, the teacher process's and this client's (both sides of the protocol; the teacher's
includes the forward pass, the same for every variant), is what to read on a loaded machine:
unlike tokens/s it barely moves when other processes take the cores.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import format_table, machine_info, median, run_and_report
from benchmarks.cpu import process_cpu_seconds, self_cpu_seconds
from benchmarks.device import add_device_args

VARIANTS = ("json", "grpc-fp32", "grpc-fp16")


@dataclass(frozen=True)
class Settings:
    sequences: int = 64
    min_len: int = 64
    max_len: int = 256
    top_k: int = 20
    clients: int = 8
    reps: int = 3
    vocab: int = 32000
    device: str = "cpu"
    quick: bool = False
    seed: int = 0
    compute_dtype: str = "FP32"


def save_teacher(directory: Path, vocab: int, context: int) -> None:
    import torch
    import transformers

    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=context, pad_token_id=0)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).eval().save_pretrained(str(directory))


def draw(s: Settings) -> list[list[int]]:
    rng = random.Random(s.seed)
    return [[rng.randrange(1, s.vocab) for _ in range(rng.randint(s.min_len, s.max_len))] for _ in range(s.sequences)]


async def _bounded(n: int, clients: int, one: Callable[[int], Awaitable[int]]) -> tuple[float, int]:
    """Run one(i) for i in range(n), `clients` at a time; (seconds, payload bytes)."""
    queue = list(range(n))
    total = 0

    async def worker() -> None:
        nonlocal total
        while queue:
            size = await one(queue.pop())  # not `total += await ...`: that reads total before the await
            total += size

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(clients)))
    return time.perf_counter() - start, total


async def measure_json(url: str, seqs: list[list[int]], s: Settings, in_flight: list[int] | None = None,
                       every: float = 0.01) -> tuple[float, int]:
    """Score `seqs` through `url`'s /v1/completions, `s.clients` requests at a time; (seconds, bytes).
    With `in_flight`, the requests sent and not yet answered are sampled into it every `every`
    seconds (from a task on the same loop) while the pass runs."""
    import aiohttp

    active = 0
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        async def one(i: int) -> int:
            nonlocal active
            body = {"model": "tiny-llama", "prompt": seqs[i], "max_tokens": 1, "prompt_logprobs": s.top_k,
                    "temperature": 1.0}
            active += 1
            try:
                async with session.post(f"{url}/v1/completions", json=body) as resp:
                    raw = await resp.read()
            finally:
                active -= 1
            if resp.status != 200:
                raise RuntimeError(f"/v1/completions answered {resp.status}: {raw[:300]!r}")
            answer = json.loads(raw)
            assert len(answer["choices"][0]["prompt_logprobs"]) == len(seqs[i])
            return len(raw)

        if in_flight is None:
            return await _bounded(len(seqs), s.clients, one)

        async def sample(samples: list[int]) -> None:
            while True:
                await asyncio.sleep(every)
                samples.append(active)

        sampler = asyncio.create_task(sample(in_flight))
        try:
            return await _bounded(len(seqs), s.clients, one)
        finally:
            sampler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sampler


async def measure_grpc(address: str, seqs: list[list[int]], s: Settings, dtype: str) -> tuple[float, int]:
    import tritonclient.grpc as tg
    import tritonclient.grpc.aio as tga

    params = {"top_k": s.top_k, "logprobs": True, "token_logprobs": True, "token_ranks": True,
              "output_dtype": dtype, "temperature": 1.0}
    async with tga.InferenceServerClient(address) as client:
        async def one(i: int) -> int:
            ids = np.asarray([seqs[i]], dtype=np.int64)
            x = tg.InferInput("INPUT_IDS", list(ids.shape), "INT64")
            x.set_data_from_numpy(ids)
            result = await client.infer("tiny-llama", [x], parameters=params, client_timeout=600)
            values = result.as_numpy("LOGITS_TOPK_VALUES")
            assert values is not None and values.shape == (1, len(seqs[i]), s.top_k)
            assert result.as_numpy("LOGITS_TOKEN_LOGPROBS") is not None
            size: int = result.get_response().ByteSize()
            return size

        return await _bounded(len(seqs), s.clients, one)


def run(s: Settings) -> dict[str, Any]:
    from teacher_server.launch import teacher_process

    seqs = draw(s)
    tokens = sum(len(q) for q in seqs)
    per_rep: dict[str, list[dict[str, float]]] = {v: [] for v in VARIANTS}
    with tempfile.TemporaryDirectory(prefix="vllm-json-") as tmp:
        directory = Path(tmp) / "teacher"
        save_teacher(directory, s.vocab, max(s.max_len, 64))
        args = ["--model", f"hf:{directory}", "--name", "tiny-llama", "--device", s.device,
                "--compute-dtype", s.compute_dtype, "--http-port", "0"]
        with teacher_process(args, log=Path(tmp) / "teacher.log", ready_timeout=300, stop_grace=10) as (_, info):
            url, address = f"http://127.0.0.1:{info['http_port']}", f"127.0.0.1:{info['port']}"
            variants: dict[str, Callable[[], Awaitable[tuple[float, int]]]] = {
                "json": lambda: measure_json(url, seqs, s),
                "grpc-fp32": lambda: measure_grpc(address, seqs, s, "FP32"),
                "grpc-fp16": lambda: measure_grpc(address, seqs, s, "FP16"),
            }
            asyncio.run(variants["json"]())  # warm-up: first requests, thread pools, connections
            asyncio.run(variants["grpc-fp32"]())
            for rep in range(s.reps):
                for name in (VARIANTS if rep % 2 == 0 else tuple(reversed(VARIANTS))):
                    server0, client0 = process_cpu_seconds(info["pid"]), self_cpu_seconds()
                    seconds, payload = asyncio.run(variants[name]())
                    server_cpu = process_cpu_seconds(info["pid"]) - server0
                    client_cpu = self_cpu_seconds() - client0
                    m = {"tokens_per_s": tokens / seconds, "bytes_per_token": payload / tokens, "seconds": seconds,
                         "teacher_cpu_us_per_token": server_cpu / tokens * 1e6,
                         "client_cpu_us_per_token": client_cpu / tokens * 1e6}
                    per_rep[name].append(m)
                    print(f"rep {rep} {name:9s} {m['tokens_per_s']:10,.0f} tokens/s "
                          f"{m['bytes_per_token']:8,.1f} bytes/token  teacher {m['teacher_cpu_us_per_token']:6,.0f} "
                          f"client {m['client_cpu_us_per_token']:6,.0f} CPU µs/token", flush=True)
    keys = ("tokens_per_s", "bytes_per_token", "teacher_cpu_us_per_token", "client_cpu_us_per_token")
    summary = {name: {k: round(median([m[k] for m in ms]), 1) for k in keys} for name, ms in per_rep.items()}
    base = summary["grpc-fp16"]
    for v in summary.values():
        v["throughput_vs_grpc_fp16"] = round(v["tokens_per_s"] / base["tokens_per_s"], 3)
        v["bytes_vs_grpc_fp16"] = round(v["bytes_per_token"] / base["bytes_per_token"], 2)
    return {"benchmark": "vllm_json", "settings": s.__dict__, "tokens": tokens, "summary": summary,
            "per_rep": per_rep, "machine": machine_info()}


def report(doc: dict[str, Any]) -> str:
    s = doc["settings"]
    rows = [(name, v["tokens_per_s"], v["bytes_per_token"], v["teacher_cpu_us_per_token"],
             v["client_cpu_us_per_token"], v["throughput_vs_grpc_fp16"], v["bytes_vs_grpc_fp16"])
            for name, v in doc["summary"].items()]
    head = (f"{s['sequences']} sequences ({doc['tokens']} tokens), top-{s['top_k']}, {s['clients']} clients, "
            f"device {s['device']}, median of {s['reps']}")
    return head + "\n" + format_table(["path", "tokens/s", "bytes/token", "teacher CPU µs/tok", "client CPU µs/tok",
                                     "speed vs fp16", "bytes vs fp16"], rows)


def parse_args(argv: Sequence[str] | None, prog: str = "benchmarks.vllm_json", doc: str | None = __doc__,
               reps: int = 3) -> Settings:
    """The scoring workload's flags; `benchmarks.gateway` measures the same workload with them."""
    p = argparse.ArgumentParser(prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sequences", type=int, default=64)
    p.add_argument("--min-len", type=int, default=64)
    p.add_argument("--max-len", type=int, default=256)
    p.add_argument("--top-k", type=int, default=20, help="prompt_logprobs / top_k (at most 20 on /v1/completions)")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--reps", type=int, default=reps)
    add_device_args(p)
    p.add_argument("--quick", action="store_true", help="8 short sequences, one repetition: a smoke test")
    a = p.parse_args(argv)
    if a.quick:
        return Settings(sequences=8, min_len=16, max_len=32, top_k=a.top_k, clients=4, reps=1, device=a.device,
                        quick=True, compute_dtype=a.compute_dtype)
    return Settings(a.sequences, a.min_len, a.max_len, a.top_k, a.clients, a.reps, device=a.device,
                    compute_dtype=a.compute_dtype)


def main(argv: Sequence[str] | None = None) -> int:
    s = parse_args(argv)
    return run_and_report(lambda: run(s), "vllm_json_quick" if s.quick else "vllm_json", report)


if __name__ == "__main__":
    raise SystemExit(main())
