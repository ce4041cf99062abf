"""Train the LLM student with and without KD (same seeds) and compare them on held-out text.

    python -m examples.llm.train_student                       # 3 seeds x (no KD, KD), top-16 logprobs
    python -m examples.llm.train_student --seeds 0 --steps 100 # one quicker pair
    python -m examples.llm.train_student --smoke               # seconds, for tests (trains a smoke teacher if needed)
    python -m examples.llm.train_student --teacher-source store   # record the teacher once, train offline

Needs the trained teacher (``python -m examples.llm.train_teacher``). The student is a smaller Llama
(``examples.llm.models``), trained on the same sequences in the same order for both arms: the
no-KD arm on next-token cross-entropy, the KD arm on ``TokenKDLoss`` (``alpha`` hard-label weight,
forward KL on the teacher's top-k log-probabilities with the tail bin).

Where the KD arm's targets come from (``--teacher-source``, ``examples.llm.student.TargetSource``):

* ``mesh`` (default): a teacher server serves the teacher directory (``--model hf:DIR``, started
  here, or ``--teachers HOST:PORT`` already running) and ``distill.DistillReader`` iterates the
  student's loader, fetching each batch's top-k log-probabilities, tail and all, in float16.
* ``store``: the samples every seed will see are recorded once through a teacher server into a
  teacher-output store (``distill.cache``; ``--store``), which is then stopped; the students train
  from the store alone (``cache_mode="read"``, no teachers). The targets are the mesh's, byte for byte.
* ``inprocess``: the teacher model in this process (the reference).

Results (per run and the mean over seeds) are printed and written to ``--out`` as JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from distill.losses import TokenKDLoss
from examples.common import cache_dir, exit_on_sigterm, seed_everything, write_json
from examples.llm import mesh, models
from examples.llm.common import Splits, cosine_lr, evaluate, load_splits, quiet, use_all_cores
from examples.llm.data import Collator, IndexBatches, TrainBatches
from examples.llm.student import (
    InProcessTeacher,
    NoTeacher,
    ReaderTeacher,
    TargetSource,
    bytes_per_token,
    kd_loss,
)
from examples.llm.tokenizer import load_tokenizer

SOURCES = ("mesh", "store", "inprocess")


@dataclass(frozen=True)
class RunResult:
    """One student run: held-out metrics, the training loss at the start and the end, time."""

    seed: int
    kd: bool
    perplexity: float
    accuracy: float
    first_loss: float
    last_loss: float
    steps: int
    seconds: float


def train_one(
    splits: Splits, pad_id: int, vocab_size: int, source: TargetSource, *, seed: int, steps: int,
    batch_size: int, lr: float, loss_fn: TokenKDLoss, eval_sequences: int, role: str = "student",
) -> RunResult:
    """Train one student from the seed's initialisation on ``(batch, targets)`` pairs from ``source``;
    ``NoTeacher`` is the no-KD baseline. The batches are the seed's, whatever the source."""
    student, losses, seconds = fit(splits, pad_id, vocab_size, source, seed=seed, steps=steps,
                                   batch_size=batch_size, lr=lr, loss_fn=loss_fn, role=role)
    m = evaluate(student, splits.eval_subset(eval_sequences), pad_id)
    first, last = loss_ends(losses)
    return RunResult(seed, not isinstance(source, NoTeacher), m.perplexity, m.accuracy, first, last, steps, seconds)


