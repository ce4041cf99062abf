"""The host's work for one batch of an `hf:` causal LM teacher, counted in ATen calls: the forward
pass, the server's output transforms at each chunk size, and the in-process baseline's one-piece
top-k, as W6 asks for them (log-probs, top-20, fp16 values, int32 ids, the tail mass).

    .venv/bin/python -m benchmarks.launches [--shape qwen2.5-1.5b] [--tokens 16384] [--chunks 64,128,256,1024]

Each ATen call is a dispatch on the host, and on a GPU nearly every call that is not a view
launches at least one kernel (top-k launches several): a few microseconds of host time each, under
the interpreter lock that a teacher's instances and its event loop share. W6 on an H200 pointed to
that host work as the served LLM teacher's limit; this counts it where no GPU is needed. The
transforms and the baseline run on the meta device at the shape's real hidden size and vocabulary
(no memory, no compute); the forward pass runs on the CPU with the shape's layer count and heads
but narrow widths (its calls depend on the layers, not on the widths; the meta device cannot take
an attention mask). Counts, not times: the same on any machine for one torch and transformers.
"""

from __future__ import annotations

import argparse
import collections
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.common import format_table, machine_info, run_and_report
from benchmarks.llm_parts import output_work
from benchmarks.shapes import SHAPES
from teacher_server.outputs import CHUNK_BYTES, OutputContext, OutputTransform, transform_output
from teacher_server.spec import TensorSpec

TOP_K = 20
FORWARD_LENGTH = 64  # positions a row in the counted forward pass (the calls do not depend on it)


class CallCounter(TorchDispatchMode):
    """Counts the ATen calls made while active: all of them, and those that are not views."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: collections.Counter[str] = collections.Counter()
        self.views = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.calls[str(func.overloadpacket.__name__)] += 1
        self.views += bool(getattr(func, "is_view", False))
        return func(*args, **(kwargs or {}))

    def summary(self) -> dict[str, Any]:
        total = sum(self.calls.values())
        return {"calls": total, "non_view_calls": total - self.views, "top": dict(self.calls.most_common(8))}


def forward_calls(shape: dict[str, Any], batch: int, length: int) -> dict[str, Any]:
    """The decoder body's calls (what `HFTeacher.hidden` runs), one padded row in the batch."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    narrow = dict(shape, hidden_size=8 * shape["num_attention_heads"], intermediate_size=16, vocab_size=64)
    model = AutoModelForCausalLM.from_config(Qwen2Config(**narrow, max_position_embeddings=length)).eval()
    ids = torch.ones((batch, length), dtype=torch.long)
    mask = torch.ones_like(ids)
    mask[-1, length // 2:] = 0
    with torch.inference_mode(), CallCounter() as counter:
        model.model(input_ids=ids, attention_mask=mask, use_cache=False)
    return counter.summary()


def _meta_batch(hidden: int, vocab: int, tokens: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The output projection's weight and a batch's final hidden states, on the meta device."""
    return (torch.empty((vocab, hidden), dtype=dtype, device="meta"),
            torch.empty((1, tokens, hidden), dtype=dtype, device="meta"))


def transform_calls(hidden: int, vocab: int, tokens: int, chunk_mib: int, dtype: torch.dtype) -> dict[str, Any]:
    """The server's output projection and transforms over `tokens` positions, `chunk_mib` a chunk."""
    weight, h = _meta_batch(hidden, vocab, tokens, dtype)
    spec = TensorSpec("LOGITS", "FP32", (-1, vocab), per_position=True)
    want = OutputTransform("LOGITS", "FP16", TOP_K, True, 1.0, True)
    context = OutputContext(None, lambda x: torch.nn.functional.linear(x, weight), vocab, chunk_mib << 20)
    with torch.inference_mode(), CallCounter() as counter:
        transform_output(h, spec, want, context)
    per_chunk = max(1, (chunk_mib << 20) // (vocab * 4))
    return {"chunk_mib": chunk_mib, "positions_per_chunk": per_chunk, "chunks": -(-tokens // per_chunk),
            **counter.summary()}


def baseline_calls(hidden: int, vocab: int, tokens: int, dtype: torch.dtype) -> dict[str, Any]:
    """The in-process baseline's projection and top-k of the whole batch at once."""
    weight, h = _meta_batch(hidden, vocab, tokens, dtype)
    with torch.inference_mode(), CallCounter() as counter:
        output_work(torch.nn.functional.linear(h, weight), TOP_K)
    return counter.summary()


def run(shape_name: str, tokens: int, chunks: list[int], dtype: str) -> dict[str, Any]:
    shape = SHAPES[shape_name]
    torch_dtype = {"FP32": torch.float32, "FP16": torch.float16, "BF16": torch.bfloat16}[dtype]
    hidden, vocab = shape["hidden_size"], shape["vocab_size"]
    batch = max(1, tokens // 512)
    return {
        "shape": shape_name, "tokens": tokens, "compute_dtype": dtype, "top_k": TOP_K,
        "default_chunk_mib": CHUNK_BYTES >> 20,
        "forward": {"rows": batch, "length": FORWARD_LENGTH, **forward_calls(shape, batch, FORWARD_LENGTH)},
        "baseline": baseline_calls(hidden, vocab, tokens, torch_dtype),
        "transforms": [transform_calls(hidden, vocab, tokens, mib, torch_dtype) for mib in chunks],
        "torch": torch.__version__, "machine": machine_info(),
    }


def report(doc: dict[str, Any]) -> str:
    fwd, base = doc["forward"], doc["baseline"]
    rows: list[list[object]] = [
        ["forward pass (decoder body)", "", "", fwd["calls"], fwd["non_view_calls"]],
        ["in process: projection + top-k, whole batch", "", 1, base["calls"], base["non_view_calls"]],
    ]
    for t in doc["transforms"]:
        default = " (default)" if t["chunk_mib"] == doc["default_chunk_mib"] else ""
        rows.append([f"server transforms, {t['chunk_mib']} MiB chunks{default}", t["positions_per_chunk"],
                     t["chunks"], t["calls"], t["non_view_calls"]])
    return (f"{doc['shape']}, {doc['tokens']:,} positions a batch, {doc['compute_dtype']}, top-{doc['top_k']} "
            f"log-probs in fp16 + int32 ids + tail\n"
            + format_table(["work", "positions a chunk", "chunks", "ATen calls", "not views"], rows))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="qwen2.5-1.5b", choices=sorted(SHAPES))
    p.add_argument("--tokens", type=int, default=16384, help="positions in the batch (default: %(default)s)")
    p.add_argument("--chunks", default="64,128,256,1024", help="chunk sizes in fp32 MiB (default: %(default)s)")
    p.add_argument("--compute-dtype", type=str.upper, default="BF16", choices=("FP32", "FP16", "BF16"))
    p.add_argument("--out", default="launches", help="results file: benchmarks/results/<OUT>.json")
    args = p.parse_args(argv)
    chunks = [int(c) for c in args.chunks.split(",") if c.strip()]
    if args.tokens < 1 or not chunks or min(chunks) < 1:
        p.error("--tokens and every --chunks size must be at least 1")
    return run_and_report(lambda: run(args.shape, args.tokens, chunks, args.compute_dtype), args.out, report)


if __name__ == "__main__":
    raise SystemExit(main())
