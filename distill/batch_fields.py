"""A user's batch's teacher inputs, found inside whatever the loader yields (`extract_inputs`).

A batch may be a tensor, a tuple/list, or a dict (a torch DataLoader yields all three). The
`inputs` option says which fields go to the teacher and under which teacher input name:
`["INPUT"]` sends field "INPUT" as input "INPUT"; `{"INPUT": "image"}` sends field "image";
`{"INPUT": 0}` sends position 0 of a tuple; a bare tensor batch is sent whole, and so is a bare
list of str (texts, `distill.text_fields`). Fields become C-contiguous CPU numpy arrays without
copying when they already are.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from distill.outputs import AUX_INPUTS
from distill.text_fields import as_text_field, is_text
from distill.types import FieldArray, Signature
from protos.kserve import DATATYPES, datatype_of

__all__ = ["extract_inputs", "signature_of"]

_NUMPY_TO_WIRE = {d.numpy_dtype: d.name for d in DATATYPES.values() if d.name != "BF16"}


def _pick(batch: Any, name: str, field: str | int, single: bool) -> Any:
    if isinstance(batch, Mapping):
        if field not in batch:
            raise TypeError(f"teacher input {name!r}: the batch has no key {field!r} (keys: {list(batch)})")
        return batch[field]
    if isinstance(batch, (tuple, list)):
        if single and not isinstance(field, int) and is_text(batch):  # a batch that is its texts
            return batch
        if not isinstance(field, int):
            raise TypeError(
                f"teacher input {name!r}: the batch is a {type(batch).__name__}, so its field must be a "
                f"position; use inputs={{{name!r}: 0}} (got {field!r})"
            )
        if not -len(batch) <= field < len(batch):
            raise TypeError(f"teacher input {name!r}: position {field} is outside a batch of {len(batch)} fields")
        return batch[field]
    if isinstance(batch, (torch.Tensor, np.ndarray)) and single:
        return batch
    raise TypeError(
        f"cannot take teacher input {name!r} from a batch of type {type(batch).__name__}; the loader must "
        "yield tensors, tuples or dicts of tensors"
    )


def _as_array(value: Any, name: str) -> FieldArray:
    if is_text(value):  # strings: a text field (distill.text_fields)
        return as_text_field(value, name)
    if isinstance(value, torch.Tensor):
        t = value.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.contiguous()
        dt = datatype_of(t.dtype)
        arr = t.view(torch.int16).numpy() if t.dtype is torch.bfloat16 else t.numpy()
        return FieldArray(arr, dt.name)
    if isinstance(value, np.ndarray):
        arr = np.ascontiguousarray(value)
        wire = _NUMPY_TO_WIRE.get(arr.dtype.newbyteorder("<") if arr.dtype.byteorder == ">" else arr.dtype)
        if wire is None or arr.dtype.byteorder == ">":
            raise TypeError(f"teacher input {name!r}: numpy dtype {arr.dtype} has no KServe v2 datatype")
        return FieldArray(arr, wire)
    raise TypeError(
        f"teacher input {name!r} is a {type(value).__name__}; the reader sends torch tensors or numpy arrays "
        "whose first dimension is the batch, or texts (a list of str)"
    )


def extract_inputs(batch: Any, inputs: Mapping[str, str | int]) -> tuple[int, dict[str, FieldArray]]:
    """(batch size, teacher input name -> FieldArray), or TypeError naming the field and the problem."""
    single = len(inputs) == 1
    out: dict[str, FieldArray] = {}
    size: int | None = None
    for name, source in inputs.items():
        fa = _as_array(_pick(batch, name, source, single), name)
        if fa.array.ndim == 0:
            raise TypeError(f"teacher input {name!r} is a scalar; it needs a batch dimension first")
        n = fa.array.shape[0]
        if size is not None and n != size:
            raise TypeError(f"teacher input {name!r} has {n} rows but the other inputs have {size}")
        size = n
        want = AUX_INPUTS.get(name)
        if want is not None and fa.datatype != want:
            raise TypeError(f"teacher input {name!r} must be {want} (ids per position, padded like the ids), got "
                            f"{fa.datatype}: convert it, e.g. score_ids.to(torch.int32)")
        out[name] = fa
    assert size is not None
    if size == 0:
        raise TypeError("the loader yielded an empty batch (0 rows); teachers cannot answer it")
    return size, out


def signature_of(fields: Mapping[str, FieldArray]) -> Signature:
    """What a teacher's declared inputs must take: every field but the auxiliary inputs (SCORE_IDS),
    which a teacher reads without declaring them (the teacher checks them itself)."""
    return tuple((n, f.datatype, f.sample_shape) for n, f in fields.items() if n not in AUX_INPUTS)
