"""The Engines workload: what DistillReader and `distill gateway` cost over calling an engine directly.

    .venv/bin/python -m benchmarks.engines [--reps 5] [--quick] [--engine vllm|teacher-server]

One engine serves a tiny random Llama (2 layers, hidden 128, head size 64 so that vLLM's CPU
backend serves it; the model is cheap, so the paths' own cost shows): a real vLLM from the cached
vLLM venv (`benchmarks.vllm_env`, `--engine vllm`, the default) or teacher-server's own
`/v1/completions` (`--engine teacher-server`, a quick stand-in). The same sequences (fixed seed)
are scored, one sequence per engine request, `prompt_logprobs: k`, through

  * direct:  the engine's `/v1/completions` with its own client (aiohttp, the request TRL's
             `VLLMClient.get_sequence_logprobs` sends), JSON parsed;
  * gateway: `distill gateway --teachers vllm://ENGINE`, the same requests to the gateway, which
             calls the engine through its reader;
  * reader:  DistillReader over batches of one sequence (`teachers="vllm://ENGINE"`, top-k
             log-probs and the tokens' own log-probs), --clients batches in flight, tensors out.

Per variant: tokens/s with --clients requests in flight, and milliseconds per sequence with one in
flight. While the throughput runs, the CPU time of the engine's processes and of the client side
(this process, where the direct client and the reader run, and the gateway's process) is counted
per token: on a machine whose cores the engine shares with the client side, what the mesh costs
the engine is its extra client-side CPU, a figure that barely moves when other processes load
the machine, unlike tokens/s. Variants are interleaved per repetition (A/B, then B/A); medians over repetitions are
reported with each path's throughput relative to direct (goal: at least 0.95) and its added
milliseconds per sequence.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import format_table, machine_info, median, run_and_report
from benchmarks.cpu import process_cpu_seconds, self_cpu_seconds, tree_cpu_seconds
from benchmarks.gateway import start_gateway, stop_gateway, wait_healthy
from benchmarks.vllm_json import Settings, draw, measure_json

VARIANTS = ("direct", "gateway", "reader")
MODEL_NAME = "tiny-llama"
GOAL = 0.95
SAMPLE_S = 0.01  # between two looks at the reader's calls in flight


def save_engine_teacher(directory: Path, vocab: int, context: int) -> None:
    """The tiny random Llama with head size 64 (vLLM's CPU attention needs it), and a word-level
    tokenizer of its whole vocabulary (vLLM loads one even for token-id prompts)."""
    import tokenizers
    import torch
    import transformers

    words = {"<pad>": 0, "<s>": 1, "[UNK]": 2, **{f"w{i}": i for i in range(3, vocab)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(words, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="<pad>",
                                         bos_token="<s>").save_pretrained(str(directory))

    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=2, head_dim=64,
                                      max_position_embeddings=context, pad_token_id=0, tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).eval().save_pretrained(str(directory))


@contextlib.contextmanager
def engine(kind: str, directory: Path, tmp: Path) -> Iterator[tuple[str, int]]:
    """The engine's `host:port` and process id while the block runs."""
    if kind == "vllm":
        from benchmarks.vllm_env import vllm_server

        with vllm_server(directory, served_model_name=MODEL_NAME, log_dir=tmp) as server:
            yield server.address, server.process.pid
        return
    from teacher_server.launch import teacher_process

    args = ["--model", f"hf:{directory}", "--name", MODEL_NAME, "--device", "cpu", "--http-port", "0"]
    with teacher_process(args, log=tmp / "teacher.log", ready_timeout=300, stop_grace=10) as (_, info):
        yield f"127.0.0.1:{info['http_port']}", int(info["pid"])


def mesh_cpu(gateway_pid: int) -> float:
    """CPU seconds of the client side: this process (the direct client, the gateway's client, or
    the reader) and the gateway's process (idle, but for its health checks, unless it is measured)."""
    return self_cpu_seconds() + process_cpu_seconds(gateway_pid)


def read_all(reader: Any, in_flight: list[int] | None = None) -> int:
    """One pass of the reader; the positions of top-k it delivered. With `in_flight`, the reader's
    calls at the engine are sampled into it every `SAMPLE_S` while the pass runs (on a thread of
    its own, so the samples do not fall only where the training loop takes a batch)."""
    if in_flight is None:
        return sum(int(outputs["LOGITS_TOPK_VALUES"].shape[1]) for _, outputs in reader)
    samples = in_flight
    done = threading.Event()

    def sample() -> None:
        while not done.wait(SAMPLE_S):
            samples.append(reader.stats().in_flight)

    sampler = threading.Thread(target=sample, name="in-flight-sampler", daemon=True)
    sampler.start()
    try:
        return read_all(reader)
    finally:
        done.set()
        sampler.join()


def run(s: Settings, kind: str) -> dict[str, Any]:
    from distill import DistillReader

    seqs = draw(s)
    tokens = sum(len(q) for q in seqs)
    batches = [{"INPUT_IDS": np.asarray([q], dtype=np.int64)} for q in seqs]
    per_rep: dict[str, list[dict[str, float]]] = {v: [] for v in VARIANTS}
    in_flight: list[int] = []  # the reader's calls at the engine, sampled in an untimed pass
    direct_in_flight: list[int] = []  # the direct client's, likewise
    with tempfile.TemporaryDirectory(prefix="engines-bench-") as name:
        tmp = Path(name)
        directory = tmp / "teacher"
        save_engine_teacher(directory, s.vocab, max(s.max_len + 8, 64))
        with engine(kind, directory, tmp) as (address, engine_pid):
            listed = f"vllm://{address}"
            gateway, gateway_url = start_gateway(listed, tmp / "gateway.log")
            options = {"teachers": listed, "inputs": ["INPUT_IDS"], "outputs": ["LOGITS"], "model": MODEL_NAME,
                       "top_k": s.top_k, "logprobs": True, "token_logprobs": True, "timeout": 600.0}
            readers = {n: DistillReader(batches, prefetch=n, **options) for n in sorted({s.clients, 1})}
            try:
                asyncio.run(wait_healthy(gateway_url, timeout=600))
                urls = {"direct": f"http://{address}", "gateway": gateway_url}

                def seconds(variant: str, clients: int, sampled: list[int] | None = None) -> float:
                    if variant == "reader":
                        started = time.perf_counter()
                        assert read_all(readers[clients], sampled) == tokens
                        return time.perf_counter() - started
                    return asyncio.run(measure_json(urls[variant], seqs, replace(s, clients=clients)))[0]

                for variant in VARIANTS:  # warm-up: connections, the readers' teachers, vLLM's graphs
                    seconds(variant, s.clients)
                    seconds(variant, 1)
                for rep in range(s.reps):
                    for variant in (VARIANTS if rep % 2 == 0 else tuple(reversed(VARIANTS))):
                        engine0, mesh0 = tree_cpu_seconds(engine_pid), mesh_cpu(gateway.pid)
                        m = {"tokens_per_s": tokens / seconds(variant, s.clients)}
                        m["engine_cpu_us_per_token"] = (tree_cpu_seconds(engine_pid) - engine0) / tokens * 1e6
                        m["client_cpu_us_per_token"] = (mesh_cpu(gateway.pid) - mesh0) / tokens * 1e6
                        m["ms_per_sequence"] = seconds(variant, 1) / len(seqs) * 1000
                        per_rep[variant].append(m)
                        print(f"rep {rep} {variant:8s} {m['tokens_per_s']:9,.0f} tokens/s  "
                              f"{m['ms_per_sequence']:7.2f} ms/sequence  CPU µs/token: engine "
                              f"{m['engine_cpu_us_per_token']:5,.0f}, client side {m['client_cpu_us_per_token']:5,.0f}",
                              flush=True)
                # The reader's calls at the engine, sampled in a pass of its own after the timed ones: a
                # look (reader.stats()) costs the reader's process CPU.
                seconds("reader", s.clients, in_flight)
                # ...and the direct client's requests at the engine, sampled alike: what the reader's are
                # compared with (its ordered delivery could leave it fewer at the end of a pass).
                asyncio.run(measure_json(urls["direct"], seqs, s, direct_in_flight, SAMPLE_S))
                # Calls the readers sent twice (hedges past their hedge delay, retries after a failure):
                # each is engine work a direct client does not ask for.
                resent = {kind: sum(getattr(r.stats(), kind) for r in readers.values())
                          for kind in ("hedges", "retries")}
            finally:
                for reader in readers.values():
                    reader.close()
                stop_gateway(gateway)
    keys = ("tokens_per_s", "ms_per_sequence", "engine_cpu_us_per_token", "client_cpu_us_per_token")
    summary = {v: {k: round(median([m[k] for m in ms]), 2) for k in keys} for v, ms in per_rep.items()}
    relative = {v: round(median([m["tokens_per_s"] / d["tokens_per_s"]
                                 for m, d in zip(per_rep[v], per_rep["direct"], strict=True)]), 3)
                for v in ("gateway", "reader")}
    added = {v: round(median([m["ms_per_sequence"] - d["ms_per_sequence"]
                              for m, d in zip(per_rep[v], per_rep["direct"], strict=True)]), 2)
             for v in ("gateway", "reader")}
    return {"benchmark": "engines", "engine": kind, "settings": s.__dict__, "tokens": tokens, "summary": summary,
            "throughput_vs_direct": relative, "added_ms_per_sequence": added, "goal": GOAL,
            "reader_calls_in_flight": _mean(in_flight), "direct_calls_in_flight": _mean(direct_in_flight),
            "reader_resent": resent,
            "per_rep": per_rep, "machine": machine_info()}


def _mean(samples: list[int]) -> float | None:
    """The mean of the samples of calls in flight; None when a pass was shorter than one interval."""
    return round(sum(samples) / len(samples), 2) if samples else None


def report(doc: dict[str, Any]) -> str:
    s = doc["settings"]
    rows = [(v, x["tokens_per_s"], x["ms_per_sequence"], doc["throughput_vs_direct"].get(v, 1.0),
             doc["added_ms_per_sequence"].get(v, 0.0), x.get("engine_cpu_us_per_token", ""),
             x.get("client_cpu_us_per_token", "")) for v, x in doc["summary"].items()]
    head = (f"engine {doc['engine']}: {s['sequences']} sequences ({doc['tokens']} tokens), prompt_logprobs "
            f"{s['top_k']}, {s['clients']} in flight (ms/sequence: 1 in flight), median of {s['reps']}; goal: "
            f"throughput >= {doc['goal']} of direct")
    table = format_table(["path", "tokens/s", "ms/sequence", "vs direct", "added ms", "engine CPU µs/token",
                          "client side CPU µs/token"], rows)
    return (f"{head}\n{table}\nthe reader's calls at the engine in an untimed throughput pass (mean of samples "
            f"every {SAMPLE_S * 1000:g} ms): {doc.get('reader_calls_in_flight')} of {s['clients']} (the direct "
            f"client's requests, likewise: {doc.get('direct_calls_in_flight')}); calls it sent twice: "
            f"{doc.get('reader_resent')}")


def parse_args(argv: Sequence[str] | None) -> tuple[Settings, str]:
    p = argparse.ArgumentParser(prog="benchmarks.engines", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", choices=("vllm", "teacher-server"), default="vllm")
    p.add_argument("--sequences", type=int, default=64)
    p.add_argument("--min-len", type=int, default=64)
    p.add_argument("--max-len", type=int, default=256)
    p.add_argument("--top-k", type=int, default=20, help="prompt_logprobs / top_k (at most 20, vLLM's default)")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="8 short sequences, one repetition: a smoke test")
    a = p.parse_args(argv)
    if a.quick:
        return Settings(sequences=8, min_len=16, max_len=32, top_k=a.top_k, clients=4, reps=1, quick=True), a.engine
    return Settings(a.sequences, a.min_len, a.max_len, a.top_k, a.clients, a.reps), a.engine


def main(argv: Sequence[str] | None = None) -> int:
    s, kind = parse_args(argv)
    name = "engines_quick" if s.quick else f"engines_{kind.replace('-', '_')}"
    return run_and_report(lambda: run(s, kind), name, report)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main())
