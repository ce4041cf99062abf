"""On-policy distillation vs off-policy KD vs no KD for the LLM student, through the mesh, per seed.

    python -m examples.llm.compare --threads 1           # 3 seeds x 3 arms, warm-started, one teacher server
    python -m examples.llm.compare --threads 1 --warm-start-steps 0   # every arm from random weights
    python -m examples.llm.compare --seeds 0 --steps 40  # one quicker round
    python -m examples.llm.compare --smoke               # tiny models, seconds, for tests

Needs nothing but the local corpus: a teacher missing from its directory is trained first
(``examples.llm.train_teacher`` with its defaults), then one teacher server serves it
(``python -m teacher_server --model hf:DIR``) for every arm.

Every arm of a seed starts from the same student weights: the seed's random initialisation trained
``--warm-start-steps`` steps on next-token cross-entropy over the training split (other batches than
the arms', in a seeded order of their own; once per seed, into a temporary directory that lives as
long as the run; not counted in any arm's steps or budget). On-policy distillation as published (GKD,
Agarwal et al. 2024) starts from a student that already models the data: a random student's samples
are noise for the teacher to grade. ``--warm-start-steps 0`` trains every arm from the random
initialisation itself. The warm start itself is evaluated too (the ``warm start`` row). The arms:

* **no KD**: next-token cross-entropy on the seed's ``--steps`` training batches.
* **off-policy KD**: the same batches through ``DistillReader`` wrapping the loader, each position's
  teacher top-k log-probabilities and tail mass, ``TokenKDLoss(alpha)`` forward KL (what
  ``train_student`` does). Its teacher-token budget is the number of positions with a next token.
* **on-policy**: the student continues prompts of ``--prompt-tokens`` from the training split by
  ``--new-tokens`` sampled tokens; the teacher scores them through ``DistillReader(None).score``
  (``examples.llm.onpolicy``); the loss is the reverse KL on the union of the student's top-k, the
  teacher's top-k and the sampled token. It samples until it has spent the off-policy arm's
  teacher-token budget (within one sequence), so it takes its own number of steps.
  ``--on-policy-fraction LAMBDA`` < 1 is GKD's mix: each step is on-policy with probability LAMBDA,
  otherwise on training text with the same scoring and divergence (``onpolicy.text_rollout``).

Held-out, per run: perplexity on ``--eval-sequences`` sequences of the held-out split, and the
teacher's per-token NLL of continuations the trained student samples from ``--eval-prompts``
held-out prompts (the same prompts and sampling seed for every arm). Results go to ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from distill.losses import TokenKDLoss
from examples.common import cache_dir, exit_on_sigterm, seed_everything, write_json
from examples.llm import mesh, models, onpolicy
from examples.llm.common import Splits, cosine_lr, evaluate, load_splits, quiet, use_all_cores
from examples.llm.student import NoTeacher, ReaderTeacher, TargetSource
from examples.llm.tokenizer import load_tokenizer
from examples.llm.train_student import fit, loss_ends, train_batches

ARMS = ("no KD", "off-policy KD", "on-policy")
RESULTS_DIR = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
RESULTS = RESULTS_DIR / "llm_onpolicy_warm.json"
"""The default ``--out`` of a warm-started comparison; ``SCRATCH_RESULTS`` that of ``--warm-start-steps 0``."""
SCRATCH_RESULTS = RESULTS_DIR / "llm_onpolicy.json"
WARM_START_STEPS = 600
"""At the default sizes (seed 0, batch 16), held-out perplexity 645 after 100 plain LM steps, 285
after 300, 138 after 600: after 600 the student's samples have the corpus's shape (indentation,
``if``/``return``, calls), after 100 they are token salad. Enough for its own samples to be worth grading."""
SMOKE_WARM_START_STEPS = 6
EVAL_SEED = 1234
"""The sampling seed of the held-out continuations: the same for every arm and run."""
START = "warm start"
"""The row of the warm-start checkpoint itself, evaluated before any arm trains from it."""
WARM_DATA_SEED = 1_000
"""Added to the seed for the warm start's batch order, so it draws other batches than the arms'."""
MIX_SEED = 2_000
"""Added to the seed for the on-policy arm's draws of which steps train on text, and of that text."""


