"""``python -m examples.crosstok``: a teacher and a student with different tokenizers, the student trained three ways.

The whole comparison in one command: two byte-level BPEs of different sizes trained on the
corpus's training split (cached), a teacher LM trained with the larger one (cached, saved with
its tokenizer), a teacher server serving it on loopback, then for each seed the arms of
``examples.crosstok.arms`` on the same pieces in the same order. Prints held-out bits per byte
per arm (mean ± standard deviation over the seeds) and writes every figure as JSON. ``--quick``:
tiny models, few files and steps, the pipeline end to end in a few minutes at most (what the test
runs).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from examples.common import cache_dir, exit_on_sigterm, write_json
from examples.crosstok import arms, mesh
from examples.crosstok.corpus import context, get_tokenizer, load_texts, spread, text_pieces
from examples.crosstok.onpolicy import OnPolicySettings
from examples.crosstok.train import get_teacher
from examples.llm.common import quiet, use_all_cores

RESULTS = Path(__file__).with_name("results.json")
QUICK = {"student_vocab": 320, "teacher_vocab": 512, "max_bytes": 128, "teacher_steps": 100, "steps": 24,
         "batch_size": 8, "eval_pieces": 32, "warmup": 0.75, "prompt_tokens": 8, "new_tokens": 16}
"""What ``--quick`` sets, whatever the flags say (the seeds too: the first two given)."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m examples.crosstok", description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="student seeds (default: 0 1 2)")
    p.add_argument("--arms", nargs="+", choices=arms.ARMS, default=list(arms.ARMS), help="arms to run (default: all)")
    p.add_argument("--student-vocab", type=int, default=2048, help="the student's tokenizer size (default: 2048)")
    p.add_argument("--teacher-vocab", type=int, default=4096, help="the teacher's tokenizer size (default: 4096)")
    p.add_argument("--max-bytes", type=int, default=256,
                   help="UTF-8 bytes per text piece at most; the models get one more position (default: 256)")
    p.add_argument("--teacher-steps", type=int, default=600, help="teacher training steps (default: 600)")
    p.add_argument("--steps", type=int, default=300, help="training steps of each student run (default: 300)")
    p.add_argument("--batch-size", type=int, default=16, help="pieces per step (default: 16)")
    p.add_argument("--lr", type=float, default=3e-3, help="peak AdamW learning rate, teacher and students "
                   "(default: 3e-3)")
    p.add_argument("--k", type=int, default=16, help="teacher top-k log-probabilities per token (default: 16)")
    p.add_argument("--temperature", type=float, default=1.0, help="KD temperature (default: 1.0)")
    p.add_argument("--alpha", type=float, default=0.5, help="hard-label weight of every KD arm (default: 0.5)")
    p.add_argument("--warmup", type=float, default=0.8,
                   help="crosstok_onpolicy: the share of --steps trained as crosstok_kd before sampling (default: 0.8)")
    p.add_argument("--prompt-tokens", type=int, default=16,
                   help="crosstok_onpolicy: student tokens of each piece's prefix the samples continue, the BOS "
                   "included (default: 16)")
    p.add_argument("--new-tokens", type=int, default=48,
                   help="crosstok_onpolicy: tokens the student samples after each prompt (default: 48)")
    p.add_argument("--eval-pieces", type=int, default=256,
                   help="held-out pieces scored, spread over the split (default: 256; 0 = all)")
    p.add_argument("--threads", type=int, default=1, help="torch threads of the student and the teacher server "
                   "(default: 1)")
    p.add_argument("--out", type=Path, default=None, help="the JSON results (default: examples/crosstok/results.json;"
                   " with --quick, <cache>/crosstok/results-quick.json)")
    p.add_argument("--quick", action="store_true",
                   help="tiny models and tokenizers on a few files, few steps, at most two seeds: for tests")
    return p


def summary(runs: Sequence[dict[str, Any]], arm_names: Sequence[str]) -> dict[str, dict[str, float]]:
    """Per arm that ran: the mean and standard deviation (0 for one seed) of bits per byte over the seeds."""
    out: dict[str, dict[str, float]] = {}
    for arm in arm_names:
        values = [r["bits_per_byte"] for r in runs if r["arm"] == arm]
        if values:
            out[arm] = {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
                        "uniform_bits_per_byte": next(r["uniform_bits_per_byte"] for r in runs if r["arm"] == arm)}
    return out


