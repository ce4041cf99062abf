"""Teacher memory while scoring one long sequence at a large vocabulary: chunked vs whole.

    .venv/bin/python -m benchmarks.teacher_memory [--device cpu|cuda] [--seq 4096] [--vocab 128256]
        [--chunk-mib 256] [--quick]

An `hf:` Llama with a tiny hidden size (64) and a 128k vocabulary, so that the logits dominate:
`[1, 4096, 128256]` fp32 logits are 2.1 GB, against about 66 MB of weights. One request scores
the sequence with the usual on-policy request: token log-probs, the top-16 log-probs and the tail
mass (`token_logprobs`, `top_k=16`, `logprobs`, `topk_tail`), run by a `ModelInstance` as the
server runs it. Modes, each in a fresh subprocess so that one's peak cannot hide the other's:
  * whole: the forward pass returns the full logits and the transforms run on them in one piece
    (what the teacher did before chunking);
  * chunked: the forward pass stops at the final hidden states and the output projection and
    the transforms run a chunk of fp32 logits at a time (`teacher_server.outputs.CHUNK_BYTES`,
    256 MiB, unless --chunk-mib says otherwise).
Memory on CPU is the process's peak resident set (VmHWM, reset after the model is loaded, so it
is the scoring's own peak) less the resident set before scoring (the interpreter, torch and the
weights); on CUDA, `torch.cuda.max_memory_allocated` less the memory allocated before scoring.
tracemalloc does not see torch's allocations, hence neither is used here.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import format_table, machine_info, write_results
from teacher_server.outputs import CHUNK_BYTES

MiB = 1 << 20
MODES = ("whole", "chunked")


def _status_kib(field: str) -> int:
    with open("/proc/self/status", encoding="utf-8") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def save_model(directory: Path, vocab: int, seq: int) -> None:
    import torch
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=max(seq, 128), pad_token_id=0, tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).eval().save_pretrained(str(directory))


def child(mode: str, directory: str, device: str, seq: int, chunk_mib: int, *,
          compute_dtype: str = "FP32") -> dict[str, Any]:
    """Score one sequence in `mode`; return the memory figures (run in its own process)."""
    import torch

    from teacher_server.instance import ModelInstance
    from teacher_server.model import load_model
    from teacher_server.outputs import OutputTransform
    from teacher_server.validation import pad_plan
    from teacher_server.work import Work

    model = load_model(f"hf:{directory}", device=device, compute_dtype=compute_dtype)
    weights = sum(p.numel() * p.element_size() for p in model.module.parameters())  # type: ignore[attr-defined]
    inst = ModelInstance(model, 0, max_batch_size=1)
    inst.chunked = mode == "chunked"
    inst.chunk_bytes = 1 << 62 if mode == "whole" else chunk_mib * MiB
    ids = torch.randint(1, model.io.outputs[0].shape[-1], (1, seq), generator=torch.Generator().manual_seed(1))
    want = [OutputTransform("LOGITS", None, 16, True, 1.0, True, token_logprobs=True)]
    work = Work([ids, torch.ones_like(ids)], 1, want, (), seq, pad_plan(model.io))
    cuda = model.device.type == "cuda"
    try:
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        else:
            with open("/proc/self/clear_refs", "w", encoding="utf-8") as f:
                f.write("5")  # resets VmHWM to the current resident set
            before = _status_kib("VmRSS") * 1024
        start = time.perf_counter()
        result = inst.run([work])
        seconds = time.perf_counter() - start
        if cuda:
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated()
        else:
            peak = _status_kib("VmHWM") * 1024
    finally:
        inst.close()
    sent = sum(len(raw) for *_, raw in result.per_request[0])
    return {"mode": mode, "device": str(model.device), "weights_bytes": weights, "before_bytes": before,
            "peak_bytes": peak, "scoring_bytes": peak - before, "seconds": seconds, "response_bytes": sent}


def run(device: str, seq: int, vocab: int, chunk_mib: int = CHUNK_BYTES // MiB, *, teacher: str = "",
        compute_dtype: str = "FP32") -> dict[str, Any]:
    """Both modes on the tiny-hidden Llama at `vocab`, or on `teacher` (a save_pretrained directory,
    e.g. a real shape from benchmarks.shapes) with its own vocabulary."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="teacher-memory-") as scratch:
        tmp = teacher or scratch
        if teacher:
            vocab = int(json.loads((Path(teacher) / "config.json").read_text(encoding="utf-8"))["vocab_size"])
        else:
            save_model(Path(tmp), vocab, seq)
        # glibc keeps freed blocks below its (moving) mmap threshold on the heap, so the resident
        # set would count some dead chunks: every block of 1 MiB or more is mapped on its own and
        # returned when freed, and the peak resident set follows the live tensors.
        env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(MiB))
        for mode in MODES:
            out = subprocess.run(
                [sys.executable, "-m", "benchmarks.teacher_memory", "--child", mode, "--dir", tmp, "--device", device,
                 "--seq", str(seq), "--chunk-mib", str(chunk_mib), "--compute-dtype", compute_dtype],
                capture_output=True, text=True, timeout=900, check=False, env=env)
            if out.returncode != 0:
                raise RuntimeError(f"mode {mode} failed ({out.returncode}):\n{out.stderr[-4000:]}")
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    return {"seq": seq, "vocab": vocab, "device": device, "chunk_mib": chunk_mib, "modes": rows,
            "teacher": teacher or "tiny-hidden Llama", "compute_dtype": compute_dtype,
            "machine": machine_info()}


def report(data: dict[str, Any]) -> str:
    headers = ["mode", "weights MiB", "before scoring MiB", "peak MiB", "scoring peak above before MiB", "seconds"]
    table = [[r["mode"], round(r["weights_bytes"] / MiB), round(r["before_bytes"] / MiB),
              round(r["peak_bytes"] / MiB), round(r["scoring_bytes"] / MiB), round(r["seconds"], 2)]
             for r in data["modes"]]
    return (f"one sequence of {data['seq']} tokens, vocabulary {data['vocab']}, device {data['device']}\n"
            + format_table(headers, table))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--chunk-mib", type=int, default=CHUNK_BYTES // MiB,
                   help="fp32 MiB of logits per chunk (default: the server's, %(default)s)")
    p.add_argument("--quick", action="store_true", help="512 tokens at a 32k vocabulary (a smoke run)")
    p.add_argument("--teacher", default="", help="a save_pretrained causal LM directory instead of the tiny Llama")
    p.add_argument("--compute-dtype", type=str.upper, default="FP32", choices=("FP32", "FP16", "BF16"))
    p.add_argument("--out", default="teacher_memory", help="results file: benchmarks/results/<OUT>.json")
    p.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    p.add_argument("--dir", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.dir, args.device, args.seq, args.chunk_mib,
                               compute_dtype=args.compute_dtype)))
        return 0
    seq, vocab = (512, 32000) if args.quick else (args.seq, args.vocab)
    data = run(args.device, seq, vocab, args.chunk_mib, teacher=args.teacher, compute_dtype=args.compute_dtype)
    if not args.quick:
        write_results(args.out, data)
    print(report(data))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
