"""Reading sealed shards: memory-map one, view its columns as torch tensors, gather rows out of them.

A shard is immutable once sealed, so what is read here is read once per process and kept: each
record batch becomes a :class:`_Segment` whose tensors sit on the mapped pages (a private,
copy-on-write mapping), and a lookup gathers rows from segments without reading the file again.
"""

from __future__ import annotations

import mmap
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

from distill.cache.errors import CacheError, DamagedShardError
from distill.cache.format import (
    _INDEXABLE,
    _META_KEY_TYPE,
    _META_NAMESPACE,
    _META_RECORDS,
    KEY_COLUMN,
    KeyType,
    OutputSpec,
    _bytes_keys_to_index,
    _describe,
)
from distill.cache.integrity import RecordChecks, check_schema
from distill.cache.namespace import Namespace
from distill.cache.values import Ragged


@dataclass
class _Segment:
    """One record batch of one sealed shard, with torch views of its columns."""

    shard: int
    keys: np.ndarray
    fixed: dict[str, torch.Tensor]  # name -> [rows, *shape]
    items: dict[str, torch.Tensor]  # name -> [n_items, *item_shape] (variable outputs)
    offsets: dict[str, np.ndarray]  # name -> [rows + 1] item offsets (variable outputs)
    checks: RecordChecks | None = None  # None: written before checksums, read unverified
    alive: np.ndarray | None = None  # rows the index may serve (None: all); damaged records are taken out


@dataclass
class _Shard:
    name: str
    nbytes: int
    rows: int
    tokens: int
    checksums: bool = True  # False: written before checksums


def _tensor_over(values: pa.Array, spec: OutputSpec, mm: mmap.mmap, base: int, size: int) -> torch.Tensor:
    """A flat torch tensor over a primitive Arrow array: on the mapped pages when they are there."""
    n = len(values)
    dtype = spec.torch_dtype
    if n == 0:
        return torch.empty(0, dtype=dtype)
    if values.null_count:
        raise CacheError(f"column {spec.name!r} has nulls: not written by distill.cache")
    buf = values.buffers()[1]
    itemsize = torch.empty(0, dtype=dtype).element_size()
    start = buf.address + values.offset * itemsize
    if base <= start and start + n * itemsize <= base + size:
        return torch.frombuffer(mm, dtype=dtype, count=n, offset=start - base)  # zero-copy
    # Compressed shards decompress into Arrow's heap: one copy, into memory torch owns.
    raw = bytearray(memoryview(buf)[values.offset * itemsize : (values.offset + n) * itemsize])
    return torch.frombuffer(raw, dtype=dtype, count=n)


