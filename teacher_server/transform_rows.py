"""The device-side half of each output transform: what it does to one chunk of positions.

`teacher_server.outputs.transform_output` cuts an output into chunks of rows `[n, C]` (positions
x classes), wraps each in a `Rows` and runs the active registry entries' `apply` on it in
registry order (`teacher_server.transforms`); each apply reads `Rows.values` (the chunk as the
earlier transforms left it) and adds its outputs with `Rows.emit`. Floating math runs in fp32
whatever the model computed in; an output is cast to its wanted dtype where it is written into the
batch's result (`Rows.emit`'s dtype), so a chunk pays one copy per output, not a cast and a copy.
All of it runs on the model's device, so only the emitted (reduced) tensors are copied to the host.

Kernel launches are the host's cost of a chunk on a GPU (a few microseconds each, under the
interpreter lock the instances share), and the chunk's size is bounded by the memory its fp32
copies take, so the common path keeps both small: a bf16/fp16 chunk is upcast only when a
transform reads its values in fp32, its half-precision original is let go once it is (the caller
keeps no reference), and each output is cast once, where it is written.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from protos.kserve import datatype
from protos.outputs import (
    PROBS,
    SCORED_LOGPROBS,
    TOKEN_LOGPROBS,
    TOKEN_RANKS,
    TOPK_INDICES,
    TOPK_TAIL,
    TOPK_VALUES,
    VALUES,
    DerivedOutput,
)
from teacher_server.spec import FLOAT_OUTPUT_DTYPES


class Want(Protocol):
    """What the applies read of an `OutputTransform`."""

    @property
    def datatype(self) -> str | None: ...
    @property
    def top_k(self) -> int: ...
    @property
    def logprobs(self) -> bool: ...
    @property
    def temperature(self) -> float: ...
    @property
    def topk_tail(self) -> bool: ...


def value_dtype(want: Want, spec_datatype: str, floating: bool) -> torch.dtype | None:
    """The dtype values taken from a floating output itself are sent as (the full tensor, top-k
    values): the wanted one, else the declared one; None: as computed (non-floating, or FP64)."""
    if not floating:
        return None
    return FLOAT_OUTPUT_DTYPES.get(want.datatype or spec_datatype)


def prob_dtype(want: Want) -> torch.dtype:
    """The dtype derived probabilities are sent as (tail mass, token log-probs, scores): fp32
    unless the request asked for another."""
    return FLOAT_OUTPUT_DTYPES[want.datatype] if want.datatype else torch.float32


def derived_dtype(output: DerivedOutput, want: Want, spec_datatype: str, floating: bool) -> torch.dtype | None:
    """The dtype a derived output is sent as, by its declared rule (`protos.outputs`): VALUES as
    `value_dtype`, PROBS as `prob_dtype`, else its fixed datatype; None: as computed."""
    if output.dtype == VALUES:
        return value_dtype(want, spec_datatype, floating)
    if output.dtype == PROBS:
        return prob_dtype(want)
    return datatype(output.dtype).torch_dtype


@dataclass(frozen=True)
class RowContext:
    """What the scoring transforms read about a run of positions, on the model's device."""

    next_ids: Tensor | None = None  # [n] int64: the token after each position (0 where there is none)
    next_valid: Tensor | None = None  # [n] bool: the position has a real next token in its sequence
    real: Tensor | None = None  # [n] bool: the position is a real token, not padding
    score_ids: Tensor | None = None  # [n, m] int64: ids whose log-probabilities are wanted

    def rows(self, start: int, end: int) -> RowContext:
        def cut(t: Tensor | None) -> Tensor | None:
            return None if t is None else t[start:end]
        return RowContext(cut(self.next_ids), cut(self.next_valid), cut(self.real), cut(self.score_ids))


