"""The student side of the distillation mesh.

A training job reads its batches through a reader that sends them to teacher servers (found from
a fixed list or the etcd registry), routes chunks to the least-loaded teacher, and yields each
batch with its teacher outputs; the KD losses here turn those outputs into a training signal;
``add_distill_args`` gives every script the same ``--distill_*`` flags; ``distill.autoscale``
keeps the teacher pool sized to the students' demand.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Imported on first use: `distill-autoscaler` and `distill top` need none of it, and the reader and
# the losses import torch (seconds of start-up).
_EXPORTS = {
    "BatchRejectedError": "distill.errors",
    "DistillError": "distill.errors",
    "FingerprintChangedError": "distill.fingerprints",
    "NoCapableTeacherError": "distill.capabilities",
    "NoTeacherError": "distill.errors",
    "ReaderClosedError": "distill.errors",
    "ReaderInUseError": "distill.errors",
    "StaleIteratorError": "distill.errors",
    "TeacherAccessError": "distill.errors",
    "TeacherMismatchError": "distill.errors",
    "add_distill_args": "distill.flags",
    "distill_options_from_args": "distill.flags",
    "KDLoss": "distill.losses",
    "SparseTargets": "distill.losses",
    "average_teachers": "distill.losses",
    "TeacherTargets": "distill.losses",
    "TokenKDLoss": "distill.losses",
    "token_divergence": "distill.losses",
    "DistillReader": "distill.reader",
    "ReaderOptions": "distill.options",
    "RouterConfig": "distill.config",
    "ReaderStats": "distill.stats",
    "ScoreFuture": "distill.submit",
    "SubmitLimitError": "distill.submit",
}

if TYPE_CHECKING:
    from distill.capabilities import NoCapableTeacherError
    from distill.config import RouterConfig
    from distill.errors import (
        BatchRejectedError,
        DistillError,
        NoTeacherError,
        ReaderClosedError,
        ReaderInUseError,
        StaleIteratorError,
        TeacherAccessError,
        TeacherMismatchError,
    )
    from distill.fingerprints import FingerprintChangedError
    from distill.flags import add_distill_args, distill_options_from_args
    from distill.losses import KDLoss, SparseTargets, TeacherTargets, TokenKDLoss, average_teachers, token_divergence
    from distill.options import ReaderOptions
    from distill.reader import DistillReader
    from distill.stats import ReaderStats
    from distill.submit import ScoreFuture, SubmitLimitError


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'distill' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "BatchRejectedError",
    "DistillError",
    "DistillReader",
    "FingerprintChangedError",
    "KDLoss",
    "NoCapableTeacherError",
    "NoTeacherError",
    "ReaderClosedError",
    "ReaderInUseError",
    "ReaderOptions",
    "ReaderStats",
    "RouterConfig",
    "ScoreFuture",
    "SparseTargets",
    "StaleIteratorError",
    "SubmitLimitError",
    "TeacherAccessError",
    "TeacherMismatchError",
    "TeacherTargets",
    "TokenKDLoss",
    "add_distill_args",
    "average_teachers",
    "distill_options_from_args",
    "token_divergence",
]
