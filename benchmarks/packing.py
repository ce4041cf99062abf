"""Sequence packing for `hf:` causal LMs, measured before it is built into the server (issue 26).

    .venv/bin/python -m benchmarks.packing [--quick] [--sequences 256] [--budget 4096] [--row 256]
                                           [--hidden 256 --layers 4 --vocab 4096] [--out NAME]
                                           [--device cuda --compute-dtype BF16]

Packing puts several sequences in one row of the batch, positions restarting at 0 for each, with
attention confined to each sequence: with `position_ids` and no attention mask, the installed
transformers (>= 4.55's masking_utils: `find_packed_sequence_indices`) builds the block-diagonal
causal mask itself and hands SDPA that 4D mask (only without a KV cache: `use_cache=False`, which
the server passes anyway). A batch then computes (almost) no padding, but its
attention is over the whole row (masked) and SDPA gets an explicit mask instead of `is_causal`.

The same sequences (a random Llama of the given shape, lengths drawn uniformly from [--min-len,
--row]) are run three ways at the same token budget (samples x padded length <= --budget per
forward pass), each pass being what the server computes per batch (logits of every position):
  * padded, length-sorted: the sequences sorted by length, batches filling the budget (the best
    padding can do: what the server's closest-lengths rule approaches under a deep queue);
  * padded, length buckets: in drawn order, power-of-two length buckets, oldest first, filling the
    budget (the server's batches with a shallow queue);
  * padded, the server's rules: `teacher_server.batch_rules` applied to the whole set queued at
    once (bucket, 0.85 padding-efficiency floor, closest lengths): the batches the server forms;
  * packed: rows of --row positions filled first-fit by decreasing length, budget / --row rows a
    pass.
Before timing, every sequence's logits from the packed pass are checked against the sequence run
alone (max |diff|, fp32). Reported: useful tokens per second (median of --reps interleaved
repetitions), padding efficiency (useful / computed positions) and packed / padded throughput
(the median over repetitions of each repetition's ratio, and the fastest pass's against the fastest
pass's: on a shared machine other jobs only ever slow a pass down).

On CUDA (`--device`) the model runs in --compute-dtype, every batch's inputs are on the device
before timing, and a pass is timed from a synchronized start to a synchronized end; the JSON names
the GPU.

Outcome (README, W6): packing is exact but no faster than the server's own padded batches on CPU,
so the server does not pack.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from benchmarks.common import format_table, machine_info, median, paired_ratios, run_and_report, sorted_groups
from benchmarks.device import DeviceChoice, add_device_args
from teacher_server.batch_rules import BatchingConfig, BatchRules, compatible
from teacher_server.work import Work

Batch = tuple[dict[str, Any], list[tuple[int, int, int]]]
"""A forward pass's keyword inputs and, per sequence: (its index, row, first position)."""


@dataclass(frozen=True)
class Settings:
    sequences: int = 256
    min_len: int = 8
    row: int = 256  # packed row length, and the longest sequence
    budget: int = 4096  # positions per forward pass (samples x padded length)
    hidden: int = 256
    layers: int = 4
    heads: int = 8
    vocab: int = 4096
    reps: int = 5
    seed: int = 0
    threads: int = 0  # torch intra-op threads (0: torch's default)
    quick: bool = False
    out: str = ""  # results file benchmarks/results/<out>.json (default packing, packing_quick)
    device: str = "cpu"
    compute_dtype: str = "FP32"

    @property
    def choice(self) -> DeviceChoice:
        return DeviceChoice(self.device, self.compute_dtype)


