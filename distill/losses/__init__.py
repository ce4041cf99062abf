"""Knowledge-distillation losses for the student's training loop.

* ``KDLoss`` (``distill.losses.classifier``): ``[N, C]`` logits, one row per sample; forward KL
  with temperature, ``T²`` on the soft term, hard/soft weight, several teachers averaged.
* ``TokenKDLoss`` and ``token_divergence`` (``distill.losses.token``): ``[B, T, V]`` logits, one
  row per token; forward KL, reverse KL or generalized JSD, masked, averaged per token, chunked.
* ``SparseTargets`` (``distill.losses.sparse``): a teacher's top-k output, logits or
  log-probabilities, with an optional tail mass; both losses take it.
* ``ScoredTargets`` (``distill.losses.scored``): the teacher's exact log-probabilities at any ids
  per position (the union of the student's top-k, the teacher's top-k and the sampled token);
  the token losses take it and compute forward KL, reverse KL or JSD on that support plus a tail.
* ``sampled_token_pg_loss``, ``sampled_token_log_ratio``, ``token_advantages``
  (``distill.losses.on_policy``): per-token ``log q - log p`` on the student's own samples, as a
  reward / advantage for policy-gradient on-policy distillation.
"""

from __future__ import annotations

import warnings
from typing import Any

from distill.losses._common import Reduction, ValueKind
from distill.losses.classifier import KDLoss, TeacherTargets, average_teachers, kd_kl_div, soft_targets
from distill.losses.on_policy import sampled_token_log_ratio, sampled_token_pg_loss, token_advantages
from distill.losses.scored import ScoredTargets
from distill.losses.sparse import SparseTargets
from distill.losses.token import (
    Divergence,
    TokenKDLoss,
    TokenReduction,
    TokenTeacherTargets,
    token_divergence,
)

__all__ = [
    "Divergence",
    "KDLoss",
    "Reduction",
    "ScoredTargets",
    "SparseTargets",
    "TeacherTargets",
    "TokenKDLoss",
    "TokenReduction",
    "TokenTeacherTargets",
    "ValueKind",
    "average_teachers",
    "kd_kl_div",
    "sampled_token_log_ratio",
    "sampled_token_pg_loss",
    "soft_targets",
    "token_advantages",
    "token_divergence",
]


def __getattr__(name: str) -> Any:
    # ``Teacher`` was this module's name for ``TeacherTargets``; the router's teacher record has that name.
    if name == "Teacher":
        warnings.warn(
            "distill.losses.Teacher is renamed TeacherTargets (Teacher is the router's record); "
            "import TeacherTargets instead",
            DeprecationWarning,
            stacklevel=2,
        )
        return TeacherTargets
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
