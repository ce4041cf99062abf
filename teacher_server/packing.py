"""Sequence packing for `hf:` causal LMs (`--pack-sequences`): several sequences per row of a
batch, so the forward pass computes almost no padding.

A padded batch `[B, W]` computes B x W positions, W the longest sequence's length; the short
sequences' rows are mostly padding. Packed, the same sequences are laid side by side in rows of
width W (first fit, longest first), each one's positions restarting at 0; transformers reads the
packing from the position ids (with no attention mask and no KV cache it builds a block-diagonal
causal mask for SDPA), so attention stays within each sequence and every sequence's outputs are
those it gets alone (benchmarks/packing.py measures this and the gain). The model's output (its
final hidden states, or its logits) is then gathered back into the padded layout `[B, W, ...]`,
so everything after it (the output transforms, the cut to each request's length, the encoding)
is unchanged.

Only batches whose every row is fully real (each `Work`'s mask marks all its positions: rows cut
by `teacher_server.rows`) are packed, and only when packing saves a row; any other batch runs
padded as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from teacher_server.work import Work


@dataclass
class Packed:
    """A batch's packed model inputs and how to put the model's outputs back in batch order."""

    ids: torch.Tensor  # [R, W] token ids, R < B rows
    positions: torch.Tensor  # [R, W] each sequence's positions from 0 (a row's unused tail: from 0 too)
    unpack: torch.Tensor  # [B * W] for each padded position: its packed position (flat), or 0 past a row's end
    rows: int  # B

    def unpacked(self, t: torch.Tensor) -> torch.Tensor:
        """A per-position output `[R, W, ...]` of the packed rows as the padded batch's `[B, W, ...]`
        (positions past a sequence's end hold another position's values: they are cut away)."""
        flat = t.reshape(t.shape[0] * t.shape[1], *t.shape[2:]).index_select(0, self.unpack)
        return flat.view(self.rows, t.shape[1], *t.shape[2:])


def lengths(works: Sequence[Work]) -> list[int] | None:
    """Each row's length, when every row of the batch is fully real (packable); else None."""
    out: list[int] = []
    for w in works:
        if w.length is None or w.useful is None or w.useful != w.batch_size * w.length:
            return None
        out.extend([w.length] * w.batch_size)
    return out


def packable(w: Work) -> bool:
    """Every row of `w` is fully real, so it can share a packed row with others."""
    return lengths([w]) is not None


def first_fit(sizes: Sequence[int], width: int) -> list[list[int]]:
    """Indices of `sizes` in rows of `width`, first fit by decreasing size (each size <= width)."""
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        r = next((k for k, free in enumerate(room) if free >= sizes[i]), None)
        if r is None:
            rows.append([])
            room.append(width)
            r = len(rows) - 1
        rows[r].append(i)
        room[r] -= sizes[i]
    return rows


def pack(ids: torch.Tensor, works: Sequence[Work]) -> Packed | None:
    """The padded batch `ids` `[B, W]` of `works` packed, or None when it cannot be (a row with
    padding inside its length) or would not save a row."""
    sizes = lengths(works)
    if sizes is None or len(sizes) != ids.shape[0] or not sizes:
        return None
    width = ids.shape[1]
    rows = first_fit(sizes, width)
    if len(rows) >= len(sizes):
        return None
    source = torch.zeros(len(rows) * width, dtype=torch.long)  # packed slot -> padded flat position
    positions = torch.zeros((len(rows), width), dtype=torch.long)
    unpack = torch.zeros(len(sizes) * width, dtype=torch.long)
    for r, members in enumerate(rows):
        at = 0
        for b in members:
            n = sizes[b]
            span = torch.arange(n)
            source[r * width + at : r * width + at + n] = b * width + span
            unpack[b * width : b * width + n] = r * width + at + span
            positions[r, at : at + n] = span
            at += n
        positions[r, at:] = torch.arange(width - at)
    device = ids.device
    packed_ids = ids.reshape(-1).index_select(0, source.to(device)).view(len(rows), width)
    return Packed(packed_ids, positions.to(device), unpack.to(device), len(sizes))
