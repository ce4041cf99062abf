"""What a served model looks like from the wire: tensor names, datatypes and shapes.

Shapes exclude the batch dimension (Triton's convention when max_batch_size > 0); -1 marks a
dimension the client chooses per request.

Requests whose -1 dimensions differ are never batched together, unless the model declares its
sequence inputs padded: an input with exactly one -1 dimension (its sequence axis) and a
`pad_value` may be padded to the longest request in a batch, and an output marked
`per_position` (exactly one -1 dimension, the same positions) is cut back to each request's own
length. `ModelIO.attention_mask` names the input that tells the model which positions are real:
it is padded with 0, and filled with ones when a client sends none. The flag forms are
`--input TOKENS:INT64:-1:pad=0`, `--output LOGITS:FP32:-1,100:per_position` and
`--attention-mask MASK`; in the JSON config `"pad_value": 0`, `"per_position": true` and a
top-level `"attention_mask": "MASK"`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from protos.kserve import DATATYPES, datatype

# Floating dtypes a model may compute in and floating outputs may be sent as (--compute-dtype,
# --output-dtype and the output_dtype request parameter).
FLOAT_OUTPUT_DTYPES = {"FP32": torch.float32, "FP16": torch.float16, "BF16": torch.bfloat16}

_FORMS = ("NAME:DATATYPE:D1,D2,...[:pad=V|:mask|:per_position] "
          "(e.g. INPUT:FP32:3,32,32, TOKENS:INT64:-1:pad=0 or LOGITS:FP32:-1,100:per_position)")


class SpecError(ValueError):
    """A tensor or model declaration that cannot be served; the message says how to fix it."""


@dataclass(frozen=True)
class TensorSpec:
    name: str
    datatype: str
    shape: tuple[int, ...]
    pad_value: float | None = None  # inputs: requests of different lengths are padded with it
    per_position: bool = False  # outputs: one entry per input position, cut back per request
    attention_mask: bool = False  # inputs: 1 at real positions, padded with 0, built when not sent
    # Integer inputs: values must be in 0..max_value-1 (token ids: the vocabulary); padded inputs: at
    # most max_length positions (the model's context). Checked before a request is queued.
    max_value: int | None = None
    max_length: int | None = None

    def __post_init__(self) -> None:
        if not self.name:
            raise SpecError("a tensor needs a name")
        if self.datatype not in DATATYPES:
            raise SpecError(
                f"tensor {self.name!r}: datatype {self.datatype!r} is not supported; "
                f"use one of {', '.join(DATATYPES)}"
            )
        if any(d == 0 or d < -1 for d in self.shape):
            raise SpecError(f"tensor {self.name!r}: dimensions must be positive or -1, got {list(self.shape)}")
        if (self.pad_value is not None or self.per_position or self.attention_mask) and self.shape.count(-1) != 1:
            raise SpecError(
                f"tensor {self.name!r}: a padded or per-position tensor needs exactly one -1 dimension "
                f"(its sequence axis), got {list(self.shape)}"
            )
        if self.pad_value is not None and self.pad_value != int(self.pad_value) and not self.datatype.startswith(
            ("FP", "BF")
        ):
            raise SpecError(f"tensor {self.name!r}: pad value {self.pad_value} does not fit {self.datatype}")
        if self.attention_mask and (self.pad_value is not None or self.per_position):
            raise SpecError(f"tensor {self.name!r}: an attention mask is padded with 0; give it no other option")

    @property
    def seq_axis(self) -> int | None:
        """The per-sample axis that is padded (inputs) or cut back (outputs); None for neither."""
        if self.pad_value is None and not self.per_position and not self.attention_mask:
            return None
        return self.shape.index(-1)

    @classmethod
    def parse(cls, text: str) -> TensorSpec:
        """Parse the flag form NAME:DATATYPE:D1,D2,... (an empty shape means one value per sample),
        optionally followed by :pad=V (a padded sequence input), :mask (the attention mask input)
        or :per_position (an output cut back to each request's length)."""
        parts = text.split(":")
        if len(parts) not in (3, 4) or not parts[0]:
            raise SpecError(f"bad tensor declaration {text!r}; expected {_FORMS}")
        name, dtype, dims = parts[:3]
        try:
            shape = tuple(int(d) for d in dims.split(",")) if dims.strip() else ()
        except ValueError:
            raise SpecError(f"bad shape in {text!r}; expected {_FORMS}") from None
        pad: float | None = None
        per_position = mask = False
        if len(parts) == 4:
            opt = parts[3].strip()
            if opt == "per_position":
                per_position = True
            elif opt == "mask":
                mask = True
            elif opt.startswith("pad="):
                try:
                    pad = float(opt[4:])
                except ValueError:
                    raise SpecError(f"bad pad value in {text!r}; expected {_FORMS}") from None
            else:
                raise SpecError(f"unknown option {opt!r} in {text!r}; expected {_FORMS}")
        return cls(name, dtype.upper(), shape, pad, per_position, mask)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> TensorSpec:
        try:
            pad = d.get("pad_value")
            return cls(str(d["name"]), str(d["datatype"]).upper(), tuple(int(x) for x in d["shape"]),
                       float(pad) if pad is not None else None, bool(d.get("per_position", False)),
                       bool(d.get("attention_mask", False)))
        except (TypeError, ValueError) as e:
            raise SpecError(f"tensor declaration {dict(d)}: {e}") from None
        except KeyError as e:
            raise SpecError(f"tensor declaration {dict(d)} lacks {e.args[0]!r}") from None

    def matches(self, shape: Sequence[int]) -> bool:
        """Whether a per-sample shape (batch dimension removed) fits this declaration."""
        return len(shape) == len(self.shape) and all(
            want in (-1, got) for want, got in zip(self.shape, shape, strict=True)
        )

    @property
    def torch_dtype(self) -> torch.dtype:
        return datatype(self.datatype).torch_dtype


@dataclass(frozen=True)
class ModelIO:
    """The declared inputs and outputs of a model, in the order forward() takes and returns them."""

    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...] = field(default=())
    attention_mask: str | None = None  # the input marking real positions (1) and padding (0)

    def __post_init__(self) -> None:
        # The mask is a mark on its input spec (so copies of `inputs` keep it) and named here too.
        if self.attention_mask is not None:
            if self.input(self.attention_mask) is None:
                raise SpecError(
                    f"attention mask {self.attention_mask!r} is not one of the inputs {[s.name for s in self.inputs]}")
            object.__setattr__(self, "inputs", tuple(
                replace(s, attention_mask=True) if s.name == self.attention_mask and not s.attention_mask else s
                for s in self.inputs))
        masks = [s.name for s in self.inputs if s.attention_mask]
        if len(masks) > 1:
            raise SpecError(f"inputs {masks} are all marked as the attention mask; mark one")
        if masks:
            object.__setattr__(self, "attention_mask", masks[0])
            if not any(s.pad_value is not None for s in self.inputs):
                raise SpecError(
                    f"attention mask {masks[0]!r} declared but no input is padded; give the token input pad=V")
        for s in self.outputs:
            if s.pad_value is not None or s.attention_mask:
                raise SpecError(f"output {s.name!r}: pad values and masks belong to inputs; mark outputs per_position")
        for s in self.inputs:
            if s.per_position:
                raise SpecError(f"input {s.name!r}: per_position belongs to outputs; give inputs pad=V")

    @classmethod
    def parse(cls, inputs: Sequence[str], outputs: Sequence[str] = (), attention_mask: str | None = None) -> ModelIO:
        return cls(tuple(TensorSpec.parse(s) for s in inputs), tuple(TensorSpec.parse(s) for s in outputs),
                   attention_mask)

    @property
    def padded(self) -> bool:
        """Requests of different sequence lengths may share a batch (some input declares a pad value)."""
        return any(s.pad_value is not None for s in self.inputs)

    def input_pad(self, index: int) -> float | None:
        """The value input `index` is padded with (the mask pads with 0); None: never padded."""
        s = self.inputs[index]
        return 0.0 if s.attention_mask else s.pad_value

    def input(self, name: str) -> TensorSpec | None:
        return next((s for s in self.inputs if s.name == name), None)

    def output(self, name: str) -> TensorSpec | None:
        return next((s for s in self.outputs if s.name == name), None)
