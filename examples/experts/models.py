"""The example's models: one tiny causal transformer, in sizes for the teachers and the student.

Written in plain torch (pre-norm blocks, learned positions, ``scaled_dot_product_attention`` with
the causal mask). It declares its tensors (``io_spec``) the way ``teacher-server`` serves a causal
LM: ``INPUT_IDS`` padded with 0, ``ATTENTION_MASK`` and per-position ``LOGITS [T, V]``, so the
server's top-k, log-probability and scoring transforms (``token_logprobs``, ``SCORE_IDS``) apply to
it. Padding is on the right and attention is causal, so padding never changes a real position's
logits; the mask is accepted and not needed.

Serve a trained one with ``teacher-server --model examples.experts.models:load --model-arg path=FILE``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from examples.experts.tasks import MAX_LEN, VOCAB_SIZE
from teacher_server.spec import ModelIO

# (width, layers, heads): the teachers are all one size; the student is narrower.
SIZES: dict[str, tuple[int, int, int]] = {"teacher": (64, 2, 4), "student": (32, 2, 4)}


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: Tensor) -> Tensor:
        b, t, w = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, w)
        x = x + self.proj(a)
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    """Token ids ``[B, T]`` (and an attention mask) to next-token logits ``[B, T, V]``."""

    io_spec = ModelIO.parse(["INPUT_IDS:INT64:-1:pad=0", "ATTENTION_MASK:INT64:-1:mask"],
                            [f"LOGITS:FP32:-1,{VOCAB_SIZE}:per_position"])

    def __init__(self, role: str) -> None:
        super().__init__()
        if role not in SIZES:
            raise ValueError(f"role must be one of {', '.join(SIZES)}, got {role!r}")
        self.role = role
        width, layers, heads = SIZES[role]
        self.embed, self.pos = nn.Embedding(VOCAB_SIZE, width), nn.Embedding(MAX_LEN, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(width), nn.Linear(width, VOCAB_SIZE)

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        x = self.embed(input_ids) + self.pos(torch.arange(input_ids.shape[1], device=input_ids.device))
        for block in self.blocks:
            x = block(x)
        out: Tensor = self.head(self.norm(x))
        return out


def parameter_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def save(model: TinyLM, path: Path) -> None:
    """The state dict, and the role beside it (``PATH.json``), so that ``load`` rebuilds the right size."""
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), path)
    path.with_suffix(".json").write_text(json.dumps({"role": model.role}))


def load(path: str) -> TinyLM:
    """A trained model in eval mode: the ``module:factory`` that ``teacher-server`` serves."""
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"no trained model at {file}: run `python -m examples.experts` to train the teachers")
    model = TinyLM(json.loads(file.with_suffix(".json").read_text())["role"])
    model.load_state_dict(torch.load(file, weights_only=True))
    return model.eval()


@torch.no_grad()
def greedy(model: nn.Module, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    """Each prompt continued greedily by up to ``max_new`` tokens (one batch per prompt length)."""
    was_training = model.training
    model.eval()
    out: list[list[int]] = [[] for _ in prompts]
    by_len: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        by_len.setdefault(len(p), []).append(i)
    for length, rows in by_len.items():
        ids = torch.tensor([prompts[i] for i in rows])
        for _ in range(min(max_new, MAX_LEN - length)):
            nxt = model(ids)[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt], dim=1)
        for j, i in enumerate(rows):
            out[i] = ids[j, length:].tolist()
    model.train(was_training)
    return out
