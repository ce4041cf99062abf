"""Checksums of a store's shards: what each record and each shard's schema hash to, checked on first read.

Arrow IPC files carry no checksum of their own, so a flipped byte in a shard (a bad disk, a partial
copy, bit rot) would otherwise be read back as a valid teacher output. A writer stores the CRC-32
of each *record* (the rows of one ``append``: one reader batch of teacher answers) in the metadata
of the record batch holding it, over the bytes a reader interprets for those rows (the keys, the
values, a ragged output's offsets relative to its first); and the CRC-32 of the schema's
description (namespace, format, key type, columns and their dtypes and shapes) in the schema's
metadata. A reader checks the schema when it opens a shard and a record the first time a lookup
touches it, once per process: verifying costs one pass over the bytes a lookup reads, and nothing
after. A record that fails is never served (see :meth:`TeacherOutputStore.lookup`).

CRC-32 (zlib) because it runs over Arrow's buffers in place (the mapped pages, no copy, the GIL
released) and detects every burst of up to 32 flipped bits and all but one in 2^32 other damages.
It is no defence against someone editing a shard on purpose, which is not the threat here.
"""

from __future__ import annotations

import json
import zlib
from typing import Any

import numpy as np
import pyarrow as pa

from distill.cache.errors import DamagedShardError
from distill.cache.format import _META_FORMAT, _META_RECORDS, _META_SCHEMA_CRC, FORMAT_NAME, KEY_COLUMN

__all__ = ["RecordChecks", "check_schema", "record_crc", "records_metadata", "with_schema_crc"]

_UNCHECKED_FORMAT = f"{FORMAT_NAME}/1".encode()  # shards written before checksums


def record_crc(batch: pa.RecordBatch, start: int, stop: int) -> int:
    """CRC-32 of rows ``[start, stop)`` of ``batch``: every byte a reader interprets for them.

    The same rows hash alike in a batch of their own (as appended) and inside the larger record
    batch they are written in: offsets are hashed relative to the rows' first, and only the
    value bytes the rows cover are read, in place.
    """
    crc = 0
    for column in batch.slice(start, stop - start).columns:
        crc = _array_crc(column, crc)
    return crc


def _array_crc(arr: pa.Array, crc: int) -> int:
    n = len(arr)
    if n == 0:
        return crc
    t = arr.type
    if pa.types.is_fixed_size_list(t):
        return _array_crc(arr.flatten(), crc)
    if pa.types.is_large_list(t) or pa.types.is_binary(t):
        offsets = np.frombuffer(arr.buffers()[1], dtype=np.int64 if pa.types.is_large_list(t) else np.int32)
        offsets = offsets[arr.offset : arr.offset + n + 1]
        if len(offsets) != n + 1:
            raise ValueError(f"{n} rows but {len(offsets)} offsets")
        crc = zlib.crc32((offsets - offsets[0]).tobytes(), crc)
        lo, hi = int(offsets[0]), int(offsets[-1])
        if pa.types.is_binary(t):
            return _bytes_crc(arr.buffers()[2], lo, hi, crc)
        values = arr.values
        size = values.type.bit_width // 8
        return _bytes_crc(values.buffers()[1], (values.offset + lo) * size, (values.offset + hi) * size, crc)
    size = t.bit_width // 8
    return _bytes_crc(arr.buffers()[1], arr.offset * size, (arr.offset + n) * size, crc)


def _bytes_crc(buf: pa.Buffer | None, lo: int, hi: int, crc: int) -> int:
    if hi == lo:
        return crc
    if buf is None or not 0 <= lo < hi <= buf.size:
        raise ValueError(f"bytes {lo}..{hi} lie outside a buffer of {0 if buf is None else buf.size}")
    return zlib.crc32(memoryview(buf)[lo:hi], crc)  # in place: the mapped file's pages, not a copy


def records_metadata(records: list[tuple[int, int]]) -> dict[bytes, bytes]:
    """A record batch's custom metadata: ``[[rows, crc], ...]``, one pair per record in row order."""
    return {_META_RECORDS: json.dumps(records, separators=(",", ":")).encode()}


