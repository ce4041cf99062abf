"""Reading a model's declarations from a file: ours (JSON) or Triton's (``config.pbtxt`` or JSON).

``--model-config`` accepts three spellings of the same facts (tensor names, datatypes, per-sample
shapes, the largest batch):

* our JSON: ``{"inputs": [{"name": "INPUT", "datatype": "FP32", "shape": [3, 32, 32]}], "outputs": [...],
  "max_batch_size": 256}``;
* Triton's ``config.pbtxt`` (protobuf text format)::

      name: "ref_teacher"
      max_batch_size: 256
      input [ { name: "INPUT" data_type: TYPE_FP32 dims: [ 3, 32, 32 ] } ]
      output [ { name: "LOGITS" data_type: TYPE_FP32 dims: [ 100 ] } ]

* Triton's JSON form of the same message (``{"input": [{"name": ..., "data_type": "TYPE_FP32",
  "dims": [...]}], ...}``).

Why strict: a declaration we silently dropped (an ``instance_group``, a ``reshape``, a typo) would
serve something other than what the file says, and the first sign would be wrong answers or a
shape error far from the cause. So a key we do not act on is refused, by name, with the flag that
does the same job where there is one. Triton's files are parsed by protobuf itself
(``text_format`` / ``json_format`` into ``model_config_pb2.ModelConfig``), never by hand.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from google.protobuf import json_format, text_format

from protos.kserve import DATATYPES, model_config_pb2
from teacher_server.spec import ModelIO, SpecError, TensorSpec

__all__ = ["ModelFileConfig", "load_model_config", "parse_triton_config"]

# Triton's DataType enum value -> our KServe datatype name (TYPE_FP32 -> FP32, TYPE_STRING -> BYTES).
_FROM_CONFIG_TYPE = {dt.config_type: name for name, dt in DATATYPES.items()}

# ModelConfig fields we act on, and those we accept knowing they change nothing here.
_TRITON_USED = {"name", "max_batch_size", "input", "output"}
_TRITON_HARMLESS = {"platform", "backend"}  # which runtime Triton would use: we run the model ourselves
_TRITON_TENSOR_USED = {"name", "data_type", "dims"}
# What to use instead, for the Triton keys people most often carry over.
_TRITON_INSTEAD = {
    "dynamic_batching": "--max-queue-delay-us / --max-queue-size (dynamic batching is on by default)",
    "instance_group": "--instances and --device",
    "version_policy": "--version",
    "parameters": "the model factory's own arguments",
}
_OURS_TOP = {"name", "max_batch_size", "inputs", "outputs", "attention_mask"}


@dataclasses.dataclass(frozen=True)
class ModelFileConfig:
    """The optional model config file: the same facts as the flags, for models served often."""

    io: ModelIO | None
    max_batch_size: int | None
    name: str | None

    @classmethod
    def load(cls, path: str | Path) -> ModelFileConfig:
        """Read a model config file: our JSON, or Triton's config.pbtxt or JSON."""
        return load_model_config(path)


