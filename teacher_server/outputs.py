"""The last step of a request's data path: each output sliced from the batch, transformed as the
request asked and encoded as raw little-endian bytes for the wire.

The transforms (the entries of `teacher_server.transforms.REGISTRY` a request activates, in its
order, each adding the outputs it declares in `protos.outputs`) run on the model's device, in the
instance thread, BEFORE the device-to-host copy: on a GPU a `[B, T, V]` logits tensor is reduced
to `[B, T, k]` values and indices there, and only those cross PCIe. Encoding then runs on host
tensors. No tensor work reaches the event loop.

Memory: an output is transformed in chunks of positions (`OutputContext.chunk_bytes` of fp32
values per chunk, 256 MiB by default), so the fp32 copies, log-softmax and top-k of a long
sequence at a large vocabulary never exist whole. With `OutputContext.head` the tensor handed in
is the model's final hidden states `[B, T, H]` and each chunk's logits are computed from them
(an `hf:` causal LM's output projection, see `teacher_server.hf_model`): when only reduced
outputs are wanted, the `[B, T, V]` logits never exist at all.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from protos.kserve import datatype, encode_tensor
from teacher_server.spec import FLOAT_OUTPUT_DTYPES, TensorSpec
from teacher_server.transform_rows import RowContext, Rows
from teacher_server.transforms import OutputDefaults, OutputTransform

__all__ = ["CHUNK_BYTES", "EncodedOutput", "NamedTensor", "OutputContext", "OutputDefaults", "OutputTransform",
           "encode_named", "encode_output", "transform_output"]

# (name, datatype, shape, raw bytes) of one encoded output tensor, ready for the response.
EncodedOutput = tuple[str, str, list[int], bytes | memoryview]
# (name, tensor) of one transformed output, still on the model's device.
NamedTensor = tuple[str, torch.Tensor]

CHUNK_BYTES = 256 << 20
"""fp32 bytes of values per chunk of positions (one `[n, V]` float32 slice).

The chunk trades host work for memory. Each chunk costs its ATen calls (16, most of them kernel
launches on a GPU) and a read of the output projection, so smaller chunks mean more launches per
batch; its transforms peak at about twice the chunk (the fp32 logits and their log-softmax). At
256 MiB a chunk's transforms hold about what the forward pass of an 8k-token sequence of a 1.5B
model holds at once anyway (`benchmarks.teacher_memory` measures it)."""


@dataclass(frozen=True)
class OutputContext:
    """What one output's transforms need besides the tensor.

    rows: per position of the tensor (flattened over its leading dimensions): the next tokens
    and the score ids; None when no scoring transform is wanted.
    head: when set, the tensor is the final hidden states and `head(h)` gives the output's rows
    (its last dimension is `width`).
    """

    rows: RowContext | None = None
    head: Callable[[torch.Tensor], torch.Tensor] | None = None
    width: int = 0
    chunk_bytes: int = CHUNK_BYTES


_NO_CONTEXT = OutputContext()


def _row_blocks(x: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    """`x` `[..., D]` as `(first row, [r, D])` blocks, views where the layout allows (a request's
    slice cut back to its length is not one flat view, but each of its sequences is)."""
    d = x.shape[-1]
    try:
        return [(0, x.view(-1, d))]
    except RuntimeError:
        pass
    per = x[0].numel() // d if x.shape[0] else 0
    return [(i * per, x[i].reshape(-1, d)) for i in range(x.shape[0])]


def _full(rows: Rows, spec: TensorSpec) -> tuple[torch.Tensor, torch.dtype | None]:
    """The output itself, as sent when no transform replaced it, and the dtype it is sent as."""
    if rows.floating:
        return rows.values, rows.value_dtype()
    return rows.values, spec.torch_dtype


def transform_output(tensor: torch.Tensor, spec: TensorSpec, want: OutputTransform,
                     context: OutputContext | None = None) -> list[NamedTensor]:
    """Apply `want` to one output on whatever device it lives on; return the tensors to send.

    Floating math runs in fp32 (a bf16/fp16 forward pass is read in fp32 a chunk at a time), and
    results are cast to the wanted dtype where they are written. Non-floating outputs are only
    top-k'd.
    """
    ctx = context or _NO_CONTEXT
    scored = ctx.rows is not None and ctx.rows.score_ids is not None
    active = [t for t in want.active(scored) if t.apply is not None]
    floating = ctx.head is not None or tensor.is_floating_point()
    if ctx.head is None and not active:
        target = FLOAT_OUTPUT_DTYPES.get(want.datatype or spec.datatype) if floating else None
        if target is not None:
            return [(spec.name, tensor.to(target))]
        if not floating and tensor.dtype != spec.torch_dtype:
            return [(spec.name, tensor.to(datatype(spec.datatype).torch_dtype))]
        return [(spec.name, tensor)]
    fp32 = floating and any(t.floating for t in active)
    x = tensor.unsqueeze(-1) if tensor.dim() < 2 and ctx.head is None else tensor
    lead = tuple(x.shape[:-1])
    total = 1
    for d in lead:
        total *= d
    width = ctx.width if ctx.head is not None else x.shape[-1]
    per_chunk = max(1, ctx.chunk_bytes // (max(width, 1) * 4))
    blocks = _row_blocks(x)
    single = len(blocks) == 1 and total <= per_chunk
    outs: list[NamedTensor] = []
    for first, block in blocks:
        for a in range(0, block.shape[0], per_chunk):
            raw = block[a : a + per_chunk]
            if ctx.head is not None:
                raw = ctx.head(raw)
            row0 = first + a
            rows = Rows(raw, want, spec.datatype, None if ctx.rows is None else ctx.rows.rows(row0, row0 + len(raw)),
                        fp32)
            del raw  # `rows` holds the chunk's only reference: its upcast lets the original go
            for step in active:
                assert step.apply is not None
                step.apply(rows)
            if not rows.reduced:
                rows.emit("", *_full(rows, spec))
            if single:
                outs = [(s, o if dt is None else o.to(dt)) for s, o, dt in rows.out]
                continue
            if not outs:  # the whole output's buffers, in the dtypes sent: each chunk is cast as it is copied in
                outs = [(s, torch.empty((total, *o.shape[1:]), dtype=dt or o.dtype, device=o.device))
                        for s, o, dt in rows.out]
            for (_, buf), (_, o, _) in zip(outs, rows.out, strict=True):
                buf[row0 : row0 + len(o)].copy_(o)
    named: list[NamedTensor] = []
    for suffix, o in outs:
        shaped = o.reshape(*lead, *o.shape[1:])
        if suffix == "" and x is not tensor:
            shaped = shaped.reshape(tensor.shape)
        named.append((spec.name + suffix, shaped))
    return named


def encode_named(tensors: list[NamedTensor]) -> list[EncodedOutput]:
    """Encode host tensors for the wire."""
    return [(name, *encode_tensor(t)) for name, t in tensors]


def encode_output(tensor: torch.Tensor, spec: TensorSpec, want: OutputTransform) -> list[EncodedOutput]:
    """Transform one request's slice of an output as asked and encode it (a host tensor)."""
    return encode_named(transform_output(tensor, spec, want))
