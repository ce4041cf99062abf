"""What the scoring transforms need from a batch besides the output: each position's next token
and whether it is real, the score ids padded to one shape, and a model's separable output
projection.

`row_context` builds the per-position view (`transform_rows.RowContext`) of a batch on the model's
device: at position t of a sequence, the next token is x[t+1] when both t and t+1 are real tokens
(inside the request's own length and, when a mask was sent, marked 1 in it), so a sequence's last
position and its padding score 0. `head_split` finds a model's `HeadSplit`: its final hidden
states and its output projection as two calls, so that the projection runs a chunk of positions
at a time (`outputs.OutputContext.head`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from teacher_server.transform_rows import RowContext
from teacher_server.work import Work


@dataclass(frozen=True)
class HeadSplit:
    """A model's forward pass in two halves: `hidden(*inputs)` returns its outputs with
    `head_output` replaced by the final hidden states `[B, T, H]`, and `head(h)` maps any `[n, H]`
    rows of them to that output's `[n, V]` rows."""

    head_output: str
    hidden: Callable[..., list[torch.Tensor]]
    head: Callable[[torch.Tensor], torch.Tensor]


def head_split(module: Any) -> HeadSplit | None:
    """The module's `HeadSplit` when it offers one (`module.head_split()`), else None."""
    split = getattr(module, "head_split", None)
    if not callable(split):
        return None
    found = split()
    return found if isinstance(found, HeadSplit) else None


def row_context(ids: torch.Tensor, mask: torch.Tensor | None, works: Sequence[Work], length: int) -> RowContext:
    """The positions of `works` (their rows of the batch, in order, `length` positions each) as
    flattened `[rows x length]` next tokens, validity, realness and score ids."""
    device = ids.device
    lengths = torch.tensor([w.length or length for w in works for _ in range(w.batch_size)], device=device)
    real = torch.arange(length, device=device).unsqueeze(0) < lengths.unsqueeze(1)
    if mask is not None:
        real &= mask != 0
    nxt = torch.zeros(ids.shape, dtype=torch.int64, device=device)
    nxt[:, :-1] = ids[:, 1:]
    valid = torch.zeros_like(real)
    valid[:, :-1] = real[:, :-1] & real[:, 1:]
    nxt = torch.where(valid, nxt, torch.zeros_like(nxt))
    scores = None
    if "SCORE_IDS" in works[0].aux:
        m = max(w.aux["SCORE_IDS"].shape[-1] for w in works)
        buf = torch.zeros((ids.shape[0], length, m), dtype=torch.int64)
        row = 0
        for w in works:
            s = w.aux["SCORE_IDS"]
            buf[row : row + w.batch_size, : s.shape[1], : s.shape[2]] = s
            row += w.batch_size
        scores = buf.view(-1, m).to(device)
    return RowContext(nxt.reshape(-1), valid.reshape(-1), real.reshape(-1), scores)
