"""A teacher's answer for texts (the text contract's outputs), as the cross-tokenizer losses read it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["TeacherText"]


@dataclass(frozen=True)
class TeacherText:
    """The teacher's tokens of a batch of texts and its scores of them, padded to its own T.

    Attributes:
        ids: int64 ``[B, T]`` ``TEXT_IDS``.
        spans: int32 ``[B, T, 2]`` ``TEXT_SPANS``: byte spans, (-1, -1) for added tokens and padding.
        mask: ``[B, T]`` ``TEXT_MASK``: 1 for the row's tokens.
        topk_values: ``[B, T, k]`` log-probabilities ``<OUT>_TOPK_VALUES`` at position ``t`` for the token
            after ``t`` (the teacher's distribution of token ``j`` sits at ``j - 1``), or None.
        topk_indices: ``[B, T, k]`` ``<OUT>_TOPK_INDICES``, teacher ids, or None.
        topk_tail: ``[B, T]`` ``<OUT>_TOPK_TAIL``, the probability outside the top-k, or None.
        token_logprobs: ``[B, T]`` ``<OUT>_TOKEN_LOGPROBS``: at ``t``, log p(x[t+1] | x[<=t]), or None.
    """

    ids: Tensor
    spans: Tensor
    mask: Tensor
    topk_values: Tensor | None = None
    topk_indices: Tensor | None = None
    topk_tail: Tensor | None = None
    token_logprobs: Tensor | None = None

    @classmethod
    def from_outputs(cls, outputs: Mapping[str, Tensor], name: str = "LOGITS") -> TeacherText:
        """From a reader's teacher outputs: ``TEXT_IDS``, ``TEXT_SPANS``, ``TEXT_MASK`` and, where
        asked, ``<name>_TOPK_VALUES``/``_TOPK_INDICES``/``_TOPK_TAIL`` and ``<name>_TOKEN_LOGPROBS``."""
        missing = [k for k in ("TEXT_IDS", "TEXT_SPANS", "TEXT_MASK") if k not in outputs]
        if missing:
            raise KeyError(f"teacher outputs lack {', '.join(missing)} (have: {', '.join(sorted(outputs)) or 'none'}); "
                           "send the texts as the TEXT input and ask for TEXT_IDS, TEXT_SPANS and TEXT_MASK")
        return cls(torch.as_tensor(outputs["TEXT_IDS"]), torch.as_tensor(outputs["TEXT_SPANS"]),
                   torch.as_tensor(outputs["TEXT_MASK"]), _get(outputs, f"{name}_TOPK_VALUES"),
                   _get(outputs, f"{name}_TOPK_INDICES"), _get(outputs, f"{name}_TOPK_TAIL"),
                   _get(outputs, f"{name}_TOKEN_LOGPROBS"))

    def token_scores(self) -> Tensor:
        """float ``[B, T]``: each token's own log-probability, ``token_logprobs`` shifted so that token
        ``j`` holds the score sent at ``j - 1`` (0 for token 0, which has no context)."""
        if self.token_logprobs is None:
            raise ValueError("the teacher's answer has no token log-probabilities; ask for them "
                             "(request parameter token_logprobs: true, output <OUT>_TOKEN_LOGPROBS)")
        lp = self.token_logprobs.float()
        return torch.cat([torch.zeros_like(lp[:, :1]), lp[:, :-1]], dim=1)

    def require_topk(self) -> tuple[Tensor, Tensor]:
        """(values, indices) of the top-k, or ValueError saying what to ask for."""
        if self.topk_values is None or self.topk_indices is None:
            raise ValueError("the teacher's answer has no top-k log-probabilities; ask for LOGITS with top_k "
                             "(outputs <OUT>_TOPK_VALUES and <OUT>_TOPK_INDICES)")
        return self.topk_values, self.topk_indices


def _get(outputs: Mapping[str, Tensor], key: str) -> Tensor | None:
    return torch.as_tensor(outputs[key]) if key in outputs else None
