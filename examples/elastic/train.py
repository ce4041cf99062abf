"""The CV student trained data-parallel with ``torchrun`` (DDP, gloo, CPU), distilling from the teacher pool.

    torchrun --standalone --nproc_per_node=2 -m examples.elastic.train --distill_teachers 127.0.0.1:9898
    torchrun --standalone --nproc_per_node=2 -m examples.elastic.train \\
        --distill_registry etcd://127.0.0.1:2379 --distill_service cv-teacher
    torchrun --standalone --nproc_per_node=2 -m examples.elastic.train --no_kd       # the baseline

Every rank owns its own ``DistillReader`` over its own slice of each epoch: teacher traffic scales
with the ranks and no rank waits for another's teacher answers; DDP only averages gradients. In
the registry each rank shows up as its own student (the reader's default id ends in ``-rank<N>``),
so the autoscaler sees the job's whole demand. Elastic: with ``--checkpoint`` rank 0 saves after
every epoch and a restarted worker group (``torchrun --max-restarts N``) resumes from there, with
whatever world size it restarts with. Run without ``torchrun`` it trains as a single process.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import distill
from examples.common import (
    Source,
    StallTimer,
    StudentResult,
    accuracy,
    no_teacher,
    parse_seeds,
    print_result,
    seed_everything,
    summarize,
    teachers_in_use,
)
from examples.cv import data
from examples.cv.models import StudentMLP
from examples.cv.train_student import StudentConfig, reader_source


@contextlib.contextmanager
def process_group() -> Iterator[tuple[int, int]]:
    """``(rank, world size)``; joins the gloo group when launched by torchrun (``WORLD_SIZE`` set)."""
    if "WORLD_SIZE" not in os.environ:
        yield 0, 1
        return
    # torchrun keeps one store for the whole job, across restarts of the worker group. Gloo's
    # connection keys from a failed attempt are still in it, and a plain init_process_group after a
    # restart dials the dead workers' ports and hangs or fails (seen with torch 2.13). A prefix per
    # attempt gives every worker group its own keys.
    store, rank, world = next(dist.rendezvous("env://"))
    store = dist.PrefixStore(f"/attempt-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    try:
        yield dist.get_rank(), dist.get_world_size()
        dist.barrier()  # no rank tears the group down while a peer is still in a collective with it
        # gloo's barrier can return on one rank while its last message to a peer is still being
        # delivered, and tearing the group down then aborts that peer (gloo issue #155). The store,
        # kept by the torchrun agent, is the last barrier: each rank checks in once out of gloo's.
        store.set(f"finished/{rank}", "1")
        store.wait([f"finished/{r}" for r in range(world)], timedelta(seconds=120))
    finally:
        dist.destroy_process_group()


def _load_checkpoint(path: Path | None) -> dict[str, Any] | None:
    if path is None or not path.is_file():
        return None
    state: dict[str, Any] = torch.load(path, map_location="cpu", weights_only=True)
    return state


def _save_checkpoint(path: Path, state: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp")
    torch.save(state, tmp)
    tmp.replace(path)  # a worker restarted mid-save still finds the previous complete checkpoint


def train_rank(cfg: StudentConfig, source: Source | None, *, rank: int, world: int,
               checkpoint: Path | None = None, resume: dict[str, Any] | None = None,
               done: Sequence[dict[str, Any]] = (), crash_after_epoch: int | None = None) -> StudentResult:
    """Train one seed on this rank's slices; returns this rank's figures (accuracy of the shared model).

    The per-rank batch is ``cfg.batch_size // world`` so the global batch, hence the optimisation,
    matches the single-process run.
    """
    seed_everything(cfg.seed)  # same seed on every rank: identical initial weights, DDP checks it anyway
    digits = data.load()
    x, y = data.subset(digits.train_x, digits.train_y, cfg.train_size, seed=cfg.seed)
    loader = data.Batches(x, y, batch_size=max(1, cfg.batch_size // world), seed=cfg.seed, augment=cfg.augment,
                          max_batches=cfg.max_batches, rank=rank, world=world)
    student = StudentMLP(hidden=cfg.hidden)
    model: nn.Module = DistributedDataParallel(student) if world > 1 else student
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    first_epoch = 0
    if resume is not None:
        student.load_state_dict(resume["model"])
        opt.load_state_dict(resume["optimizer"])
        first_epoch = int(resume["epoch"]) + 1
        loader.epoch = first_epoch  # the same augmented batches the interrupted run would have seen
    kd = distill.KDLoss(temperature=cfg.temperature, alpha=cfg.alpha) if source is not None else None
    ce = nn.CrossEntropyLoss()
    timer, samples = StallTimer(), 0
    started = time.perf_counter()
    with (source or no_teacher)(loader) as batches:
        if rank == 0 or world == 1:
            student_id = getattr(batches, "student_id", None)
            if student_id:
                print(f"rank {rank}: distilling as student {student_id}", flush=True)
        for epoch in range(first_epoch, cfg.epochs):
            model.train()
            for batch, teacher in timer.wrap(batches):
                logits = model(batch["INPUT"])
                if kd is None:
                    loss = ce(logits, batch["label"])
                else:
                    loss = kd(logits, teacher["LOGITS"] if teacher is not None else None, batch["label"])
                opt.zero_grad(set_to_none=True)
                loss.backward()  # DDP all-reduces the gradients here
                opt.step()
                samples += len(batch["label"])
            if checkpoint is not None and rank == 0:
                _save_checkpoint(checkpoint, {"seed": cfg.seed, "epoch": epoch, "model": student.state_dict(),
                                              "optimizer": opt.state_dict(), "done": list(done)})
            if world > 1:
                dist.barrier()  # the checkpoint of this epoch exists before any rank can fail
            if crash_after_epoch == epoch and rank == world - 1 and resume is None:
                print(f"rank {rank}: simulated crash after epoch {epoch}", file=sys.stderr, flush=True)
                os._exit(3)  # like a lost worker: no cleanup; torchrun restarts the group
        used = teachers_in_use(batches)
    seconds = time.perf_counter() - started
    return StudentResult(
        seed=cfg.seed, kd=kd is not None, test_accuracy=accuracy(student, digits.test_x, digits.test_y),
        seconds=seconds, samples=samples, samples_per_s=samples / max(seconds, 1e-9),
        stall_fraction=min(1.0, timer.waited / max(seconds, 1e-9)), teachers_in_use=used,
    )


def _job_totals(r: StudentResult, world: int) -> StudentResult:
    """Sum samples and samples/s over ranks, average the stall fraction (no-op for one process)."""
    if world == 1:
        return r
    t = torch.tensor([float(r.samples), r.samples_per_s, r.stall_fraction, float(r.teachers_in_use)],
                     dtype=torch.float64)
    dist.all_reduce(t)
    return StudentResult(seed=r.seed, kd=r.kd, test_accuracy=r.test_accuracy, seconds=r.seconds,
                         samples=int(t[0]), samples_per_s=float(t[1]), stall_fraction=float(t[2]) / world,
                         teachers_in_use=r.teachers_in_use)


def build_parser() -> argparse.ArgumentParser:
    d = StudentConfig()
    p = argparse.ArgumentParser(prog="torchrun --standalone --nproc_per_node=2 -m examples.elastic.train",
                                description=__doc__.split("\n")[0])
    p.add_argument("--no_kd", action="store_true", help="train on hard labels only (the baseline); no teachers")
    p.add_argument("--seeds", type=parse_seeds, default=[0, 1, 2], help="comma-separated seeds (default: 0,1,2)")
    p.add_argument("--epochs", type=int, default=d.epochs, help="(default: %(default)s)")
    p.add_argument("--train_size", type=int, default=d.train_size, help="labelled images (default: %(default)s)")
    p.add_argument("--batch_size", type=int, default=d.batch_size,
                   help="global batch, split over the ranks (default: %(default)s)")
    p.add_argument("--checkpoint", type=Path, default=None,
                   help="save after every epoch and resume from here after a restart (elastic)")
    p.add_argument("--crash_after_epoch", type=int, default=None, metavar="E",
                   help="demonstrate elastic recovery: the last rank dies after epoch E of the first seed it "
                   "trains (not again after resuming); needs --checkpoint and torchrun --max-restarts >= 1")
    p.add_argument("--json", type=Path, default=None, help="rank 0 writes the results here")
    p.add_argument("--smoke", action="store_true", help="a seconds-long run (1 seed, 2 epochs of 3 batches)")
    distill.add_distill_args(p)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    source: Source | None = None
    if not args.no_kd:
        try:
            source = reader_source(**distill.distill_options_from_args(args))
        except ValueError as e:
            parser.error(f"{e} (or pass --no_kd for the baseline)")
    if args.crash_after_epoch is not None and args.checkpoint is None:
        parser.error("--crash_after_epoch needs --checkpoint (or the restarted group starts over and crashes again)")
    torch.set_num_threads(1)  # several ranks share the machine's cores
    seeds = [args.seeds[0]] if args.smoke else args.seeds
    label = "KD" if source is not None else "no KD"
    with process_group() as (rank, world):
        state = _load_checkpoint(args.checkpoint)
        done: list[dict[str, Any]] = list(state["done"]) if state else []
        if state is not None and rank == 0:
            print(f"resuming from {args.checkpoint}: seed {state['seed']} after epoch {state['epoch']}, "
                  f"{world} rank(s)", flush=True)
        results = [StudentResult(**r) for r in done]
        cfg = StudentConfig()
        for seed in seeds:
            if any(r.seed == seed for r in results):
                continue
            cfg = StudentConfig(seed=seed, epochs=2 if args.smoke else args.epochs, train_size=args.train_size,
                                batch_size=args.batch_size, max_batches=3 if args.smoke else 0)
            resume = state if state is not None and state["seed"] == seed else None
            crash = args.crash_after_epoch if state is None and not results else None
            r = _job_totals(train_rank(cfg, source, rank=rank, world=world, checkpoint=args.checkpoint,
                                       resume=resume, done=[asdict(x) for x in results],
                                       crash_after_epoch=crash), world)
            results.append(r)
            if rank == 0:
                print_result(r, f"{label} ({world} ranks)")
        if rank == 0:
            summarize(results, f"{label} ({world} ranks)", args.json, world_size=world,
                      config={k: v for k, v in asdict(cfg).items() if k != "seed"})
            if args.checkpoint is not None:
                with contextlib.suppress(FileNotFoundError):
                    args.checkpoint.unlink()  # finished: the next run starts afresh
    return 0


if __name__ == "__main__":
    sys.exit(main())
