"""Writing a store: each process appends to its own shards under ``tmp/`` and seals them into ``shards/``.

A shard becomes visible to readers only by an atomic rename after its footer is written and
fsynced, so a writer killed mid-shard leaves a ``.partial`` file that no reader opens (see
:mod:`distill.cache.store` for the layout).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, Protocol, Union

import numpy as np
import pyarrow as pa
import torch

from distill.cache.errors import SchemaMismatchError, StoreClosedError
from distill.cache.format import (
    _DTYPES,
    _META_FINGERPRINTS,
    _META_FORMAT,
    _META_KEY_TYPE,
    _META_NAMESPACE,
    FORMAT_NAME,
    KEY_COLUMN,
    SHARD_FORMAT_VERSION,
    KeyType,
    OutputSpec,
    _as_bytes_list,
    _as_int_keys,
    _describe,
    _dtype_name,
    _fsync_dir,
    _host,
)
from distill.cache.integrity import record_crc, records_metadata, with_schema_crc
from distill.cache.namespace import Namespace
from distill.cache.values import Ragged

__all__ = ["OutputValue", "ShardWriter", "WritableStore"]


class WritableStore(Protocol):
    """What a writer needs of its store (``TeacherOutputStore`` is one): where it lives, what its
    shards are named by, and what it holds already. The writer does not reach into the store
    otherwise, so the store can import the writer without the writer importing the store."""

    @property
    def path(self) -> Path: ...

    @property
    def namespace(self) -> Namespace: ...

    @property
    def key_type(self) -> KeyType: ...

    @property
    def output_specs(self) -> dict[str, OutputSpec]: ...

# A fixed-shape output [N, ...]; or a variable-length one: N tensors [T_i, ...], or a Ragged (packed).
OutputValue = Union[torch.Tensor, np.ndarray, "Ragged", Sequence[Union[torch.Tensor, np.ndarray]]]  # noqa: UP007


class ShardWriter:
    """Appends whole batches to this process's own shards and seals them atomically.

    Rows go to ``tmp/<writer>-<seq>.arrow.partial`` as Arrow IPC record batches; :meth:`seal`
    writes the file footer, fsyncs, and renames the file into ``shards/`` (then fsyncs the
    directory). A process killed before that leaves the ``.partial`` file, which no reader opens.
    Not thread-safe: one writer per thread.
    """

    def __init__(
        self,
        store: WritableStore,
        shard_max_bytes: int,
        shard_max_rows: int | None,
        compression: Literal["zstd", "lz4"] | None,
        batch_bytes: int = 16 << 20,
    ) -> None:
        self.store = store
        self.shard_max_bytes = shard_max_bytes
        self.shard_max_rows = shard_max_rows
        self.batch_bytes = batch_bytes
        self._pending: list[pa.RecordBatch] = []
        self._pending_bytes = 0
        self._pending_records: list[tuple[int, int]] = []  # (rows, CRC-32) of each appended batch
        self._options = pa.ipc.IpcWriteOptions(compression=compression)
        self.writer_id = f"{_host()}.{os.getpid()}.{secrets.token_hex(4)}"
        self._seq = 0
        self._specs: dict[str, OutputSpec] | None = store.output_specs or None
        self._schema: pa.Schema | None = None
        self._sink: pa.NativeFile | None = None
        self._ipc: Any = None
        self._tmp: Path | None = None
        self._rows = 0
        self.sealed: list[Path] = []
        self._closed = False
        self.fingerprints: dict[str, str] = {}  # see set_fingerprints()

    def set_fingerprints(self, fingerprints: Mapping[str, str]) -> None:
        """The fingerprints ({service: fingerprint}) of the teachers whose answers are appended from
        now on, recorded in each shard's metadata. A shard holds one teacher's answers per service:
        a change seals the shard open (it keeps the fingerprints it was written under)."""
        wanted = {s: fp for s, fp in fingerprints.items() if fp}
        if wanted != self.fingerprints:
            self.seal()
            self.fingerprints = wanted

    def append(self, keys: Any, outputs: Mapping[str, OutputValue]) -> None:
        """Append one batch: ``keys`` (N ints, or N bytes/str) and, per output, either a tensor
        ``[N, ...]`` or a list of N tensors ``[T_i, ...]`` (variable length, same trailing shape).

        Every batch must carry the same outputs with the same dtypes and per-sample shapes as the
        store holds. The batch is written to disk now, but readers see it only once its shard is sealed.
        """
        if self._closed:
            raise StoreClosedError("this shard writer is closed; make a new one with store.writer()")
        if self.store.key_type == "int64":
            key_arr = pa.array(_as_int_keys(keys), type=pa.int64())
        else:
            key_arr = pa.array(_as_bytes_list(keys), type=pa.binary())
        n = len(key_arr)
        if n == 0:
            return
        columns, specs = self._columns(n, outputs)
        if self._specs is None:
            self._specs = specs
        elif specs != self._specs:
            raise SchemaMismatchError(
                f"appended outputs {_describe(specs)} differ from the store's {_describe(self._specs)}: every batch "
                "must carry the same outputs, dtypes and per-sample shapes"
            )
        if self._ipc is None:
            self._start_shard()
        assert self._schema is not None and self._ipc is not None and self._sink is not None
        batch = pa.RecordBatch.from_arrays([key_arr, *columns], schema=self._schema)
        # Each append is one record with its own checksum (distill.cache.integrity), hashed here on
        # the appending thread (a reader's writer thread) while its bytes are still in cache.
        self._pending_records.append((n, record_crc(batch, 0, n)))
        self._pending.append(batch)
        self._pending_bytes += batch.nbytes
        self._rows += n
        if self._pending_bytes >= self.batch_bytes:
            self._flush()
        if self._sink.tell() + self._pending_bytes >= self.shard_max_bytes or (
            self.shard_max_rows is not None and self._rows >= self.shard_max_rows
        ):
            self.seal()

    def _columns(self, n: int, outputs: Mapping[str, OutputValue]) -> tuple[list[pa.Array], dict[str, OutputSpec]]:
        names = list(self._specs) if self._specs is not None else sorted(outputs)
        if set(names) != set(outputs):
            raise SchemaMismatchError(f"appended outputs {sorted(outputs)} differ from the store's {sorted(names)}")
        cols: list[pa.Array] = []
        specs: dict[str, OutputSpec] = {}
        for name in names:
            value = outputs[name]
            known = self._specs.get(name) if self._specs is not None else None
            if isinstance(value, (torch.Tensor, np.ndarray)) and not (known is not None and known.variable):
                t = torch.as_tensor(value).detach().cpu().contiguous()
                if t.ndim == 0 or t.shape[0] != n:
                    raise SchemaMismatchError(
                        f"output {name!r} has shape {tuple(t.shape)}; expected [{n}, ...] (one per key)"
                    )
                spec = OutputSpec(name, _dtype_name(t.dtype), tuple(t.shape[1:]))
                if spec.item_numel:
                    cols.append(pa.FixedSizeListArray.from_arrays(_arrow_values(t), spec.item_numel))
            else:
                values, lengths = _packed(name, n, value)
                spec = OutputSpec(name, _dtype_name(values.dtype), (-1, *values.shape[1:]))
                offsets = np.zeros(n + 1, dtype=np.int64)
                np.cumsum(lengths * spec.item_numel, out=offsets[1:])
                cols.append(pa.LargeListArray.from_arrays(pa.array(offsets, type=pa.int64()), _arrow_values(values)))
            if spec.item_numel == 0:
                raise SchemaMismatchError(
                    f"output {name!r} has an empty per-sample shape {spec.shape}: nothing to store"
                )
            specs[name] = spec
        return cols, specs

    def _start_shard(self) -> None:
        assert self._specs is not None
        meta = {
            _META_NAMESPACE: self.store.namespace.to_json().encode(),
            _META_FORMAT: f"{FORMAT_NAME}/{SHARD_FORMAT_VERSION}".encode(),
            _META_KEY_TYPE: self.store.key_type.encode(),
        }
        if self.fingerprints:
            meta[_META_FINGERPRINTS] = json.dumps(self.fingerprints, sort_keys=True).encode()
        key_type = pa.int64() if self.store.key_type == "int64" else pa.binary()
        fields = [pa.field(KEY_COLUMN, key_type, nullable=False)] + [s.arrow_field() for s in self._specs.values()]
        self._schema = with_schema_crc(pa.schema(fields, metadata=meta))
        self._tmp = self.store.path / "tmp" / f"{self.writer_id}-{self._seq:06d}.arrow.partial"
        self._sink = pa.OSFile(str(self._tmp), "wb")
        self._ipc = pa.ipc.new_file(self._sink, self._schema, options=self._options)
        self._rows = 0

    def _flush(self) -> None:
        """Write the buffered batches to the shard file as one record batch."""
        if not self._pending:
            return
        batch = self._pending[0]
        if len(self._pending) > 1:
            (batch,) = pa.Table.from_batches(self._pending).combine_chunks().to_batches() or [batch]
        self._ipc.write_batch(batch, custom_metadata=records_metadata(self._pending_records))
        self._pending = []
        self._pending_bytes = 0
        self._pending_records = []

    def seal(self) -> Path | None:
        """Finish the current shard and make it visible to readers (atomically); returns its path."""
        if self._ipc is None:
            return None
        assert self._sink is not None and self._tmp is not None
        self._flush()
        self._ipc.close()
        self._sink.close()
        fd = os.open(self._tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        final = self.store.path / "shards" / f"{time.time_ns():020d}-{self.writer_id}-{self._seq:06d}.arrow"
        os.rename(self._tmp, final)
        _fsync_dir(final.parent)
        self._ipc = self._sink = self._tmp = None
        self._seq += 1
        self.sealed.append(final)
        return final

    def abort(self) -> None:
        """Drop the current shard unsealed (its rows are lost; readers never saw them)."""
        if self._ipc is not None:
            assert self._sink is not None and self._tmp is not None
            self._pending = []
            self._pending_bytes = 0
            self._pending_records = []
            with contextlib.suppress(Exception):
                self._ipc.close()
            self._sink.close()
            self._tmp.unlink(missing_ok=True)
            self._ipc = self._sink = self._tmp = None

    def close(self) -> None:
        """Seal what was appended; the writer cannot be used after."""
        if not self._closed:
            self.seal()
            self._closed = True

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        # Rows already appended are valid teacher outputs even when the caller failed later: seal them.
        self.close()


def _packed(name: str, n: int, value: OutputValue) -> tuple[torch.Tensor, np.ndarray]:
    """A variable-length output as (values packed along the first dim, per-sample lengths)."""
    if isinstance(value, Ragged):
        values = value.values.detach().cpu()
        lengths = value.lengths.detach().cpu().numpy().astype(np.int64)
        if len(lengths) != n or int(lengths.sum()) != values.shape[0] or (lengths < 0).any():
            raise SchemaMismatchError(
                f"output {name!r}: a Ragged of {len(lengths)} samples with lengths summing to {int(lengths.sum())} "
                f"and values of shape {tuple(values.shape)} does not fit {n} keys"
            )
        return values, lengths
    if isinstance(value, (torch.Tensor, np.ndarray)):  # [N, T, ...]: every sample has the same T
        t = torch.as_tensor(value).detach().cpu()
        if t.ndim < 2 or t.shape[0] != n:
            raise SchemaMismatchError(f"output {name!r} has shape {tuple(t.shape)}; expected [{n}, T, ...]")
        return t.reshape(n * t.shape[1], *t.shape[2:]), np.full(n, t.shape[1], dtype=np.int64)
    ts = [torch.as_tensor(x).detach().cpu() for x in value]
    if len(ts) != n:
        raise SchemaMismatchError(f"output {name!r} has {len(ts)} samples for {n} keys")
    if any(t.ndim == 0 for t in ts):
        raise SchemaMismatchError(f"variable-length output {name!r} needs samples of shape [T, ...]")
    trailing = {tuple(t.shape[1:]) for t in ts}
    dtypes = {t.dtype for t in ts}
    if len(trailing) != 1 or len(dtypes) != 1:
        raise SchemaMismatchError(
            f"variable-length output {name!r} mixes shapes {sorted(trailing)} / dtypes {dtypes}: "
            "only the first dimension may vary between samples"
        )
    lengths = np.fromiter((t.shape[0] for t in ts), dtype=np.int64, count=n)
    return torch.cat(ts), lengths


def _arrow_values(t: torch.Tensor) -> pa.Array:
    flat = t.reshape(-1).contiguous()
    if flat.dtype == torch.bfloat16:
        return pa.array(flat.view(torch.int16).numpy().view(np.uint16), type=pa.uint16())
    return pa.array(flat.numpy(), type=_DTYPES[_dtype_name(flat.dtype)][1])