@dataclass(frozen=True)
class Settings:
    """One comparison's sizes (``--smoke`` shrinks them)."""

    steps: int
    batch_size: int
    lr: float
    k: int
    alpha: float
    prompt_tokens: int
    new_tokens: int
    eval_sequences: int
    eval_prompts: int
    role: str
    warm_start_steps: int
    warm_start_lr: float
    on_policy_fraction: float


@dataclass(frozen=True)
class ArmResult:
    """One trained student: held-out perplexity and accuracy, the NLLs of its own held-out samples
    under the teacher and itself, its teacher-token budget, and its training."""

    arm: str
    seed: int
    perplexity: float
    accuracy: float
    teacher_nll: float
    student_nll: float
    reverse_kl: float
    sample_tokens: int
    teacher_tokens: int
    steps: int
    first_loss: float
    last_loss: float
    seconds: float
    start_digest: str
    text_steps: int = 0
    """Steps on training text instead of the student's samples (the on-policy arm with lambda < 1)."""


def offpolicy_tokens(splits: Splits, pad_id: int, s: Settings, seed: int) -> int:
    """The off-policy arm's teacher-scored tokens: positions with a next token in the seed's batches."""
    plan = train_batches(splits, pad_id, batch_size=s.batch_size, seed=seed, steps=s.steps).plan()
    return sum(len(splits.train[i]) - 1 for rows in plan for i in rows)


def weights_digest(model: torch.nn.Module) -> str:
    """A short SHA-256 of every parameter and buffer, in order: equal digests, equal weights."""
    h = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        h.update(name.encode())
        h.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def start_student(splits: Splits, pad_id: int, vocab_size: int, s: Settings, *, seed: int,
                  checkpoint: Path | None) -> torch.nn.Module:
    """The student every arm of ``seed`` trains from: the seed's initialisation, with the warm-start
    ``checkpoint``'s weights loaded into it when there is one."""
    seed_everything(seed)
    student = models.build(s.role, vocab_size, max_len=splits.seq_len, pad_token_id=pad_id)
    if checkpoint is not None:
        student.load_state_dict(torch.load(checkpoint, map_location="cpu", weights_only=True))
    return student


def warm_start(splits: Splits, pad_id: int, vocab_size: int, s: Settings, *, seed: int,
               directory: Path) -> tuple[Path, torch.nn.Module, list[float], float]:
    """Train the seed's initialisation ``warm_start_steps`` steps on next-token cross-entropy (batches
    in the order of ``seed + WARM_DATA_SEED``) and save it into ``directory``. Returns (the
    checkpoint, the warm student, its loss per step, training seconds)."""
    student, losses, seconds = fit(splits, pad_id, vocab_size, NoTeacher(), seed=seed, steps=s.warm_start_steps,
                                   batch_size=s.batch_size, lr=s.warm_start_lr, loss_fn=TokenKDLoss(alpha=1.0),
                                   role=s.role, data_seed=seed + WARM_DATA_SEED)
    path = directory / f"warm-start-seed{seed}.pt"
    torch.save(student.state_dict(), path)
    return path, student, losses, seconds


