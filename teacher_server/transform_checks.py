"""The checks of a wanted output against the model's declaration that the transform registry's
entries name (`teacher_server.transforms`), and the facts about a model they rest on.

Each check is made for one parameter by its wire name (`per_position("token_ranks")`), so a
registry entry built by `teacher_server.transforms.flag_transform` names its parameter once; it
returns why the wanted output cannot be served, in words for the client, or None.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from teacher_server.spec import FLOAT_OUTPUT_DTYPES, ModelIO, TensorSpec

__all__ = ["OutputCheck", "Wanted", "class_dim", "per_position", "scoreable", "tail_check", "token_input",
           "top_k_check"]


class Wanted(Protocol):
    """What the checks read of a wanted output (`teacher_server.transforms.OutputTransform`)."""

    @property
    def name(self) -> str: ...
    def __getitem__(self, key: str) -> object: ...


OutputCheck = Callable[[Wanted, TensorSpec, frozenset[str]], "str | None"]
"""(wanted output, the model's declaration of it, the parameters the request named) -> why not, or None."""


def class_dim(what: str) -> OutputCheck:
    """`what` needs a class dimension on a floating output."""
    def check(want: Wanted, spec: TensorSpec, asked: frozenset[str]) -> str | None:
        floating = spec.datatype in FLOAT_OUTPUT_DTYPES or spec.datatype == "FP64"
        if want[what] and floating and not spec.shape:
            return f"output {want.name!r} has no class dimension; {what} needs one"
        return None
    return check


def top_k_check(what: str) -> OutputCheck:
    """`what` (a k) needs a class dimension at least k wide."""
    def check(want: Wanted, spec: TensorSpec, asked: frozenset[str]) -> str | None:
        k = int(want[what] or 0)  # type: ignore[call-overload]
        if not k:
            return None
        if not spec.shape:
            return f"output {want.name!r} has no class dimension; {what} needs one"
        if spec.shape[-1] != -1 and k > spec.shape[-1]:
            return f"output {want.name!r}: {what} {k} exceeds its last dimension {spec.shape[-1]}"
        return None
    return check


def tail_check(what: str) -> OutputCheck:
    """`what`, the mass outside the top-k, asked for without a top-k."""
    def check(want: Wanted, spec: TensorSpec, asked: frozenset[str]) -> str | None:
        if want[what] and not want["top_k"] and what in asked:
            return f"output {want.name!r}: {what} is the probability mass outside the top-k; ask for top_k too"
        return None
    return check


def per_position(what: str) -> OutputCheck:
    """`what` reads each position's next token: a floating per-position output with classes."""
    def check(want: Wanted, spec: TensorSpec, asked: frozenset[str]) -> str | None:
        if not want[what]:
            return None
        if not scoreable(spec):
            return (f"output {want.name!r}: {what} needs a floating per-position output [T, V] of a model with a "
                    "padded token input (an hf: causal LM has one: LOGITS)")
        return None
    return check


def scoreable(spec: TensorSpec) -> bool:
    """Whether the scoring transforms apply to output `spec`: floating, per position, with classes."""
    return spec.per_position and spec.datatype.startswith(("FP", "BF")) and len(spec.shape) >= 2


def token_input(io: ModelIO) -> int | None:
    """The index of the model's token input: its first padded integer input that is not the
    attention mask (an hf: causal LM's INPUT_IDS); None when it has none."""
    for i, s in enumerate(io.inputs):
        if s.pad_value is not None and not s.attention_mask and s.datatype.startswith(("INT", "UINT")):
            return i
    return None
