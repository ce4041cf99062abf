"""The last step of a request's data path: each output sliced from the batch, transformed as the
request asked and encoded as raw little-endian bytes for the wire.

The transforms (temperature, log-softmax, top-k over the last dimension, the probability mass
outside the top-k, floating dtype) run on the model's device, in the instance thread, BEFORE the
device-to-host copy: on a GPU a `[B, T, V]` logits tensor is reduced to `[B, T, k]` values and
indices there, and only those cross PCIe. Encoding then runs on host tensors. No tensor work
reaches the event loop.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from protos.kserve import datatype, encode_tensor
from teacher_server.spec import FLOAT_OUTPUT_DTYPES, TensorSpec


@dataclass(frozen=True)
class OutputTransform:
    """One output a request wants, and how.

    datatype: FP32/FP16/BF16 for floating outputs (None keeps the model's dtype).
    top_k: send the k largest values of the last dimension and their int32 indices (0: the full tensor).
    logprobs: send log_softmax(x / temperature) over the last dimension instead of raw values.
    temperature: divides floating values before anything else (1.0: unchanged).
    topk_tail: with top_k, also send `<OUT>_TOPK_TAIL`, the probability mass outside the top-k
    (of softmax(x / temperature)) per position.
    """

    name: str
    datatype: str | None = None  # None: keep the model's dtype
    top_k: int = 0
    logprobs: bool = False
    temperature: float = 1.0
    topk_tail: bool = False

    def with_name(self, name: str) -> OutputTransform:
        return OutputTransform(name, self.datatype, self.top_k, self.logprobs, self.temperature, self.topk_tail)


@dataclass(frozen=True)
class OutputDefaults:
    """Server-wide defaults for outputs; requests override them with parameters."""

    datatype: str | None = None  # FP32/FP16/BF16 for floating outputs; None keeps the model's
    top_k: int = 0
    logprobs: bool = False
    temperature: float = 1.0
    topk_tail: bool = False

    def transform(self, name: str = "") -> OutputTransform:
        return OutputTransform(name, self.datatype, self.top_k, self.logprobs, self.temperature, self.topk_tail)


# (name, datatype, shape, raw bytes) of one encoded output tensor, ready for the response.
EncodedOutput = tuple[str, str, list[int], bytes]
# (name, tensor) of one transformed output, still on the model's device.
NamedTensor = tuple[str, torch.Tensor]


def transform_output(tensor: torch.Tensor, spec: TensorSpec, want: OutputTransform) -> list[NamedTensor]:
    """Apply `want` to one output on whatever device it lives on; return the tensors to send.

    Floating math runs in fp32 (a bf16/fp16 forward pass is upcast first), and the result is cast
    to the wanted dtype last. Non-floating outputs are only top-k'd.
    """
    floating = tensor.is_floating_point()
    target = FLOAT_OUTPUT_DTYPES.get(want.datatype or spec.datatype) if floating else None
    if floating and (want.logprobs or want.temperature != 1.0 or want.topk_tail):
        x = tensor.float()
        if want.temperature != 1.0:
            x = x / want.temperature
        if want.logprobs:
            x = torch.log_softmax(x, dim=-1)
        tensor = x
    if want.top_k:
        k = min(want.top_k, tensor.shape[-1])
        values, indices = torch.topk(tensor, k, dim=-1, sorted=True)
        out: list[NamedTensor] = [
            (f"{spec.name}_TOPK_VALUES", values if target is None else values.to(target)),
            (f"{spec.name}_TOPK_INDICES", indices.to(torch.int32)),
        ]
        if want.topk_tail and floating:
            logp = values if want.logprobs else values - torch.logsumexp(tensor, dim=-1, keepdim=True)
            tail = (1.0 - logp.float().exp().sum(dim=-1)).clamp_(min=0.0)
            tail_dtype = torch.float32 if want.datatype is None else FLOAT_OUTPUT_DTYPES[want.datatype]
            out.append((f"{spec.name}_TOPK_TAIL", tail.to(tail_dtype)))
        return out
    if target is not None:
        tensor = tensor.to(target)
    elif not floating and tensor.dtype != spec.torch_dtype:
        tensor = tensor.to(datatype(spec.datatype).torch_dtype)
    return [(spec.name, tensor)]


def encode_named(tensors: list[NamedTensor]) -> list[EncodedOutput]:
    """Encode host tensors for the wire."""
    return [(name, *encode_tensor(t)) for name, t in tensors]


def encode_output(tensor: torch.Tensor, spec: TensorSpec, want: OutputTransform) -> list[EncodedOutput]:
    """Transform one request's slice of an output as asked and encode it (a host tensor)."""
    return encode_named(transform_output(tensor, spec, want))