def train_on_policy(student: torch.nn.Module, splits: Splits, reader: onpolicy.Scorer, s: Settings, *, seed: int,
                    budget: int) -> tuple[torch.nn.Module, list[float], int, float, int]:
    """The on-policy arm: sample, score through ``reader``, step, until ``budget`` teacher-scored
    tokens are spent; ``student`` (trained in place) is the seed's starting point. With
    ``on_policy_fraction`` < 1 (GKD's ``lambda``) each step is on-policy with that probability and
    otherwise on training text (``onpolicy.text_rollout``), scored and trained on the same way. Returns
    (student, loss per step, tokens scored, training seconds, steps on training text)."""
    sequences = -(-budget // s.new_tokens)
    steps = -(-sequences // s.batch_size)
    opt = torch.optim.AdamW(student.parameters(), lr=s.lr, weight_decay=0.01, betas=(0.9, 0.95))
    sched = cosine_lr(opt, steps, warmup=max(1, steps // 20))
    loss_fn = TokenKDLoss("reverse_kl")
    gen = torch.Generator().manual_seed(seed)
    eligible = torch.tensor([i for i, seq in enumerate(splits.train) if len(seq) >= s.prompt_tokens])
    order = eligible[torch.randperm(len(eligible), generator=gen)].tolist()
    mix = torch.Generator().manual_seed(seed + MIX_SEED)  # its own stream: lambda = 1 draws nothing from it
    length = s.prompt_tokens + s.new_tokens
    texts = [i for i, seq in enumerate(splits.train) if len(seq) >= length] if s.on_policy_fraction < 1 else []
    if s.on_policy_fraction < 1 and not texts:
        raise ValueError(f"no training sequence has --prompt-tokens + --new-tokens = {length} tokens for the "
                         "steps on training text; lower them or use --on-policy-fraction 1")
    text_order = [texts[i] for i in torch.randperm(len(texts), generator=mix).tolist()]
    text_at = text_steps = 0
    losses: list[float] = []
    tokens = 0
    started = time.perf_counter()
    student.train()
    for step in range(steps):
        first = step * s.batch_size
        rows = [order[(first + r) % len(order)] for r in range(min(s.batch_size, sequences - first))]
        if s.on_policy_fraction >= 1 or float(torch.rand((), generator=mix)) < s.on_policy_fraction:
            rollout = onpolicy.sample(student, onpolicy.prompts_from(splits.train, rows, s.prompt_tokens),
                                      s.new_tokens, k=s.k, generator=gen)
        else:
            chosen = [text_order[(text_at + r) % len(text_order)] for r in range(len(rows))]
            text_at += len(rows)
            text_steps += 1
            rollout = onpolicy.text_rollout(student, onpolicy.prompts_from(splits.train, chosen, length),
                                            s.prompt_tokens, k=s.k)
        outputs = reader.score(rollout.batch())  # staleness 0: scored before the step that trains on it
        logits = student(input_ids=rollout.input_ids).logits
        loss = onpolicy.on_policy_loss(loss_fn, logits, rollout, outputs)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))
        tokens += rollout.tokens
    return student, losses, tokens, time.perf_counter() - started, text_steps


def held_out_prompts(splits: Splits, s: Settings) -> torch.Tensor:
    """The first ``prompt_tokens`` of ``eval_prompts`` held-out sequences spread over the split."""
    long_enough = [seq for seq in splits.held_out if len(seq) >= s.prompt_tokens]
    step = max(1, len(long_enough) // s.eval_prompts)
    chosen = long_enough[::step][: s.eval_prompts]
    return torch.tensor([seq[: s.prompt_tokens] for seq in chosen], dtype=torch.long)


def judge(arm: str, student: torch.nn.Module, splits: Splits, pad_id: int, s: Settings, *, seed: int,
          evaluator: onpolicy.Scorer, prompts: torch.Tensor, losses: Sequence[float], tokens: int, seconds: float,
          start_digest: str) -> ArmResult:
    """One trained student's held-out perplexity and teacher NLL of its own held-out samples."""
    m = evaluate(student, splits.eval_subset(s.eval_sequences), pad_id)
    nll = onpolicy.teacher_nll(student, evaluator, prompts, s.new_tokens, seed=EVAL_SEED, batch_size=s.batch_size)
    first, last = loss_ends(losses)
    return ArmResult(arm, seed, m.perplexity, m.accuracy, nll.teacher_nll, nll.student_nll, nll.reverse_kl,
                     nll.tokens, tokens, len(losses), first, last, round(seconds, 1), start_digest)


def run_seed(splits: Splits, pad_id: int, vocab_size: int, s: Settings, *, seed: int, kd_source: TargetSource,
             scorer: onpolicy.Scorer, evaluator: onpolicy.Scorer, prompts: torch.Tensor,
             scratch: Path) -> list[ArmResult]:
    """The warm start of one seed (when ``warm_start_steps`` > 0; its checkpoint in ``scratch``), then
    the three arms from it, each evaluated on held-out text and on its own held-out samples."""
    budget = offpolicy_tokens(splits, pad_id, s, seed)
    out: list[ArmResult] = []
    checkpoint: Path | None = None
    if s.warm_start_steps > 0:
        checkpoint, warm, losses, seconds = warm_start(splits, pad_id, vocab_size, s, seed=seed, directory=scratch)
        r = judge(START, warm, splits, pad_id, s, seed=seed, evaluator=evaluator, prompts=prompts, losses=losses,
                  tokens=0, seconds=seconds, start_digest=weights_digest(warm))
        out.append(r)
        print(f"  seed {seed} {START:>13}: held-out perplexity {r.perplexity:8.2f}, teacher NLL of own samples "
              f"{r.teacher_nll:.3f} (own {r.student_nll:.3f}); {r.steps} plain LM steps, loss {r.first_loss:.3f} -> "
              f"{r.last_loss:.3f}, {r.seconds:.1f} s", flush=True)
    for arm in ARMS:
        student = start_student(splits, pad_id, vocab_size, s, seed=seed, checkpoint=checkpoint)
        digest = weights_digest(student)
        if arm == "on-policy":
            student, losses, tokens, seconds, text_steps = train_on_policy(student, splits, scorer, s, seed=seed,
                                                                           budget=budget)
        else:
            text_steps = 0
            source = NoTeacher() if arm == "no KD" else kd_source
            student, losses, seconds = fit(splits, pad_id, vocab_size, source, seed=seed, steps=s.steps,
                                           batch_size=s.batch_size, lr=s.lr,
                                           loss_fn=TokenKDLoss(alpha=s.alpha), role=s.role, student=student)
            tokens = 0 if arm == "no KD" else budget
        r = judge(arm, student, splits, pad_id, s, seed=seed, evaluator=evaluator, prompts=prompts, losses=losses,
                  tokens=tokens, seconds=seconds, start_digest=digest)
        r = dataclasses.replace(r, text_steps=text_steps)
        first, last = r.first_loss, r.last_loss
        out.append(r)
        print(f"  seed {seed} {arm:>13}: held-out perplexity {r.perplexity:8.2f}, teacher NLL of own samples "
              f"{r.teacher_nll:.3f} (own {r.student_nll:.3f}); {r.steps} steps, {r.teacher_tokens:,} teacher tokens, "
              f"loss {first:.3f} -> {last:.3f}, {r.seconds:.1f} s", flush=True)
    return out


def summarize(runs: Sequence[ArmResult]) -> dict[str, dict[str, float]]:
    """Mean and sample standard deviation over seeds of each arm's metrics (and the warm start's)."""
    summary: dict[str, dict[str, float]] = {}
    for arm in (START, *ARMS):
        rows = [r for r in runs if r.arm == arm]
        if not rows:
            continue
        entry: dict[str, float] = {"seeds": len(rows)}
        for field in ("perplexity", "accuracy", "teacher_nll", "student_nll", "reverse_kl", "teacher_tokens",
                      "steps", "seconds"):
            values = [float(getattr(r, field)) for r in rows]
            entry[field] = statistics.fmean(values)
            entry[f"{field}_sd"] = statistics.stdev(values) if len(values) > 1 else 0.0
        summary[arm] = entry
    return summary


def ensure_teacher(path: Path, *, smoke: bool, threads: int) -> None:
    """Train the teacher into ``path`` when it is not there (the train_teacher defaults)."""
    if (path / "config.json").is_file():
        return
    from examples.llm import train_teacher

    print(f"no teacher at {path}: training it first (python -m examples.llm.train_teacher)", flush=True)
    argv = ["--smoke"] if smoke else ["--threads", str(threads)]
    if train_teacher.main([*argv, "--out", str(path)]) != 0:
        raise RuntimeError("training the teacher failed")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m examples.llm.compare", description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="one run of each arm per seed")
    p.add_argument("--steps", type=int, default=100,
                   help="optimizer steps of the no-KD and off-policy arms (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per step (default: %(default)s)")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate of every arm (default: %(default)s)")
    p.add_argument("--k", type=int, default=16, help="teacher top-k, and the student's top-k scored on-policy "
                   "(default: %(default)s)")
    p.add_argument("--alpha", type=float, default=0.5, help="hard-label weight of off-policy KD (default: %(default)s)")
    p.add_argument("--prompt-tokens", type=int, default=16, help="prompt length on-policy (default: %(default)s)")
    p.add_argument("--new-tokens", type=int, default=48, help="sampled tokens per prompt (default: %(default)s)")
    p.add_argument("--eval-sequences", type=int, default=128, help="held-out sequences for perplexity "
                   "(default: %(default)s)")
    p.add_argument("--eval-prompts", type=int, default=64, help="held-out prompts the trained students continue "
                   "(default: %(default)s)")
    p.add_argument("--warm-start-steps", type=int, default=None, metavar="N",
                   help="plain LM steps every arm of a seed starts from, once per seed, not in any arm's budget; 0: "
                   f"every arm from random weights (default: {WARM_START_STEPS}; {SMOKE_WARM_START_STEPS} with "
                   "--smoke)")
    p.add_argument("--warm-start-lr", type=float, default=None, help="peak learning rate of the warm start "
                   "(default: --lr)")
    p.add_argument("--on-policy-fraction", type=float, default=1.0, metavar="LAMBDA",
                   help="GKD's lambda: the share of the on-policy arm's steps on the student's samples, the rest on "
                   "training text with the same divergence (default: %(default)s, every step on-policy)")
    p.add_argument("--threads", type=int, default=0, help="torch threads, here and in the teacher server "
                   "(default: one per core)")
    p.add_argument("--teacher", type=Path, default=None, help="teacher directory (default: the cache's llm/teacher;"
                   " trained there when missing)")
    p.add_argument("--out", type=Path, default=None, help="results JSON (default: benchmarks/results/"
                   f"{RESULTS.name}, {SCRATCH_RESULTS.name} with --warm-start-steps 0; <cache>/llm/compare-smoke.json "
                   "with --smoke)")
    p.add_argument("--smoke", action="store_true", help="tiny models, few files, 12 steps, the first seed: for tests")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    quiet()
    threads = use_all_cores(args.threads or (1 if args.smoke else 0))
    teacher_path = args.teacher or models.teacher_dir(smoke=args.smoke)
    ensure_teacher(teacher_path, smoke=args.smoke, threads=threads)
    tok = load_tokenizer(teacher_path)
    seq_len = int(models.load_teacher(teacher_path).config.max_position_embeddings)
    splits = load_splits(tok, seq_len, smoke=args.smoke)
    pad_id = int(tok.pad_token_id)
    seeds = args.seeds[:1] if args.smoke else args.seeds
    warm_steps = args.warm_start_steps
    if warm_steps is None:
        warm_steps = SMOKE_WARM_START_STEPS if args.smoke else WARM_START_STEPS
    warm_lr = args.lr if args.warm_start_lr is None else args.warm_start_lr
    if not 0.0 <= args.on_policy_fraction <= 1.0:
        raise SystemExit(f"--on-policy-fraction must be in [0, 1], got {args.on_policy_fraction}")
    if warm_steps < 0:
        raise SystemExit(f"--warm-start-steps must be >= 0, got {warm_steps}")
    if args.smoke:
        s = Settings(steps=12, batch_size=8, lr=args.lr, k=8, alpha=args.alpha, prompt_tokens=8, new_tokens=24,
                     eval_sequences=16, eval_prompts=8, role="student-smoke", warm_start_steps=warm_steps,
                     warm_start_lr=warm_lr, on_policy_fraction=args.on_policy_fraction)
    else:
        s = Settings(steps=args.steps, batch_size=args.batch_size, lr=args.lr, k=args.k, alpha=args.alpha,
                     prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens, eval_sequences=args.eval_sequences,
                     eval_prompts=args.eval_prompts, role="student", warm_start_steps=warm_steps,
                     warm_start_lr=warm_lr, on_policy_fraction=args.on_policy_fraction)
    if s.prompt_tokens + s.new_tokens > seq_len:
        raise SystemExit(f"--prompt-tokens + --new-tokens must fit the teacher's {seq_len} positions")
    prompts = held_out_prompts(splits, s)
    print(f"{len(seeds)} seed(s) x {', '.join(ARMS)}: {s.steps} steps x {s.batch_size} sequences off-policy; on-policy "
          f"prompts of {s.prompt_tokens} + {s.new_tokens} sampled tokens; top-{s.k}; {len(prompts)} held-out prompts; "
          f"on-policy fraction {s.on_policy_fraction:g}; warm start: {s.warm_start_steps} plain LM steps; "
          f"{threads} torch threads", flush=True)
    runs: list[ArmResult] = []
    started = time.perf_counter()
    with contextlib.ExitStack() as stack:
        from distill import DistillReader

        teachers = stack.enter_context(mesh.serve_teacher(teacher_path, k=s.k, temperature=1.0,
                                                          max_batch_size=s.batch_size, threads=threads))
        print(f"teacher server: {teachers} serving hf:{teacher_path}", flush=True)
        kd_source = ReaderTeacher("mesh", mesh.reader_options(k=s.k, temperature=1.0, teachers=teachers))
        scorer = stack.enter_context(DistillReader(None, **onpolicy.reader_options(teachers=teachers, k=s.k)))
        evaluator = stack.enter_context(DistillReader(None, **onpolicy.reader_options(teachers=teachers, k=s.k,
                                                                                      scoring=False)))
        scratch = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="compare-warm-start-")))
        for seed in seeds:
            runs.extend(run_seed(splits, pad_id, len(tok), s, seed=seed, kd_source=kd_source, scorer=scorer,
                                 evaluator=evaluator, prompts=prompts, scratch=scratch))
    summary = summarize(runs)
    for arm, m in summary.items():
        print(f"{arm:>13}: perplexity {m['perplexity']:.2f} ± {m['perplexity_sd']:.2f}, teacher NLL of own samples "
              f"{m['teacher_nll']:.3f} ± {m['teacher_nll_sd']:.3f} over {int(m['seeds'])} seed(s)")
    out = args.out or (cache_dir() / "llm" / "compare-smoke.json" if args.smoke
                       else RESULTS if s.warm_start_steps else SCRATCH_RESULTS)
    write_json(out, {"runs": [asdict(r) for r in runs], "mean": summary, "settings": asdict(s), "seeds": seeds,
                     "seq_len": seq_len, "torch_threads": threads, "teacher": str(teacher_path),
                     "teacher_version": mesh.teacher_version(teacher_path), "eval_seed": EVAL_SEED,
                     "wall_seconds": round(time.perf_counter() - started, 1)})
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    exit_on_sigterm()  # the teacher servers and etcd it starts stop with it
    sys.exit(main())
