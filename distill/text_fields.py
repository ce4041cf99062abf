"""Text fields: a batch field of strings sent to teachers that score text in their own tokens.

A reader whose ``inputs`` name the teacher input ``TEXT`` (`protos.text`) takes that batch field
as a list or tuple of ``str`` (or a numpy array of str or object), one text per row, and sends it as
BYTES ``[B, 1]`` (UTF-8), chunked by rows like any input. Only teachers whose registry record
declares ``text_prompts`` get such a chunk (`distill.capabilities`), or, with no record (a static
``host:port``), whose metadata declares the TEXT input (`distill.teacher_state`).

Each chunk's answer is padded by its teacher to that chunk's longest tokenization, so the chunks
of one batch may come back at different widths T. The batch's outputs are padded on the right to
the widest of them (`PAD_VALUES`): token ids (``TEXT_IDS``, top-k indices) with 0, spans
(``TEXT_SPANS``) with -1, the mask (``TEXT_MASK``) with 0, and every value (log-probabilities,
top-k values, tails, scores) with 0. ``TEXT_MASK`` says which positions are a row's tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from distill.types import FieldArray
from protos.text import TEXT_SPANS, encode_bytes

__all__ = ["PAD_VALUES", "as_text_field", "is_text", "pad_value", "text_rows", "widen"]

PAD_VALUES = {TEXT_SPANS: -1}
"""Per-position outputs padded with something else than 0 when a batch's chunks differ in width."""


def pad_value(name: str) -> int:
    """What the positions past a chunk's own width hold in output `name` of a text batch."""
    return PAD_VALUES.get(name, 0)


def is_text(value: Any) -> bool:
    """Whether a batch field holds texts: a non-empty list or tuple of str, or a numpy array of str
    or object (rows of str)."""
    if isinstance(value, (list, tuple)):
        return bool(value) and all(isinstance(v, str) for v in value)
    return isinstance(value, np.ndarray) and value.dtype.kind in ("U", "O")


def as_text_field(value: Any, name: str) -> FieldArray:
    """The texts of `value` as a BYTES field `[B, 1]` of UTF-8 bytes; TypeError naming a row that
    is not a str."""
    if isinstance(value, np.ndarray) and (value.ndim not in (1, 2) or value.shape[1:] not in ((), (1,))):
        raise TypeError(f"teacher input {name!r}: an array of texts must be [B] or [B, 1], got {list(value.shape)}")
    rows: Sequence[Any] = value.reshape(-1).tolist() if isinstance(value, np.ndarray) else value
    data = np.empty((len(rows), 1), dtype=object)
    for i, text in enumerate(rows):
        if not isinstance(text, str):
            raise TypeError(f"teacher input {name!r}: row {i} is a {type(text).__name__}; a text field holds one "
                            "str per row")
        data[i, 0] = text.encode("utf-8")
    return FieldArray(data, "BYTES")


def text_rows(field: FieldArray, start: int, stop: int) -> bytes:
    """Rows `start`..`stop` of a BYTES field as KServe serialises them (what a request carries)."""
    return encode_bytes(field.array[start:stop, 0].tolist())


def widen(buf: torch.Tensor, width: int, name: str) -> torch.Tensor:
    """`buf` `[B, T, ...]` padded on the right to `width` positions with `pad_value(name)`."""
    grown = torch.full((buf.shape[0], width, *buf.shape[2:]), pad_value(name), dtype=buf.dtype,
                       pin_memory=buf.is_pinned())
    grown[:, :buf.shape[1]] = buf
    return grown