def read_shard(
    path: Path, namespace: Namespace, key_type: KeyType, known: dict[str, OutputSpec] | None, shard_index: int
) -> tuple[dict[str, OutputSpec], list[_Segment], _Shard]:
    """Map the sealed shard at ``path`` and check it belongs to the store: (its outputs, segments, summary).

    ``known`` is what the store already holds (None before its first readable shard), and
    ``shard_index`` the number the store gives this shard. Raises :class:`DamagedShardError` when
    its footer, schema or a record batch's header is damaged, :class:`CacheError` (or an OS error)
    when it cannot be part of the store; the store then rejects it. Records are not verified here
    but on first use (:class:`RecordChecks`): a damaged record's segment is kept, and never served.
    """
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    whole = pa.py_buffer(mm)
    try:
        reader = pa.ipc.open_file(whole)
        schema = reader.schema
    except pa.ArrowException as e:
        raise DamagedShardError(f"not a readable Arrow file: {e}".splitlines()[0]) from e
    checksums = check_schema(schema)
    meta = schema.metadata or {}
    if _META_NAMESPACE not in meta:
        raise CacheError("no namespace in the shard's metadata: not written by distill.cache")
    try:
        ns = Namespace.from_json(meta[_META_NAMESPACE])
        specs = {f.name: OutputSpec.from_field(f) for f in schema if f.name != KEY_COLUMN}
    except (ValueError, TypeError, AttributeError) as e:  # metadata that is not ours, or damaged (unchecked)
        raise CacheError(f"its metadata cannot be read: {e}") from e
    if ns != namespace:
        raise CacheError(f"namespace differs from the store's in {', '.join(namespace.diff(ns))}")
    if meta.get(_META_KEY_TYPE, b"").decode() != key_type:
        raise CacheError(f"keys are {meta.get(_META_KEY_TYPE, b'?').decode()}, the store's are {key_type}")
    if known is not None and specs != known:
        raise CacheError(f"outputs {_describe(specs)} differ from the store's {_describe(known)}")
    wrong = [f.name for f in schema if f.name in specs and f.type != specs[f.name].arrow_field().type]
    if wrong:
        raise (DamagedShardError if checksums else CacheError)(f"columns {wrong} are not of their dtype's Arrow type")
    segments = []
    rows = tokens = 0
    base, size = whole.address, whole.size
    for i in range(reader.num_record_batches):
        try:
            rb, custom = reader.get_batch_with_custom_metadata(i)
            key_col = rb.column(KEY_COLUMN)
            keys = (
                key_col.to_numpy(zero_copy_only=False).astype(np.int64, copy=False)
                if key_type == "int64"
                else _bytes_keys_to_index(key_col)
            )
        except (pa.ArrowException, OSError, ValueError, KeyError, IndexError) as e:  # OSError: decompression
            raise DamagedShardError(f"record batch {i} cannot be read: {e}".splitlines()[0]) from e
        if not checksums and custom is not None and _META_RECORDS in custom:
            raise DamagedShardError("its schema says it has no checksums, but its record batches have them")
        checks = RecordChecks.of(rb, i, custom) if checksums else None
        seg = _Segment(shard_index, keys, {}, {}, {}, checks)
        try:
            tokens += _columns(seg, rb, specs, mm=mm, base=base, size=size)
        except (CacheError, ValueError, RuntimeError, pa.ArrowException):
            if checks is None:
                raise
            # Columns that cannot even be mapped: the whole record batch is one damaged record.
            seg = _Segment(shard_index, keys, {}, {}, {}, RecordChecks(rb, i, [len(rb)], None))
        segments.append(seg)
        rows += len(rb)
    return specs, segments, _Shard(path.name, size, rows, tokens, checksums)


def _columns(seg: _Segment, rb: pa.RecordBatch, specs: dict[str, OutputSpec], *, mm: mmap.mmap, base: int,
             size: int) -> int:
    """Fill ``seg`` with torch views of ``rb``'s output columns; returns its tokens (the first
    variable output's items)."""
    tokens = 0
    first_variable = next((s.name for s in specs.values() if s.variable), None)
    for spec in specs.values():
        col = rb.column(spec.name)
        if spec.variable:
            offsets = col.offsets.to_numpy().astype(np.int64)
            if np.any(offsets % spec.item_numel):
                raise CacheError(f"column {spec.name!r} has a sample that is not whole rows of {spec.item_shape}")
            flat = _tensor_over(col.values, spec, mm, base, size)
            seg.items[spec.name] = flat.view(-1, *spec.item_shape)
            seg.offsets[spec.name] = offsets // spec.item_numel
            if spec.name == first_variable:
                tokens += int(seg.offsets[spec.name][-1] - seg.offsets[spec.name][0])
        else:
            flat = _tensor_over(col.flatten(), spec, mm, base, size)
            seg.fixed[spec.name] = flat.view(len(rb), *spec.shape)
    return tokens