class Rows:
    """One chunk `[n, C]` of one output while its transforms run."""

    def __init__(self, raw: Tensor, want: Want, spec_datatype: str, context: RowContext | None, fp32: bool) -> None:
        self.floating = raw.is_floating_point()
        self._values = raw
        # The chunk is read in fp32 but not copied yet: `values` upcasts it on first read.
        self._upcast = self.floating and fp32 and raw.dtype != torch.float32
        self.want = want
        self.spec_datatype = spec_datatype
        self.context = context
        self.reduced = False  # some transform replaced the full tensor
        self.is_logprobs = False  # `values` are log-probabilities
        self.topk: tuple[Tensor, Tensor] | None = None
        self.out: list[tuple[str, Tensor, torch.dtype | None]] = []
        self._logp: Tensor | None = None

    @property
    def values(self) -> Tensor:
        """The chunk as the earlier transforms left it (fp32 when floating math was asked for)."""
        if self._upcast:
            self._values = self._values.float()
            self._upcast = False
        return self._values

    @values.setter
    def values(self, tensor: Tensor) -> None:
        self._values = tensor
        self._upcast = False

    def log_softmax(self) -> Tensor:
        """log_softmax of the values over classes, fp32.

        Memory at its peak, in fp32 chunks C: CUDA reads an fp16 chunk as it is (one kernel, 1.5C
        with the fp16 input); any other chunk is upcast first and its half-precision original let go
        (`Rows` holds the only reference), so the peak is the fp32 input and output (2C), not 2.5C.
        """
        if self._upcast and self._values.dtype == torch.float16 and self._values.is_cuda:
            return torch.log_softmax(self._values, dim=-1, dtype=torch.float32)
        values = self.values  # fp32 unless no floating transform asked for it (a registered one may not)
        # Not values.float() always: on an fp32 tensor it is still one more dispatch a chunk.
        return torch.log_softmax(values if values.dtype == torch.float32 else values.float(), dim=-1)

    def divide(self, by: float) -> None:
        """values / by, in fp32 when asked; a fresh upcast copy is divided in place (the model's
        own tensor is never written)."""
        if self._upcast:
            self.values = self._values.float().div_(by)
        else:
            self.values = self._values / by

    def emit(self, output: DerivedOutput | str, tensor: Tensor, dtype: torch.dtype | None = None) -> None:
        """Add an output: a declared one (sent in the dtype its declaration says, unless `dtype`
        says otherwise) or, by its suffix, the full one (""); `dtype`: what it is sent as (the cast
        happens where it is written)."""
        if isinstance(output, DerivedOutput):
            dtype = dtype or derived_dtype(output, self.want, self.spec_datatype, self.floating)
            output = output.suffix
        self.out.append((output, tensor, None if dtype == tensor.dtype else dtype))

    def value_dtype(self) -> torch.dtype | None:
        """The dtype of values taken from the output itself (the full tensor, top-k values)."""
        return value_dtype(self.want, self.spec_datatype, self.floating)

    def prob_dtype(self) -> torch.dtype:
        """The dtype of derived probabilities (tail mass, token log-probs): fp32 unless asked otherwise."""
        return prob_dtype(self.want)

    def logprobs(self) -> Tensor:
        """log_softmax(x / temperature) of the chunk, fp32, computed once."""
        if self.is_logprobs:
            return self.values
        if self._logp is None:
            self._logp = self.log_softmax()
        return self._logp

    def context_or_refuse(self) -> RowContext:
        if self.context is None:
            raise RuntimeError("a scoring transform ran without the positions' token context")
        return self.context


def apply_temperature(rows: Rows) -> None:
    if rows.floating:
        rows.divide(rows.want.temperature)


def apply_logprobs(rows: Rows) -> None:
    if rows.floating:
        rows.values = rows.log_softmax()
        rows.is_logprobs = True


def apply_top_k(rows: Rows) -> None:
    k = min(rows.want.top_k, rows.values.shape[-1])
    values, indices = torch.topk(rows.values, k, dim=-1, sorted=True)
    rows.topk = (values, indices)
    rows.emit(TOPK_VALUES, values)
    rows.emit(TOPK_INDICES, indices)
    rows.reduced = True


def apply_topk_tail(rows: Rows) -> None:
    if not rows.floating or rows.topk is None:
        return
    values = rows.topk[0]
    logp = values if rows.is_logprobs else values - torch.logsumexp(rows.values, dim=-1, keepdim=True)
    tail = (1.0 - logp.float().exp().sum(dim=-1)).clamp_(min=0.0)
    rows.emit(TOPK_TAIL, tail)


def apply_token_logprobs(rows: Rows) -> None:
    ctx = rows.context_or_refuse()
    assert ctx.next_ids is not None and ctx.next_valid is not None
    picked = rows.logprobs().gather(-1, ctx.next_ids.unsqueeze(-1)).squeeze(-1)
    picked = torch.where(ctx.next_valid, picked, torch.zeros_like(picked))
    rows.emit(TOKEN_LOGPROBS, picked)
    rows.reduced = True


def apply_token_ranks(rows: Rows) -> None:
    """The rank of each position's next token: 1 + the number of classes scored strictly higher
    (vLLM's rank of a prompt token). Temperature and log-softmax keep the order, so the values as
    the earlier transforms left them are compared; 0 where there is no next token."""
    ctx = rows.context_or_refuse()
    assert ctx.next_ids is not None and ctx.next_valid is not None
    picked = rows.values.gather(-1, ctx.next_ids.unsqueeze(-1))
    if rows.topk is None:
        ranks = (rows.values > picked).sum(dim=-1, dtype=torch.int32) + 1
    else:
        # A token inside the top-k has every higher class there too: count within the k values,
        # and pass over the whole row only for the positions whose token is outside.
        values, indices = rows.topk
        ranks = (values > picked.to(values.dtype)).sum(dim=-1, dtype=torch.int32) + 1
        outside = (indices != ctx.next_ids.unsqueeze(-1)).all(dim=-1).nonzero().squeeze(-1)
        if outside.numel():
            ranks[outside] = (rows.values[outside] > picked[outside]).sum(dim=-1, dtype=torch.int32) + 1
    rows.emit(TOKEN_RANKS, torch.where(ctx.next_valid, ranks, torch.zeros_like(ranks)))
    rows.reduced = True


def apply_scored(rows: Rows) -> None:
    ctx = rows.context_or_refuse()
    assert ctx.score_ids is not None
    picked = rows.logprobs().gather(-1, ctx.score_ids)
    if ctx.real is not None:
        picked = torch.where(ctx.real.unsqueeze(-1), picked, torch.zeros_like(picked))
    rows.emit(SCORED_LOGPROBS, picked)
    rows.reduced = True
