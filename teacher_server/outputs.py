"""The last step of a request's data path: each output sliced from the batch, transformed as the
request asked (top-k, floating dtype) and encoded as raw little-endian bytes for the wire.

It runs on the model instance's thread, right after the forward pass, so no tensor work reaches
the event loop.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from protos.kserve import datatype, encode_tensor
from teacher_server.spec import FLOAT_OUTPUT_DTYPES, TensorSpec


@dataclass(frozen=True)
class OutputTransform:
    """One output a request wants, and how: datatype for floating outputs, top-k or the full tensor."""

    name: str
    datatype: str | None = None  # None: keep the model's dtype
    top_k: int = 0


@dataclass(frozen=True)
class OutputDefaults:
    """Server-wide defaults for outputs; requests override them with parameters."""

    datatype: str | None = None  # FP32/FP16/BF16 for floating outputs; None keeps the model's
    top_k: int = 0


# (name, datatype, shape, raw bytes) of one encoded output tensor, ready for the response.
EncodedOutput = tuple[str, str, list[int], bytes]


def encode_output(tensor: torch.Tensor, spec: TensorSpec, want: OutputTransform) -> list[EncodedOutput]:
    """Convert one request's slice of an output as asked (top-k, dtype) and encode it for the wire."""
    target = FLOAT_OUTPUT_DTYPES.get(want.datatype or spec.datatype)
    if not tensor.is_floating_point():
        target = None
    if want.top_k:
        k = min(want.top_k, tensor.shape[-1])
        values, indices = torch.topk(tensor, k, dim=-1, sorted=True)
        if target is not None:
            values = values.to(target)
        return [
            (f"{spec.name}_TOPK_VALUES", *encode_tensor(values)),
            (f"{spec.name}_TOPK_INDICES", *encode_tensor(indices.to(torch.int64))),
        ]
    if target is not None and tensor.dtype != target:
        tensor = tensor.to(target)
    elif target is None and tensor.dtype != spec.torch_dtype:
        tensor = tensor.to(datatype(spec.datatype).torch_dtype)
    return [(spec.name, *encode_tensor(tensor))]
