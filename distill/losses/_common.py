"""Checks and dtype rules shared by the classifier and the token-level losses."""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor

Reduction = Literal["batchmean", "sum", "none"]
_REDUCTIONS: tuple[str, ...] = ("batchmean", "sum", "none")

ValueKind = Literal["logits", "logprobs"]
_VALUE_KINDS: tuple[str, ...] = ("logits", "logprobs")

_INDEX_DTYPES = (torch.int64, torch.int32)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _compute(t: Tensor, like: Tensor | None = None) -> Tensor:
    """``t`` in at least float32, or in ``like``'s dtype and on its device when given."""
    if like is None:
        return t.to(_compute_dtype(t.dtype))
    return t.to(device=like.device, dtype=like.dtype, non_blocking=True)


def _number(name: str, value: float) -> float:
    if isinstance(value, (bool, str, bytes)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}") from None


def _check_temperature(temperature: float) -> float:
    t = _number("temperature", temperature)
    if not (math.isfinite(t) and t > 0):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    return t


def _check_kind(kind: str, what: str = "kind") -> None:
    if kind not in _VALUE_KINDS:
        raise ValueError(f"{what} must be 'logits' or 'logprobs', got {kind!r}")


def _check_reduction(reduction: str) -> None:
    if reduction not in _REDUCTIONS:
        hint = (
            " (torch's 'mean' divides by N*C and is not the KL divergence; use 'batchmean')"
            if reduction == "mean"
            else ""
        )
        raise ValueError(f"reduction must be one of {', '.join(_REDUCTIONS)}, got {reduction!r}{hint}")


def _reduce(per_sample: Tensor, reduction: str) -> Tensor:
    if reduction == "batchmean":
        return per_sample.mean()
    if reduction == "sum":
        return per_sample.sum()
    return per_sample


def _kept_rows(valid: Tensor | None, rows: int, what: str) -> Tensor | None:
    """The indices (int64, on ``valid``'s device) of the rows a per-row validity mask keeps; None
    when there is no mask or it keeps every row, so the common case costs nothing. The reader
    delivers such a mask (``distill.outputs.VALID_ROWS``) for rows whose teacher outputs are not
    finite, with ``nonfinite="mask"``."""
    if valid is None:
        return None
    if valid.dtype != torch.bool or tuple(valid.shape) != (rows,):
        raise ValueError(
            f"valid must be a bool tensor of shape [{rows}] (one flag per row of {what}), got "
            f"{valid.dtype} {tuple(valid.shape)}; pass the reader's teacher['VALID_ROWS'] as it is"
        )
    if bool(valid.all()):
        return None
    return valid.nonzero().squeeze(1)
