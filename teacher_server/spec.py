"""What a served model looks like from the wire: tensor names, datatypes and shapes.

Shapes exclude the batch dimension (Triton's convention when max_batch_size > 0); -1 marks a
dimension the client chooses per request.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from protos.kserve import DATATYPES, datatype

# Floating dtypes a model may compute in and floating outputs may be sent as (--compute-dtype,
# --output-dtype and the output_dtype request parameter).
FLOAT_OUTPUT_DTYPES = {"FP32": torch.float32, "FP16": torch.float16, "BF16": torch.bfloat16}

_FORMS = "NAME:DATATYPE:D1,D2,... (e.g. INPUT:FP32:3,32,32 or TOKENS:INT64:-1)"


class SpecError(ValueError):
    """A tensor or model declaration that cannot be served; the message says how to fix it."""


@dataclass(frozen=True)
class TensorSpec:
    name: str
    datatype: str
    shape: tuple[int, ...]

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

    @classmethod
    def parse(cls, text: str) -> TensorSpec:
        """Parse the flag form NAME:DATATYPE:D1,D2,... (an empty shape means one value per sample)."""
        parts = text.split(":")
        if len(parts) != 3 or not parts[0]:
            raise SpecError(f"bad tensor declaration {text!r}; expected {_FORMS}")
        name, dtype, dims = parts
        try:
            shape = tuple(int(d) for d in dims.split(",")) if dims.strip() else ()
        except ValueError:
            raise SpecError(f"bad shape in {text!r}; expected {_FORMS}") from None
        return cls(name, dtype.upper(), shape)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> TensorSpec:
        try:
            return cls(str(d["name"]), str(d["datatype"]).upper(), tuple(int(x) for x in d["shape"]))
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

    @classmethod
    def parse(cls, inputs: Sequence[str], outputs: Sequence[str] = ()) -> ModelIO:
        return cls(tuple(TensorSpec.parse(s) for s in inputs), tuple(TensorSpec.parse(s) for s in outputs))

    def input(self, name: str) -> TensorSpec | None:
        return next((s for s in self.inputs if s.name == name), None)

    def output(self, name: str) -> TensorSpec | None:
        return next((s for s in self.outputs if s.name == name), None)


@dataclass(frozen=True)
class ModelFileConfig:
    """The optional model config file: the same facts as the flags, for models served often."""

    io: ModelIO | None
    max_batch_size: int | None
    name: str | None

    @classmethod
    def load(cls, path: str | Path) -> ModelFileConfig:
        """Read a model config file: our JSON, or Triton's config.pbtxt or JSON (teacher_server.model_config)."""
        from teacher_server.model_config import load_model_config  # here: it imports this module

        return load_model_config(path)