def gather(segs: Sequence[_Segment], spec: OutputSpec, seg_ids: np.ndarray, rows: np.ndarray) -> torch.Tensor | Ragged:
    """Output ``spec`` of the given (segment, row) pairs, in the order given.

    A run of consecutive rows of one segment is returned as a view of the mapped file; anything
    else is gathered into a new tensor with one vectorised index per segment touched.
    """
    n = len(rows)
    if n == 0:
        empty = torch.empty((0, *spec.item_shape), dtype=spec.torch_dtype)
        return Ragged(empty, torch.zeros(0, dtype=torch.int64)) if spec.variable else empty.view(0, *spec.shape)
    s0 = int(seg_ids[0])
    if n == 1 or (int(seg_ids[-1]) == s0 and bool((seg_ids == s0).all()) and bool((np.diff(rows) == 1).all())):
        # Consecutive rows of one segment (a data set read in the order it was recorded): a view of
        # the mapped file, found without grouping (the common case, on the loader thread per batch).
        r0, r1 = int(rows[0]), int(rows[-1]) + 1
        if not spec.variable:
            return segs[s0].fixed[spec.name][r0:r1]
        off = segs[s0].offsets[spec.name]
        lengths = torch.from_numpy(np.diff(off[r0 : r1 + 1]))
        return Ragged(segs[s0].items[spec.name][int(off[r0]) : int(off[r1])], lengths)
    # One stable sort groups the hits by segment; each group is then one vectorised index.
    order = np.argsort(seg_ids, kind="stable")
    cuts = np.flatnonzero(np.diff(seg_ids[order])) + 1
    groups = [(int(seg_ids[g[0]]), g) for g in np.split(order, cuts)]
    contiguous = len(groups) == 1 and (n == 1 or bool(np.all(np.diff(rows) == 1)))
    if not spec.variable:
        if contiguous:
            return segs[groups[0][0]].fixed[spec.name][int(rows[0]) : int(rows[-1]) + 1]
        work = _INDEXABLE.get(spec.torch_dtype, spec.torch_dtype)
        pieces = [
            segs[s].fixed[spec.name].view(work).index_select(0, torch.from_numpy(rows[pos])) for s, pos in groups
        ]
        return _in_order(pieces, [pos for _, pos in groups]).view(spec.torch_dtype)
    starts = np.empty(n, dtype=np.int64)
    lens = np.empty(n, dtype=np.int64)
    for s, pos in groups:
        off = segs[s].offsets[spec.name]
        r = rows[pos]
        starts[pos] = off[r]
        lens[pos] = off[r + 1] - off[r]
    lengths = torch.from_numpy(lens)
    if contiguous:
        items = segs[groups[0][0]].items[spec.name]
        return Ragged(items[int(starts[0]) : int(starts[0] + lens.sum())], lengths)
    out_starts = np.cumsum(lens) - lens
    work = _INDEXABLE.get(spec.torch_dtype, spec.torch_dtype)
    # Item ranges of all hits at once (in segment order), then cut per segment.
    src_all = _ranges(starts[order], lens[order])
    dst_all = _ranges(out_starts[order], lens[order])
    per_group = np.add.reduceat(lens[order], np.concatenate(([0], cuts))) if len(order) else lens[:0]
    bounds = np.cumsum(per_group)[:-1]
    pieces = [
        segs[s].items[spec.name].view(work).index_select(0, torch.from_numpy(src))
        for (s, _), src in zip(groups, np.split(src_all, bounds), strict=True)
    ]
    return Ragged(_in_order(pieces, np.split(dst_all, bounds)).view(spec.torch_dtype), lengths)


def _in_order(pieces: list[torch.Tensor], dests: Sequence[np.ndarray]) -> torch.Tensor:
    """Rows gathered per segment, put back in asked order: ``out[dests[i][j]] = pieces[i][j]``.

    One concatenation and one ``index_select`` by the inverse permutation: torch's ``index_copy_``
    and indexed assignment are an order of magnitude slower for 16-bit dtypes on CPU.
    """
    if len(pieces) == 1 and bool(np.all(np.diff(dests[0]) == 1)):
        return pieces[0]
    whole = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
    inverse = np.argsort(np.concatenate(dests), kind="stable")
    return whole.index_select(0, torch.from_numpy(inverse))


def _ranges(starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """Concatenation of ``arange(start, start + len)`` for each pair, without a Python loop."""
    total = int(lens.sum())
    before = np.cumsum(lens) - lens
    return np.repeat(starts - before, lens) + np.arange(total, dtype=np.int64)