def make_model(s: Settings) -> tuple[torch.nn.Module, str]:
    """A random Llama of the settings' shape, and the attention implementation it runs (sdpa)."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=s.vocab, hidden_size=s.hidden, intermediate_size=s.hidden * 4, num_hidden_layers=s.layers,
        num_attention_heads=s.heads, num_key_value_heads=max(1, s.heads // 4), max_position_embeddings=s.row,
        pad_token_id=0)
    torch.manual_seed(s.seed)
    model = transformers.LlamaForCausalLM(config).eval().to(s.choice.torch_device, s.choice.dtype)
    return model, str(model.config._attn_implementation)


def on_device(batches: list[Batch], device: torch.device) -> list[Batch]:
    return [({k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}, where)
            for inputs, where in batches]



def draw(s: Settings) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(s.seed)
    lengths = torch.randint(s.min_len, s.row + 1, (s.sequences,), generator=g).tolist()
    return [torch.randint(1, s.vocab, (n,), generator=g) for n in lengths]


def padded(seqs: Sequence[torch.Tensor], order: Sequence[int]) -> Batch:
    """One right-padded batch of the sequences `order` indexes, with their attention mask."""
    width = max(len(seqs[i]) for i in order)
    ids = torch.zeros((len(order), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, i in enumerate(order):
        ids[r, : len(seqs[i])] = seqs[i]
        mask[r, : len(seqs[i])] = 1
    return {"input_ids": ids, "attention_mask": mask, "use_cache": False}, [(i, r, 0) for r, i in enumerate(order)]


def sorted_batches(seqs: Sequence[torch.Tensor], budget: int) -> list[Batch]:
    """Length-sorted batches, each as many sequences as fit samples x longest <= budget."""
    return [padded(seqs, group) for group in sorted_groups(range(len(seqs)), budget, lambda i: len(seqs[i]))]


def bucket_batches(seqs: Sequence[torch.Tensor], budget: int) -> list[Batch]:
    """In drawn order: each batch starts with the oldest sequence left and takes the next ones of
    its power-of-two length bucket while samples x longest <= budget (the server's shallow-queue rule)."""
    left = list(range(len(seqs)))
    batches = []
    while left:
        first = left[0]
        bucket = (len(seqs[first]) - 1).bit_length()
        cur, longest = [first], len(seqs[first])
        for i in left[1:]:
            n = len(seqs[i])
            if (n - 1).bit_length() == bucket and (len(cur) + 1) * max(longest, n) <= budget:
                cur.append(i)
                longest = max(longest, n)
        taken = set(cur)
        left = [i for i in left if i not in taken]
        batches.append(padded(seqs, cur))
    return batches


@dataclass(eq=False)
class _Queued:
    work: Work
    index: int


def server_batches(seqs: Sequence[torch.Tensor], budget: int) -> list[Batch]:
    """The server's own choice (teacher_server.batch_rules, as `DynamicBatcher._take_compatible`
    applies it) with every sequence queued at once, one request each: the oldest left starts a
    batch, which takes the oldest of its length bucket while they fit and keep its padding
    efficiency >= 0.85, or, when more are queued than one batch holds, the run of closest lengths."""
    config = BatchingConfig(max_batch_tokens=budget)
    rules, floor = BatchRules(config), config.min_padding_efficiency
    queue = [_Queued(Work([q[None]], 1, [], (), len(q)), i) for i, q in enumerate(seqs)]
    batches = []
    while queue:
        batch, pool = queue[:1], queue[1:]
        first = batch[0].work
        taken, _ = rules.oldest_first(batch, [p for p in pool if compatible(first, p.work)], floor)
        if len(pool) > len(taken) and rules.oldest_first(batch, pool)[1]:
            taken = rules.closest_lengths(batch, pool, floor) or taken
        batch += taken
        chosen = set(map(id, batch))
        queue = [p for p in queue if id(p) not in chosen]
        batches.append(padded(seqs, [p.index for p in batch]))
    return batches


def packed_batches(seqs: Sequence[torch.Tensor], budget: int, row: int) -> list[Batch]:
    """Rows of `row` positions filled first-fit by decreasing length; budget // row rows a pass.
    Each sequence's positions restart at 0; a row's unused tail is a segment of its own (positions
    from 0 again), so no real token attends to it and it to no real token."""
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(seqs)), key=lambda i: -len(seqs[i])):
        n = len(seqs[i])
        r = next((k for k, free in enumerate(room) if free >= n), None)
        if r is None:
            rows.append([])
            room.append(row)
            r = len(rows) - 1
        rows[r].append(i)
        room[r] -= n
    per_pass = max(1, budget // row)
    batches = []
    for a in range(0, len(rows), per_pass):
        group = rows[a : a + per_pass]
        ids = torch.zeros((len(group), row), dtype=torch.long)
        pos = torch.zeros_like(ids)
        where = []
        for r, members in enumerate(group):
            at = 0
            for i in members:
                n = len(seqs[i])
                ids[r, at : at + n] = seqs[i]
                pos[r, at : at + n] = torch.arange(n)
                where.append((i, r, at))
                at += n
            pos[r, at:] = torch.arange(row - at)
        # No attention mask and no KV cache: transformers then reads the packing from position_ids.
        batches.append(({"input_ids": ids, "position_ids": pos, "use_cache": False}, where))
    return batches


def computed(batches: Sequence[Batch]) -> int:
    return sum(b["input_ids"].numel() for b, _ in batches)


def max_diff(model: torch.nn.Module, seqs: Sequence[torch.Tensor], batches: Sequence[Batch]) -> float:
    """Largest |logit difference| of any sequence's positions between `batches` and the sequence alone."""
    worst = 0.0
    device = next(model.parameters()).device
    with torch.inference_mode():
        for inputs, where in batches:
            logits = model(**inputs).logits.float()
            for i, r, at in where:
                alone = model(input_ids=seqs[i][None].to(device), use_cache=False).logits[0].float()
                worst = max(worst, (logits[r, at : at + len(seqs[i])] - alone).abs().max().item())
    return worst


def timed(model: torch.nn.Module, batches: Sequence[Batch], choice: DeviceChoice) -> float:
    with torch.inference_mode():
        choice.synchronize()
        start = time.perf_counter()
        for inputs, _ in batches:
            model(**inputs)
        choice.synchronize()
        return time.perf_counter() - start


def run(s: Settings) -> dict[str, Any]:
    import transformers

    if s.threads:
        torch.set_num_threads(s.threads)
    s.choice.check()
    model, attention = make_model(s)
    seqs = draw(s)
    useful = sum(len(q) for q in seqs)
    variants: dict[str, list[Batch]] = {
        "padded_sorted": sorted_batches(seqs, s.budget),
        "padded_buckets": bucket_batches(seqs, s.budget),
        "padded_server": server_batches(seqs, s.budget),
        "packed": packed_batches(seqs, s.budget, s.row),
    }
    variants = {k: on_device(v, s.choice.torch_device) for k, v in variants.items()}
    check = variants["packed"] if not s.quick else variants["packed"][:1]
    diffs = {"packed": max_diff(model, seqs, check),
             "padded_sorted": max_diff(model, seqs, variants["padded_sorted"][:2])}
    for batches in variants.values():  # warm-up
        timed(model, batches[:2], s.choice)
    seconds: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(s.reps):
        for name, batches in variants.items():
            seconds[name].append(timed(model, batches, s.choice))
    results = {}
    for name, batches in variants.items():
        t = median(seconds[name])
        results[name] = {"tokens_per_s": round(useful / t, 1), "seconds": [round(x, 4) for x in seconds[name]],
                         "best_tokens_per_s": round(useful / min(seconds[name]), 1),
                         "passes": len(batches), "computed_tokens": computed(batches),
                         "padding_efficiency": round(useful / computed(batches), 4)}

    def over(name: str) -> float:  # median over repetitions of the paired ratio: steadier on a busy machine
        return round(median(paired_ratios(seconds[name], seconds["packed"])), 3)

    def best_over(name: str) -> float:  # fastest pass against fastest pass: what load cannot inflate
        return round(min(seconds[name]) / min(seconds["packed"]), 3)

    return {
        "benchmark": "packing", "settings": asdict(s),
        "machine": machine_info(torch.get_num_threads()) | s.choice.info(),
        "attention": attention, "torch": torch.__version__,
        "transformers": transformers.__version__, "useful_tokens": useful, "max_abs_diff": diffs, "variants": results,
        "packed_over_sorted": over("padded_sorted"),
        "packed_over_buckets": over("padded_buckets"),
        "packed_over_server": over("padded_server"),
        "best_packed_over_sorted": best_over("padded_sorted"),
        "best_packed_over_server": best_over("padded_server"),
    }


def report(doc: dict[str, Any]) -> str:
    rows = [[k, v["tokens_per_s"], v["padding_efficiency"], v["passes"]] for k, v in doc["variants"].items()]
    return "\n".join([
        format_table(["variant", "useful tok/s", "padding eff.", "passes"], rows),
        f"packed / padded length-sorted: {doc['packed_over_sorted']}; / padded buckets: "
        f"{doc['packed_over_buckets']}; / the server's batches: {doc['packed_over_server']}; "
        f"max |diff| packed vs alone: {doc['max_abs_diff']['packed']:.1e}",
        f"fastest passes: packed / padded length-sorted {doc['best_packed_over_sorted']}; / the server's batches "
        f"{doc['best_packed_over_server']}",
    ])


def parse_args(argv: Sequence[str] | None) -> Settings:
    p = argparse.ArgumentParser(prog="python -m benchmarks.packing", description=__doc__.split("\n\n")[0])
    d = Settings()
    p.add_argument("--quick", action="store_true", help="few sequences and repetitions: a smoke test")
    for name in ("sequences", "min_len", "row", "budget", "hidden", "layers", "heads", "vocab", "reps", "seed",
                 "threads"):
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=None, help=f"(default {getattr(d, name)})")
    p.add_argument("--out", default="", help="results file benchmarks/results/<OUT>.json (default packing)")
    add_device_args(p)
    a = p.parse_args(argv)
    values = {k: v for k, v in vars(a).items() if v is not None and k not in ("quick", "out")}
    if a.quick:
        values = {"sequences": 24, "reps": 1, "row": 64, "budget": 512, "hidden": 64, "layers": 2,
                  "vocab": 512, **values}
    s = Settings(quick=a.quick, out=a.out or ("packing_quick" if a.quick else "packing"), **values)
    if s.min_len < 1 or s.min_len > s.row or s.budget < s.row or s.sequences < 1 or s.reps < 1:
        p.error("need 1 <= --min-len <= --row <= --budget, --sequences >= 1, --reps >= 1")
    return s


def main(argv: Sequence[str] | None = None) -> int:
    s = parse_args(argv)
    run_once: Callable[[], dict[str, Any]] = lambda: run(s)  # noqa: E731
    return run_and_report(run_once, s.out, report)


if __name__ == "__main__":
    sys.exit(main())