def _schema_crc(schema: pa.Schema) -> int:
    # Our own description, not Arrow's type strings (they differ between pyarrow versions): the
    # metadata (namespace, format, key type), and each column's name and dtype/shape metadata.
    meta = sorted((k, v) for k, v in (schema.metadata or {}).items() if k != _META_SCHEMA_CRC)
    columns = [(f.name, f.nullable, sorted((f.metadata or {}).items())) for f in schema]
    return zlib.crc32(repr((meta, columns)).encode())


def with_schema_crc(schema: pa.Schema) -> pa.Schema:
    """``schema`` with the checksum of its own description in its metadata."""
    return schema.with_metadata({**(schema.metadata or {}), _META_SCHEMA_CRC: str(_schema_crc(schema)).encode()})


def check_schema(schema: pa.Schema) -> bool:
    """Whether a shard of this schema carries checksums: False for a shard written before them
    (format version 1, no schema checksum), True when its schema matches its checksum.

    Raises :class:`DamagedShardError` otherwise: a schema without its checksum whose format is
    not version 1, or one whose description does not match the checksum.
    """
    meta = schema.metadata or {}
    stored = meta.get(_META_SCHEMA_CRC)
    if stored is None:
        if meta.get(_META_FORMAT) == _UNCHECKED_FORMAT:
            return False
        raise DamagedShardError(
            f"its schema has no checksum and its format is {meta.get(_META_FORMAT, b'?')[:64]!r}, not "
            f"{_UNCHECKED_FORMAT.decode()!r} (written before checksums): its metadata is damaged")
    if stored != str(_schema_crc(schema)).encode():
        raise DamagedShardError("its schema and metadata do not match their checksum: the file's footer is damaged")
    return True


class RecordChecks:
    """The records of one record batch (their rows and checksums), and which were verified (once each).

    ``crcs`` is None when the record batch's checksums cannot be read: then it is one record of all
    its rows, and damaged.
    """

    def __init__(self, batch: pa.RecordBatch, index: int, rows: list[int], crcs: list[int] | None) -> None:
        self.batch = batch
        self.index = index  # the record batch's position in its shard
        self.ends = np.cumsum(np.asarray(rows, dtype=np.int64))
        self.crcs = crcs
        self.checked = np.zeros(len(rows), dtype=bool)
        self._done = False  # every record checked: asked on each lookup, so kept rather than recounted

    @classmethod
    def of(cls, batch: pa.RecordBatch, index: int, custom: Any) -> RecordChecks:
        """The checks of ``batch`` from its custom metadata (a damaged record batch header: one damaged record)."""
        try:
            pairs = json.loads((custom or {})[_META_RECORDS])
            rows = [int(r) for r, _ in pairs]
            crcs = [int(c) for _, c in pairs]
            if sum(rows) == len(batch) and all(r > 0 for r in rows):
                return cls(batch, index, rows, crcs)
        except (KeyError, ValueError, TypeError):
            pass
        return cls(batch, index, [len(batch)], None)

    @property
    def done(self) -> bool:
        return self._done

    def records_of(self, rows: np.ndarray) -> np.ndarray:
        """The records holding ``rows`` (each once)."""
        return np.unique(np.searchsorted(self.ends, rows, side="right"))

    def rows(self, record: int) -> tuple[int, int]:
        return int(self.ends[record - 1]) if record else 0, int(self.ends[record])

    def verify(self, records: np.ndarray) -> list[int]:
        """Check the given records not checked yet; returns the damaged ones among them."""
        bad = []
        for r in (int(r) for r in records):
            if self.checked[r]:
                continue
            try:
                ok = self.crcs is not None and record_crc(self.batch, *self.rows(r)) == self.crcs[r]
            except (ValueError, IndexError, pa.ArrowException):  # offsets or lengths that point nowhere
                ok = False
            self.checked[r] = True
            if not ok:
                bad.append(r)
        self._done = bool(self.checked.all())
        return bad

    def keys(self, record: int) -> list[Any]:
        """The keys of ``record`` as stored (damaged records may hold damaged keys too)."""
        start, stop = self.rows(record)
        try:
            return self.batch.column(KEY_COLUMN).slice(start, stop - start).to_pylist()
        except (ValueError, pa.ArrowException):
            return []
