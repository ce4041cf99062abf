"""A student's padded batch, re-batched by the teacher: rows in, rows out.

A training loop pads its batch to the longest row and sends it as one `[B, L_max]` request with
an attention mask. Run as sent, the teacher (the expensive resource) computes every pad position.
Instead, on arrival each row is cut back to the positions its mask marks (`RowSplitter.split`):
from its first marked position to its last, so right padding, left padding and both are cut, and
zeros inside a row stay (with the row's own mask). Each row becomes a `Work` of batch size 1 that
joins the batcher's length buckets with every other queued sequence, from any client and any
front end. When the rows have run, `Rows.assemble` puts the answer back together at the request's
own padded width, in row order, with zeros at the padding positions of per-position outputs.

The token metrics count by the mask: each row's `Work.useful` is its marked positions.

What is refused (InvalidRequestError, INVALID_ARGUMENT), naming the row:
  * a request whose every row is all padding (nothing to compute);
  * a row that is all padding when the request wants an output that is not per-position (a
    sequence-level answer of an empty sequence is undefined; per-position outputs of such a row
    are all padding, so zeros).

A request needs no split (returned as one Work, counted by its mask) when every row's marked span
is the full width. Models this does not apply to (`RowSplitter.applies` is False) are served as
before: no attention mask declared, or an output with a client-sized dimension that is not
per-position (its width would depend on which batch a row ran in).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from teacher_server.errors import InvalidRequestError
from teacher_server.outputs import EncodedOutput
from teacher_server.spec import ModelIO
from teacher_server.work import Work


@dataclass
class Rows:
    """One request split into rows: `works` run (the rows with a marked position), `spans` say
    where each of the request's rows sits in its padded width ((start, stop); start == stop for a
    row that is all padding)."""

    works: list[Work]
    spans: list[tuple[int, int]]
    width: int
    axes: dict[str, int]  # per-position output -> sequence axis (batch dimension included)
    flat: frozenset[str] = frozenset()  # declared outputs that are not per-position

    def axis(self, name: str) -> int | None:
        """The sequence axis of encoded output `name`: that of the per-position output it is, or
        was derived from (`LOGITS_TOPK_VALUES`, and any other `LOGITS_...` a transform adds);
        None for an output that is not per-position."""
        if name in self.axes or name in self.flat:
            return self.axes.get(name)
        return next((a for base, a in self.axes.items() if name.startswith(base + "_")), None)

    def request_rows(self, per_work: Sequence[Sequence[int]]) -> tuple[int, ...]:
        """The request's rows that `works` (one row each) name in `per_work`, in its numbering
        (rows that are all padding ran nowhere and are skipped)."""
        ran = [r for r, (start, stop) in enumerate(self.spans) if start != stop]
        return tuple(ran[k] for k, rows in enumerate(per_work) if rows)

    def assemble(self, answers: Sequence[Sequence[EncodedOutput]]) -> list[EncodedOutput]:
        """The request's outputs from its rows' (`answers`, in `works` order): each output at the
        request's batch size, per-position outputs at its padded width with zeros at padding."""
        template = answers[0]
        out: list[EncodedOutput] = []
        for j, (name, dtype, shape0, raw0) in enumerate(template):
            axis = self.axis(name)
            numel0 = math.prod(shape0)
            itemsize = len(raw0) // numel0 if numel0 else 1
            parts = [a[j] for a in answers]
            if axis is None:
                if len(parts) != len(self.spans):  # cannot happen: RowSplitter refuses empty rows here
                    raise RuntimeError(f"output {name!r} is not per-position but a row was all padding")
                out.append((name, dtype, [len(self.spans), *shape0[1:]], b"".join(p[3] for p in parts)))
                continue
            outer = math.prod(shape0[1:axis])
            inner = math.prod(shape0[axis + 1 :]) * itemsize
            whole = np.zeros((len(self.spans), outer, self.width * inner), dtype=np.uint8)
            k = 0
            for r, (start, stop) in enumerate(self.spans):
                if start == stop:
                    continue
                _, _, shape, raw = parts[k]
                k += 1
                if shape[axis] != stop - start:
                    raise RuntimeError(f"output {name!r}: row {r} came back with {shape[axis]} positions, "
                                       f"{stop - start} were sent")
                whole[r, :, start * inner : stop * inner] = np.frombuffer(raw, dtype=np.uint8).reshape(outer, -1)
            shape = [len(self.spans), *shape0[1:]]
            shape[axis] = self.width
            out.append((name, dtype, shape, whole.tobytes()))
        return out


