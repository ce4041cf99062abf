"""Small sequence models for padded-batching tests, importable by teacher servers as
tests.seq_models:<factory>.

Each records the token shape of every batch it runs (`BATCHES`), so tests can see how requests
were grouped, and waits on `GATE` before running, so a test can hold the one model instance busy
while it queues requests in a known order.
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F
from torch import nn

from teacher_server.spec import ModelIO

VOCAB, HIDDEN, KERNEL = 50, 16, 3

BATCHES: list[tuple[int, ...]] = []
GATE = threading.Event()
GATE.set()


def _gate_and_record(tokens: torch.Tensor) -> None:
    if not GATE.is_set():
        GATE.wait(60)
    BATCHES.append(tuple(tokens.shape))


class CausalConvLM(nn.Module):
    """Embedding, causal conv, per-position logits [B, T, V], and a mask-weighted mean [B, H].

    Position t only sees tokens <= t, so right padding leaves the real positions' logits alone;
    the pooled output is right only if the mask marks the padding.
    """

    io_spec = ModelIO.parse(
        ["TOKENS:INT64:-1:pad=0", "MASK:INT64:-1:mask"],
        [f"LOGITS:FP32:-1,{VOCAB}:per_position", f"POOLED:FP32:{HIDDEN}"],
    )

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.emb = nn.Parameter(torch.randn(VOCAB, HIDDEN, generator=g))
        self.conv = nn.Parameter(torch.randn(HIDDEN, HIDDEN, KERNEL, generator=g) / HIDDEN)
        self.head = nn.Parameter(torch.randn(HIDDEN, VOCAB, generator=g) / HIDDEN)

    def forward(self, tokens: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
        _gate_and_record(tokens)
        m = mask.to(torch.float32).unsqueeze(-1)
        e = self.emb[tokens] * m  # [B, T, H]
        h = torch.tanh(F.conv1d(F.pad(e.transpose(1, 2), (KERNEL - 1, 0)), self.conv)).transpose(1, 2)
        pooled = (h * m).sum(1) / m.sum(1).clamp(min=1.0)
        return {"LOGITS": h @ self.head, "POOLED": pooled}


class CausalConvLMUncut(CausalConvLM):
    """The same model with MASK declared as a plain padded input, not as the attention mask: the
    server cannot cut rows back to a mask it does not know, so padded positions are computed and
    answered, as by a teacher that does not re-batch rows (a Triton server, an older teacher)."""

    io_spec = ModelIO.parse(
        ["TOKENS:INT64:-1:pad=0", "MASK:INT64:-1:pad=0"],
        [f"LOGITS:FP32:-1,{VOCAB}:per_position", f"POOLED:FP32:{HIDDEN}"],
    )


class UnpaddedSeq(nn.Module):
    """One client-sized TOKENS input and no padding declared: requests of different lengths must
    never be concatenated (torch.cat would fail, as in issue #11)."""

    io_spec = ModelIO.parse(["TOKENS:INT64:-1"], [f"LOGITS:FP32:-1,{VOCAB}"])

    def __init__(self) -> None:
        super().__init__()
        self.lm = CausalConvLM()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        _gate_and_record(tokens)
        m = torch.ones_like(tokens).to(torch.float32).unsqueeze(-1)
        e = self.lm.emb[tokens] * m
        h = torch.tanh(F.conv1d(F.pad(e.transpose(1, 2), (KERNEL - 1, 0)), self.lm.conv)).transpose(1, 2)
        return h @ self.lm.head


def causal_conv_lm() -> CausalConvLM:
    return CausalConvLM()


def causal_conv_lm_uncut() -> CausalConvLMUncut:
    return CausalConvLMUncut()


def unpadded_seq() -> UnpaddedSeq:
    return UnpaddedSeq()
