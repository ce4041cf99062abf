"""A transform registered from outside the library, as a user would add one: `entropy` adds
`<OUT>_ENTROPY` `[.., T]` FP32, the entropy (after temperature) of each position's classes.

Its output is declared once (`ENTROPY_OUTPUT`), named by its teacher-side entry (`ENTROPY`) and,
in a student's process, passed to `distill.outputs.register`. `entropy_lm` is a teacher model
factory that registers the transform in the teacher's own process first, so a real
`python -m teacher_server --model tests.entropy_transform:entropy_lm` serves it.
"""

from __future__ import annotations

from typing import Any

from protos.outputs import DROP_CLASSES, PROBS, flag_output
from teacher_server.transform_rows import Rows
from teacher_server.transforms import REGISTRY, flag_transform, register
from tests.models import TinyLM, tiny_lm

ENTROPY_OUTPUT = flag_output("entropy", DROP_CLASSES, PROBS)
"""`<OUT>_ENTROPY`: one value per position, FP32 unless output_dtype says otherwise."""


def _apply_entropy(rows: Rows) -> None:
    lp = rows.logprobs()
    rows.emit(ENTROPY_OUTPUT, -(lp.exp() * lp).sum(dim=-1))


ENTROPY = flag_transform("entropy", "send <OUT>_ENTROPY, the entropy after temperature of each position",
                         _apply_entropy, outputs=(ENTROPY_OUTPUT,), reduces=True, server_default=False)


def entropy_lm(**kwargs: Any) -> TinyLM:
    """`tests.models.tiny_lm`, on a teacher that serves the entropy transform."""
    if ENTROPY not in REGISTRY:
        register(ENTROPY)
    return tiny_lm(**kwargs)
