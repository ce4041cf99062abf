"""``SparseTargets``: a teacher's top-k output (values, class ids, optional tail mass)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from distill.losses._common import _INDEX_DTYPES, ValueKind, _check_kind, _check_temperature, _compute

__all__ = ["SparseTargets"]


@dataclass(frozen=True)
class SparseTargets:
    """A teacher's top-k output: ``k`` values per position, their class ids, and optionally the tail.

    Sending ``k`` of ``C`` values cuts wire traffic by ``C/k`` (it matters for vocabulary-sized
    outputs). Shapes are ``[N, k]`` (one row per sample) or ``[B, T, k]`` (one row per token; any
    number of leading dimensions is accepted). The ids in a row must be distinct (a top-k output
    always is); order does not matter.

    What the values mean is said by ``kind``, explicitly:

    * ``kind="logits"`` (the default, and today's behaviour): raw teacher logits of the top-k
      classes. The loss softens them: the teacher distribution at temperature ``T`` is
      ``softmax(values / T)`` renormalised over the top-k support, mass 0 elsewhere. A tail
      cannot be given with logits: the mass outside the top-k at the loss's ``T`` is known only to
      the teacher.
    * ``kind="logprobs"``: the teacher's log-probabilities of the top-k classes, *already at the
      temperature the teacher served them with* (the server applies its temperature before the
      log-softmax, over the full vocabulary, which is the only place it is exact). The loss uses
      them as they are and applies its temperature to the student only, so serve with the same
      temperature as the loss. Without a tail the top-k are renormalised (``softmax(values)``);
      with a tail the teacher distribution has ``k + 1`` bins, ``exp(values)`` and ``tail``,
      rescaled to sum to 1 (which only absorbs the rounding of half-precision values).

    ``tail`` (``[N]`` or ``[B, T]``) is the teacher's probability mass outside the top-k. The
    sparse divergences compare the teacher and the student on the partition "each top-k class on
    its own, every other class in one tail bin": the student's tail bin is
    ``1 - sum_k q[indices_k]``, computed as a log-sum-exp over the classes outside the top-k (no
    cancellation). Without a tail the teacher's tail bin is 0, which for the forward KL is exactly
    ``sum_k p_k (log p_k - log q_T[indices_k])`` with the student over all ``C`` classes.

    Attributes:
        values: ``[..., k]`` teacher logits or log-probabilities (any float dtype).
        indices: ``[..., k]`` int64 or int32 class ids in ``[0, C)``.
        tail: ``[...]`` probability outside the top-k (any float dtype), or None.
        kind: ``"logits"`` or ``"logprobs"``; what ``values`` hold.
    """

    values: Tensor
    indices: Tensor
    tail: Tensor | None = None
    kind: ValueKind = "logits"

    def __post_init__(self) -> None:
        if self.values.dim() < 2 or self.indices.dim() < 2:
            raise ValueError(
                "SparseTargets expects values and indices of shape [N, k] or [B, T, k], got "
                f"values {tuple(self.values.shape)} and indices {tuple(self.indices.shape)}"
            )
        if self.values.shape != self.indices.shape:
            raise ValueError(
                f"SparseTargets values {tuple(self.values.shape)} and indices "
                f"{tuple(self.indices.shape)} must have the same shape [..., k]"
            )
        if self.values.shape[-1] == 0:
            raise ValueError("SparseTargets needs k >= 1 classes per row, got k = 0")
        if not self.values.is_floating_point():
            raise ValueError(f"SparseTargets values must be floating point, got {self.values.dtype}")
        if self.indices.dtype not in _INDEX_DTYPES:
            raise ValueError(f"SparseTargets indices must be int64 or int32, got {self.indices.dtype}")
        _check_kind(self.kind, "SparseTargets kind")
        if self.tail is not None:
            if self.kind != "logprobs":
                raise ValueError(
                    "SparseTargets got a tail with kind='logits'; the tail mass is a probability at the "
                    "teacher's temperature, so the values must be log-probabilities at that temperature: "
                    "pass kind='logprobs', or drop the tail"
                )
            if self.tail.shape != self.values.shape[:-1]:
                raise ValueError(
                    f"SparseTargets tail {tuple(self.tail.shape)} must have the values' shape without "
                    f"the last dimension, {tuple(self.values.shape[:-1])}"
                )
            if not self.tail.is_floating_point():
                raise ValueError(f"SparseTargets tail must be floating point, got {self.tail.dtype}")

    @classmethod
    def from_outputs(cls, outputs: Mapping[str, Tensor], name: str, kind: ValueKind = "logits") -> SparseTargets:
        """Build from a teacher's outputs dict, which carries ``<name>_TOPK_VALUES`` and
        ``<name>_TOPK_INDICES`` when the teacher serves output ``name`` as top-k, and
        ``<name>_TOPK_TAIL`` when it also sends the mass outside the top-k. ``kind`` says what the
        values are (the teacher's configuration decides it; the wire does not say)."""
        keys = (f"{name}_TOPK_VALUES", f"{name}_TOPK_INDICES")
        missing = [k for k in keys if k not in outputs]
        if missing:
            raise KeyError(
                f"teacher outputs lack {', '.join(missing)} (have: {', '.join(sorted(outputs)) or 'none'}); "
                f"is the teacher serving {name!r} as top-k?"
            )
        return cls(values=outputs[keys[0]], indices=outputs[keys[1]], tail=outputs.get(f"{name}_TOPK_TAIL"), kind=kind)

    @property
    def k(self) -> int:
        """The number of classes kept per row."""
        return int(self.values.shape[-1])

    @property
    def shape(self) -> torch.Size:
        """``[..., k]``, the values' shape."""
        return self.values.shape

    def without_tail(self) -> SparseTargets:
        """The same targets renormalised over the top-k (the tail dropped)."""
        return replace(self, tail=None)

    def log_probs(self, temperature: float = 1.0) -> tuple[Tensor, Tensor | None]:
        """The teacher's log-probabilities of the top-k bins ``[..., k]`` and of the tail bin
        ``[...]`` (None without a tail), float32 or wider, detached.

        ``temperature`` applies to ``kind="logits"`` only (see the class docstring). A tail of exactly
        0 (e.g. underflowed in half precision) counts as the smallest normal number of the compute
        dtype (``torch.finfo(float32).tiny``), so that a reverse KL stays finite.
        """
        _check_temperature(temperature)
        v = _compute(self.values.detach())
        if self.kind == "logits":
            return torch.log_softmax(v / temperature, dim=-1), None
        if self.tail is None:
            return torch.log_softmax(v, dim=-1), None
        tail = self.tail.detach().to(device=v.device, dtype=v.dtype, non_blocking=True)
        log_tail = tail.clamp_min(torch.finfo(v.dtype).tiny).log()
        log_total = torch.logaddexp(torch.logsumexp(v, dim=-1), log_tail)
        return v - log_total.unsqueeze(-1), log_tail - log_total

    def probs(self, temperature: float = 1.0) -> Tensor:
        """The teacher's probabilities of the top-k classes, ``[..., k]``, float32 or wider.

        They sum to 1 without a tail, to ``1 - tail`` with one.
        """
        return self.log_probs(temperature)[0].exp()

    def to_dense(self, num_classes: int, temperature: float = 1.0) -> Tensor:
        """The same distribution scattered into ``[..., num_classes]`` with zeros off the support."""
        if self.k > num_classes:
            raise ValueError(
                f"SparseTargets has k = {self.k} classes per row but num_classes = {num_classes}"
            )
        if self.tail is not None:
            raise ValueError(
                "SparseTargets with a tail cannot be made dense: the tail's mass has no class ids; "
                "use .without_tail() to renormalise over the top-k, or a loss that takes the tail bin"
            )
        p = self.probs(temperature)
        dense = p.new_zeros((*p.shape[:-1], num_classes))
        return dense.scatter_(-1, self.indices.to(p.device, torch.int64), p)
