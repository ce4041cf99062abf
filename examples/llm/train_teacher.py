"""Train the LLM teacher (a small Llama-style causal LM) from scratch on CPU and save it in the cache.

    python -m examples.llm.train_teacher                 # ~2.1M parameters, a few CPU minutes
    python -m examples.llm.train_teacher --smoke         # a tiny model on a few files, seconds, for tests

The model and its tokenizer go to ``examples.llm.models.teacher_dir()`` (or ``--out``) with
``save_pretrained``, so the directory is a complete local Hugging Face model; ``train_info.json``
beside them records the held-out perplexity and next-token accuracy, the steps, the seed and
the wall time.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from examples.common import seed_everything, write_json
from examples.llm import models
from examples.llm.common import LMMetrics, cosine_lr, evaluate, load_splits, quiet, use_all_cores
from examples.llm.data import Batches, Collator
from examples.llm.tokenizer import DEFAULT_VOCAB, get_tokenizer

INFO = "train_info.json"


@dataclass(frozen=True)
class TeacherResult:
    """What a teacher training run produced."""

    directory: Path
    metrics: LMMetrics
    first_loss: float
    last_loss: float
    steps: int
    seconds: float
    parameters: int


def train_teacher(
    out: Path, *, steps: int = 450, seq_len: int = 64, batch_size: int = 16, lr: float = 2e-3, seed: int = 0,
    vocab_size: int = DEFAULT_VOCAB, eval_sequences: int = 256, smoke: bool = False, log_every: int = 25,
    threads: int = 0,
) -> TeacherResult:
    """Train the teacher for ``steps`` AdamW steps on the training split; evaluate; save model + tokenizer."""
    threads = use_all_cores(threads)
    tok = get_tokenizer(vocab_size, smoke=smoke)
    splits = load_splits(tok, seq_len, smoke=smoke)
    pad_id = int(tok.pad_token_id)
    gen_seed = seed_everything(seed)
    del gen_seed
    model = models.build("teacher-smoke" if smoke else "teacher", len(tok), max_len=seq_len,
                         pad_token_id=pad_id, eos_token_id=int(tok.eos_token_id))
    params = models.parameter_count(model)
    print(f"teacher: {params:,} parameters; {len(splits.train):,} training / {len(splits.held_out):,} held-out "
          f"sequences of <= {seq_len} tokens; {threads} torch threads", flush=True)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.95))
    sched = cosine_lr(opt, steps, warmup=max(1, steps // 20))
    loader = Batches(splits.train, Collator(pad_id), batch_size=batch_size, seed=seed)
    losses: list[float] = []
    model.train()
    started = time.perf_counter()
    step = 0
    while step < steps:
        for batch in loader:
            loss = model(**batch).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            losses.append(float(loss.detach()))
            step += 1
            if log_every and step % log_every == 0:
                print(f"  step {step}/{steps}  loss {sum(losses[-log_every:]) / log_every:.3f}  "
                      f"{time.perf_counter() - started:.0f} s", flush=True)
            if step >= steps:
                break
    seconds = time.perf_counter() - started
    metrics = evaluate(model, splits.eval_subset(eval_sequences), pad_id)
    window = max(1, min(10, len(losses) // 4))
    first, last = sum(losses[:window]) / window, sum(losses[-window:]) / window
    tmp = out.with_name(f"{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(str(tmp))
    tok.save_pretrained(str(tmp))
    write_json(tmp / INFO, {
        "held_out_perplexity": metrics.perplexity, "held_out_accuracy": metrics.accuracy,
        "held_out_loss": metrics.loss, "held_out_tokens": metrics.tokens, "first_loss": first, "last_loss": last,
        "steps": steps, "batch_size": batch_size, "seq_len": seq_len, "lr": lr, "seed": seed,
        "seconds": round(seconds, 1), "torch_threads": threads, "parameters": params,
        "vocab_size": len(tok), "model": "LlamaForCausalLM", "smoke": smoke,
    })
    shutil.rmtree(out, ignore_errors=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp.replace(out)
    return TeacherResult(out, metrics, first, last, steps, seconds, params)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m examples.llm.train_teacher", description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=450, help="optimizer steps (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per step (default: %(default)s)")
    p.add_argument("--seq-len", type=int, default=64, help="tokens per sequence at most (default: %(default)s)")
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate (default: %(default)s)")
    p.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB, help="tokenizer size (default: %(default)s)")
    p.add_argument("--eval-sequences", type=int, default=256,
                   help="held-out sequences evaluated (default: %(default)s)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: one per core)")
    p.add_argument("--seed", type=int, default=0, help="seed for initialisation and data order (default: 0)")
    p.add_argument("--out", type=Path, default=None, help="output directory (default: the cache's llm/teacher)")
    p.add_argument("--smoke", action="store_true", help="tiny model, few files, 30 steps: seconds, for tests")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    quiet()
    out = args.out or models.teacher_dir(smoke=args.smoke)
    if args.smoke:
        result = train_teacher(out, steps=30, seq_len=64, batch_size=8, lr=5e-3, seed=args.seed,
                               vocab_size=512, eval_sequences=16, smoke=True, log_every=0, threads=args.threads or 1)
    else:
        result = train_teacher(out, steps=args.steps, seq_len=args.seq_len, batch_size=args.batch_size, lr=args.lr,
                               seed=args.seed, vocab_size=args.vocab_size, eval_sequences=args.eval_sequences,
                               threads=args.threads)
    m = result.metrics
    print(f"teacher: loss {result.first_loss:.3f} -> {result.last_loss:.3f} in {result.steps} steps, "
          f"{result.seconds:.1f} s; held-out perplexity {m.perplexity:.2f}, next-token accuracy {m.accuracy:.4f} "
          f"({m.tokens:,} tokens); saved to {result.directory}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