def load_model_config(path: str | Path) -> ModelFileConfig:
    """Read ``path`` in whichever of the three forms it is (see the module docstring).

    Raises SpecError naming the file and what is wrong: missing, unparsable, or keys we would
    otherwise ignore.
    """
    p = Path(path)
    try:
        text = p.read_text()
    except FileNotFoundError:
        raise SpecError(f"model config {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as e:
        raise SpecError(f"model config {path} cannot be read: {e}") from None
    if p.suffix == ".pbtxt" or not text.lstrip().startswith(("{", "[")):
        msg = model_config_pb2.ModelConfig()
        try:
            text_format.Parse(text, msg)
        except text_format.ParseError as e:
            raise SpecError(f"model config {path} is not a Triton config.pbtxt we can read: {e} "
                            "(a JSON file should start with '{')") from None
        return parse_triton_config(msg, str(path))
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise SpecError(f"model config {path} is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise SpecError(f"model config {path} must be a JSON object with 'inputs' and 'outputs' "
                        "(or Triton's 'input' and 'output')")
    ours = "inputs" in raw or "outputs" in raw or not set(raw) - _OURS_TOP
    if "input" in raw or "output" in raw or not ours:
        msg = model_config_pb2.ModelConfig()
        try:
            json_format.ParseDict(raw, msg)
        except json_format.ParseError as e:
            raise SpecError(f"model config {path} is not a Triton model configuration we can read: {e}") from None
        return parse_triton_config(msg, str(path))
    return _parse_ours(raw, str(path))


def _refuse(where: str, keys: set[str], known: set[str]) -> None:
    if not keys:
        return
    hints = [f"{k}: use {_TRITON_INSTEAD[k]}" for k in sorted(keys) if k in _TRITON_INSTEAD]
    raise SpecError(f"{where}: key(s) {', '.join(sorted(keys))} are not understood by teacher-server, which reads "
                    f"only {', '.join(sorted(known))}; remove them" + (f" ({'; '.join(hints)})" if hints else ""))


def _parse_ours(raw: Mapping[str, Any], path: str) -> ModelFileConfig:
    _refuse(f"model config {path}", set(raw) - _OURS_TOP, _OURS_TOP)
    tensor_keys = {f.name for f in dataclasses.fields(TensorSpec)}
    specs: dict[str, tuple[TensorSpec, ...]] = {}
    for side in ("inputs", "outputs"):
        entries = raw.get(side, [])
        if not isinstance(entries, list) or not all(isinstance(d, dict) for d in entries):
            raise SpecError(f"model config {path}: {side!r} must be a list of objects with name, datatype, shape")
        for d in entries:
            _refuse(f"model config {path}, {side} entry {d.get('name', '?')!r}", set(d) - tensor_keys, tensor_keys)
        specs[side] = tuple(TensorSpec.from_dict(d) for d in entries)
    if specs["outputs"] and not specs["inputs"]:
        raise SpecError(f"model config {path} declares outputs but no inputs; declare the inputs too")
    mask = None if raw.get("attention_mask") is None else str(raw["attention_mask"])
    io = ModelIO(specs["inputs"], specs["outputs"], mask) if specs["inputs"] else None
    return ModelFileConfig(io, _max_batch(raw.get("max_batch_size"), path), _name(raw.get("name"), path))


def _max_batch(value: Any, path: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise SpecError(f"model config {path}: max_batch_size must be a positive integer, got {value!r}")
    return value


def _name(value: Any, path: str) -> str | None:
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise SpecError(f"model config {path}: name must be a string, got {value!r}")
    return value


def _set_fields(msg: Any) -> set[str]:
    return {f.name for f, _ in msg.ListFields()}


def parse_triton_config(msg: model_config_pb2.ModelConfig, where: str = "model config") -> ModelFileConfig:
    """Our view of a Triton ``ModelConfig``: inputs, outputs and the batch bound.

    ``max_batch_size: 0`` means, in Triton, a model that does not batch and whose dims include
    every dimension: served here only when the first dimension of every tensor is -1 (it is then
    the batch dimension, as our server always batches).
    """
    _refuse(where, _set_fields(msg) - _TRITON_USED - _TRITON_HARMLESS, _TRITON_USED | _TRITON_HARMLESS)
    batched = msg.max_batch_size > 0
    sides: dict[str, tuple[TensorSpec, ...]] = {}
    for side, tensors in (("input", msg.input), ("output", msg.output)):
        out = []
        for t in tensors:
            _refuse(f"{where}, {side} {t.name or '?'!r}", _set_fields(t) - _TRITON_TENSOR_USED, _TRITON_TENSOR_USED)
            if t.data_type not in _FROM_CONFIG_TYPE:
                known = ", ".join(model_config_pb2.DataType.Name(d.config_type) for d in DATATYPES.values())
                raise SpecError(f"{where}, {side} {t.name!r}: data_type "
                                f"{model_config_pb2.DataType.Name(t.data_type)} is not supported; use one of {known}")
            dims = tuple(int(d) for d in t.dims)
            if not batched:
                if not dims or dims[0] != -1:
                    raise SpecError(f"{where}: max_batch_size 0 (no batching) with {side} {t.name!r} dims "
                                    f"{list(dims)}; teacher-server always batches: set max_batch_size > 0 and "
                                    "leave the batch dimension out of dims, as Triton does for batching models")
                dims = dims[1:]
            out.append(TensorSpec(t.name, _FROM_CONFIG_TYPE[t.data_type], dims))
        sides[side] = tuple(out)
    if sides["output"] and not sides["input"]:
        raise SpecError(f"{where} declares outputs but no inputs; declare the inputs too")
    io = ModelIO(sides["input"], sides["output"]) if sides["input"] else None
    return ModelFileConfig(io, msg.max_batch_size if batched else None, msg.name or None)
