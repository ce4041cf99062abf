"""Several small batches in one teacher call.

Every call costs the student a fixed amount of CPU (gRPC's C core, an asyncio task, the answer's
checks), whatever its size; for batches of a few rows from a fast loader that fixed cost is most
of the student's work per batch. Batches the loader read in a row reach the event loop together
(`distill.readahead`), and their chunks go to a teacher as one request when they have the same
inputs (names, datatypes, per-sample shapes) and request parameters, and fit the teacher's batch
limit together: the teacher batches requests anyway, so one request of four batches costs it what four requests do,
and the student pays for one call instead of four.

The chunks that wait for a teacher with a free slot (all are at their in-flight limits) are
bundled the same way when one frees. A call carries at most the waiting rows divided by the number
of usable teachers, so bundling never puts on one teacher what several could compute at once, even
when only one of them has a free slot.

Each chunk of a bundle keeps its own fate: an answer is cut back into the chunks' rows; a failure
sends each chunk again; a refusal sends each alone, with nothing held against it or the teacher
(which batch was refused is unknown), so only the guilty batch is then refused, as it would have
been alone; a late bundle is raced whole on another teacher, and is cancelled only once every
batch it carries is answered.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from distill.batches import Chunk
from distill.types import FieldArray

__all__ = ["bundle_pieces", "fits_with", "split_outputs"]


def _layout(chunk: Chunk) -> tuple[tuple[str, str, tuple[int, ...]], ...]:
    return tuple((n, f.datatype, f.array.shape[1:]) for n, f in chunk.job.fields.items())


def fits_with(first: Chunk, other: Chunk) -> bool:
    """Whether `other` can share a request with `first`: the same inputs, sample shapes included
    (a padded batch of another length cannot join), the same request parameters (a request has one
    temperature), and neither a chunk that was refused, alone or in a bundle (it goes alone until it
    is answered or fails), nor texts (`distill.text_fields`)."""
    if other.suspect or first.suspect or other.alone or first.alone:
        return False
    if first.job.parameters is not other.job.parameters and first.job.parameters != other.job.parameters:
        return False
    a, b = first.job.fields, other.job.fields
    if a.keys() != b.keys() or first.job.text:  # texts go alone: each batch's answer at its own width
        return False
    return _layout(first) == _layout(other)


def bundle_pieces(chunks: Sequence[Chunk]) -> tuple[tuple[Mapping[str, FieldArray], int, int], ...]:
    """The chunks' rows as a request's pieces (`ChunkRequest.pieces`): joined only on the wire."""
    return tuple((c.job.fields, c.start, c.stop) for c in chunks)


def split_outputs(outputs: dict[str, torch.Tensor], chunks: Sequence[Chunk]) -> list[dict[str, torch.Tensor]]:
    """The answer to a bundle, cut back into each chunk's rows (views of the answer's tensors)."""
    parts: list[dict[str, torch.Tensor]] = []
    at = 0
    for c in chunks:
        parts.append({name: value[at:at + c.size] for name, value in outputs.items()})
        at += c.size
    return parts
