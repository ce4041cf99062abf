"""Aligning a student's and a teacher's tokenizations of the same texts by bytes.

Both sides describe their tokens by byte spans that tile the text (`teacher_server.text_spans`).
A *chunk* is a run of tokens on each side that ends at the same byte: the chunk boundaries are the
byte offsets at which both sides have a token end, so each chunk covers the same bytes on both
sides, and the chunks together cover every byte of the text once. Where the two tokenizers split a
text alike, every chunk is one token on each side; where they differ, a chunk holds the tokens of
each side up to the next byte both agree on. The rules:

* a boundary is the end of a non-empty token on both sides; the text's end is always one;
* a token belongs to the chunk its end falls in (a token ending at a boundary closes that chunk);
  a token with an empty span joins the chunk its end falls in, the one before it when its end is a
  boundary, the first chunk at byte 0;
* tokens the tokenizer added (span -1, BOS/EOS) and padding belong to no chunk (index -1);
* a chunk counts (``valid``) when every token in it on both sides has a score: the teacher's score of
  token ``j`` sits at position ``j - 1`` (the text contract) and the student's distribution for its
  token ``i`` at logits position ``i - 1``, so a chunk holding either side's token 0 (a tokenizer
  that adds no BOS) is masked out.

Everything is computed for the whole batch at once: the byte offsets at which each side has a token
end are marked in a ``[B, L + 1]`` table (L the longest text in bytes), their common marks' running
count gives each token's chunk, and the per-chunk first/last token and counts are scatters.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

__all__ = ["Alignment", "align", "chunk_sums"]


@dataclass(frozen=True)
class Alignment:
    """The chunks of a batch, per row (C = the most chunks of any row).

    Attributes:
        student_chunk: int64 ``[B, Ts]``: each student token's chunk, -1 for added tokens and padding.
        teacher_chunk: int64 ``[B, Tt]``: each teacher token's chunk, likewise.
        num_chunks: int64 ``[B]``: the row's chunk count.
        valid: bool ``[B, C]``: the chunk exists and every token in it has a score on both sides.
        chunk_bytes: int64 ``[B, C, 2]``: each chunk's byte range [start, end) (0, 0 past the row's chunks).
        student_first, student_last, teacher_first, teacher_last: int64 ``[B, C]``: the chunk's first and
            last token index on each side (-1 past the row's chunks).
        student_count, teacher_count: int64 ``[B, C]``: its number of tokens on each side.
    """

    student_chunk: Tensor
    teacher_chunk: Tensor
    num_chunks: Tensor
    valid: Tensor
    chunk_bytes: Tensor
    student_first: Tensor
    student_last: Tensor
    student_count: Tensor
    teacher_first: Tensor
    teacher_last: Tensor
    teacher_count: Tensor

    @property
    def exists(self) -> Tensor:
        """bool ``[B, C]``: the chunk is one of its row's (``c < num_chunks``)."""
        c = self.valid.shape[1]
        return torch.arange(c, device=self.num_chunks.device) < self.num_chunks.unsqueeze(1)

    def counted(self, student_loss_mask: Tensor | None = None) -> Tensor:
        """bool ``[B, C]``: the valid chunks whose student tokens all have a non-zero
        `student_loss_mask` ``[B, Ts]`` (e.g. the completion's tokens); every valid chunk without one."""
        if student_loss_mask is None:
            return self.valid
        if tuple(student_loss_mask.shape) != tuple(self.student_chunk.shape):
            raise ValueError(f"student_loss_mask {tuple(student_loss_mask.shape)} must have the student tokens' "
                             f"shape {tuple(self.student_chunk.shape)}")
        left_out = (student_loss_mask.to(self.student_chunk.device) == 0).long()
        return self.valid & (chunk_sums(left_out, self.student_chunk, self.valid.shape[1]) == 0)

    @property
    def one_to_one(self) -> Tensor:
        """bool ``[B, C]``: a valid chunk of one token on each side."""
        return self.valid & (self.student_count == 1) & (self.teacher_count == 1)


def _tensor(x: Any, name: str, dims: int) -> Tensor:
    t = torch.from_numpy(np.ascontiguousarray(x)) if isinstance(x, np.ndarray) else x
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch tensor or a numpy array, got {type(x).__name__}")
    if t.dim() != dims or t.is_floating_point():
        raise ValueError(f"{name} must be an integer array of {dims} dimensions, got {t.dtype} {tuple(t.shape)}")
    return t


def _side(spans: Any, mask: Any, name: str) -> tuple[Tensor, Tensor, Tensor]:
    """(real, ends, non_empty) of one side: bool ``[B, T]``, int64 ``[B, T]``, bool ``[B, T]``."""
    s = _tensor(spans, f"{name}_spans", 3)
    m = _tensor(mask, f"{name}_mask", 2)
    if s.shape[-1] != 2 or tuple(s.shape[:2]) != tuple(m.shape):
        raise ValueError(f"{name}_spans {tuple(s.shape)} must be [B, T, 2] with {name}_mask's [B, T] "
                         f"{tuple(m.shape)}; pass the spans and the mask of one tokenization")
    s = s.long()
    real = (m.to(s.device) != 0) & (s[..., 0] >= 0)
    ends = torch.where(real, s[..., 1], torch.zeros_like(s[..., 1]))
    return real, ends, real & (s[..., 1] > s[..., 0])


def _marks(ends: Tensor, non_empty: Tensor, width: int) -> Tensor:
    """bool ``[B, width]``: the byte offsets at which a non-empty token ends."""
    idx = torch.where(non_empty, ends, torch.zeros_like(ends))
    counts = torch.zeros(ends.shape[0], width, dtype=torch.int64, device=ends.device)
    return counts.scatter_add_(1, idx, non_empty.long()) > 0


def _token_chunks(real: Tensor, ends: Tensor, cum: Tensor, num: Tensor) -> Tensor:
    """Each token's chunk: the number of boundaries before its end; -1 outside every chunk."""
    before = cum.gather(1, (ends - 1).clamp_min(0))
    chunk = torch.where(ends > 0, before, torch.zeros_like(before))
    keep = real & (chunk < num.unsqueeze(1))
    return torch.where(keep, chunk, torch.full_like(chunk, -1))


def _per_chunk(chunk: Tensor, count: int) -> tuple[Tensor, Tensor, Tensor]:
    """(first, last, count) token index of each chunk, ``[B, count]``; -1 / 0 where a chunk has none."""
    rows, width = chunk.shape
    dump = torch.where(chunk >= 0, chunk, torch.full_like(chunk, count))  # column `count` collects the rest
    index = torch.arange(width, device=chunk.device).expand(rows, width)
    big = torch.full((rows, count + 1), width, dtype=torch.int64, device=chunk.device)
    first = big.scatter_reduce(1, dump, index, "amin")[:, :count]
    last = torch.full_like(big, -1).scatter_reduce(1, dump, index, "amax")[:, :count]
    n = torch.zeros_like(big).scatter_add_(1, dump, torch.ones_like(index))[:, :count]
    return torch.where(n > 0, first, torch.full_like(first, -1)), last, n


def align(student_spans: Any, student_mask: Any, teacher_spans: Any, teacher_mask: Any) -> Alignment:
    """The chunks of each row, from both sides' byte spans and masks (``[B, T, 2]`` and ``[B, T]``,
    torch or numpy, each side padded to its own T; the teacher's are its ``TEXT_SPANS`` and
    ``TEXT_MASK``). Computed on the student spans' device.

    Raises ValueError when a row's two tokenizations cover different byte lengths (not the same text).
    """
    s_real, s_ends, s_full = _side(student_spans, student_mask, "student")
    t_real, t_ends, t_full = _side(teacher_spans, teacher_mask, "teacher")
    device = s_ends.device
    t_real, t_ends, t_full = t_real.to(device), t_ends.to(device), t_full.to(device)
    if s_ends.shape[0] != t_ends.shape[0]:
        raise ValueError(f"the student has {s_ends.shape[0]} rows and the teacher {t_ends.shape[0]}; "
                         "align the teacher's answer for the same batch of texts")
    s_len = s_ends.amax(1) if s_ends.shape[1] else torch.zeros(s_ends.shape[0], dtype=torch.int64, device=device)
    t_len = t_ends.amax(1) if t_ends.shape[1] else torch.zeros_like(s_len)
    if bool((s_len != t_len).any()):
        bad = (s_len != t_len).nonzero().squeeze(1).tolist()
        raise ValueError(f"rows {bad[:8]}: the student's tokens cover {s_len[bad[0]].item()} bytes and the teacher's "
                         f"{t_len[bad[0]].item()}; both sides must tokenize the same texts, untruncated")
    width = int(s_len.max().item()) + 1 if s_len.numel() else 1
    common = _marks(s_ends, s_full, width) & _marks(t_ends, t_full, width)
    common[:, 0] = False
    cum = common.long().cumsum(1)
    num = cum[:, -1]
    s_chunk = _token_chunks(s_real, s_ends, cum, num)
    t_chunk = _token_chunks(t_real, t_ends, cum, num)
    count = int(num.max().item()) if num.numel() else 0
    s_first, s_last, s_count = _per_chunk(s_chunk, count)
    t_first, t_last, t_count = _per_chunk(t_chunk, count)
    offsets = torch.arange(width, device=device).expand_as(cum)
    where_end = torch.where(common, cum - 1, torch.full_like(cum, count))
    chunk_end = torch.zeros(cum.shape[0], count + 1, dtype=torch.int64, device=device)
    chunk_end = chunk_end.scatter_reduce(1, where_end, offsets, "amax")[:, :count]
    chunk_start = torch.cat([torch.zeros_like(chunk_end[:, :1]), chunk_end[:, :-1]], dim=1)
    exists = torch.arange(count, device=device) < num.unsqueeze(1)
    chunk_start = torch.where(exists, chunk_start, torch.zeros_like(chunk_start))
    valid = exists & (s_first > 0) & (t_first > 0)
    return Alignment(s_chunk, t_chunk, num, valid, torch.stack([chunk_start, chunk_end], dim=-1),
                     s_first, s_last, s_count, t_first, t_last, t_count)


def chunk_sums(values: Tensor, chunk: Tensor, count: int) -> Tensor:
    """``[B, count]``: the sum of `values` ``[B, T]`` over each chunk's tokens (`chunk` ``[B, T]``
    from an `Alignment`); differentiable in `values`."""
    dump = torch.where(chunk >= 0, chunk, torch.full_like(chunk, count)).to(values.device)
    out = values.new_zeros(values.shape[0], count + 1)
    return out.scatter_add(1, dump, values)[:, :count]
