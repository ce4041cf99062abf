"""The cross-tokenizer example's training loop, its metric (bits per byte) and its teacher.

* ``fit``: AdamW with warm-up and cosine decay (``examples.llm.common.cosine_lr``), one step per
  ``(batch, teacher outputs)`` pair, the arm's loss a function of the student's logits, the batch
  and the outputs. Every arm and the teacher train with it.
* ``bits_per_byte``: the metric the arms are compared by. Perplexities of models with different
  tokenizers are not comparable (a token is a different amount of text on each side); the total
  negative log-likelihood of the same texts is. So: the sum over the held-out pieces of
  ``-log2 p(token | tokens before)`` over each piece's text tokens (each model with its own
  tokenizer, the BOS as the first context), divided by the pieces' UTF-8 bytes. Byte-level
  tokenizers cover every byte, so this is the bits the model needs to encode the text.
  ``uniform_bits_per_byte`` is the same for a model that spreads its mass evenly over its
  vocabulary: ``log2(V)`` bits per token; a trained model must do better.
* ``get_teacher``: the teacher LM (``examples.llm.models``, a ``LlamaForCausalLM``) trained on the
  training pieces with the teacher's tokenizer and saved with ``save_pretrained`` beside that
  tokenizer, so ``teacher-server --model hf:DIR`` serves it and scores text in its own tokens.
  Cached: a directory whose ``train_info.json`` records the same settings is used as it is.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import PreTrainedTokenizerFast

from examples.common import seed_everything, write_json
from examples.crosstok.corpus import TextCollator, batches, plan
from examples.llm import models
from examples.llm.common import cosine_lr
from examples.llm.data import IGNORE_INDEX

INFO = "train_info.json"
Batch = dict[str, Any]
LossFn = Callable[[Tensor, Batch, Any], Tensor]
"""An arm's loss: (the student's logits [B, T, V], the batch, the teacher's outputs or None) -> scalar."""


def next_token_ce(logits: Tensor, batch: Batch, outputs: Any = None) -> Tensor:
    """Mean next-token cross-entropy over the text tokens (the no-KD loss; ``outputs`` unused)."""
    labels = batch["labels"][:, 1:]
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX)


def fit(model: nn.Module, pairs: Iterable[tuple[Batch, Any]], loss_fn: LossFn, *, steps: int,
        lr: float) -> tuple[list[float], float]:
    """Train ``model`` in place on ``steps`` pairs; returns (the loss of each step, training seconds)."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.95))
    sched = cosine_lr(opt, steps, warmup=max(1, steps // 20))
    losses: list[float] = []
    model.train()
    started = time.perf_counter()
    for batch, outputs in pairs:
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        loss = loss_fn(logits, batch, outputs)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))
    if len(losses) != steps:
        raise RuntimeError(f"the batches ran out after {len(losses)} of {steps} steps")
    return losses, time.perf_counter() - started


@dataclass(frozen=True)
class BitsPerByte:
    """A model's held-out bits per byte, and what it is made of."""

    bits_per_byte: float
    uniform_bits_per_byte: float
    bits: float
    bytes: int
    tokens: int


@torch.no_grad()
def bits_per_byte(model: nn.Module, tokenizer: PreTrainedTokenizerFast, pieces: Sequence[str], *, max_len: int,
                  batch_size: int = 16) -> BitsPerByte:
    """Held-out bits per byte of ``model`` with its ``tokenizer`` on ``pieces`` (the module docstring's rule)."""
    was_training = model.training
    model.eval()
    collate = TextCollator(tokenizer, max_len)
    nats, tokens = 0.0, 0
    for start in range(0, len(pieces), batch_size):
        batch = collate(pieces[start : start + batch_size])
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        labels = batch["labels"][:, 1:]
        nats += float(F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels.flatten(),
                                      ignore_index=IGNORE_INDEX, reduction="sum"))
        tokens += int((labels != IGNORE_INDEX).sum())
    model.train(was_training)
    size = sum(len(p.encode("utf-8")) for p in pieces)
    if size == 0:
        raise ValueError("no held-out bytes to evaluate on: the pieces are empty")
    bits = nats / math.log(2)
    return BitsPerByte(bits / size, tokens * math.log2(len(tokenizer)) / size, bits, size, tokens)


def get_teacher(directory: Path, tokenizer: PreTrainedTokenizerFast, pieces: Sequence[str], held_out: Sequence[str],
                *, role: str, steps: int, batch_size: int, lr: float, max_len: int, seed: int = 0) -> dict[str, Any]:
    """The trained teacher in ``directory`` (trained and saved first unless the cached one has these
    settings); returns its ``train_info.json``, held-out bits per byte included."""
    settings = {"role": role, "steps": steps, "batch_size": batch_size, "lr": lr, "max_len": max_len, "seed": seed,
                "vocab_size": len(tokenizer), "pieces": len(pieces)}
    cached = _read_info(directory)
    if cached.get("settings") == settings:
        return cached
    seed_everything(seed)
    model = models.build(role, len(tokenizer), max_len=max_len, pad_token_id=int(tokenizer.pad_token_id),
                         eos_token_id=int(tokenizer.eos_token_id))
    order = plan(len(pieces), batch_size=batch_size, steps=steps, seed=seed)
    pairs = ((b, None) for b in batches(pieces, TextCollator(tokenizer, max_len), order))
    losses, seconds = fit(model, pairs, next_token_ce, steps=steps, lr=lr)
    metric = bits_per_byte(model, tokenizer, held_out, max_len=max_len)
    info = {"settings": settings, "parameters": models.parameter_count(model), "seconds": round(seconds, 1),
            "first_loss": losses[0], "last_loss": losses[-1], **asdict(metric)}
    tmp = directory.with_name(f"{directory.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(str(tmp))
    tokenizer.save_pretrained(str(tmp))
    write_json(tmp / INFO, info)
    shutil.rmtree(directory, ignore_errors=True)
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp.replace(directory)
    return info


def _read_info(directory: Path) -> dict[str, Any]:
    try:
        info: dict[str, Any] = json.loads((directory / INFO).read_text())
    except (OSError, ValueError):
        return {}
    return info if (directory / "config.json").is_file() else {}
