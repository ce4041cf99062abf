"""Position chunks for the token-level losses: one plan of views over the student and the
teacher tensors, and the hand-made activation checkpoint that recomputes a chunk's loss in the
backward pass (see ``distill.losses.token``, "Memory")."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable


class ChunkLoss(Protocol):
    """A chunk's loss as a function of its student rows (everything else captured)."""

    def loss(self, student: Tensor) -> Tensor: ...


def _as3(x: Tensor) -> Tensor:
    """``[..., P, D]`` as ``[B, P, D]`` (a view whenever the layout allows it)."""
    return x.reshape(-1, x.shape[-2], x.shape[-1]) if x.dim() > 2 else x.unsqueeze(0)


def _flat_view(x: Tensor) -> Tensor | None:
    try:
        return x.view(-1, x.shape[-1])
    except RuntimeError:
        return None


class Chunks:
    """One plan of position chunks applied to the student and to every teacher tensor, as views.

    Positions are flattened when all tensors allow a flat view; otherwise (e.g. ``logits[:, :-1]``)
    chunks stay inside one batch row, so a shifted student or teacher is not copied either. The
    student is cut with one ``split`` (or ``unbind`` then ``split``): their backward assembles the
    full gradient once, where per-chunk slicing would allocate a full-size gradient per chunk.
    """

    def __init__(self, student: Tensor, others: list[Tensor], chunk_size: int):
        self.chunk_size = chunk_size
        self.student3 = _as3(student)
        self.flat = all(_flat_view(_as3(x)) is not None for x in [student, *others])
        self.per_row = self.student3.shape[1]

    def student_chunks(self) -> Iterator[tuple[int, Tensor]]:
        """``(first flat position, [n, V] view)`` over all positions."""
        n = self.chunk_size
        if self.flat:
            for i, chunk in enumerate(torch.split(self.student3.view(-1, self.student3.shape[-1]), n)):
                yield i * n, chunk
            return
        for b, row in enumerate(torch.unbind(self.student3, 0)):
            for i, chunk in enumerate(torch.split(row, n)):
                yield b * self.per_row + i * n, chunk

    def take(self, x: Tensor, start: int, end: int) -> Tensor:
        """Positions ``[start, end)`` of ``x`` (``[..., D]`` with the student's positions) as a view."""
        x3 = _as3(x)
        if self.flat:
            return x3.view(-1, x3.shape[-1])[start:end]
        b, i = divmod(start, self.per_row)
        return x3[b, i : i + end - start]


def take_rows(t: Tensor, rows: Tensor | None) -> Tensor:
    return t if rows is None else t.index_select(0, rows.to(t.device, non_blocking=True))


class Recomputed(torch.autograd.Function):
    """A chunk's loss that keeps nothing but its (viewed) student input for the backward pass.

    The forward runs without a graph; the backward recomputes the chunk with one and takes its
    gradient. This is activation checkpointing done by hand: ``torch.utils.checkpoint`` would do
    the same, but it imports the compiler stack (seconds) on first use.
    """

    @staticmethod
    def forward(ctx: Any, student: Tensor, chunk: ChunkLoss) -> Tensor:
        ctx.save_for_backward(student)
        ctx.chunk = chunk
        with torch.no_grad():
            return chunk.loss(student)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        (student,) = ctx.saved_tensors
        with torch.enable_grad():
            x = student.detach().requires_grad_(True)
            (g,) = torch.autograd.grad(ctx.chunk.loss(x), x, grad)
        return g, None
