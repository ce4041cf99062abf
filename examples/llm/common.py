"""What the LLM example's scripts share: the tokenized splits, the held-out evaluation, CPU threads."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedTokenizerFast

from examples.llm.data import IGNORE_INDEX, Batches, Collator, Corpus, encode_files, load_corpus

SMOKE_FILES = 20
"""Files per split in smoke runs."""


def use_all_cores(threads: int = 0) -> int:
    """Give torch one intra-op thread per core this process may run on (its default can be fewer).

    ``threads`` > 0 sets that many instead: on a machine whose cores are busy with other work, fewer
    threads than cores is faster (threads that wait on each other while descheduled stall every op).
    """
    if threads > 0:
        torch.set_num_threads(threads)
        return threads
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        n = os.cpu_count() or 1
    torch.set_num_threads(n)
    return n


def quiet() -> None:
    """No ``transformers`` progress bars (saving and loading a small model draws one per call)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def cosine_lr(opt: torch.optim.Optimizer, steps: int, warmup: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up then cosine decay to 10 % of the peak (the usual small-LM schedule)."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, steps - warmup))
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(opt, factor)


@dataclass(frozen=True)
class Splits:
    """Tokenized training and held-out sequences (lists of ids, at most ``seq_len`` each)."""

    train: list[list[int]]
    held_out: list[list[int]]
    seq_len: int

    def eval_subset(self, n: int) -> list[list[int]]:
        """``n`` held-out sequences spread evenly over the split (all of it when ``n`` <= 0 or larger)."""
        if n <= 0 or n >= len(self.held_out):
            return self.held_out
        step = len(self.held_out) / n
        return [self.held_out[int(i * step)] for i in range(n)]


def load_splits(tokenizer: PreTrainedTokenizerFast, seq_len: int, *, corpus: Corpus | None = None,
                smoke: bool = False) -> Splits:
    """The corpus tokenized and cut into sequences (the Rust tokenizer takes seconds for the whole stdlib)."""
    c = corpus or load_corpus(max_files=SMOKE_FILES if smoke else 0)
    return Splits(encode_files(tokenizer, list(c.texts("train")), seq_len),
                  encode_files(tokenizer, list(c.texts("held_out")), seq_len), seq_len)


@dataclass(frozen=True)
class LMMetrics:
    """Held-out next-token metrics over the positions that have a next token (padding excluded)."""

    loss: float
    perplexity: float
    accuracy: float
    tokens: int


@torch.no_grad()
def evaluate(model: nn.Module, sequences: list[list[int]], pad_id: int, *, batch_size: int = 16) -> LMMetrics:
    """Mean next-token cross-entropy, its exp (perplexity) and top-1 accuracy of ``model`` on ``sequences``."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    total_loss, correct, count = 0.0, 0, 0
    for batch in Batches(sequences, Collator(pad_id), batch_size=batch_size, seed=0, shuffle=False):
        b = {k: v.to(device) for k, v in batch.items()}
        logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits[:, :-1].float()
        labels = b["labels"][:, 1:]
        valid = labels != IGNORE_INDEX
        total_loss += float(F.cross_entropy(logits[valid], labels[valid], reduction="sum"))
        correct += int((logits.argmax(-1)[valid] == labels[valid]).sum())
        count += int(valid.sum())
    model.train(was_training)
    if count == 0:
        raise ValueError("no held-out positions to evaluate on: the evaluation set is empty")
    mean = total_loss / count
    return LMMetrics(mean, math.exp(mean), correct / count, count)
