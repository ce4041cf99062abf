"""Small real models for tests, importable by teacher-server subprocesses as tests.models:<factory>."""

from __future__ import annotations

import os
import time

import torch
from torch import nn

from teacher_server.spec import ModelIO


class Affine(nn.Module):
    """y = x @ W + b over a flat [D] input: cheap, deterministic, exact in fp32."""

    io_spec = ModelIO.parse(["X:FP32:8"], ["Y:FP32:4"])

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(1)
        self.w = nn.Parameter(torch.randn(8, 4, generator=g))
        self.b = nn.Parameter(torch.randn(4, generator=g))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.w + self.b


class Sleepy(Affine):
    """Affine plus a fixed sleep per batch (GIL released): an emulated accelerator.

    The sleep comes from TEST_SLEEP_MS (default 50) so a subprocess teacher can be made slow.
    """

    def __init__(self, sleep_ms: float | None = None) -> None:
        super().__init__()
        self.sleep_s = (float(os.environ.get("TEST_SLEEP_MS", "50")) if sleep_ms is None else sleep_ms) / 1000

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.sleep_s)
        return super().forward(x)


class TwoHeads(nn.Module):
    """Two inputs, dict outputs: checks names map by key and several tensors travel."""

    io_spec = ModelIO.parse(["A:FP32:4", "B:INT64:4"], ["SUM:FP32:4", "ARGMAX:INT64:"])

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> dict[str, torch.Tensor]:
        s = a + b.to(a.dtype)
        return {"ARGMAX": s.argmax(dim=1), "SUM": s}


def affine() -> Affine:
    return Affine()


def sleepy() -> Sleepy:
    return Sleepy()


def two_heads() -> TwoHeads:
    return TwoHeads()


def slow_load() -> Affine:
    """Takes a while to load, like a big checkpoint: health must say NOT_SERVING meanwhile."""
    time.sleep(float(os.environ.get("TEST_LOAD_S", "1.5")))
    return Affine()


def undeclared() -> nn.Module:
    """No io_spec: inputs come from flags, outputs are inferred."""
    return nn.Sequential(nn.Linear(8, 3))


def broken() -> nn.Module:
    class Broken(Affine):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if float(x.sum()) > 1e6:
                raise RuntimeError("boom")
            return super().forward(x)

    return Broken()


class Affine2(Affine):
    """Same tensors as Affine, other weights: a second teacher for mixture tests."""

    def __init__(self) -> None:
        super().__init__()
        with torch.no_grad():
            self.w.mul_(-0.5)


def affine2() -> Affine2:
    return Affine2()


def sleepy_20() -> Sleepy:
    return Sleepy(20)


def sleepy_200() -> Sleepy:
    """Ten times slower than sleepy_20: a straggler."""
    return Sleepy(200)


def linear4() -> nn.Module:
    """Four input features: a teacher whose input does not match the students' eight."""
    return nn.Sequential(nn.Linear(4, 3))


class Bf16In(nn.Module):
    """Takes BF16 inputs and answers FP32: checks bf16 bytes travel untouched."""

    io_spec = ModelIO.parse(["X:BF16:8"], ["Y:FP32:8"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.float() * 2


def bf16_in() -> Bf16In:
    return Bf16In()


class Stuck(Affine):
    """Affine that blocks for TEST_STUCK_S seconds (default 120) on any batch that is not all
    zeros: a forward pass far longer than any drain grace. The warm-up batch (zeros) runs at once."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if bool(x.any()):
            time.sleep(float(os.environ.get("TEST_STUCK_S", "120")))
        return super().forward(x)


def stuck() -> Stuck:
    return Stuck()


class TinyLM(nn.Module):
    """Token ids [B, T] to next-token logits [B, T, vocab]: a per-position output over a vocabulary,
    configured by factory arguments (--model-arg vocab=37) instead of environment variables."""

    def __init__(self, vocab: int, hidden: int, seed: int, scale: float) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.embed = nn.Parameter(torch.randn(vocab, hidden, generator=g))
        self.head = nn.Parameter(torch.randn(hidden, vocab, generator=g) * scale)
        self.io_spec = ModelIO.parse(["TOKENS:INT64:-1"], [f"LOGITS:FP32:-1,{vocab}"])

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embed[tokens] @ self.head


def tiny_lm(vocab: int = 50, hidden: int = 16, seed: int = 0, scale: float = 1.0) -> TinyLM:
    if vocab < 2:
        raise ValueError(f"vocab must be at least 2, got {vocab}")
    return TinyLM(vocab, hidden, seed, scale)


def omp_wait_policy() -> nn.Module:
    """Refuses to load, naming the OpenMP wait policy its process has (tests of teacher_server.entry)."""
    raise ValueError(f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '<unset>')}")