class RowSplitter:
    """Cuts the rows of one padded model's requests back to their masks (see the module's doc)."""

    def __init__(self, io: ModelIO) -> None:
        if not self.applies(io):
            raise ValueError("RowSplitter needs a padded model with an attention mask and per-position outputs")
        self._io = io
        names = [s.name for s in io.inputs]
        assert io.attention_mask is not None
        self._mask = names.index(io.attention_mask)
        mask_spec = io.inputs[self._mask]
        self._mask_axis = mask_spec.shape.index(-1) + 1
        self._axes = {s.name: s.shape.index(-1) + 1 for s in io.outputs if s.per_position}
        self._per_position = {s.name for s in io.outputs if s.per_position}
        self._flat = frozenset(s.name for s in io.outputs if not s.per_position)

    @staticmethod
    def applies(io: ModelIO) -> bool:
        """Rows can be cut and reassembled: the model is padded, declares its attention mask, and
        every output with a client-sized dimension is per-position."""
        return io.padded and io.attention_mask is not None and all(
            s.per_position or -1 not in s.shape for s in io.outputs)

    def split(self, work: Work) -> Work | Rows:
        """`work` itself (counted by its mask) when no row has padding to cut, else its rows."""
        mask = work.inputs[self._mask]
        marked = mask != 0
        if marked.dim() > 2:  # a mask with more per-sample dimensions: a position is real if any is
            marked = marked.movedim(self._mask_axis, 1).flatten(2).any(dim=2)
        width = marked.shape[1]
        counts = marked.sum(dim=1)  # marked positions per row: what the token metrics count
        if width == 0 or bool((counts == width).all()):
            work.useful = int(counts.sum())
            return work
        first = marked.to(torch.int8).argmax(dim=1)
        last = width - marked.flip(1).to(torch.int8).argmax(dim=1)
        spans = [(int(a), int(b)) if int(c) else (0, 0)
                 for a, b, c in zip(first.tolist(), last.tolist(), counts.tolist(), strict=True)]
        empty = [r for r, (a, b) in enumerate(spans) if a == b]
        name = self._io.inputs[self._mask].name
        if len(empty) == len(spans):
            raise InvalidRequestError(
                f"input {name!r} marks no position in any row: the request has nothing to compute; "
                "send at least one real token per request")
        if empty:
            sequence_level = [w.name for w in work.outputs if w.name not in self._per_position]
            if sequence_level:
                raise InvalidRequestError(
                    f"input {name!r}: row {empty[0]} marks no position, and output {sequence_level[0]!r} is "
                    "not per-position, so that row has no answer; drop rows that are all padding")
        useful = counts.tolist()
        rows = []
        for r, (start, stop) in enumerate(spans):
            if start == stop:
                continue
            inputs = [_row(x, r, plan, start, stop) for x, plan in zip(work.inputs, work.pads, strict=True)]
            # Inputs only the transforms read (SCORE_IDS) are padded like the ids: [B, T, ...].
            aux = {name: x[r : r + 1, start:stop].contiguous() for name, x in work.aux.items()}
            rows.append(Work(inputs, 1, work.outputs, work.shape_key, stop - start, work.pads, useful=int(useful[r]),
                             aux=aux))
        return Rows(rows, spans, width, self._axes, self._flat)


def _row(x: torch.Tensor, r: int, plan: tuple[int, float] | None, start: int, stop: int) -> torch.Tensor:
    """Row `r` of input `x`, cut to [start, stop) along its sequence axis when it has one; a small
    contiguous copy, so the row no longer holds the request's whole buffer alive in the queue."""
    row = x[r : r + 1]
    if plan is not None:
        row = row.narrow(plan[0] + 1, start, stop - start)
    return row.contiguous()