def table(teacher: dict[str, Any], runs: Sequence[dict[str, Any]], means: dict[str, dict[str, float]],
          seeds: Sequence[int]) -> str:
    """The printed table: held-out bits per byte per arm, per seed and mean ± std."""
    head = f"{'held-out bits per byte':<26}{'vocab':>7}" + "".join(f"{'seed ' + str(s):>10}" for s in seeds)
    lines = [head + f"{'mean ± std':>18}",
             f"{'teacher':<26}{teacher['settings']['vocab_size']:>7}" + " " * 10 * len(seeds)
             + f"{teacher['bits_per_byte']:>18.4f}"]
    for arm in arms.ARMS:
        if arm in means:
            own = {r["seed"]: r for r in runs if r["arm"] == arm}
            m = means[arm]
            lines.append(f"{arm:<26}{next(iter(own.values()))['vocab_size']:>7}"
                         + "".join(f"{own[s]['bits_per_byte']:>10.4f}" for s in seeds)
                         + f"{m['mean']:>10.4f} ± {m['std']:.4f}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.quick:
        for name, value in QUICK.items():
            setattr(args, name, value)
        args.seeds = args.seeds[:2]
    quiet()
    threads = use_all_cores(args.threads)
    started = time.perf_counter()
    root = cache_dir() / "crosstok"
    out = args.out or (root / "results-quick.json" if args.quick else RESULTS)
    corpus = load_texts(quick=args.quick)
    student_tok = get_tokenizer(args.student_vocab, corpus, quick=args.quick)
    teacher_tok = get_tokenizer(args.teacher_vocab, corpus, quick=args.quick)
    train = text_pieces(corpus.texts("train"), args.max_bytes)
    held_out = spread(text_pieces(corpus.texts("held_out"), args.max_bytes), args.eval_pieces)
    max_len = context(args.max_bytes)
    print(f"crosstok: {len(train):,} training pieces, {len(held_out):,} held-out pieces "
          f"({sum(len(p.encode()) for p in held_out):,} bytes) of <= {args.max_bytes} bytes; tokenizers: student "
          f"{len(student_tok):,}, teacher {len(teacher_tok):,} entries; {threads} torch thread(s)", flush=True)
    teacher_dir = root / (f"teacher-{args.teacher_vocab}" + ("-quick" if args.quick else ""))
    teacher = get_teacher(teacher_dir, teacher_tok, train, held_out, role="teacher-smoke" if args.quick else "teacher",
                          steps=args.teacher_steps, batch_size=args.batch_size, lr=args.lr, max_len=max_len)
    print(f"teacher: {teacher['parameters']:,} parameters, held-out {teacher['bits_per_byte']:.4f} bits per byte "
          f"(uniform {teacher['uniform_bits_per_byte']:.4f}); {teacher_dir}", flush=True)
    wanted = [a for a in arms.ARMS if a in args.arms]
    runs: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        served = None
        if any(a != "no_kd" for a in wanted):
            served = stack.enter_context(mesh.serve(teacher_dir, k=args.k, temperature=args.temperature,
                                                    max_batch_size=args.batch_size, threads=threads))
            print(f"teacher server: {served.endpoint} serving hf:{teacher_dir}, registered as {served.service!r} "
                  f"in {served.registry}", flush=True)
        setup = arms.Setup(student_tok, teacher_tok, train, held_out, role="student-smoke" if args.quick else "student",
                           max_len=max_len, steps=args.steps, batch_size=args.batch_size, lr=args.lr, k=args.k,
                           temperature=args.temperature, alpha=args.alpha, mesh=served,
                           onpolicy=OnPolicySettings(args.warmup, args.prompt_tokens, args.new_tokens))
        for seed in args.seeds:
            for arm in wanted:
                r = arms.run(arm, seed, setup)
                runs.append(r)
                print(f"  seed {seed} {arm:<26} {r['bits_per_byte']:.4f} bits per byte; train loss "
                      f"{r['first_loss']:.3f} -> {r['last_loss']:.3f}; {r['seconds']} s", flush=True)
    means = summary(runs, wanted)
    print(table(teacher, runs, means, args.seeds))
    seconds = time.perf_counter() - started
    print(f"total {seconds:.0f} s")
    write_json(out, {
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "teacher": teacher, "summary": means, "runs": runs, "seconds": round(seconds, 1),
        "machine": {"python": platform.python_version(), "torch": torch.__version__, "cpus": os.cpu_count()}})
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    exit_on_sigterm()  # the teacher servers and etcd it starts stop with it
    sys.exit(main())