def fit(
    splits: Splits, pad_id: int, vocab_size: int, source: TargetSource, *, seed: int, steps: int,
    batch_size: int, lr: float, loss_fn: TokenKDLoss, role: str = "student", student: torch.nn.Module | None = None,
    data_seed: int | None = None,
) -> tuple[torch.nn.Module, list[float], float]:
    """The training of ``train_one``: (the trained student, its loss per step, training seconds).

    ``student``: train this model (trained in place; a warm start) instead of the seed's fresh
    initialisation. ``data_seed``: the batches' order (default ``seed``), so a warm start can draw
    other batches than the runs that continue from it.
    """
    if student is None:
        seed_everything(seed)
        student = models.build(role, vocab_size, max_len=splits.seq_len, pad_token_id=pad_id)
    opt = torch.optim.AdamW(student.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.95))
    sched = cosine_lr(opt, steps, warmup=max(1, steps // 20))
    loader = train_batches(splits, pad_id, batch_size=batch_size, seed=seed if data_seed is None else data_seed,
                           steps=steps)
    losses: list[float] = []
    started = time.perf_counter()
    student.train()
    for batch, targets in source.pairs(loader):
        logits = student(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        loss = kd_loss(loss_fn, logits, targets, batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))
    if len(losses) != steps:
        raise RuntimeError(f"the {source.name} source yielded {len(losses)} batches for {steps} steps")
    return student, losses, time.perf_counter() - started


def loss_ends(losses: Sequence[float]) -> tuple[float, float]:
    """The mean training loss over the first and the last few steps (a quarter of the run, at most 10)."""
    window = max(1, min(10, len(losses) // 4))
    return sum(losses[:window]) / window, sum(losses[-window:]) / window


def train_batches(splits: Splits, pad_id: int, *, batch_size: int, seed: int, steps: int) -> TrainBatches:
    """The seed's ``steps`` batches, padded to the full sequence length (one shape per sample, as a
    store needs), each with the ``index`` of its sequences: the same in every source."""
    return TrainBatches(splits.train, Collator(pad_id, pad_to=splits.seq_len), batch_size=batch_size, seed=seed,
                        steps=steps)


def needed_indices(splits: Splits, pad_id: int, *, seeds: Sequence[int], steps: int, batch_size: int) -> list[int]:
    """Every training sequence the seeds' runs will draw, sorted: what a store must hold for them."""
    return sorted({i for seed in seeds for b in train_batches(splits, pad_id, batch_size=batch_size, seed=seed,
                                                               steps=steps).plan() for i in b})


def store_holds(store: Path, indices: Sequence[int]) -> bool:
    """Whether ``store`` exists and holds every one of ``indices`` (then no teacher is needed at all)."""
    import numpy as np

    from distill.cache import StoreNotFoundError, TeacherOutputStore

    try:
        with TeacherOutputStore.open(store, mode="r") as opened:
            return bool(opened.lookup(np.asarray(indices, dtype=np.int64), outputs=[]).hit.all())
    except StoreNotFoundError:
        return False


def record_store(splits: Splits, pad_id: int, store: Path, indices: Sequence[int], *, teachers: str,
                 batch_size: int, k: int, temperature: float) -> None:
    """Record the sequences ``indices`` into ``store`` through ``teachers`` (stored ones are skipped)."""
    loader = IndexBatches(splits.train, Collator(pad_id, pad_to=splits.seq_len), indices, batch_size=batch_size)
    batches, seconds = mesh.record(loader, store, teachers=teachers, k=k, temperature=temperature)
    print(f"store: {len(indices):,} sequences ({batches} batches) recorded into {store} in {seconds:.1f} s",
          flush=True)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m examples.llm.train_student", description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="one KD and one no-KD run per seed")
    p.add_argument("--steps", type=int, default=150, help="optimizer steps per run (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per step (default: %(default)s)")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (default: %(default)s)")
    p.add_argument("--k", type=int, default=16, help="teacher top-k per position (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=1.0, help="KD temperature (default: %(default)s)")
    p.add_argument("--alpha", type=float, default=0.5, help="hard-label weight in the KD loss (default: %(default)s)")
    p.add_argument("--eval-sequences", type=int, default=128,
                   help="held-out sequences evaluated (default: %(default)s)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: one per core)")
    p.add_argument("--teacher", type=Path, default=None, help="teacher directory (default: the cache's llm/teacher)")
    p.add_argument("--teacher-source", choices=SOURCES, default="mesh",
                   help="KD targets from a teacher server through DistillReader (mesh), from a store recorded "
                   "once through one (store), or from the teacher in this process (default: %(default)s)")
    p.add_argument("--teachers", metavar="HOST:PORT[,HOST:PORT]", default=None,
                   help="teacher servers already serving the teacher directory (--model hf:DIR, --name "
                   f"{mesh.MODEL_NAME}) for mesh and for recording the store (default: start one here)")
    p.add_argument("--store", type=Path, default=None,
                   help="the teacher-output store for --teacher-source store (default: <cache>/llm/store-<teacher "
                   "digest>-k<K>-T<T>[-smoke])")
    p.add_argument("--out", type=Path, default=None, help="results JSON (default: <cache>/llm/student_results.json)")
    p.add_argument("--smoke", action="store_true", help="tiny models, few files, 15 steps, one seed: for tests")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    quiet()
    # The smoke models are too small to gain from intra-op threads: one, unless asked.
    threads = use_all_cores(args.threads or (1 if args.smoke else 0))
    teacher_path = args.teacher or models.teacher_dir(smoke=args.smoke)
    if args.smoke and not (teacher_path / "config.json").is_file():
        from examples.llm import train_teacher

        train_teacher.main(["--smoke"])
    teacher_model = models.load_teacher(teacher_path)
    tok = load_tokenizer(teacher_path)  # the teacher's own tokenizer, saved beside it
    seq_len = int(teacher_model.config.max_position_embeddings)
    splits = load_splits(tok, seq_len, smoke=args.smoke)
    pad_id = int(tok.pad_token_id)
    seeds, steps, batch_size = ([args.seeds[0]], 15, 8) if args.smoke else (args.seeds, args.steps, args.batch_size)
    eval_sequences = 16 if args.smoke else args.eval_sequences
    role = "student-smoke" if args.smoke else "student"
    loss_fn = TokenKDLoss(temperature=args.temperature, alpha=args.alpha)
    probe = models.build(role, len(tok), max_len=seq_len)
    print(f"student: {models.parameter_count(probe):,} parameters (teacher {models.parameter_count(teacher_model):,});"
          f" {steps} steps x {batch_size} sequences of <= {seq_len} tokens; top-{args.k} logprobs at "
          f"T={args.temperature}, alpha={args.alpha}; teacher source: {args.teacher_source}; {threads} torch threads",
          flush=True)
    del probe
    version = mesh.teacher_version(teacher_path)
    store = args.store or cache_dir() / "llm" / (f"store-{version}-k{args.k}-T{args.temperature:g}"
                                                  + ("-smoke" if args.smoke else ""))
    runs: list[RunResult] = []
    with contextlib.ExitStack() as stack:
        teachers = args.teachers
        needed: list[int] = []
        if args.teacher_source == "store":
            needed = needed_indices(splits, pad_id, seeds=seeds, steps=steps, batch_size=batch_size)
            if store_holds(store, needed):
                print(f"store: {store} holds all {len(needed):,} sequences the runs draw; no teacher needed",
                      flush=True)
                needed = []
        if teachers is None and (args.teacher_source == "mesh" or needed):
            teachers = stack.enter_context(mesh.serve_teacher(
                teacher_path, k=args.k, temperature=args.temperature, max_batch_size=batch_size, threads=threads))
            print(f"teacher server: {teachers} serving hf:{teacher_path} (version {version})", flush=True)
        kd_source: TargetSource
        if args.teacher_source == "inprocess":
            kd_source = InProcessTeacher(teacher_model, k=args.k, temperature=args.temperature)
        elif args.teacher_source == "mesh":
            assert teachers is not None
            kd_source = ReaderTeacher("mesh", mesh.reader_options(k=args.k, temperature=args.temperature,
                                                                  teachers=teachers))
        else:
            if needed:
                assert teachers is not None
                record_store(splits, pad_id, store, needed, teachers=teachers, batch_size=batch_size, k=args.k,
                             temperature=args.temperature)
            stack.close()  # the students train from the store alone: no teacher server from here on
            kd_source = ReaderTeacher("store", mesh.reader_options(k=args.k, temperature=args.temperature,
                                                                   store=store, version=version))
        for seed in seeds:
            for source in (NoTeacher(), kd_source):
                r = train_one(splits, pad_id, len(tok), source, seed=seed, steps=steps, batch_size=batch_size,
                              lr=args.lr, loss_fn=loss_fn, eval_sequences=eval_sequences, role=role)
                runs.append(r)
                print(f"  seed {seed} {'KD   ' if r.kd else 'no KD'}: held-out perplexity {r.perplexity:.2f}, "
                      f"next-token accuracy {r.accuracy:.4f}; train loss {r.first_loss:.3f} -> {r.last_loss:.3f}; "
                      f"{r.seconds:.1f} s", flush=True)
    summary: dict[str, dict[str, float]] = {}
    for label, kd in (("no KD", False), ("KD", True)):
        arm = [r for r in runs if r.kd == kd]
        summary[label] = {"perplexity": statistics.fmean(r.perplexity for r in arm),
                          "accuracy": statistics.fmean(r.accuracy for r in arm),
                          "seconds": statistics.fmean(r.seconds for r in arm)}
        print(f"{label}: mean held-out perplexity {summary[label]['perplexity']:.2f}, mean next-token accuracy "
              f"{summary[label]['accuracy']:.4f} over {len(arm)} seed(s)")
    wire = bytes_per_token(len(tok), args.k)
    print(f"teacher bytes per token on the wire: full vocabulary fp32 {wire['full_fp32']:,} B, top-{args.k} fp16 + "
          f"int32 ids (+ fp16 tail) {wire['topk_fp16_int32']:,} B "
          f"({wire['full_fp32'] / wire['topk_fp16_int32']:.0f}x less)")
    out = args.out or cache_dir() / "llm" / ("student_results-smoke.json" if args.smoke else "student_results.json")
    write_json(out, {"runs": [asdict(r) for r in runs], "mean": summary, "bytes_per_token": wire,
                     "k": args.k, "temperature": args.temperature, "alpha": args.alpha, "steps": steps,
                     "batch_size": batch_size, "seq_len": seq_len, "eval_sequences": eval_sequences,
                     "torch_threads": threads, "teacher": str(teacher_path), "teacher_version": version,
                     "teacher_source": args.teacher_source,
                     **({"store": str(store)} if args.teacher_source == "store" else {})})
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    exit_on_sigterm()  # the teacher servers and etcd it starts stop with it
    sys.exit(main())
