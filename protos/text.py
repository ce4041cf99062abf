"""The tensors of text requests, declared once for the teacher and the student.

A teacher with a tokenizer scores text in its own tokens (`teacher_server.text_requests`): a
request sends input `TEXT` (BYTES `[B, 1]`, one UTF-8 string per row) in place of the token ids
and may ask, besides its model's usual outputs computed on the teacher's ids, for `TEXT_IDS`
(INT64 `[B, T]`), `TEXT_SPANS` (INT32 `[B, T, 2]`: each token's byte span [start, end) in its
row's text, (-1, -1) for tokens the tokenizer added and for padding) and `TEXT_MASK` (INT8
`[B, T]`: 1 for the row's tokens). Its vocabulary comes from the same server: input `VOCAB_IDS`
(INT64 `[N, 1]`) answered with `VOCAB_PIECES` (BYTES `[N, 1]`, the bytes each id stands for).
These tensors are optional: a request sends `TEXT` or the ids, never both, and `VOCAB_IDS` alone.

BYTES travel as KServe v2 serialises them (raw contents, Triton's binary data extension): each
element is its length as 4 little-endian bytes, then its bytes (`encode_bytes`, `decode_bytes`).
Pure Python and numpy: nothing here imports torch.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["OPTIONAL_INPUTS", "TEXT", "TEXT_IDS", "TEXT_INPUTS", "TEXT_MASK", "TEXT_ONLY_OUTPUTS",
           "TEXT_OUTPUTS", "TEXT_SPANS", "VOCAB_IDS", "VOCAB_PIECES", "decode_bytes", "encode_bytes",
           "gather_bytes"]

TEXT = "TEXT"
TEXT_IDS = "TEXT_IDS"
TEXT_SPANS = "TEXT_SPANS"
TEXT_MASK = "TEXT_MASK"
VOCAB_IDS = "VOCAB_IDS"
VOCAB_PIECES = "VOCAB_PIECES"

TensorDecl = tuple[str, str, tuple[int, ...]]
"""(name, KServe datatype, per-sample shape; -1: any size)."""

TEXT_INPUTS: tuple[TensorDecl, ...] = ((TEXT, "BYTES", (1,)), (VOCAB_IDS, "INT64", (1,)))
"""The optional inputs a teacher with a tokenizer declares besides its model's."""
TEXT_OUTPUTS: tuple[TensorDecl, ...] = ((TEXT_IDS, "INT64", (-1,)), (TEXT_SPANS, "INT32", (-1, 2)),
                                        (TEXT_MASK, "INT8", (-1,)), (VOCAB_PIECES, "BYTES", (1,)))
"""The outputs a teacher with a tokenizer declares besides its model's."""
OPTIONAL_INPUTS = frozenset(name for name, _, _ in TEXT_INPUTS)
"""Declared inputs a request leaves out unless it sends text or asks the vocabulary."""
TEXT_ONLY_OUTPUTS = frozenset(name for name, _, _ in TEXT_OUTPUTS)
"""Declared outputs only a text (or vocabulary) request answers: a client asking for every declared
output of an ids request leaves them out."""

def encode_bytes(items: Sequence[bytes]) -> bytes:
    """The KServe v2 serialisation of BYTES elements: each one's length (uint32, little-endian), then it."""
    parts: list[bytes] = []
    for item in items:
        parts.append(len(item).to_bytes(4, "little"))
        parts.append(item)
    return b"".join(parts)


def decode_bytes(buf: bytes | memoryview, count: int) -> list[bytes]:
    """The `count` BYTES elements serialised in `buf`; ValueError saying where it does not parse."""
    view = memoryview(buf).cast("B")
    out: list[bytes] = []
    at = 0
    for i in range(count):
        if at + 4 > len(view):
            raise ValueError(f"element {i}: its 4-byte length runs past the {len(view)} bytes received; BYTES "
                             "elements are each a little-endian uint32 length, then that many bytes")
        n = int.from_bytes(view[at:at + 4], "little")
        at += 4
        if at + n > len(view):
            raise ValueError(f"element {i}: length {n} runs past the {len(view)} bytes received")
        out.append(bytes(view[at:at + n]))
        at += n
    if at != len(view):
        raise ValueError(f"{len(view) - at} bytes after the {count} elements of the shape; send one element per row")
    return out


def gather_bytes(blob: np.ndarray, starts: np.ndarray, ends: np.ndarray, index: np.ndarray) -> bytes:
    """The serialised elements `index` of a table of elements held as one serialised `blob` (uint8)
    where element i occupies `blob[starts[i]:ends[i]]` (its length prefix included): one gather,
    no loop per element."""
    first, last = starts[index], ends[index]
    sizes = last - first
    total = int(sizes.sum())
    if total == 0:
        return b""
    offsets = np.cumsum(sizes) - sizes  # where each element lands in the answer
    picks = np.arange(total, dtype=np.int64) + np.repeat(first - offsets, sizes)
    return bytes(blob[picks].tobytes())
